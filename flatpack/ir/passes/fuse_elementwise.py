"""fuse-elementwise: cheap ops join a neighbouring layer (Gillis §III-C)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.ir import ops
from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class FuseElementwise:
    """Element-wise, activation, normalization, dropout and view/reshape layers join the layer
    of their latest producer, so a ``linear → add → gelu → dropout`` run becomes one layer.

    Parameter-free layers computed from the inputs alone (attention masks, position ids,
    casts, sizes) join the first layer that reads them: they are preprocessing, not a
    place to cut. Whole layers move, never single nodes, so the glue that ``LayerGraph``
    established (multi-output ops with their projections, in-place writes with their
    targets) is kept.
    """

    name: ClassVar[str] = "fuse-elementwise"

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        analysis = graph.analysis
        members = {index: list(layer.nodes) for index, layer in enumerate(graph.layers)}
        owner = {name: index for index, names in members.items() for name in names}

        def external_deps(group: int) -> set[int]:
            return {owner[dep] for name in members[group] for dep in analysis.order_deps[name]
                    if dep in owner} - {group}

        def move(group: int, target: int) -> None:
            for name in members[group]:
                owner[name] = target
            members[target].extend(members.pop(group))

        for group in sorted(members):
            nodes = [analysis.nodes[name] for name in members[group]]
            if not all(ops.kind(node) in ops.FUSABLE_KINDS for node in nodes):
                continue
            producers = external_deps(group)
            if producers:
                move(group, max(producers))

        dependents: dict[str, set[str]] = {}
        for name, deps in analysis.order_deps.items():
            for dep in deps:
                dependents.setdefault(dep, set()).add(name)
        for group in sorted(members, reverse=True):
            if any(name in analysis.param_dependent for name in members[group]):
                continue
            readers = {owner[user] for name in members[group] for user in dependents.get(name, ())} - {group}
            if readers and min(readers) > group:
                move(group, min(readers))

        return graph.with_layers([members[index] for index in sorted(members)])
