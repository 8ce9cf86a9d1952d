"""The planner's view of Gillis's channel split (Gillis §II-C, §III-C):
for every group of consecutive layers that a channel split applies to, the numbers the
fork-join cost model needs.

The rules themselves — which ops keep a value sliced, which make a partial sum — are the
stage kernel's (:mod:`flatpack.stage.channels`), since a fork-join worker applies them to
its stage module at run time: the split the planner costs is the split that runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from flatpack.ir import meta
from flatpack.ir.values import value_info
from flatpack.stage.channels import (PARTIAL, WHOLE, Analyser, ChannelAnalysis, NotChannelSplittable, Sliced,
                                     channel_ranges)

if TYPE_CHECKING:
    from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class ChannelGroup:
    """What the cost model needs of a group's channel split, at the example batch: the
    split layers' fewest channels, the weights a partition keeps, the share of the group's
    FLOPs that divide over the partitions (the rest every partition repeats), and the share
    of its output bytes joined by concatenation, by summation, or taken whole."""

    max_partitions: int
    limiting_layer: str
    whole_bytes: int
    sliced: tuple[tuple[int, int], ...]     # (channels, bytes) of each sliced weight
    split_flops_share: float
    sliced_output_share: float
    partial_output_share: float

    def partition_bytes(self, parts: int) -> int:
        return self.whole_bytes + sum(math.ceil(nbytes * channel_ranges(channels, parts)[0][1] / channels)
                                      for channels, nbytes in self.sliced)

    @property
    def whole_output_share(self) -> float:
        return max(0.0, 1.0 - self.sliced_output_share - self.partial_output_share)


def summarize(analysis: ChannelAnalysis, nodes: list[torch.fx.Node], flops_of: Callable[[torch.fx.Node], int],
              output_bytes: list[int]) -> ChannelGroup:
    """The planner's numbers for one analysed group (``output_bytes`` per group output)."""
    total_flops = sum(flops_of(node) for node in nodes)
    split_flops = sum(flops_of(node) for node in nodes if analysis.states.get(node.name, WHOLE) != WHOLE)
    out_total = sum(output_bytes) or 1
    sliced_out = sum(b for b, s in zip(output_bytes, analysis.outputs) if isinstance(s, Sliced))
    partial_out = sum(b for b, s in zip(output_bytes, analysis.outputs) if s == PARTIAL)
    node, channels = min(analysis.anchors, key=lambda anchor: anchor[1])
    sliced = tuple((analysis.sliced_params[name][1], nbytes) for name, nbytes in analysis.param_bytes.items()
                   if name in analysis.sliced_params)
    whole = sum(nbytes for name, nbytes in analysis.param_bytes.items() if name not in analysis.sliced_params)
    return ChannelGroup(channels, node, whole, sliced, split_flops / total_flops if total_flops else 1.0,
                        sliced_out / out_total, partial_out / out_total)


def group_table(graph: LayerGraph) -> dict[tuple[int, int], ChannelGroup]:
    """The channel split of every group start..end of the chain that has one, by the same
    rules the runtime applies to the group's stage module (``runtime/channel_split.py``).

    Extending a group keeps every op it had, with the same inputs, so once a group cannot
    be split no longer group from the same start can: each start is analysed once, layer by
    layer, up to its first failure. A group with a non-tensor input (a size, a flag) is
    left out, as the runtime can only broadcast tensors."""

    nodes = graph.analysis.nodes
    order = {node.name: position for position, node in enumerate(graph.gm.graph.nodes)}

    def shape_of(node: torch.fx.Node) -> tuple[int, ...] | None:
        info = value_info(node)
        return tuple(info.shape) if info.kind == "tensor" else None

    def flops_of(node: torch.fx.Node) -> int:
        return int(node.meta.get(meta.FLOPS, 0) or 0)

    table: dict[tuple[int, int], ChannelGroup] = {}
    for start in range(len(graph.layers)):
        if any(value.info.kind != "tensor" for value in graph.boundary(start - 1).values):
            continue
        analyser = Analyser([], shape_of, lambda node: value_info(node).nbytes, f"layers {start}..",
                             lambda node: str(node.target))
        group_nodes: list[torch.fx.Node] = []
        seen: set[str] = set()
        for end in range(start, len(graph.layers)):
            layer = graph.layers[end].nodes
            # the free nodes (weights, values made from weights alone) the layer reads, first
            added = sorted((set(layer) | graph.analysis.needed_free(layer)) - seen, key=order.__getitem__)
            seen.update(added)
            group_nodes += [nodes[name] for name in added]
            try:
                analyser.feed(nodes[name] for name in added)
                analysis = analyser.result()
            except NotChannelSplittable:
                break
            if not analysis.anchors:
                continue
            outputs = graph.boundary(end).values
            analysis = dataclasses.replace(analysis, outputs=tuple(analysis.states.get(value.name, WHOLE)
                                                                    for value in outputs))
            table[(start, end)] = summarize(analysis, group_nodes, flops_of,
                                            [value.info.nbytes for value in outputs])
    return table

