"""Gillis's channel split of a layer group (Gillis §II-C Fig. 2b, §III-C):
which parts of a group's fx graph can be cut by output channels, and what each partition
keeps.

Every worker receives the group's whole inputs (broadcast). A conv or linear layer whose
input is whole keeps a contiguous slice of its filters (output channels / features): its
output is *sliced*. Channel-local ops (activations, batch norm, pooling, reductions over
other dimensions, elementwise arithmetic) keep a sliced value sliced, with per-channel
weights sliced the same way. A conv or linear layer fed a sliced value keeps the matching
slice of its *input* channels ("the next layer's input channels follow"): each partition
then holds a *partial* sum of the output, completed by the master. Partial sums go only
through linear ops (add, subtract, scale); a whole value added to a partial sum, and the
bias of a layer that makes one, are counted on partition 0 alone.

The group's outputs are joined by the master: sliced ones concatenated along their channel
dimension, partial ones summed, whole ones (the same on every partition) taken from
partition 0. An op the rules do not cover that meets a sliced or partial value makes the
group unsplittable by channel (:class:`NotChannelSplittable`, naming the op).

One analysis serves the planner (on the compiler's graph, with shapes from the example
run) and the runtime (on a stage's traced module, with shapes from ``ShapeProp``), so the
split the planner costs is the split that runs (the planner's numbers: :mod:`flatpack.ir.channels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from flatpack.errors import PlanError

WHOLE = "whole"
PARTIAL = "partial"

_CONV_DIMS = {"conv1d": 1, "conv2d": 2, "conv3d": 3}
_WEIGHTED = {*_CONV_DIMS, "linear"}
_UNARY = {"relu", "relu_", "gelu", "tanh", "sigmoid", "silu", "hardtanh", "leaky_relu", "elu", "selu", "softplus",
          "hardswish", "hardsigmoid", "mish", "relu6", "dropout", "contiguous", "clone", "exp", "abs", "sqrt",
          "rsqrt", "square", "erf", "pos"}
_POOLS = {"max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
          "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "adaptive_max_pool1d",
          "adaptive_max_pool2d", "adaptive_max_pool3d"}
_REDUCTIONS = {"mean", "sum", "amax", "amin"}
_ADDITIVE = {"add", "sub", "add_", "sub_", "iadd", "isub"}
_SCALING = {"mul", "truediv", "div", "mul_", "div_", "imul", "itruediv"}
_NEGATE = {"neg"}


@dataclass(frozen=True)
class Sliced:
    """A value each partition holds a contiguous slice of, along ``dim`` of ``channels``."""

    dim: int
    channels: int


State = Any  # WHOLE, PARTIAL or a Sliced


class NotChannelSplittable(PlanError):
    """The group has an op the channel split cannot cut; the message names it."""


@dataclass(frozen=True)
class ChannelAnalysis:
    """The channel split of one group: how each node's value is held, which weights are
    sliced along which axis, and how the master joins each output."""

    states: dict[str, State]
    sliced_params: dict[str, tuple[int, int]]            # get_attr target -> (axis, channels)
    bias_on_first: frozenset[str]                         # partial-making layers: bias on partition 0
    whole_on_first: dict[str, int]                        # partial ± whole nodes -> the partial's arg index
    narrowed: dict[tuple[str, int], tuple[int, Sliced]]   # (node, arg) of a whole operand -> (axis, slice)
    outputs: tuple[State, ...]
    anchors: tuple[tuple[str, int], ...]                  # (layer, channels) of every split layer, by weight name
    param_bytes: dict[str, int] = field(default_factory=dict)   # every weight the group reads

    @property
    def max_partitions(self) -> int:
        return min(channels for _, channels in self.anchors)

    def check_partitions(self, parts: int, where: str) -> None:
        """PlanError unless every split layer has at least ``parts`` channels."""
        if not self.anchors:
            raise NotChannelSplittable(f"{where} has no conv or linear layer whose output channels could be split; "
                                       "split it by batch or run it on the master alone")
        node, channels = min(self.anchors, key=lambda anchor: anchor[1])
        if parts > channels:
            raise PlanError(f"{where}: layer {node} has {channels} output channels, fewer than the {parts} partitions "
                            f"asked for; split it over at most {channels} partitions, or split by batch")


def channel_ranges(channels: int, parts: int) -> list[tuple[int, int]]:
    """(start, length) of each partition's channels: ``torch.tensor_split``'s cut, the first
    ``channels % parts`` partitions one channel longer."""
    base, extra = divmod(channels, parts)
    ranges, start = [], 0
    for index in range(parts):
        length = base + (1 if index < extra else 0)
        ranges.append((start, length))
        start += length
    return ranges


def op_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if isinstance(node.target, torch._ops.OpOverload):  # the export frontend's aten ops: aten::add.Tensor -> add
        return node.target._schema.name.split("::")[-1]
    name = getattr(node.target, "__name__", str(node.target))
    return name.strip("_") if name.startswith("__") else name


def analyse(nodes: Iterable[torch.fx.Node], shape_of: Callable[[torch.fx.Node], tuple[int, ...] | None],
            param_bytes: Callable[[torch.fx.Node], int], where: str = "the group",
            param_name: Callable[[torch.fx.Node], str] = lambda node: str(node.target)) -> ChannelAnalysis:
    """The channel split of the compute ``nodes`` (in graph order); values made elsewhere
    are the group's inputs, whole on every partition. ``param_name`` gives a weight's name
    in the model (``c2.weight``): split layers are named by it. Raises NotChannelSplittable."""
    return Analyser(list(nodes), shape_of, param_bytes, where, param_name).run()


class Analyser:
    def __init__(self, nodes: list[torch.fx.Node], shape_of: Callable, param_bytes: Callable, where: str,
                 param_name: Callable[[torch.fx.Node], str]):
        self.nodes = nodes
        self.param_name = param_name
        self.inside = {node.name for node in nodes}
        self.shape_of = shape_of
        self.param_bytes_of = param_bytes
        self.where = where
        self.states: dict[str, State] = {}
        self.sliced_params: dict[str, tuple[int, int]] = {}
        self.whole_params: set[str] = set()
        self.bias_on_first: set[str] = set()
        self.whole_on_first: dict[str, int] = {}
        self.narrowed: dict[tuple[str, int], tuple[int, Sliced]] = {}
        self.anchors: list[tuple[str, int]] = []
        self.param_bytes: dict[str, int] = {}
        self.outputs: tuple[State, ...] = ()

    def run(self) -> ChannelAnalysis:
        self.feed(self.nodes)
        return self.result()

    def feed(self, nodes: Iterable[torch.fx.Node]) -> None:
        """Carries the states on through more nodes (in graph order): a group grown by a
        layer is analysed from where the smaller group stopped."""
        for node in nodes:
            if node.op == "output":
                self.outputs = tuple(self.state(value) for value in _flatten(node.args[0]))
            elif node.op == "get_attr":
                self.param_bytes[str(node.target)] = self.param_bytes_of(node)
            elif node.op in ("call_function", "call_method"):
                self.states[node.name] = self.visit(node)

    def result(self) -> ChannelAnalysis:
        outputs = self.outputs
        for name in self.sliced_params.keys() & self.whole_params:
            raise NotChannelSplittable(f"{self.where}: weight {name} is needed whole by one op and sliced by another; "
                                       "split this group by batch")
        return ChannelAnalysis(dict(self.states), dict(self.sliced_params), frozenset(self.bias_on_first),
                               dict(self.whole_on_first), dict(self.narrowed), outputs, tuple(self.anchors),
                               self.param_bytes)

    def state(self, value: Any) -> State:
        if isinstance(value, torch.fx.Node) and value.op != "get_attr":
            return self.states.get(value.name, WHOLE)
        return WHOLE

    def fail(self, node: torch.fx.Node, why: str) -> NotChannelSplittable:
        return NotChannelSplittable(f"{self.where}: op {node.name} ({op_name(node)}) {why}; split this group by batch "
                                    "or cut the group before it")

    def use_whole(self, node: torch.fx.Node) -> None:
        for value in node.all_input_nodes:
            if value.op == "get_attr":
                self.whole_params.add(str(value.target))

    def slice_param(self, value: Any, axis: int, channels: int, node: torch.fx.Node) -> None:
        if value is None:
            return
        if not isinstance(value, torch.fx.Node) or value.op != "get_attr":
            raise self.fail(node, "reads a weight that is computed, not stored, so it cannot be sliced")
        name = str(value.target)
        if self.sliced_params.get(name, (axis, channels)) != (axis, channels):
            raise self.fail(node, f"slices weight {name} differently from an earlier op")
        self.sliced_params[name] = (axis, channels)

    def visit(self, node: torch.fx.Node) -> State:
        states = [self.state(value) for value in node.all_input_nodes]
        name = op_name(node)
        if all(state == WHOLE for state in states):
            if name in _WEIGHTED and self.splits_output(node):
                return self.split_output(node, name)
            self.use_whole(node)
            return WHOLE
        if name in _WEIGHTED:
            return self.split_input(node, name)
        if name == "batch_norm":
            return self.batch_norm(node)
        first = self.state(node.args[0]) if node.args else WHOLE
        if name in _UNARY or name in _NEGATE:
            if isinstance(first, Sliced) or (first == PARTIAL and name in _NEGATE | {"contiguous", "clone", "pos"}):
                return first
            raise self.fail(node, "is not linear, so it cannot take a partial sum")
        if name in _POOLS:
            return self.pooled(node, first)
        if name in _REDUCTIONS:
            return self.reduction(node, first)
        if name in _ADDITIVE or name in _SCALING:
            return self.binary(node, name)
        raise self.fail(node, "meets a channel-split value and is not one the split knows how to cut")

    # conv / linear ------------------------------------------------------------------------
    def splits_output(self, node: torch.fx.Node) -> bool:
        weight = _arg(node, 1, "weight")
        groups = _arg(node, 6, "groups", 1)
        return isinstance(weight, torch.fx.Node) and weight.op == "get_attr" and groups == 1

    def split_output(self, node: torch.fx.Node, name: str) -> State:
        weight = _arg(node, 1, "weight")
        shape = self.shape_of(weight)
        out_shape = self.shape_of(node)
        if not shape or not out_shape:
            raise self.fail(node, "has no recorded shape")
        channels = shape[0]
        dim = len(out_shape) - 1 if name == "linear" else len(out_shape) - 1 - _CONV_DIMS[name]
        self.slice_param(weight, 0, channels, node)
        self.slice_param(_arg(node, 2, "bias"), 0, channels, node)
        name = self.param_name(weight)
        self.anchors.append((name[:-len(".weight")] if name.endswith(".weight") else name, channels))
        return Sliced(dim, channels)

    def split_input(self, node: torch.fx.Node, name: str) -> State:
        source = self.state(_arg(node, 0, "input"))
        weight = _arg(node, 1, "weight")
        out_shape = self.shape_of(node)
        if not isinstance(source, Sliced) or not out_shape or _arg(node, 6, "groups", 1) != 1:
            raise self.fail(node, "reads a partial sum or a grouped convolution's input")
        expected = len(out_shape) - 1 if name == "linear" else len(out_shape) - 1 - _CONV_DIMS[name]
        if source.dim != expected:
            raise self.fail(node, f"reads channels sliced along dimension {source.dim}, not its input channels")
        self.slice_param(weight, 1, source.channels, node)
        if _arg(node, 2, "bias") is not None:
            self.bias_on_first.add(node.name)
        return PARTIAL

    # channel-local ops --------------------------------------------------------------------
    def batch_norm(self, node: torch.fx.Node) -> State:
        source = self.state(node.args[0])
        if not isinstance(source, Sliced) or source.dim != 1:
            raise self.fail(node, "normalizes over channels other than the split ones")
        for index, key in ((1, "running_mean"), (2, "running_var"), (3, "weight"), (4, "bias")):
            self.slice_param(_arg(node, index, key), 0, source.channels, node)
        return source

    def pooled(self, node: torch.fx.Node, source: State) -> State:
        if not isinstance(source, Sliced) or source.dim != 1:
            raise self.fail(node, "pools a value that is not split along dimension 1")
        return source

    def reduction(self, node: torch.fx.Node, source: State) -> State:
        dims = _arg(node, 1, "dim")
        keepdim = bool(_arg(node, 2, "keepdim", False))
        in_shape = self.shape_of(node.args[0])
        if not isinstance(source, Sliced) or dims is None or not in_shape:
            raise self.fail(node, "reduces over every dimension, the split channels included")
        dims = [d % len(in_shape) for d in (dims if isinstance(dims, (tuple, list)) else (dims,))]
        if source.dim in dims:
            raise self.fail(node, "reduces over the split channels")
        return Sliced(source.dim if keepdim else source.dim - sum(d < source.dim for d in dims), source.channels)

    def binary(self, node: torch.fx.Node, name: str) -> State:
        operands = list(node.args[:2])
        states = [self.state(value) for value in operands]
        out_shape = self.shape_of(node)
        if any(isinstance(state, Sliced) for state in states):
            sliced = next(state for state in states if isinstance(state, Sliced))
            if PARTIAL in states or any(isinstance(s, Sliced) and s != sliced for s in states):
                raise self.fail(node, "mixes differently split values")
            for index, (value, state) in enumerate(zip(operands, states)):
                if state == WHOLE and isinstance(value, torch.fx.Node):
                    self.narrow_whole(node, index, value, sliced, out_shape)
            return sliced
        # partial sums: linear ops only
        if name in _ADDITIVE:
            if states == [PARTIAL, PARTIAL]:
                return PARTIAL
            if states[0] == PARTIAL:
                self.whole_on_first[node.name] = 0
                self.use_whole(node)
                return PARTIAL
            if name in ("add", "iadd"):
                self.whole_on_first[node.name] = 1
                self.use_whole(node)
                return PARTIAL
            raise self.fail(node, "subtracts a partial sum from a whole value")
        if states == [PARTIAL, WHOLE] or (states == [WHOLE, PARTIAL] and name in ("mul", "imul")):
            self.use_whole(node)
            return PARTIAL
        raise self.fail(node, "divides by or multiplies two partial sums")

    def narrow_whole(self, node: torch.fx.Node, index: int, value: torch.fx.Node, sliced: Sliced,
                     out_shape: tuple[int, ...] | None) -> None:
        """A whole operand broadcast against a sliced one: sliced too where it spans the
        split channels, kept whole where it broadcasts along them."""
        shape = self.shape_of(value)
        if shape is None or out_shape is None:
            raise self.fail(node, "has an operand of unknown shape")
        axis = len(shape) - (len(out_shape) - sliced.dim)
        if axis < 0 or shape[axis] == 1:
            if value.op == "get_attr":
                self.whole_params.add(str(value.target))
            return
        if shape[axis] != sliced.channels:
            raise self.fail(node, f"has an operand of {shape[axis]} channels against {sliced.channels}")
        self.narrowed[(node.name, index)] = (axis, sliced)
        if value.op == "get_attr":
            self.slice_param(value, axis, sliced.channels, node)
            del self.narrowed[(node.name, index)]


def _arg(node: torch.fx.Node, index: int, key: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(key, default)


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]

