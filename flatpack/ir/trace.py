"""Tracing frontends: torch.fx first, torch.export (non-strict) when fx cannot capture the model.

Both produce the same *flat graph*: an ``fx.GraphModule`` whose placeholders are the
tensor leaves of the inputs in order, whose parameters and buffers are ``get_attr`` nodes
(every ``nn.Module`` is inlined, so stage code needs only torch), and whose output is a
flat tuple. The nesting of inputs and outputs is kept beside it as JSON (``ir.structure``).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import io
import logging
import math
import operator
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.fx.graph import CodeGen
from torch.fx.graph_module import _copy_attr

from flatpack.errors import InputError, TraceError, first_line
from flatpack.ir import ops, structure

FX = "fx"
EXPORT = "export"

# node.meta key: {argument index or keyword name: (value in train mode, value in eval mode)}
# for the constant arguments of an op that depend on the module's mode (dropout's ``train``,
# batch_norm's ``training``, attention's ``dropout_p``, a BatchNorm step counter's increment).
# Codegen emits them as functions of the stage's ``self.training`` (see ``ir.trace.switch_modes``).
MODE_ARGS = "flatpack_mode_args"


class ModeWarning(UserWarning):
    """The compiled stages cannot follow ``.train()`` / ``.eval()`` for some part of the model."""


@dataclass
class Signature:
    """The parameters of ``model.forward``, kept as plain data so a loaded artifact can bind calls."""

    parameters: list[tuple[str, str, bool]]  # (name, inspect kind name, has a default)

    @classmethod
    def of(cls, model: nn.Module) -> Signature:
        params = inspect.signature(model.forward).parameters.values()
        return cls([(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params])

    def bind(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Normalizes a call so that passing an argument by position or by name is the same call."""
        sig = inspect.Signature([
            inspect.Parameter(name, getattr(inspect.Parameter, kind_name),
                              default=None if has_default else inspect.Parameter.empty)
            for name, kind_name, has_default in self.parameters
        ])
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as err:
            names = ", ".join(name for name, _, _ in self.parameters)
            raise InputError(
                f"the inputs do not match forward({names}): {err}. Pass the arguments that "
                "forward takes, as a tuple of positional inputs and/or a dict of keyword inputs."
            ) from None
        return bound.args, dict(bound.kwargs)

    def by_name(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """The given arguments keyed by parameter name (positional ones matched in order)."""
        return dict(zip((name for name, _, _ in self.parameters), args)) | kwargs

    def to_json(self) -> list:
        return [list(p) for p in self.parameters]

    @classmethod
    def from_json(cls, data: list) -> Signature:
        return cls([(name, kind_name, bool(has_default)) for name, kind_name, has_default in data])


@dataclass
class Traced:
    """A captured model: the flat graph and what is needed to call it like the original."""

    gm: torch.fx.GraphModule
    frontend: str
    signature: Signature
    input_structure: dict
    output_structure: dict
    example_leaves: list[torch.Tensor]
    param_kinds: dict[str, str] = field(default_factory=dict)  # canonical name -> parameter|frozen|buffer|constant
    aliases: dict[str, list[str]] = field(default_factory=dict)  # canonical name -> every name of that tensor
    dynamic_batch: bool = False
    # per tensor input, the dimensions the graph leaves free (export); None: not known (fx
    # graphs run whatever shapes their Python code accepts)
    dynamic_dims: list[list[int]] | None = None
    notes: list[str] = field(default_factory=list)
    training: bool = True  # the model's mode when it was traced: the stages start in it
    mode_fixed: list[str] = field(default_factory=list)  # what stays in ``training`` mode after switching
    # how torch.export captured it (None: fx), so that the trace in the other mode starts where
    # this one succeeded instead of repeating the attempts the model already refused
    export_route: ExportRoute | None = None


@dataclass(frozen=True)
class ExportRoute:
    """Which example and which dynamic-shape attempt gave the exported graph: ``doubled``, the
    batch-1 example repeated to batch 2 (``_repeat_batch``); ``attempt``, the index into
    ``_export_attempts`` (its last entry: static shapes)."""

    doubled: bool
    attempt: int


class _InliningTracer(torch.fx.Tracer):
    """Traces through every submodule, so the graph holds only torch ops and get_attr nodes.

    Normalization modules check ``input.dim()`` in Python before computing, which a
    symbolic tensor cannot answer; the check only guards against misuse, so it is skipped
    while tracing (the example run in ``ValueProp`` still runs the real ops).
    """

    def __init__(self) -> None:
        super().__init__()
        # A buffer read becomes a get_attr node, so ops on buffers alone (a counter's
        # ``add_(1)``) are in the graph instead of running once at trace time.
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        return False

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if not hasattr(type(m), "_check_input_dim") or "_check_input_dim" in vars(m):
            return super().call_module(m, forward, args, kwargs)
        object.__setattr__(m, "_check_input_dim", lambda *_: None)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            object.__delattr__(m, "_check_input_dim")


def flatten_inputs(signature: Signature, args: tuple, kwargs: dict) -> tuple[list[Any], dict]:
    """Flat leaves (constants dropped) and the JSON structure of a call's inputs."""
    bound = signature.bind(args, kwargs)
    leaves, spec = pytree.tree_flatten(bound)
    return [leaf for leaf in leaves if not structure.is_constant(leaf)], structure.from_treespec(spec, leaves)


def trace(model: nn.Module, args: tuple, kwargs: dict | None = None) -> Traced:
    """Captures ``model`` called as ``model(*args, **kwargs)`` into a flat graph."""
    kwargs = kwargs or {}
    signature = Signature.of(model)
    bound_args, bound_kwargs = signature.bind(args, kwargs)
    leaves, spec = pytree.tree_flatten((bound_args, bound_kwargs))
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and not structure.is_constant(leaf):
            raise InputError(
                f"an example input of type {type(leaf).__name__} is neither a tensor nor a "
                "JSON constant (None, bool, int, float, str); pass tensors, or nest them in "
                "tuples, lists and dicts."
            )
    input_structure = structure.from_treespec(spec, leaves)
    tensor_leaves = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    failures: list[tuple[str, BaseException]] = []
    notes: list[str] = []
    if _returns_transformers_cache(model, signature, bound_args, bound_kwargs):
        # the graph is traced with use_cache=False, a constant the caller never passes: the
        # compiled model keeps the input structure of the user's own call
        bound_kwargs = {**bound_kwargs, "use_cache": False}
        spec = pytree.tree_flatten((bound_args, bound_kwargs))[1]
        notes.append(CACHE_NOTE)
    traced = None
    if not _fx_applicable(signature, bound_args, bound_kwargs):
        notes.append("fx skipped: forward takes *args/**kwargs or nested inputs, which fx cannot bind")
    else:
        try:
            traced = _trace_fx(model, signature, bound_args, bound_kwargs)
        except Exception as err:  # noqa: BLE001 - any fx failure sends us to export
            failures.append((FX, err))
            notes.append(f"fx failed: {first_line(err)}")
    if traced is None:
        try:
            traced = _trace_export(model, signature, bound_args, bound_kwargs, spec)
        except Exception as err:  # noqa: BLE001
            failures.append((EXPORT, err))
            raise _trace_error(model, failures) from err
    traced.input_structure = input_structure
    traced.example_leaves = tensor_leaves
    traced.notes = notes + traced.notes
    switch_modes(model, traced, signature, bound_args, bound_kwargs, spec)
    _record_parameters(model, traced)
    return traced


CACHE_NOTE = ("traced with use_cache=False: the model's config turns transformers' key/value cache "
              "(past_key_values) on, and stages carry tensors, not cache objects; the compiled model returns "
              "every other output, as the model called with use_cache=False does")


def _returns_transformers_cache(model: nn.Module, signature: Signature, args: tuple, kwargs: dict) -> bool:
    """A transformers model whose config has ``use_cache`` on (BART's, T5's and most decoders'
    default) called without ``use_cache``: it would return a Cache object among its outputs."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False):
        return False
    names = [name for name, _, _ in signature.parameters]
    return "use_cache" in names and "use_cache" not in signature.by_name(args, kwargs)


def _fx_applicable(signature: Signature, args: tuple, kwargs: dict) -> bool:
    if any(kind in ("VAR_POSITIONAL", "VAR_KEYWORD") for _, kind, _ in signature.parameters):
        return False
    return all(isinstance(v, torch.Tensor) or structure.is_constant(v) for v in (*args, *kwargs.values()))


def _trace_fx(model: nn.Module, signature: Signature, args: tuple, kwargs: dict) -> Traced:
    names = [name for name, _, _ in signature.parameters]
    given = signature.by_name(args, kwargs)
    defaults = {
        p.name: p.default
        for p in inspect.signature(model.forward).parameters.values()
        if p.name not in given and p.default is not inspect.Parameter.empty
    }
    concrete = {name: value for name, value in given.items() if not isinstance(value, torch.Tensor)}
    concrete |= defaults
    attributes_before = set(vars(model))
    graph = _InliningTracer().trace(model, concrete_args=concrete or None)
    gm = torch.fx.GraphModule(model, graph)
    # fx stores each tensor constant created in forward on the traced module itself
    # (`_tensor_constant0`, ...); the GraphModule has copied them, so take them off the
    # user's model, or a second trace names the same constant `_tensor_constant1`
    for name in set(vars(model)) - attributes_before:
        delattr(model, name)
    _drop_specialized_placeholders(gm.graph, names, set(concrete))
    _refuse_baked_parameters(gm)
    _functionalize_simple_inplace(gm.graph)
    output_structure = _flatten_output_node(gm.graph)
    gm.recompile()
    return Traced(gm, FX, signature, {}, output_structure, [])


def _drop_specialized_placeholders(graph: torch.fx.Graph, names: list[str], concrete_names: set[str]) -> None:
    """fx keeps a placeholder and an assertion for each concrete argument; the flat graph drops both.

    fx creates one placeholder per parameter of forward, in order, so position names them.
    """
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    for name, node in zip(names, placeholders):
        if name not in concrete_names:
            continue
        for user in list(node.users):
            _erase_with_users(user)
        graph.erase_node(node)


def _refuse_baked_parameters(gm: torch.fx.GraphModule) -> None:
    """A constant that requires grad is a parameter fx saw as a plain tensor (read through
    ``self.parameters()`` or ``named_parameters()``): its gradient would be lost, so fx's
    capture is refused and torch.export, which tracks parameters by identity, takes over."""
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not str(node.target).startswith("_tensor_constant"):
            continue
        value = getattr(gm, str(node.target))
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise TraceError(f"fx baked a tensor that requires grad into the constant {node.target}: "
                             "a parameter was read other than by attribute access")


def _erase_with_users(node: torch.fx.Node) -> None:
    for user in list(node.users):
        _erase_with_users(user)
    node.graph.erase_node(node)


def _functionalize_simple_inplace(graph: torch.fx.Graph) -> None:
    """Later readers of a tensor mutated in place read the mutating node instead.

    The op itself stays in place (its semantics on aliases are kept); the rewrite makes the
    data dependence explicit so that passes order the readers after the write. Aliasing
    through views is handled by the ordering constraints in ``LayerGraph``.
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        for written in ops.mutated_inputs(node):
            if written.op == "get_attr":
                continue
            for user in list(written.users):
                if user is not node and order[user] > order[node]:
                    user.replace_input_with(written, node)


def _plain_containers(value: Any) -> Any:
    """fx stores output containers as immutable_dict/immutable_list and a namedtuple as a call
    to its class; give pytree the user's own container types back."""
    if isinstance(value, torch.fx.Node):
        target = value.target
        if value.op == "call_function" and isinstance(target, type) and issubclass(target, tuple) \
                and hasattr(target, "_fields"):
            return target(*(_plain_containers(arg) for arg in value.args))
        return value
    if isinstance(value, dict):
        return {key: _plain_containers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_containers(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain_containers(item) for item in value)
    return value


def _flatten_output_node(graph: torch.fx.Graph) -> dict:
    output = next(node for node in graph.nodes if node.op == "output")
    leaves, spec = pytree.tree_flatten(_plain_containers(output.args[0]))
    for leaf in leaves:
        if not isinstance(leaf, torch.fx.Node) and not structure.is_constant(leaf):
            raise TraceError(
                f"the model returns a {type(leaf).__name__}, which is neither a tensor nor a "
                "JSON constant; return tensors (nested in tuples, lists or dicts)."
            )
    output.args = (tuple(leaf for leaf in leaves if isinstance(leaf, torch.fx.Node)),)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and isinstance(node.target, type) and not node.users:
            graph.erase_node(node)  # a namedtuple built only to be returned
    return structure.from_treespec(spec, leaves)


def _trace_export(model: nn.Module, signature: Signature, args: tuple, kwargs: dict,
                  spec: pytree.TreeSpec, route: ExportRoute | None = None) -> Traced:
    """The model captured by torch.export. ``route``: how an earlier trace of the same model
    and example succeeded (the other mode's), tried first."""
    notes: list[str] = []
    with _quiet_torch_logs():
        exported, route = _export_example(model, signature, args, kwargs, notes, route)
    gm = exported.module()
    graph = gm.graph
    out_spec = gm._out_spec
    if out_spec is None:
        raise TraceError("torch.export produced a module without an output spec (gm._out_spec is None); "
                         "flatpack needs it to rebuild the output structure")
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards_fn"):
            graph.erase_node(node)
    _inline_grad_mode_regions(gm)
    leaves = pytree.tree_leaves((args, kwargs))
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise TraceError(f"torch.export produced {len(placeholders)} inputs for {len(leaves)} input leaves")
    for placeholder, leaf in zip(placeholders, leaves):
        if isinstance(leaf, torch.Tensor):
            continue
        for user in list(placeholder.users):
            user.args = pytree.tree_map(lambda a: leaf if a is placeholder else a, user.args)
            user.kwargs = pytree.tree_map(lambda a: leaf if a is placeholder else a, user.kwargs)
        graph.erase_node(placeholder)
    output = next(node for node in graph.nodes if node.op == "output")
    flat_outputs = list(output.args[0])
    output.args = (tuple(leaf for leaf in flat_outputs if isinstance(leaf, torch.fx.Node)),)
    output_structure = structure.from_treespec(out_spec, flat_outputs)
    graph._codegen = CodeGen()
    for attr in ("_in_spec", "_out_spec"):
        if hasattr(gm, attr):
            delattr(gm, attr)
    gm._forward_pre_hooks.clear()
    gm._forward_hooks.clear()
    gm.recompile()
    dynamic_dims = _dynamic_dims(graph)
    dynamic = any(0 in dims for dims in dynamic_dims)
    return Traced(gm, EXPORT, signature, {}, output_structure, [], dynamic_batch=dynamic, notes=notes,
                  dynamic_dims=dynamic_dims, export_route=route)


_BATCH_ONE_NOTE = "the example has batch 1, which torch.export fixes"


def _export_example(model: nn.Module, signature: Signature, args: tuple, kwargs: dict, notes: list[str],
                    route: ExportRoute | None) -> tuple[torch.export.ExportedProgram, ExportRoute]:
    """One export where one serves. torch.export specializes every size-1 dimension, so an
    example of batch 1 would give a graph fixed to batch 1 (and a profile that cannot vary the
    batch): such an example is exported repeated to batch 2 first — the graph is the same for
    every batch — and at batch 1 only when the doubled export fails or the model fixes the
    batch anyway (then the batch-2 graph would be wrong for the example)."""
    start = route.attempt if route is not None else 0
    if not _batch_of_one(args, kwargs) or (route is not None and not route.doubled):
        exported, attempt = _export_dynamic(model, signature, args, kwargs, notes, start)
        return exported, ExportRoute(doubled=False, attempt=attempt)
    doubled_args, doubled_kwargs = pytree.tree_map_only(torch.Tensor, _repeat_batch, (args, kwargs))
    doubled_notes: list[str] = []
    try:
        exported, attempt = _export_dynamic(model, signature, doubled_args, doubled_kwargs, doubled_notes, start)
    except Exception as err:  # noqa: BLE001 - keep the batch-1 graph and say why
        failure = (f"{_BATCH_ONE_NOTE}; tracing it repeated to batch 2 failed ({first_line(err)}): "
                   "the graph runs at batch 1 only")
    else:
        if any(0 in dims for dims in _dynamic_dims(exported.graph_module.graph)):
            notes.extend([*doubled_notes, f"{_BATCH_ONE_NOTE}; traced the example repeated to batch 2 so that "
                                          "the batch dimension stays dynamic"])
            return exported, ExportRoute(doubled=True, attempt=attempt)
        failure = f"{_BATCH_ONE_NOTE}, and the model fixes its batch: the graph runs at batch 1 only"
    exported, attempt = _export_dynamic(model, signature, args, kwargs, notes, 0)
    notes.append(failure)
    return exported, ExportRoute(doubled=False, attempt=attempt)


def _export_attempts(given: dict[str, Any]) -> list[tuple[str, dict | None]]:
    """What ``_export_dynamic`` tries, in order: the batch and sequence dimensions dynamic, then
    the batch alone, then static shapes (None)."""
    attempts: list[tuple[str, dict | None]] = [("batch and sequence", _batch_dynamic_shapes(given, sequence=True)),
                                               ("batch", _batch_dynamic_shapes(given, sequence=False))]
    if attempts[0][1] == attempts[1][1]:
        attempts = attempts[1:]  # no sequence-like input: one dynamic attempt
    return [*attempts, ("static", None)]


def _export_dynamic(model: nn.Module, signature: Signature, args: tuple, kwargs: dict,
                    notes: list[str], start: int = 0) -> tuple[torch.export.ExportedProgram, int]:
    """torch.export with the batch and sequence dimensions dynamic, then the batch alone, then
    static shapes: the first that the model allows, beginning at attempt ``start`` (where an
    earlier trace of the model succeeded), and its index. ``notes`` says what was given up and why."""
    attempts = _export_attempts(signature.by_name(args, kwargs))
    start = min(start, len(attempts) - 1)
    for index, (what, shapes) in enumerate(attempts[start:-1], start):
        try:
            return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=shapes), index
        except Exception as err:  # noqa: BLE001 - retry with fewer dynamic dimensions before giving up
            notes.append(f"dynamic {what} dimensions refused ({first_line(err)})")
    notes.append("traced with static shapes")
    return torch.export.export(model, args, kwargs, strict=False), len(attempts) - 1


def _dynamic_dims(graph: torch.fx.Graph) -> list[list[int]]:
    """For each tensor placeholder, in order, the dimensions export left symbolic."""
    return [_symbolic_dims(value) for node in graph.nodes
            if node.op == "placeholder" and isinstance(value := node.meta.get("val"), torch.Tensor)]


def free_dims(node: torch.fx.Node) -> list[int] | None:
    """The dimensions of a tensor node that export left symbolic (None: not known, as for an
    fx graph, whose nodes carry no symbolic shapes)."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return None
    return _symbolic_dims(value)


def _symbolic_dims(value: torch.Tensor) -> list[int]:
    """The dimensions of a traced tensor value that export left symbolic."""
    return [index for index, size in enumerate(value.shape) if _symbolic(size)]


def _symbolic(size: Any) -> bool:
    """A size export left free; a SymInt that export pinned to a number is not."""
    if not isinstance(size, torch.SymInt):
        return False
    return size.node.maybe_as_int() is None


def _batch_of_one(args: tuple, kwargs: dict) -> bool:
    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    return bool(tensors) and all(tensor.shape[0] == 1 for tensor in tensors)


def _repeat_batch(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor]) if tensor.dim() > 0 else tensor


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs warnings, and prints whole graphs, when it gives up on a
    data-dependent value; flatpack reports the failure itself, in one TraceError."""
    loggers = [logging.getLogger(name) for name in ("torch.fx.experimental.symbolic_shapes", "torch._export",
                                                    "torch.export")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _inline_grad_mode_regions(gm: torch.fx.GraphModule) -> None:
    """Inlines ``wrap_with_set_grad_enabled`` regions (``torch.no_grad()`` blocks in forward).

    torch.export keeps such a block as a higher-order op over a subgraph (Llama's rotary
    embedding). Inlined, the ops run in the caller's grad mode; a no-grad region's outputs
    are detached, which gives the same values and the same (absent) gradients.
    """
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or getattr(node.target, "__name__", "") != "wrap_with_set_grad_enabled":
            continue
        enabled, body_node, *operands = node.args
        body = getattr(gm, str(body_node.target))
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(operands)
        results: list[Any] = []
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(placeholders)
                elif inner.op == "output":
                    results = list(pytree.tree_leaves(pytree.tree_map_only(torch.fx.Node, env.get, inner.args[0])))
                elif inner.op == "get_attr":
                    raise TraceError("a torch.no_grad() region reads its own attribute; rewrite it to take "
                                     "the tensor as an argument")
                else:
                    env[inner] = graph.node_copy(inner, lambda n: env[n])
            if not enabled:
                results = [graph.call_function(torch.ops.aten.detach.default, (r,))
                           if isinstance(r, torch.fx.Node) else r for r in results]
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(results[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise TraceError("a torch.no_grad() region's result is used as a tuple; flatpack cannot inline it")
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            delattr(gm, str(body_node.target))


def switch_modes(model: nn.Module, traced: Traced, signature: Signature, args: tuple, kwargs: dict,
                 spec: pytree.TreeSpec) -> None:
    """Lets the stages follow ``.train()`` / ``.eval()`` like the original module.

    Python reads ``self.training`` while tracing, so each graph is one mode's. The model is
    traced a second time in the other mode (``model.train(not model.training)``, restored
    afterwards) by the same frontend and the two graphs are aligned node by node:

    - an op whose constant arguments differ between the modes (dropout's ``train``,
      batch_norm's ``training``, attention's ``dropout_p``) gets ``MODE_ARGS`` in its meta:
      codegen emits those arguments as functions of the stage's ``self.training``;
    - a BatchNorm step counter (``num_batches_tracked.add_(1)``, present in train mode only)
      becomes ``add_(1 if training else 0)``, inserted into an eval-mode graph if need be;
    - anything else that differs (a Python branch on ``self.training`` that adds or drops
      ops, such as timm's drop-path) cannot switch: the stages keep the traced mode there,
      ``traced.mode_fixed`` names the modules and a :class:`ModeWarning` is issued.
    """
    traced.training = bool(model.training)
    other_mode = not model.training
    states = [(module, module.training) for module in model.modules()]
    try:
        model.train(other_mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if traced.frontend == FX:
                other = _trace_fx(model, signature, args, kwargs)
            else:
                other = _trace_export(model, signature, args, kwargs, spec, traced.export_route)
    except Exception as err:  # noqa: BLE001 - the traced mode still works; say what cannot switch
        reason = f"it cannot be traced in {_mode(other_mode)} mode: {first_line(err)}"
        traced.mode_fixed = [f"the whole model ({reason})"]
    else:
        traced.mode_fixed = _align_modes(traced, other, primary_is_train=traced.training)
    finally:
        for module, mode in states:
            module.training = mode
    if traced.mode_fixed:
        shown = "; ".join(traced.mode_fixed[:6]) + ("; …" if len(traced.mode_fixed) > 6 else "")
        message = (f"{type(model).__name__} was traced in {_mode(traced.training)} mode, and its stages keep "
                   f"{_mode(traced.training)}-mode behaviour after .{'eval' if traced.training else 'train'}() "
                   f"in: {shown}. Compile the model in the mode you will run it in.")
        traced.notes.append(f"mode fixed: {shown}")
        warnings.warn(message, ModeWarning, stacklevel=3)


def _mode(training: bool) -> str:
    return "train" if training else "eval"


def _node_key(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        name = target
    elif isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        name = str(target)
    else:
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"
    return f"{node.op}:{name}"


def _align_modes(primary: Traced, other: Traced, primary_is_train: bool) -> list[str]:
    """Marks the mode-dependent arguments of ``primary``'s nodes (``MODE_ARGS``) from the
    trace of the other mode; returns what cannot switch, by module."""
    p_nodes = list(primary.gm.graph.nodes)
    o_nodes = list(other.gm.graph.nodes)
    p_keys = [_node_key(node) for node in p_nodes]
    o_keys = [_node_key(node) for node in o_nodes]
    pairs: dict[torch.fx.Node, torch.fx.Node] = {}  # other node -> primary node
    p_only: list[torch.fx.Node] = []
    o_only: list[torch.fx.Node] = []
    if p_keys == o_keys:
        pairs = dict(zip(o_nodes, p_nodes))
    else:
        matcher = difflib.SequenceMatcher(None, p_keys, o_keys, autojunk=False)
        for tag, i1, i2, j1, j2 in matcher.get_opcodes():
            if tag == "equal":
                pairs.update(zip(o_nodes[j1:j2], p_nodes[i1:i2]))
            else:
                p_only.extend(p_nodes[i1:i2])
                o_only.extend(o_nodes[j1:j2])
    # ops that only copy their input (``contiguous`` when one mode's kernel already returns a
    # contiguous tensor) may appear in one mode alone; readers look through them
    copies = {node for node in (*p_only, *o_only) if _is_transparent(node)}
    p_only = [node for node in p_only if node not in copies]
    o_only = [node for node in o_only if node not in copies]
    fixed: list[torch.fx.Node] = []
    for o_node, p_node in list(pairs.items()):
        if o_node.op not in ("call_function", "call_method", "call_module", "output"):
            continue
        p_call, o_call = (p_node.args, dict(p_node.kwargs)), (o_node.args, dict(o_node.kwargs))
        if isinstance(p_node.target, torch._ops.OpOverload) and (
                len(p_node.args) != len(o_node.args) or p_node.kwargs.keys() != o_node.kwargs.keys()):
            p_call, o_call = _with_defaults(p_node), _with_defaults(o_node)
        differing = _differing_constants(p_call, o_call, pairs, copies)
        if differing is None:
            fixed.append(p_node)
        elif differing:
            p_node.args, p_node.kwargs = p_call
            p_node.meta[MODE_ARGS] = {key: (p, o) if primary_is_train else (o, p)
                                      for key, (p, o) in differing.items()}
    inserted: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in (p_only if primary_is_train else o_only):
        if node.op == "get_attr":
            continue  # matters only through its users
        if not _is_step_counter(node):
            fixed.append(node)
        elif primary_is_train:
            step = _step_counter_operands(node)[1]
            node.meta[MODE_ARGS] = {1: (step, type(step)(0))}
        else:
            inserted[node] = _insert_step_counter(primary, other, node, o_nodes, pairs, inserted)
    fixed.extend(node for node in (o_only if primary_is_train else p_only) if node.op != "get_attr")
    if inserted:
        primary.gm.recompile()
    return _describe_fixed(fixed)


_TRANSPARENT = {"contiguous", "clone", "alias"}


def _is_transparent(node: torch.fx.Node) -> bool:
    return (node.op in ("call_function", "call_method") and ops.op_name(node) in _TRANSPARENT
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node))


def _with_defaults(node: torch.fx.Node) -> tuple[tuple, dict]:
    """An ATen call's arguments with the omitted ones spelled out (torch.export drops those
    equal to their defaults, so attention's ``dropout_p=0.0`` vanishes in eval mode)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        # the caller checked the primary node's target; its paired node has the same key (_node_key)
        raise TypeError(f"{node.name}: defaults are known for ATen ops only, not for target {target!r}")
    args, kwargs = list(node.args), dict(node.kwargs)
    for index, argument in enumerate(target._schema.arguments):
        if not argument.has_default_value():
            continue
        if argument.kwarg_only:
            kwargs.setdefault(argument.name, argument.default_value)
        elif index == len(args) and argument.name not in kwargs:
            args.append(argument.default_value)
    return tuple(args), kwargs


def _differing_constants(p_call: tuple[tuple, dict], o_call: tuple[tuple, dict],
                         pairs: dict[torch.fx.Node, torch.fx.Node],
                         copies: set[torch.fx.Node]) -> dict[int | str, tuple] | None:
    """The top-level scalar arguments that differ between two aligned calls ``(args, kwargs)``,
    or None when they differ otherwise (another input, another structure)."""
    (p_args, p_kwargs), (o_args, o_kwargs) = p_call, o_call
    if len(p_args) != len(o_args) or p_kwargs.keys() != o_kwargs.keys():
        return None
    differing: dict[int | str, tuple] = {}
    keyed = [*((i, p, o) for i, (p, o) in enumerate(zip(p_args, o_args))),
             *((k, p_kwargs[k], o_kwargs[k]) for k in p_kwargs)]
    for key, p_arg, o_arg in keyed:
        if _same_argument(p_arg, o_arg, pairs, copies):
            continue
        if _is_scalar(p_arg) and _is_scalar(o_arg):
            differing[key] = (p_arg, o_arg)
            continue
        return None
    return differing


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float))


def _same_argument(p_arg: Any, o_arg: Any, pairs: dict[torch.fx.Node, torch.fx.Node],
                   copies: set[torch.fx.Node]) -> bool:
    """Whether two aligned arguments are the same value; nodes compare through ``pairs``,
    looking through ``copies`` (value-preserving ops present in one mode only)."""
    if isinstance(p_arg, torch.fx.Node) or isinstance(o_arg, torch.fx.Node):
        if not (isinstance(p_arg, torch.fx.Node) and isinstance(o_arg, torch.fx.Node)):
            return False
        while o_arg in copies:
            o_arg = o_arg.args[0]
        while p_arg in copies:
            p_arg = p_arg.args[0]
        return pairs.get(o_arg) is p_arg
    if type(p_arg) is not type(o_arg):
        return False
    if isinstance(p_arg, (tuple, list)):
        return len(p_arg) == len(o_arg) and all(_same_argument(p, o, pairs, copies) for p, o in zip(p_arg, o_arg))
    if isinstance(p_arg, dict):
        return p_arg.keys() == o_arg.keys() and all(_same_argument(p_arg[k], o_arg[k], pairs, copies)
                                                    for k in p_arg)
    if isinstance(p_arg, torch.Tensor):
        return p_arg is o_arg or (p_arg.shape == o_arg.shape and bool(torch.equal(p_arg, o_arg)))
    if isinstance(p_arg, float) and math.isnan(p_arg):
        return math.isnan(o_arg)
    try:
        return bool(p_arg == o_arg)
    except Exception:  # noqa: BLE001 - an object without a usable ==
        return p_arg is o_arg


def _is_step_counter(node: torch.fx.Node) -> bool:
    """``num_batches_tracked.add_(1)``: an in-place add of a constant to a buffer, read by
    nothing but the next such add (torch.export chains a BatchNorm called twice)."""
    return (node.op in ("call_method", "call_function") and ops.op_name(node) == "add_" and len(node.args) == 2
            and not node.kwargs and isinstance(node.args[0], torch.fx.Node)
            and (node.args[0].op == "get_attr" or _is_step_counter(node.args[0]))
            and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool)
            and all(user.op in ("call_method", "call_function") and ops.op_name(user) == "add_"
                    and user.args[0] is node for user in node.users))


def _step_counter_operands(node: torch.fx.Node) -> tuple[torch.fx.Node, int | float]:
    """The counter a step counter adds to and its constant increment (``_is_step_counter`` holds)."""
    counter, step = node.args[0], node.args[1]
    if not isinstance(counter, torch.fx.Node) or not isinstance(step, (int, float)):
        raise TypeError(f"{node.name} is not a step counter (add_ of a constant to a buffer): {node.format_node()}")
    return counter, step


def _insert_step_counter(primary: Traced, other: Traced, node: torch.fx.Node, o_nodes: list[torch.fx.Node],
                         pairs: dict[torch.fx.Node, torch.fx.Node],
                         inserted: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
    """Copies a train-only step counter into the eval-mode graph as ``add_(0)`` (eval) / ``add_(1)`` (train)."""
    graph = primary.gm.graph
    after = o_nodes[o_nodes.index(node) + 1:]
    anchor = next(pairs[o] for o in after if o in pairs)
    counted, step = _step_counter_operands(node)
    with graph.inserting_before(anchor):
        written = inserted.get(counted)
        if written is None:
            root = counted
            while root.op != "get_attr":
                root = _step_counter_operands(root)[0]
            target = str(root.target)
            try:
                fetch_attr(primary.gm, target)
            except AttributeError:
                _copy_attr(other.gm, primary.gm, target)
            written = graph.get_attr(target)
            written.meta.update({k: v for k, v in node.meta.items() if k == "nn_module_stack"})
        counter = graph.create_node(node.op, node.target, (written, type(step)(0)), {})
    counter.meta.update({k: v for k, v in node.meta.items() if k == "nn_module_stack"})
    counter.meta[MODE_ARGS] = {1: (step, type(step)(0))}
    return counter


def _describe_fixed(nodes: list[torch.fx.Node]) -> list[str]:
    """One entry per module whose ops differ between the modes in a way that cannot switch."""
    by_module: dict[str, list[str]] = {}
    for node in nodes:
        stack = node.meta.get("nn_module_stack") or {}
        where = "forward of the top module"
        if stack:
            path, owner = list(stack.values())[-1]
            path = str(path)
            for prefix in ("L['self'].", "L__self__."):
                path = path.removeprefix(prefix)
            path = path.replace("._modules['", ".").replace("']", "")
            where = f"'{path}' ({getattr(owner, '__name__', owner)})"
        names = by_module.setdefault(where, [])
        op = "output" if node.op == "output" else ops.op_name(node)
        if op not in names:
            names.append(op)
    return [f"{where}: {', '.join(names[:4])}" for where, names in by_module.items()]


def _batch_dynamic_shapes(given: dict[str, Any], sequence: bool = True) -> dict:
    """Marks dim 0 of every input tensor ``Dim.AUTO``: dynamic where the model allows it.

    With ``sequence``, dim 1 of integer and boolean inputs of two or more dimensions (token
    ids, attention masks, position ids) is ``Dim.AUTO`` too: a sequence model compiled at one
    length runs at others. Where the model fixes the length (a learned position table sliced
    to the example's length), export specializes it and the stages check it instead
    (``StagedModule`` names the input, its compiled shape and how to recompile).
    """
    auto = torch.export.Dim.AUTO

    def dims(leaf: torch.Tensor) -> dict[int, Any]:
        marked = {0: auto}
        if sequence and leaf.dim() >= 2 and (leaf.dtype == torch.bool or not leaf.is_floating_point()) \
                and not leaf.is_complex():
            marked[1] = auto
        return marked

    def spec_of(value: Any) -> Any:
        return pytree.tree_map(
            lambda leaf: dims(leaf) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else None, value
        )

    return {name: spec_of(value) for name, value in given.items()}


def _record_parameters(model: nn.Module, traced: Traced) -> None:
    by_id: dict[int, list[str]] = {}
    kinds_by_id: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
        kinds_by_id[id(param)] = "parameter" if param.requires_grad else "frozen"
    for name, buffer in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(buffer), []).append(name)
        kinds_by_id.setdefault(id(buffer), "buffer")
    for node in traced.gm.graph.nodes:
        if node.op != "get_attr":
            continue
        target = str(node.target)
        value = fetch_attr(traced.gm, target)
        names = by_id.get(id(value), [])
        traced.param_kinds[target] = kinds_by_id.get(id(value), "constant")
        traced.aliases[target] = sorted(set(names) | {target})


def fetch_attr(root: nn.Module, target: str) -> Any:
    """The object a ``get_attr`` target names: ``layers.0.weight`` on ``root``."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


_DATA_DEPENDENT = ("control flow", "data-dependent", "data dependent", "GuardOnDataDependent",
                   "Could not guard", "Could not extract specialized integer", "len() on")
_UNSUPPORTED = ("not supported", "Unsupported", "NotImplemented", "unsupported")


def _trace_error(model: nn.Module, failures: list[tuple[str, BaseException]]) -> TraceError:
    module_path = _failing_module(model, failures)
    module = _get_submodule(model, module_path)
    texts = " ".join(f"{type(err).__name__} {err}" for _, err in failures)
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training and module.momentum is None:
        construct = ("BatchNorm(momentum=None) in training mode, which averages its running statistics "
                     "with the Python float 1/num_batches_tracked, a data-dependent value")
        fix = "give the BatchNorm a float momentum, or compile the model in eval mode"
    elif "Cache" in texts and "not a known type" in texts:
        # transformers returns its key/value cache (past_key_values) when use_cache is on,
        # the default of BART, T5 and most decoders; stages carry tensors, not cache objects
        construct = "a transformers Cache object (past_key_values) among the outputs"
        fix = ("build the model with use_cache=False in its config, or pass use_cache=False with the "
               "example inputs")
    elif any(marker in texts for marker in _DATA_DEPENDENT):
        construct = "data-dependent control flow (a Python branch or loop on a tensor's value)"
        fix = ("rewrite the branch with torch.cond or torch.where, make the value a concrete "
               "input (pass it as a Python constant), or move that code outside the model")
    elif any(marker in texts for marker in _UNSUPPORTED):
        construct = "an operation neither tracer supports"
        fix = "replace it with a torch operation, or run it outside the model before flatpack.compile"
    else:
        construct = "a construct neither tracer could capture"
        fix = ("check that the example inputs run the model eagerly, rewrite data-dependent "
               "branches with torch.cond, or pass concrete inputs")
    where = f"in submodule '{module_path}' ({type(module).__name__})" if module_path \
        else f"in {type(model).__name__}.forward"
    details = "; ".join(f"{frontend}: {first_line(err)}" for frontend, err in failures)
    return TraceError(f"could not trace the model {where}: {construct}. Fix: {fix}. ({details})")


def _get_submodule(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _failing_module(model: nn.Module, failures: list[tuple[str, BaseException]]) -> str:
    """The deepest submodule of ``model`` whose forward was on the stack when tracing failed."""
    names = {id(module): name for name, module in model.named_modules()}
    deepest = ""
    for _, err in failures:
        for frame, _ in traceback.walk_tb(err.__traceback__):
            owner = frame.f_locals.get("self")
            name = names.get(id(owner)) if owner is not None else None
            if name and len(name) >= len(deepest):
                deepest = name
    return deepest
