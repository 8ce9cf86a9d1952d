"""Plan + LayerGraph -> one self-contained artifact per stage: source, weight shard, manifest.

Tied weights: a parameter read by several stages is *replicated* — each of those stages
carries its own copy in its shard, and the manifest lists the other stages under
``shared_with``. The sync rule: after backward, the gradients of a shared parameter are
summed over the stages that hold it and every copy applies the same update, so the copies
stay equal. ``Compiled.as_module()`` implements the rule in-process by giving all stages one
``nn.Parameter`` object, which makes autograd do the summing.
"""

from __future__ import annotations

import builtins
import importlib
import keyword
import math
import operator
import re
import types
from typing import Any

import torch
import torch.fx
from torch import nn

from flatpack.errors import CodegenError
from flatpack.ir.graph import LayerGraph
from flatpack.ir.trace import MODE_ARGS, fetch_attr, free_dims
from flatpack.ir.values import TENSOR, value_info
from flatpack.partitioner.plan import Plan
from flatpack.stage.artifact import StageArtifact
from flatpack.stage.manifest import Manifest, ParameterEntry, ValueEntry
from flatpack.version import __version__

_ALLOWED_MODULE_ROOTS = {"torch", "math", "operator", "builtins", "_operator"}


def attribute_name(target: str, taken: set[str]) -> str:
    """A Python identifier for a parameter's qualified name: ``layer.0.weight`` -> ``layer_0_weight``."""
    base = re.sub(r"\W", "_", target).strip("_") or "attr"
    if base[0].isdigit() or keyword.iskeyword(base):
        base = f"p_{base}"
    name, suffix = base, 1
    while name in taken:
        suffix += 1
        name = f"{base}_{suffix}"
    taken.add(name)
    return name

def emit_stages(graph: LayerGraph, plan: Plan) -> list[StageArtifact]:
    """Emits every stage of ``plan``; each artifact runs with torch alone."""
    plan.check_against(len(graph.layers))
    holders: dict[str, list[int]] = {}
    for index, stage in enumerate(plan.stages):
        for layer in range(stage.start, stage.end + 1):
            for param in graph.layer_params(layer):
                if index not in holders.setdefault(param, []):
                    holders[param].append(index)
    return [_emit_stage(graph, plan, index, holders) for index in range(len(plan.stages))]

def _emit_stage(graph: LayerGraph, plan: Plan, index: int, holders: dict[str, list[int]]) -> StageArtifact:
    stage = plan.stages[index]
    analysis = graph.analysis
    last = index == len(plan.stages) - 1
    compute = [name for layer in graph.layers[stage.start:stage.end + 1] for name in layer.nodes]
    input_names = graph.crossing(stage.start - 1)
    output_names = graph.output_names() if last else graph.crossing(stage.end)
    needed = set(compute) | analysis.needed_free(compute)
    if last:
        free_outputs = [name for name in output_names if name in analysis.free]
        needed |= set(free_outputs) | analysis.needed_free(free_outputs)

    new_graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for name in input_names:
        env[analysis.nodes[name]] = new_graph.placeholder(name)
    taken: set[str] = set()
    attributes: dict[str, str] = {}  # canonical target -> attribute
    for name in sorted(needed, key=analysis.position.__getitem__):
        node = analysis.nodes[name]
        if node.op == "get_attr":
            target = str(node.target)
            if target not in attributes:
                attributes[target] = attribute_name(target, taken)
            env[node] = new_graph.get_attr(attributes[target])
            env[node].name = node.name
            continue
        if node.op == "call_module":
            raise CodegenError(f"stage {index}: node {name} calls submodule {node.target!r}; flatpack "
                               "inlines modules when tracing, so this graph did not come from flatpack.trace")
        env[node] = new_graph.node_copy(node, lambda n: env[n])
        if node.meta.get(MODE_ARGS):
            _follow_mode(new_graph, env[node], node.meta[MODE_ARGS])
    outputs = tuple(env[analysis.nodes[name]] for name in output_names)
    new_graph.output(outputs)
    new_graph.lint()

    python_code = new_graph.python_code(root_module="self")
    imports = _imports_for(python_code.globals, python_code.src, index)
    tensors = {target: _fetch_tensor(graph.gm, target) for target in attributes}
    manifest = Manifest(
        stage=index,
        num_stages=len(plan.stages),
        layers=(stage.start, stage.end),
        layer_names=tuple(layer.name for layer in graph.layers[stage.start:stage.end + 1]),
        frontend=graph.traced.frontend,
        dynamic_batch=graph.traced.dynamic_batch,
        # the mode the model was traced in, which the stage starts in; ``mode_fixed``: what
        # keeps that mode's behaviour after .train()/.eval() (see ir.trace.switch_modes)
        training=graph.traced.training,
        mode_fixed=tuple(graph.traced.mode_fixed),
        inputs=tuple(_io_entry(graph, name) for name in input_names),
        outputs=tuple(_io_entry(graph, name) for name in output_names),
        parameters=tuple(
            ParameterEntry(
                name=target,
                attr=attr,
                kind=graph.traced.param_kinds.get(target, "constant"),
                shape=tuple(tensors[target].shape),
                dtype=str(tensors[target].dtype).removeprefix("torch."),
                aliases=tuple(graph.traced.aliases.get(target, [target])),
                shared_with=tuple(other for other in holders.get(target, []) if other != index),
            )
            for target, attr in attributes.items()
        ),
        flatpack_version=__version__,
    )
    source = _render_source(python_code.src, imports, manifest)
    return StageArtifact(index, source, tensors, manifest)

def _follow_mode(graph: torch.fx.Graph, node: torch.fx.Node, mode_args: dict) -> None:
    """Replaces the node's mode-dependent constants with functions of ``self.training``:
    ``training`` itself for a ``True``/``False`` flag, ``(eval_value, train_value)[training]``
    otherwise. The emitted stage reads ``self.training`` once, at the top of forward."""
    training = next((n for n in graph.nodes if n.op == "get_attr" and n.target == "training"), None)
    if training is None:
        first = next(n for n in graph.nodes if n.op != "placeholder")  # ``node`` at the latest
        with graph.inserting_before(first):
            training = graph.get_attr("training")
    args, kwargs = list(node.args), dict(node.kwargs)
    with graph.inserting_before(node):
        for key, (train_value, eval_value) in mode_args.items():
            if train_value is True and eval_value is False:
                value: Any = training
            else:
                value = graph.call_function(operator.getitem, ((eval_value, train_value), training))
            if isinstance(key, int):
                args[key] = value
            else:
                kwargs[key] = value
    node.args, node.kwargs = tuple(args), kwargs

def _io_entry(graph: LayerGraph, name: str) -> ValueEntry:
    """A stage input's or output's name, kind, shape and dtype; for a tensor of a graph traced
    with a dynamic batch, ``dynamic``: the dimensions whose size may differ from the example's
    (the stage worker checks what it is given against it, flatpack/stage/tensor_check.py)."""
    node = graph.analysis.nodes[name]
    info = value_info(node)
    if info.kind != TENSOR:
        return ValueEntry(name, info.kind, info.nbytes, python_type=info.python_type)
    dynamic = free_dims(node) if graph.traced.dynamic_batch else None
    return ValueEntry(name, info.kind, info.nbytes, info.shape, info.dtype,
                      dynamic=tuple(dynamic) if dynamic is not None else None)


def _fetch_tensor(root: nn.Module, target: str) -> torch.Tensor:
    value = fetch_attr(root, target)
    if isinstance(value, torch.fx.GraphModule):
        raise CodegenError(f"the graph calls the subgraph {target!r}, a control-flow operator such as "
                           "torch.cond; flatpack cannot emit those in a stage yet. Keep the branch "
                           "outside the model, or express it with torch.where.")
    if not isinstance(value, torch.Tensor):
        raise CodegenError(f"attribute {target!r} is a {type(value).__name__}, not a tensor; "
                           "stages can only carry tensors as weights")
    # A snapshot: the artifact keeps the weights of compile time even if the model trains on.
    return value.detach().clone()

def _imports_for(globals_: dict[str, Any], src: str, index: int) -> list[str]:
    """Import lines that define every global name the generated forward uses."""
    lines = []
    for name, obj in sorted(globals_.items()):
        if not re.search(rf"\b{re.escape(name)}\b", src):
            continue
        if name == "torch":
            continue
        if name in ("inf", "nan") and isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
            lines.append(f"{name} = float({name!r})")
        elif name == "NoneType":
            lines.append("NoneType = type(None)")
        elif obj is torch.device:
            lines.append(f"{name} = torch.device")
        elif getattr(builtins, name, None) is obj:
            continue
        elif isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__} as {name}")
        else:
            lines.append(_import_callable(name, obj, index))
    return lines

def _import_callable(name: str, obj: Any, index: int) -> str:
    module_name = getattr(obj, "__module__", None) or ""
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "")
    root = module_name.split(".")[0]
    if root not in _ALLOWED_MODULE_ROOTS or not qualname or "<" in qualname:
        raise CodegenError(
            f"stage {index} calls {module_name}.{qualname or obj!r}, which a fresh interpreter "
            "without your model's code cannot import. Express it with torch operations, or "
            "keep the model traceable by torch.export so it lowers to ATen ops."
        )
    resolved: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        resolved = getattr(resolved, part, None)
    if resolved is not obj:
        raise CodegenError(f"stage {index}: {module_name}.{qualname} does not name the function the graph calls")
    head, _, rest = qualname.partition(".")
    if not rest:
        return f"from {module_name} import {head} as {name}"
    return f"from {module_name} import {head} as _{name}_owner\n{name} = _{name}_owner.{rest}"

def _render_source(forward_src: str, imports: list[str], manifest: Manifest) -> str:
    body = "\n".join(f"    {line}" if line.strip() else "" for line in forward_src.strip("\n").splitlines())
    inputs = ", ".join(manifest.input_names) or "none"
    outputs = ", ".join(manifest.output_names) or "none"
    first, last = manifest.layers
    header = [
        f"# Generated by flatpack {manifest.flatpack_version}: stage {manifest.stage} of "
        f"{manifest.num_stages}, layers {first}..{last}.",
        "# Do not edit: the artifact's flatpack.index.json records this file's sha256. Weights live in "
        "weights.safetensors.",
        "import torch",
        *imports,
        "",
        "",
        "class Stage(torch.nn.Module):",
        f'    """Layers {first}..{last}: {", ".join(manifest.layer_names)[:200]}',
        "",
        f"    Inputs: {inputs}",
        f"    Outputs: {outputs}",
        '    """',
    ]
    return "\n".join(header) + "\n" + body + "\n"
