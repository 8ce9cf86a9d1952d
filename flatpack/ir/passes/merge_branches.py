"""merge-branches: fork…join regions become single layers, so the chain is linear (Gillis Fig. 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.ir import ops
from flatpack.ir.graph import LayerGraph, module_path


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

    *Long-lived values* pass whole blocks by: the encoder output that every decoder block
    of BART or T5 reads (its cross-attention), the decoder's input ids waiting across the
    encoder, the cell before last that an AmoebaNet cell reads. A value is long-lived when
    it crosses the boundary between two consecutive blocks of a stack (children ``N`` and
    ``N+1`` of one module, ``decoder.layers.0`` → ``decoder.layers.1``, where block ``N+1``
    reads what block ``N`` made) without having been made in block ``N``, and every later
    reader applies parameters to it (a projection, an embedding: it is an input of the
    blocks ahead, not a partial result waiting for a join). At a *module
    boundary* — the layers on its two sides belong to two sibling submodules, and the later
    one reads what the earlier made: consecutive blocks, ``encoder`` → ``decoder`` — up to
    ``long_lived`` (default 1) long-lived values cross without counting, so these models
    keep a cut between every two blocks, where ``torch.distributed.pipelining`` users cut
    them (``tests/unit/test_passes.py::test_merge_branches_cuts_an_encoder_decoder_between_blocks``).
    Inside a block, and between parallel branches (inception towers, attention heads), the
    rule is unchanged. ``long-lived=0`` turns this off.
    """

    name: ClassVar[str] = "merge-branches"
    max_crossing: int = 1
    long_lived: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.max_crossing, int) or isinstance(self.max_crossing, bool) or self.max_crossing < 1:
            raise ValueError(f"max-crossing must be a positive integer, got {self.max_crossing!r}")
        if not isinstance(self.long_lived, int) or isinstance(self.long_lived, bool) or self.long_lived < 0:
            raise ValueError(f"long-lived must be a non-negative integer, got {self.long_lived!r}")

    def __call__(self, graph: LayerGraph) -> LayerGraph:
        count = len(graph.layers)
        if count < 2:
            return graph
        analysis = graph.analysis
        spans: list[tuple[str, int, int]] = []  # (branch value, producer layer, last reader layer)
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
            spans.append((node.name, max(producer, 0), max(readers)))
        modules = self._module_boundaries(graph) if self.long_lived else {}
        long_lived = self._long_lived(graph, spans, modules)
        ranges: list[tuple[int, int]] = []
        start = 0
        for boundary in range(count - 1):
            crossing = [name for name, first, last in spans if first <= boundary < last]
            exempt = min(self.long_lived, sum(name in long_lived for name in crossing)) if boundary in modules else 0
            if len(crossing) - exempt <= self.max_crossing:
                ranges.append((start, boundary))
                start = boundary + 1
        ranges.append((start, count - 1))
        return graph.merged(ranges)

    @staticmethod
    def _module_boundaries(graph: LayerGraph) -> dict[int, tuple[str, str, str]]:
        """Boundary -> (parent, earlier child, later child) where the boundary runs between two
        sibling submodules and the later reads a value the earlier made.

        A layer's side is the module of its last (earlier layer) or first (later layer)
        parameter-dependent node: masks and sizes computed in the parent do not move it.
        """
        analysis = graph.analysis
        dependent = [[analysis.nodes[name] for name in layer.nodes if name in analysis.param_dependent]
                     for layer in graph.layers]
        found: dict[int, tuple[str, str, str]] = {}
        for boundary in range(len(graph.layers) - 1):
            if not dependent[boundary] or not dependent[boundary + 1]:
                continue
            before = module_path(dependent[boundary][-1]).split(".")
            after = module_path(dependent[boundary + 1][0]).split(".")
            shared = 0
            while shared < min(len(before), len(after)) and before[shared] == after[shared]:
                shared += 1
            if shared == len(before) or shared == len(after) or not before[shared] or not after[shared]:
                continue  # one side is the other's parent: no sibling to cut between
            parent = ".".join(before[:shared])
            earlier = ".".join(before[:shared + 1])
            later = ".".join(after[:shared + 1])
            if MergeBranches._reads_from(graph, boundary, earlier, later):
                found[boundary] = (parent, earlier, later)
        return found

    @staticmethod
    def _reads_from(graph: LayerGraph, boundary: int, earlier: str, later: str) -> bool:
        """Whether a value made under module ``earlier`` crosses ``boundary`` to a reader under ``later``."""
        nodes = graph.analysis.nodes
        for name in graph.crossing(boundary):
            if not _under(module_path(nodes[name]), earlier):
                continue
            if any(_under(module_path(user), later) for user in nodes[name].users if user.op != "output"):
                return True
        return False

    @staticmethod
    def _long_lived(graph: LayerGraph, spans: list[tuple[str, int, int]],
                    modules: dict[int, tuple[str, str, str]]) -> set[str]:
        """Branch values that cross the boundary between blocks ``N`` and ``N+1`` of a stack
        without having been made in block ``N``: they pass a whole block by."""
        nodes = graph.analysis.nodes
        found: set[str] = set()
        for boundary, (_parent, earlier, later) in modules.items():
            first, second = earlier.rsplit(".", 1)[-1], later.rsplit(".", 1)[-1]
            if not (first.isdigit() and second.isdigit() and int(second) == int(first) + 1):
                continue
            for name, start, end in spans:
                if start <= boundary < end and not _under(module_path(nodes[name]), earlier) \
                        and MergeBranches._feeds_parameters(graph, name, boundary):
                    found.add(name)
        return found

    @staticmethod
    def _feeds_parameters(graph: LayerGraph, name: str, boundary: int) -> bool:
        """Whether every later reader of ``name`` applies parameters to it directly (a
        cross-attention projection, an embedding): an input to the blocks ahead, not a partial
        result waiting to be joined (an inception tower's output on its way to the concat)."""
        readers = [user for user in graph.analysis.nodes[name].users
                   if user.op != "output" and graph.layer_of.get(user.name, -1) > boundary]
        return bool(readers) and all(MergeBranches._applies_parameters(graph, user) for user in readers)

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


def _under(path: str, module: str) -> bool:
    """Whether ``path`` is ``module`` or one of its submodules."""
    return path == module or path.startswith(module + ".")
