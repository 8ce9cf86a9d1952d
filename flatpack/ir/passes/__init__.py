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
from flatpack.registry import Registry

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
    factory = PASSES.factory(name)
    options = options or {}
    if dataclasses.is_dataclass(factory):
        fields = {f.name.replace("_", "-") for f in dataclasses.fields(factory)}
        unknown = set(options) - fields
        if unknown:
            raise PassError(f"pass {name!r} has no option {', '.join(sorted(unknown))}; "
                            f"its options are: {', '.join(sorted(fields)) or 'none'}")
    try:
        return factory(**{key.replace("-", "_"): value for key, value in options.items()})
    except (TypeError, ValueError) as err:
        raise PassError(f"bad options for pass {name!r}: {err}") from None


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth < 0:
                raise PassError(f"unbalanced '}}' in pass pipeline {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise PassError(f"unbalanced '{{' in pass pipeline {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_pipeline(text: str) -> list[Pass]:
    """Parses ``"a,b{key=value,...}"`` into pass objects."""
    passes = []
    for item in _split_top_level(text):
        name, brace, rest = item.partition("{")
        options: dict[str, Any] = {}
        if brace:
            if not rest.endswith("}"):
                raise PassError(f"pass {item!r}: options must end with '}}'")
            for pair in _split_top_level(rest[:-1]):
                key, equals, value = pair.partition("=")
                if not equals:
                    raise PassError(f"pass {name.strip()!r}: option {pair!r} must be key=value")
                options[key.strip()] = _parse_value(value.strip())
        passes.append(make_pass(name.strip(), options))
    return passes


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
