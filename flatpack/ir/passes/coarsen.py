"""coarsen: merge adjacent layers until at most N remain (FuncPipe §4, "MIQP Solution")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.ir import meta
from flatpack.ir.graph import LayerGraph
from flatpack.ir.values import TENSOR, value_info

BY_CHOICES = ("time", "params", "activation")


@dataclass(frozen=True)
class Coarsen:
    """Merges adjacent layers until at most ``max_layers`` remain, balancing ``by``.

    FuncPipe merges layers before solving so the MIQP stays small; like it, this merges
    the adjacent pair whose combined weight is smallest, repeatedly, which keeps the
    heaviest layers apart. Weights:

    - ``params``: bytes of trainable parameters the layer reads (from shapes).
    - ``activation``: bytes of the tensors the layer produces (from the example run).
    - ``time``: the profiler's measured seconds when ``layer.meta["profile"]`` exists
      (issue 3); until then a FLOP estimate from shapes (``ir.ops.estimate_flops``),
      which ranks layers but does not predict seconds.
    """

    name: ClassVar[str] = "coarsen"
    max_layers: int = 48
    by: str = "time"

    def __post_init__(self) -> None:
        if not isinstance(self.max_layers, int) or self.max_layers < 1:
            raise ValueError(f"max-layers must be a positive integer, got {self.max_layers!r}")
        if self.by not in BY_CHOICES:
            raise ValueError(f"by must be one of {', '.join(BY_CHOICES)}, got {self.by!r}")

    @property
    def reads_profile(self) -> bool:
        """``compile(profile=...)`` profiles the chain before a pass that reads profiles."""
        return self.by == "time"

    def weight(self, graph: LayerGraph, index: int) -> float:
        layer = graph.layers[index]
        if self.by == "params":
            return float(layer.meta[meta.PARAM_BYTES])
        if self.by == "activation":
            return float(sum(value_info(graph.analysis.nodes[name]).nbytes for name in layer.nodes
                             if value_info(graph.analysis.nodes[name]).kind == TENSOR))
        profile = layer.meta.get(meta.PROFILE)
        if profile is not None:
            return profile.forward_s.at(1) + profile.backward_s.at(1)
        return float(layer.meta[meta.LAYER_FLOPS])

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        if len(graph.layers) <= self.max_layers:
            return graph
        ranges = [(index, index) for index in range(len(graph.layers))]
        weights = [self.weight(graph, index) for index in range(len(graph.layers))]
        while len(ranges) > self.max_layers:
            pair = min(range(len(ranges) - 1), key=lambda i: (weights[i] + weights[i + 1], i))
            ranges[pair:pair + 2] = [(ranges[pair][0], ranges[pair + 1][1])]
            weights[pair:pair + 2] = [weights[pair] + weights[pair + 1]]
        return graph.merged(ranges)
