"""merge-branches: fork…join regions become single layers, so the chain is linear (Gillis Fig. 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class MergeBranches:
    """Removes every boundary that lies inside a fork…join region.

    The rule: a boundary lies inside a region when two or more *parameter-dependent*
    values cross it on their way to a later layer — a residual block's skip and branch,
    an inception module's parallel towers, attention's query, key and value. The layers on
    both sides of such a boundary are merged.

    Values that depend on no trainable parameter — attention masks, position ids, sizes,
    raw model inputs — are not branches: they are computed once and may cross any number
    of boundaries as extra tensors, so a mask used by every encoder layer does not collapse
    the encoder into one layer. A value whose only remaining reader is the model's output
    does not count either (it is carried to the end, not joined).
    """

    name: ClassVar[str] = "merge-branches"

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        count = len(graph.layers)
        if count < 2:
            return graph
        branches = [0] * (count + 1)
        for name in graph.analysis.param_dependent:
            if name in graph.analysis.free or name not in graph.analysis.nodes:
                continue
            producer = graph.producer_layer(name)
            readers = graph.consumers_after(name, producer, include_output=False)
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
            if crossing < 2:
                ranges.append((start, boundary))
                start = boundary + 1
        ranges.append((start, count - 1))
        return graph.merged(ranges)
