"""What a solver sees: the chain as plain numbers, never torch objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flatpack.ir import meta
from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class ChainLayer:
    name: str
    param_bytes: int
    flops: int
    boundary_bytes: int  # bytes crossing the boundary after this layer
    profile: dict[str, Any] | None = None


@dataclass(frozen=True)
class Problem:
    chain: tuple[ChainLayer, ...]
    stages: int | None = None
    target: str = "local"
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_graph(cls, graph: LayerGraph, stages: int | None = None, target: str = "local",
                   **options: Any) -> "Problem":
        chain = tuple(
            ChainLayer(layer.name, layer.meta[meta.PARAM_BYTES], layer.meta[meta.LAYER_FLOPS],
                       graph.boundary(index).nbytes, layer.meta.get(meta.PROFILE))
            for index, layer in enumerate(graph.layers)
        )
        return cls(chain, stages, target, options)
