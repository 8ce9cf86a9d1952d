"""Graph passes over the LayerGraph: a registry of names and a pipeline parser.

A pass is any object with a ``name`` and ``__call__(LayerGraph) -> LayerGraph``; the ones
here are small frozen dataclasses whose fields are their options. Pipelines are strings:

    "fuse-elementwise,merge-branches,coarsen{max-layers=48,by=time}"

Option names use hyphens in the string and underscores in the dataclass. Users may mix
their own pass objects into the list given to ``run_pipeline``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from flatpack.errors import PassError
from flatpack.ir.graph import LayerGraph
from flatpack.registry import Registry, parse_specs

DEFAULT_PIPELINE = "fuse-elementwise,merge-branches"


@runtime_checkable
class Pass(Protocol):
    name: str

    def __call__(self, graph: LayerGraph) -> LayerGraph: ...


PASSES: Registry[Pass] = Registry("pass", PassError, {
    "fuse-elementwise": "flatpack.ir.passes.fuse_elementwise:FuseElementwise",
    "merge-branches": "flatpack.ir.passes.merge_branches:MergeBranches",
    "coarsen": "flatpack.ir.passes.coarsen:Coarsen",
})


def register_pass(name: str, factory: Callable[..., Pass]) -> None:
    """Registers a pass factory under ``name``; a name can be registered once."""
    PASSES.register(name, factory)


def available_passes() -> list[str]:
    return PASSES.names()


def make_pass(name: str, options: dict[str, Any] | None = None) -> Pass:
    return PASSES.make(name, options)


def parse_pipeline(text: str) -> list[Pass]:
    """Parses ``"a,b{key=value,...}"`` into pass objects."""
    return [make_pass(name, options) for name, options in parse_specs(text, PassError, "pass pipeline")]


def resolve(passes: str | Sequence[Pass | str] | None) -> list[Pass]:
    if passes is None:
        return parse_pipeline(DEFAULT_PIPELINE)
    if isinstance(passes, str):
        return parse_pipeline(passes)
    resolved: list[Pass] = []
    for item in passes:
        if isinstance(item, str):
            resolved.extend(parse_pipeline(item))
        elif callable(item):
            resolved.append(item)
        else:
            raise PassError(f"{item!r} is neither a pass name nor a callable LayerGraph -> LayerGraph")
    return resolved


def run_pipeline(graph: LayerGraph, passes: str | Sequence[Pass | str] | None) -> LayerGraph:
    """Applies the passes in order and checks the chain's invariants after each."""
    for graph_pass in resolve(passes):
        result = graph_pass(graph)
        if not isinstance(result, LayerGraph):
            name = getattr(graph_pass, "name", repr(graph_pass))
            raise PassError(f"pass {name} returned {type(result).__name__}, not a LayerGraph")
        result.validate()
        graph = result
    return graph


def pass_spec(graph_pass: Pass) -> str:
    """The pipeline-string form of a pass object (inverse of ``parse_pipeline``)."""
    name = getattr(graph_pass, "name", None) or getattr(graph_pass, "__name__", type(graph_pass).__name__)
    if not dataclasses.is_dataclass(graph_pass):
        return name
    options = [f"{f.name.replace('_', '-')}={getattr(graph_pass, f.name)}" for f in dataclasses.fields(graph_pass)]
    return f"{name}{{{','.join(options)}}}" if options else name
