"""A registry of named factories, imported lazily and refusing duplicate names.

Passes and solvers both use it: built-ins are listed as ``"module:attribute"`` strings so
that nothing is imported until a pipeline or a compile names it. Both are named in strings
with options, ``"name{key=value,...}"`` (hyphens in keys stand for underscores), which
:func:`parse_specs` reads and :meth:`Registry.make` turns into objects.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, error: type[Exception], builtins: dict[str, str]) -> None:
        self.kind = kind
        self.error = error
        self.builtins = dict(builtins)
        self.factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> None:
        if name in self.builtins or name in self.factories:
            raise self.error(f"a {self.kind} named {name!r} is already registered; pick another name")
        self.factories[name] = factory

    def unregister(self, name: str) -> None:
        """Removes a name :meth:`register` added (a plug-in's, a test's); the built-ins stay."""
        if name in self.builtins:
            raise self.error(f"{name!r} is a built-in {self.kind}; only registered ones can be removed")
        if self.factories.pop(name, None) is None:
            raise self.error(f"no {self.kind} named {name!r} is registered")

    def names(self) -> list[str]:
        return sorted({*self.builtins, *self.factories})

    def factory(self, name: str) -> Callable[..., T]:
        if name in self.factories:
            return self.factories[name]
        if name not in self.builtins:
            raise self.error(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}")
        module_name, _, attribute = self.builtins[name].partition(":")
        return getattr(importlib.import_module(module_name), attribute)

    def make(self, name: str, options: dict[str, Any] | None = None) -> T:
        """The object ``name`` names, built with ``options``; unknown options are refused and
        the error lists the known ones."""
        factory = self.factory(name)
        options = options or {}
        self._refuse_unknown_options(name, factory, options)
        try:
            return factory(**{key.replace("-", "_"): value for key, value in options.items()})
        except (TypeError, ValueError) as err:
            raise self.error(f"bad options for {self.kind} {name!r}: {err}") from None

    def _refuse_unknown_options(self, name: str, factory: Callable[..., T], options: dict[str, Any]) -> None:
        """A dataclass factory's fields are its options: any other name is refused, listing them."""
        if not (isinstance(factory, type) and dataclasses.is_dataclass(factory)):
            return
        fields = {f.name.replace("_", "-") for f in dataclasses.fields(factory)}
        unknown = {key.replace("_", "-") for key in options} - fields
        if unknown:
            raise self.error(f"{self.kind} {name!r} has no option {', '.join(sorted(unknown))}; "
                             f"its options are: {', '.join(sorted(fields)) or 'none'}")


def split_top_level(text: str, error: type[Exception], what: str) -> list[str]:
    """``text`` split at the commas outside braces."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth < 0:
                raise error(f"unbalanced '}}' in {what} {text!r}")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise error(f"unbalanced '{{' in {what} {text!r}")
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_specs(text: str, error: type[Exception], what: str) -> list[tuple[str, dict[str, Any]]]:
    """``"a,b{key=value,...}"`` as (name, options) pairs."""
    specs = []
    for item in split_top_level(text, error, what):
        name, brace, rest = item.partition("{")
        options: dict[str, Any] = {}
        if brace:
            if not rest.endswith("}"):
                raise error(f"{what} {item!r}: options must end with '}}'")
            for pair in split_top_level(rest[:-1], error, what):
                key, equals, value = pair.partition("=")
                if not equals:
                    raise error(f"{what} {name.strip()!r}: option {pair!r} must be key=value")
                options[key.strip()] = parse_value(value.strip())
        specs.append((name.strip(), options))
    return specs
