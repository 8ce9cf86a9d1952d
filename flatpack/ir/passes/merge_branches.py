"""merge-branches: fork…join regions become single layers, so the chain is linear (Gillis Fig. 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.ir import ops
from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class MergeBranches:
    """Removes every boundary that lies inside a fork…join region.

    The rule: a boundary lies inside a region when two or more *branch values* cross it on
    their way to a later layer — a residual block's skip and branch, an inception module's
    parallel towers, attention's query, key and value. The layers on both sides of such a
    boundary are merged. A branch value is

    - a value that depends on a trainable parameter, counted up to its last reader; or
    - a parameter-free value (a model input, or something computed from inputs alone)
      counted up to the last reader that applies parameters to it directly — an inception
      module at the model's input forks the input itself into convolutions.

    Parameter-free values built from sizes and constants alone (an RNN's zero initial
    state ``zeros(x.size(0), hidden)``) carry no input data and are side values too.

    Other parameter-free values — attention masks, position ids, sizes — are side values:
    computed once, they may cross any number of boundaries as extra tensors, so a mask used
    by every encoder layer does not collapse the encoder into one layer. A value whose only
    remaining reader is the model's output does not count either (it is carried to the
    end, not joined).

    ``max_crossing`` (default 1) is how many branch values a boundary may carry and stay a
    cut. 1 gives Gillis's linear chain. Networks whose natural cuts carry several tensors
    need more: an AmoebaNet cell reads the outputs of the two cells before it, so two
    branch values cross between every pair of cells (torchgpipe and FuncPipe cut there and
    ship both); ``merge-branches{max-crossing=2}`` keeps those cuts while still merging the
    cells' insides, where more values cross.
    """

    name: ClassVar[str] = "merge-branches"
    max_crossing: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_crossing, int) or isinstance(self.max_crossing, bool) or self.max_crossing < 1:
            raise ValueError(f"max-crossing must be a positive integer, got {self.max_crossing!r}")

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        count = len(graph.layers)
        if count < 2:
            return graph
        analysis = graph.analysis
        branches = [0] * (count + 1)
        carries_data = self._carries_input_data(graph)
        for node in analysis.graph.nodes:
            if node.name in analysis.free or node.op == "get_attr" or node.op == "output":
                continue
            if node.name not in analysis.param_dependent and node.name not in carries_data:
                continue
            producer = graph.producer_layer(node.name)
            readers = graph.consumers_after(node.name, producer, include_output=False)
            if node.name not in analysis.param_dependent:
                readers = [graph.layer_of[user.name] for user in node.users
                           if user.name in graph.layer_of and graph.layer_of[user.name] > producer
                           and self._applies_parameters(graph, user)]
            if not readers:
                continue
            start, end = max(producer, 0), max(readers)
            branches[start] += 1
            branches[end] -= 1
        ranges: list[tuple[int, int]] = []
        crossing = 0
        start = 0
        for boundary in range(count - 1):
            crossing += branches[boundary]
            if crossing <= self.max_crossing:
                ranges.append((start, boundary))
                start = boundary + 1
        ranges.append((start, count - 1))
        return graph.merged(ranges)

    @staticmethod
    def _carries_input_data(graph: LayerGraph) -> set[str]:
        """Nodes whose value derives from the model's input values (not only their shapes)."""
        carrying: set[str] = set()
        for node in graph.analysis.graph.nodes:
            if node.op == "placeholder":
                carrying.add(node.name)
            elif not ops.reads_metadata_only(node) and any(inp.name in carrying for inp in node.all_input_nodes):
                carrying.add(node.name)
        return carrying

    @staticmethod
    def _applies_parameters(graph: LayerGraph, node) -> bool:
        analysis = graph.analysis
        return any(inp.name in analysis.free and inp.name in analysis.param_dependent
                   for inp in node.all_input_nodes)
