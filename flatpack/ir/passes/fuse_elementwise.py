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

    An element-wise *function* of one tensor that torch spells as several ops — the
    activation ``torch.where(x > 0, x, 0.1 * x)``, or ``x * sigmoid(x)`` — reads ``x`` from
    each of its ops, so each op alone looks like the start of a branch. When every reader of
    ``x`` belongs to such a function (element-wise ops whose inputs are ``x``, each other and
    parameters), it is one op: it joins ``x``'s producer, and the block boundary after it
    carries one value
    (``tests/unit/test_passes.py::test_fuse_elementwise_keeps_a_multi_op_activation_with_its_producer``).

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

        functions = self._elementwise_functions(graph)
        to_reader: set[int] = set()
        for group in sorted(members):
            nodes = [analysis.nodes[name] for name in members[group]]
            if not all(ops.kind(node) in ops.FUSABLE_KINDS for node in nodes):
                continue
            producers = external_deps(group)
            if len(producers) == 1 and self._input_read_elsewhere(graph, nodes, functions):
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
    def _elementwise_functions(graph: LayerGraph) -> dict[str, set[str]]:
        """Tensor name -> the nodes of the element-wise function of it that all its readers form.

        Only tensors read by two or more ops, every one of them inside the function, are
        listed: the function is the ops reachable from the tensor whose kind is fusable and
        whose non-free inputs are the tensor or earlier ops of the function, and it has one
        result (one op read from outside it). One reader outside it (a residual add, a
        linear), or two results, means the tensor forks, and it is not listed.
        """
        analysis = graph.analysis
        compute = {node.name for node in analysis.compute}
        functions: dict[str, set[str]] = {}
        for base in analysis.graph.nodes:
            readers = [user for user in base.users if user.op != "output"]
            if base.name in analysis.free or len(readers) < 2 or len(readers) != len(base.users):
                continue
            inside: set[str] = set()
            frontier = sorted(readers, key=lambda user: analysis.position[user.name])
            while frontier:
                node = frontier.pop(0)
                if node.name in inside or node.name not in compute or ops.kind(node) not in ops.FUSABLE_KINDS:
                    continue
                if not all(inp is base or inp.name in inside or inp.name in analysis.free
                           for inp in node.all_input_nodes):
                    continue
                inside.add(node.name)
                frontier.extend(node.users)
                frontier.sort(key=lambda user: analysis.position[user.name])
            results = [name for name in inside
                       if any(user.name not in inside for user in analysis.nodes[name].users)]
            # one result: the ops reconverge (where(x > 0, x, 0.1 * x)); two readers that each
            # go their own way (relu before two convolutions) are a fork, not a function
            if all(user.name in inside for user in readers) and len(results) == 1:
                functions[base.name] = inside
        return functions

    @staticmethod
    def _input_read_elsewhere(graph: LayerGraph, nodes: list, functions: dict[str, set[str]]) -> bool:
        """True when a tensor these nodes read is also read outside them (they start a branch),
        unless all of its readers form one element-wise function of it."""
        inside = {node.name for node in nodes}
        free = graph.analysis.free
        for node in nodes:
            for base in node.all_input_nodes:
                if base.name in inside or base.name in free:
                    continue
                if base.name in functions and inside <= functions[base.name]:
                    continue
                if any(user.name not in inside for user in base.users):
                    return True
        return False
