"""The LayerGraph IR: a traced flat graph plus an ordered chain of layers over its nodes.

Vocabulary:

- *compute node*: a call node that belongs to exactly one layer.
- *free node*: ``get_attr`` (a parameter, buffer or constant) and side-effect-free,
  deterministic ops over free nodes alone (``weight.t()``, ``arange(8)``). Free nodes
  belong to no layer; every stage that needs one recomputes it, so they never cross a
  boundary (this is also how tied weights reach both of their stages).
- *boundary i*: the values produced at or before layer i and consumed after it. Boundary
  -1 is the model's inputs, boundary ``len(layers)-1`` its outputs. A boundary carries as
  many values as cross it: the hidden state, but also masks, position ids, sizes and skip
  connections. Nothing is assumed to be a single tensor.

Invariants (``validate``): each compute node is in exactly one layer; a node's producers and
the in-place writes it must follow (``order_deps``) are in its layer or an earlier one; a
tuple-valued node (a multi-output op) never crosses a boundary; an in-place write shares a
layer with the tensor it writes, so no stage writes into a tensor another stage made.
"""

from __future__ import annotations

import operator

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

import torch
import torch.fx

from flatpack.errors import PlanError
from flatpack.ir import meta, ops
from flatpack.ir.profile import merge_layer_profiles
from flatpack.ir.trace import MODE_ARGS, Traced
from flatpack.ir.values import OTHER, ValueInfo, ValueProp, value_info

CALL_OPS = ("call_function", "call_method", "call_module")
OUTPUT = "output"

_NONDETERMINISTIC = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
                     "randperm", "bernoulli", "normal", "uniform", "dropout", "multinomial",
                     "native_dropout", "exponential", "geometric", "cauchy", "log_normal"}


@dataclass
class Layer:
    """A contiguous piece of the chain: node names in graph order, and documented metadata."""

    name: str
    nodes: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BoundaryValue:
    """One value crossing a boundary."""

    name: str
    info: ValueInfo
    param_dependent: bool

    def to_json(self) -> dict:
        return {"name": self.name, **self.info.to_json(), "param_dependent": self.param_dependent}


@dataclass(frozen=True)
class Boundary:
    """Everything that crosses between layer ``index`` and layer ``index + 1``."""

    index: int
    values: tuple[BoundaryValue, ...]

    @property
    def nbytes(self) -> int:
        return sum(value.info.nbytes for value in self.values)

    def to_json(self) -> dict:
        return {"after_layer": self.index, "bytes": self.nbytes,
                "values": [value.to_json() for value in self.values]}


class GraphAnalysis:
    """Facts about the flat graph that do not depend on how it is cut into layers."""

    def __init__(self, traced: Traced) -> None:
        self.traced = traced
        self.graph = traced.gm.graph
        self.nodes: dict[str, torch.fx.Node] = {node.name: node for node in self.graph.nodes}
        self.position: dict[str, int] = {node.name: index for index, node in enumerate(self.graph.nodes)}
        self.output = next(node for node in self.graph.nodes if node.op == OUTPUT)
        self.alias_root = self._alias_classes()
        self.writes_by_class: dict[str, list[torch.fx.Node]] = {}
        for node in self.graph.nodes:
            for written in _written_in_some_mode(node):
                self.writes_by_class.setdefault(self.alias_root[written.name], []).append(node)
        self.free = self._find_free()
        self.param_dependent = self._find_param_dependent()
        self.compute = [n for n in self.graph.nodes if n.op in CALL_OPS and n.name not in self.free]
        self.touched_by_class = self._touching_written_classes()
        self.attributes = {str(n.target): n for n in self.graph.nodes if n.op == "get_attr"}
        self.order_deps = self._order_dependencies()
        for node in self.graph.nodes:
            node.meta[meta.FREE] = node.name in self.free
            node.meta[meta.PARAM_DEPENDENT] = node.name in self.param_dependent

    def _alias_classes(self) -> dict[str, str]:
        """Node name -> the root of the tensors it may share storage with (views, in-place results)."""
        root: dict[str, str] = {}

        def find(name: str) -> str:
            while root.get(name, name) != name:
                name = root[name]
            return name

        for node in self.graph.nodes:
            base = ops.aliased_input(node)
            if base is not None:
                root[find(node.name)] = find(base.name)
        return {node.name: find(node.name) for node in self.graph.nodes}

    def _find_free(self) -> set[str]:
        """get_attr nodes, and pure ops over free nodes that read no buffer written in place
        (recomputing such a read in another stage could see the write)."""
        free: set[str] = set()
        for node in self.graph.nodes:
            if node.op == "get_attr":
                free.add(node.name)
            elif node.op in CALL_OPS and self._side_effect_free(node):
                inputs = node.all_input_nodes
                if all(inp.name in free and self.alias_root[inp.name] not in self.writes_by_class
                       for inp in inputs):
                    free.add(node.name)
        return free

    @staticmethod
    def _side_effect_free(node: torch.fx.Node) -> bool:
        if node.op == "call_module" or ops.mutated_inputs(node) or not node.users:
            return False
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags:
            return False
        return ops.op_name(node).rstrip("_") not in _NONDETERMINISTIC

    def _find_param_dependent(self) -> set[str]:
        kinds = self.traced.param_kinds
        dependent: set[str] = set()
        for node in self.graph.nodes:
            if node.op == "get_attr" and kinds.get(str(node.target)) == "parameter":
                dependent.add(node.name)
            elif any(inp.name in dependent for inp in node.all_input_nodes):
                dependent.add(node.name)
        return dependent

    def _touching_written_classes(self) -> dict[str, list[torch.fx.Node]]:
        """Alias class written in place -> the compute nodes that read or write it, in graph order."""
        touched: dict[str, list[torch.fx.Node]] = {}
        for node in self.compute:
            classes = {self.alias_root[inp.name] for inp in node.all_input_nodes} | {self.alias_root[node.name]}
            for cls in classes & self.writes_by_class.keys():
                touched.setdefault(cls, []).append(node)
        return touched

    def _order_dependencies(self) -> dict[str, set[str]]:
        """Data producers, plus the in-place writes a node must follow or precede.

        Tensors that share storage (views, in-place results) form alias classes. A reader
        of a class comes after the earlier writes to it; a write comes after the earlier
        readers and writes. Only non-free producers are listed: free values are recomputed
        where needed.
        """
        deps: dict[str, set[str]] = {
            node.name: {inp.name for inp in node.all_input_nodes if inp.name not in self.free}
            for node in self.compute
        }
        for cls, writes in self.writes_by_class.items():
            for node in self.touched_by_class.get(cls, []):
                pos = self.position[node.name]
                for write in writes:
                    if write is not node and self.position[write.name] < pos:
                        deps[node.name].add(write.name)
                    elif write is not node and self.position[write.name] > pos:
                        deps[write.name].add(node.name)
        return deps

    def glued_spans(self) -> list[tuple[int, int]]:
        """Position spans that must share a layer.

        A node whose result nobody reads (an assertion) and the node after it — except an
        unused ``getitem`` projection (an LSTM's final states), which has no effect to
        order; a multi-output op and its ``getitem`` projections; an in-place write and the tensor
        it writes (and, for a written buffer, every node that touches it), so that a stage
        never writes into storage another stage owns.
        """
        spans: list[tuple[int, int]] = []
        for previous, node in zip(self.compute, self.compute[1:]):
            if not previous.users and not ops.mutated_inputs(previous) and previous.target is not operator.getitem:
                spans.append((self.position[previous.name], self.position[node.name]))
        if len(self.compute) > 1 and not self.compute[-1].users:
            spans.append((self.position[self.compute[-2].name], self.position[self.compute[-1].name]))
        for node in self.compute:
            for inp in node.all_input_nodes:
                if inp.name in self.free or inp.op == "placeholder":
                    continue
                if value_info(inp).kind == OTHER and inp.op in CALL_OPS:
                    spans.append((self.position[inp.name], self.position[node.name]))
        for cls, writes in self.writes_by_class.items():
            touching = [self.position[n.name] for n in self.touched_by_class.get(cls, [])]
            root_node = self.nodes[cls]
            last_write = max(self.position[w.name] for w in writes)
            if root_node.op == "placeholder":
                continue
            if root_node.name in self.free:
                spans.append((min(touching), max(touching)))
                continue
            members = [self.position[n.name] for n in self.compute
                       if self.alias_root[n.name] == cls and self.position[n.name] <= last_write]
            spans.append((min(members), last_write))
        return spans

    def needed_free(self, names: Iterable[str]) -> set[str]:
        """The free nodes (transitively) that the given nodes read."""
        needed: set[str] = set()
        stack = [inp for name in names for inp in self.nodes[name].all_input_nodes]
        while stack:
            node = stack.pop()
            if node.name in self.free and node.name not in needed:
                needed.add(node.name)
                stack.extend(node.all_input_nodes)
        return needed


class LayerGraph:
    """The flat graph, its analysis and an ordered chain of layers.

    Passes never mutate a LayerGraph: ``with_layers`` returns a new one sharing the graph.
    """

    def __init__(self, analysis: GraphAnalysis, layers: list[Layer], graph_meta: dict | None = None) -> None:
        self.analysis = analysis
        self.layers = layers
        self.meta: dict[str, Any] = dict(graph_meta or {})
        self.meta.setdefault(meta.FRONTEND, analysis.traced.frontend)
        for layer in layers:
            self._fill_layer_meta(layer)

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_traced(cls, traced: Traced) -> LayerGraph:
        ValueProp(traced.gm).propagate(*traced.example_leaves)
        ops.annotate_flops(traced.gm.graph)
        analysis = GraphAnalysis(traced)
        groups = _group_by_spans([n.name for n in analysis.compute],
                                 [analysis.position[n.name] for n in analysis.compute],
                                 analysis.glued_spans())
        layers = [Layer(name="", nodes=group) for group in groups]
        graph = cls(analysis, layers)
        graph.validate()
        return graph

    def with_layers(self, groups: list[list[str]]) -> LayerGraph:
        """A new LayerGraph over the same nodes, cut into ``groups`` (lists of node names)."""
        position = self.analysis.position
        layers = [Layer(name="", nodes=sorted(group, key=position.__getitem__)) for group in groups if group]
        return LayerGraph(self.analysis, layers, self.meta)

    def merged(self, ranges: list[tuple[int, int]]) -> LayerGraph:
        """Merges each inclusive range of consecutive layers into one; ranges cover the chain.
        Profiles (``meta.PROFILE``) merge too when every layer of a range has one."""
        groups = [[name for layer in self.layers[start:end + 1] for name in layer.nodes] for start, end in ranges]
        graph = self.with_layers(groups)
        for layer, (start, end) in zip(graph.layers, ranges):
            profiles = [old.meta.get(meta.PROFILE) for old in self.layers[start:end + 1]]
            present = [profile for profile in profiles if profile is not None]
            if len(present) == len(profiles):
                layer.meta[meta.PROFILE] = merge_layer_profiles(layer.name, present)
        return graph

    # queries ------------------------------------------------------------------------------
    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.analysis.traced.gm

    @property
    def traced(self) -> Traced:
        return self.analysis.traced

    def __len__(self) -> int:
        return len(self.layers)

    @cached_property
    def layer_of(self) -> dict[str, int]:
        return {name: index for index, layer in enumerate(self.layers) for name in layer.nodes}

    def producer_layer(self, name: str) -> int:
        """Layer that makes a non-free value; -1 for a model input."""
        return self.layer_of.get(name, -1)

    @cached_property
    def _spans(self) -> list[tuple[int, int, str]]:
        """(producer layer, last consumer layer, name) of each non-free value that is consumed."""
        last = len(self.layers)
        spans = []
        for node in self.gm.graph.nodes:
            if node.name in self.analysis.free or node.op not in ("placeholder", *CALL_OPS):
                continue
            consumers = [last if user.op == OUTPUT else self.layer_of[user.name] for user in node.users
                         if user.op == OUTPUT or user.name not in self.analysis.free]
            if consumers:
                spans.append((self.producer_layer(node.name), max(consumers), node.name))
        return spans

    def crossing(self, index: int) -> list[str]:
        """Names of the values crossing boundary ``index`` (after layer ``index``), in graph order."""
        return [name for producer, consumer, name in self._spans if producer <= index < consumer]

    def boundary(self, index: int) -> Boundary:
        nodes = self.analysis.nodes
        return Boundary(index, tuple(
            BoundaryValue(name, value_info(nodes[name]), name in self.analysis.param_dependent)
            for name in self.crossing(index)
        ))

    def boundaries(self) -> list[Boundary]:
        """The boundaries between consecutive layers (``len(self) - 1`` of them)."""
        return [self.boundary(index) for index in range(len(self.layers) - 1)]

    def consumers_after(self, name: str, index: int, include_output: bool = True) -> list[int]:
        node = self.analysis.nodes[name]
        last = len(self.layers)
        found = []
        for user in node.users:
            if user.op == OUTPUT:
                if include_output:
                    found.append(last)
            elif user.name not in self.analysis.free and self.layer_of[user.name] > index:
                found.append(self.layer_of[user.name])
        return found

    def output_names(self) -> list[str]:
        """Flat output values in order (free ones are recomputed by the last stage)."""
        return [node.name for node in self.analysis.output.args[0]]

    def layer_params(self, index: int) -> list[str]:
        return self.layers[index].meta[meta.PARAMS]

    # checks -------------------------------------------------------------------------------
    def validate(self) -> None:
        seen: dict[str, int] = {}
        for index, layer in enumerate(self.layers):
            for name in layer.nodes:
                if name in seen:
                    raise PlanError(f"node {name} is in layers {seen[name]} and {index}")
                seen[name] = index
        missing = {n.name for n in self.analysis.compute} - seen.keys()
        if missing:
            raise PlanError(f"compute nodes in no layer: {sorted(missing)[:5]}")
        for name, index in seen.items():
            for dep in self.analysis.order_deps[name]:
                if seen.get(dep, -1) > index:
                    raise PlanError(f"node {name} (layer {index}) must follow {dep} (layer {seen[dep]})")
        for producer, consumer, name in self._spans:
            if consumer > producer and value_info(self.analysis.nodes[name]).kind == OTHER and producer >= 0:
                raise PlanError(f"value {name} ({value_info(self.analysis.nodes[name]).python_type}) "
                                "cannot cross a boundary")

    # metadata -----------------------------------------------------------------------------
    def _fill_layer_meta(self, layer: Layer) -> None:
        nodes = [self.analysis.nodes[name] for name in layer.nodes]
        params = sorted({str(self.analysis.nodes[name].target) for name in self.analysis.needed_free(layer.nodes)
                         if self.analysis.nodes[name].op == "get_attr"})
        kinds = self.traced.param_kinds
        layer.meta[meta.PARAMS] = params
        layer.meta[meta.PARAM_BYTES] = sum(value_info(self.analysis.attributes[p]).nbytes for p in params
                                           if kinds.get(p) == "parameter")
        layer.meta[meta.LAYER_FLOPS] = sum(n.meta.get(meta.FLOPS, 0) for n in nodes)
        layer.meta[meta.OP_SUMMARY] = _op_summary(nodes)
        if not layer.name:
            layer.name = _layer_name(nodes)

    # serialization ------------------------------------------------------------------------
    def to_json(self) -> dict:
        layers = []
        for index, layer in enumerate(self.layers):
            boundary = self.boundary(index)
            layers.append({
                "index": index, "name": layer.name, "nodes": layer.nodes,
                "ops": layer.meta[meta.OP_SUMMARY], "params": layer.meta[meta.PARAMS],
                "param_bytes": layer.meta[meta.PARAM_BYTES], "flops": layer.meta[meta.LAYER_FLOPS],
                "boundary": boundary.to_json(),
            })
        return {"frontend": self.meta[meta.FRONTEND], "inputs": self.boundary(-1).to_json(),
                "layers": layers, "outputs": self.output_names(),
                "total_param_bytes": self.total_param_bytes()}

    def total_param_bytes(self) -> int:
        kinds = self.traced.param_kinds
        return sum(value_info(node).nbytes for target, node in self.analysis.attributes.items()
                   if kinds.get(target) == "parameter")


def _written_in_some_mode(node: torch.fx.Node) -> list[torch.fx.Node]:
    """What the node writes in place in the traced mode or, once the stage is switched, in the
    other: a batch norm traced in eval mode updates its running statistics in train mode
    (its ``training`` flag is in ``MODE_ARGS``), so the readers of those buffers are ordered
    and kept in one stage as in a train-mode trace."""
    written = ops.mutated_inputs(node)
    switched = node.meta.get(MODE_ARGS)
    if written or not switched or node.op != "call_function" or ops.op_name(node) not in ("batch_norm",
                                                                                         "native_batch_norm"):
        return written
    names = ops._FUNCTIONAL_BATCH_NORM if node.target is torch.nn.functional.batch_norm else ops._ATEN_BATCH_NORM
    position = names.index("training")
    if switched.get(position, switched.get("training", (None, None)))[0] is not True:
        return written
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    return [stat for key in ("running_mean", "running_var") if isinstance(stat := bound.get(key), torch.fx.Node)]


def _group_by_spans(names: list[str], positions: list[int], spans: list[tuple[int, int]]) -> list[list[str]]:
    """One group per node, except that nodes inside a common (merged) span share one group."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    groups: list[list[str]] = []
    current_span = None
    span_index = 0
    for name, pos in zip(names, positions):
        while span_index < len(merged) and merged[span_index][1] < pos:
            span_index += 1
        inside = span_index < len(merged) and merged[span_index][0] <= pos
        if inside and current_span == span_index:
            groups[-1].append(name)
        else:
            groups.append([name])
        current_span = span_index if inside else None
    return groups


def _op_summary(nodes: list[torch.fx.Node], limit: int = 4) -> str:
    counts: dict[str, int] = {}
    flops: dict[str, int] = {}
    for node in nodes:
        name = ops.op_name(node)
        counts[name] = counts.get(name, 0) + 1
        flops[name] = flops.get(name, 0) + node.meta.get(meta.FLOPS, 0)
    ranked = sorted(counts, key=lambda n: (-flops[n], -counts[n], n))
    parts = [f"{name}×{counts[name]}" if counts[name] > 1 else name for name in ranked[:limit]]
    if len(ranked) > limit:
        parts.append(f"+{len(ranked) - limit}")
    return ", ".join(parts)


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost submodule whose forward made ``node`` ('' for the top)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    paths = [str(path) for path, _ in stack.values() if not str(path).startswith("_")]
    if not paths:
        return ""
    path = paths[-1]
    for prefix in ("L['self'].", "L__self__."):
        path = path.removeprefix(prefix)
    return path.replace("._modules['", ".").replace("']", "")


def _layer_name(nodes: list[torch.fx.Node]) -> str:
    """The module path shared by the layer's parameter-dependent nodes, and its heaviest op."""
    weighted = [n for n in nodes if n.meta.get(meta.PARAM_DEPENDENT)] or nodes
    paths = [p for p in (module_path(n) for n in weighted) if p]
    if not paths:
        return nodes[0].name if nodes else "empty"
    parts = [p.split(".") for p in paths]
    common = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    prefix = ".".join(common)
    heaviest = max(nodes, key=lambda n: n.meta.get(meta.FLOPS, 0))
    return f"{prefix}:{ops.op_name(heaviest)}" if prefix else f"{paths[0]}:{ops.op_name(heaviest)}"
