"""A registry of named factories, imported lazily and refusing duplicate names.

Passes and solvers both use it: built-ins are listed as ``"module:attribute"`` strings so
that nothing is imported until a pipeline or a compile names it.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

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

    def names(self) -> list[str]:
        return sorted({*self.builtins, *self.factories})

    def factory(self, name: str) -> Callable[..., T]:
        if name in self.factories:
            return self.factories[name]
        if name not in self.builtins:
            raise self.error(f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}")
        module_name, _, attribute = self.builtins[name].partition(":")
        return getattr(importlib.import_module(module_name), attribute)
