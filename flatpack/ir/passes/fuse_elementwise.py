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

    A one-input op applied to a tensor that other layers also read starts a branch, so it
    joins its *reader* instead: in a pre-norm transformer (GPT-2) ``ln_1`` and the
    ``view(-1, d)`` before ``c_attn`` read the residual stream, which the residual add reads
    too. Joining the producer would carry both the stream and its normalized copy across
    the boundary after the add — a fork to ``merge-branches`` and twice the bytes — and
    the natural cut, right after the residual add, would disappear.

    Parameter-free layers computed from the inputs alone (attention masks, position ids,
    casts, sizes) join the first layer that reads them: they are preprocessing, not a
    place to cut. Layers that touch only buffers and constants and that nothing reads
    (BatchNorm's ``num_batches_tracked += 1`` in training mode) join the layer before.
    Whole layers move, never single nodes, so the glue that ``LayerGraph``
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

        to_reader: set[int] = set()
        for group in sorted(members):
            nodes = [analysis.nodes[name] for name in members[group]]
            if not all(ops.kind(node) in ops.FUSABLE_KINDS for node in nodes):
                continue
            producers = external_deps(group)
            if len(producers) == 1 and self._input_read_elsewhere(graph, nodes):
                to_reader.add(group)
            elif producers:
                move(group, max(producers))

        dependents: dict[str, set[str]] = {}
        for name, deps in analysis.order_deps.items():
            for dep in deps:
                dependents.setdefault(dep, set()).add(name)
        for group in sorted(members, reverse=True):
            if group not in members:
                continue
            if group not in to_reader and any(name in analysis.param_dependent for name in members[group]):
                continue
            readers = {owner[user] for name in members[group] for user in dependents.get(name, ())} - {group}
            if readers and min(readers) > group:
                move(group, min(readers))
            elif not readers and self._touches_only_free_values(graph, members[group]):
                earlier = [index for index in members if index < group]
                if earlier:
                    move(group, max(earlier))

        return graph.with_layers([members[index] for index in sorted(members)])

    @staticmethod
    def _touches_only_free_values(graph: LayerGraph, names: list[str]) -> bool:
        """A layer that reads only parameters, buffers and constants and that nothing reads:
        a side effect such as BatchNorm's ``num_batches_tracked += 1``. It is no place to
        cut, so it joins the layer before it."""
        analysis = graph.analysis
        inside = set(names)
        return all(inp.name in analysis.free or inp.name in inside
                   for name in names for inp in analysis.nodes[name].all_input_nodes)

    @staticmethod
    def _input_read_elsewhere(graph: LayerGraph, nodes: list) -> bool:
        """True when a tensor these nodes read is also read outside them (they start a branch)."""
        inside = {node.name for node in nodes}
        free = graph.analysis.free
        for node in nodes:
            for base in node.all_input_nodes:
                if base.name in inside or base.name in free:
                    continue
                if any(user.name not in inside for user in base.users):
                    return True
        return False
