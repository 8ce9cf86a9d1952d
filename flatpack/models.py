"""One namespace of model names: the built-in examples (flatpack/examples.py) and the zoo
(flatpack/zoo/) registered together, so that a name means one model wherever it is used.
The command line's MODEL resolves through :func:`find`; a name defined twice is refused
when this module is imported (the registry refuses duplicates), not resolved by whichever
list is read first.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from flatpack import examples, zoo
from flatpack.errors import InputError
from flatpack.factories import import_factory
from flatpack.registry import Registry

EXAMPLE, ZOO = "example", "zoo"


@dataclass(frozen=True)
class NamedModel:
    """A model the command line knows by name; ``build(size)`` gives ``(model, example_inputs)``.
    Examples have one size (``size`` is ignored); zoo models are built at ``tiny`` or ``full``."""

    name: str
    origin: str                 # EXAMPLE or ZOO
    summary: str
    builder: Callable[[str], tuple[nn.Module, Any]] = field(repr=False)
    passes: str | None = None   # the pass pipeline of the model's natural cuts (None: the default)

    def build(self, size: str = "tiny") -> tuple[nn.Module, Any]:
        return self.builder(size)

    def label(self, size: str) -> str:
        """The name as reports print it: a zoo model with its size."""
        return f"{self.name} ({size})" if self.origin == ZOO else self.name


def _example_builder(factory: Callable[[], tuple[nn.Module, Any]]) -> Callable[[str], tuple[nn.Module, Any]]:
    return lambda _size: factory()


def _zoo_builder(name: str) -> Callable[[str], tuple[nn.Module, Any]]:
    return lambda size: zoo.build(name, size)


def register_builtins(registry: Registry[NamedModel]) -> Registry[NamedModel]:
    """Registers every example and zoo model in ``registry``; a name already there (from
    either list) raises InputError naming it."""
    for name, factory in examples.EXAMPLES.items():
        summary = (factory.__doc__ or f"built-in example {name}").strip().splitlines()[0]
        _register(registry, NamedModel(name, EXAMPLE, summary, _example_builder(factory)))
    for name, entry in zoo.ZOO.items():
        _register(registry, NamedModel(name, ZOO, entry.summary, _zoo_builder(name), entry.passes))
    return registry


def _register(registry: Registry[NamedModel], model: NamedModel) -> None:
    # a registry holds factories: this one hands out the model's (immutable) entry
    registry.register(model.name, lambda: model)


MODELS: Registry[NamedModel] = register_builtins(Registry("model", InputError, {}))


def model_names(origin: str | None = None) -> list[str]:
    """Every registered name (of one ``origin``, EXAMPLE or ZOO, if given), in registration order."""
    return [name for name, factory in MODELS.factories.items() if origin is None or factory().origin == origin]


def find(name: str) -> NamedModel | None:
    """The model registered as ``name``, or None (MODEL is then a factory path)."""
    return MODELS.make(name) if name in MODELS.factories else None


def close_matches(name: str) -> list[str]:
    return difflib.get_close_matches(name, model_names(), n=3)


def load(spec: str, size: str = "tiny") -> tuple[nn.Module, Any]:
    """MODEL is ``path/to/file.py:factory``, ``package.module:factory`` or a registered model
    name (flatpack.models: a built-in example, or a zoo model built at ``size``)."""
    named = find(spec)
    if named is not None:
        return named.build(size)
    source, colon, attribute = spec.rpartition(":")
    if not colon and not spec.endswith(".py"):
        close = close_matches(spec)
        if close:
            raise InputError(f"unknown model {spec!r}; did you mean {' or '.join(close)}? (see flatpack inspect "
                             "--help for what MODEL may be)")
    if not colon or not source or not attribute:
        raise InputError(f"MODEL {spec!r} must be path/to/file.py:factory, package.module:factory, one "
                         f"of the built-in examples ({', '.join(model_names(EXAMPLE))}) or a zoo "
                         f"model ({', '.join(model_names(ZOO))})")
    factory = import_factory(spec, "MODEL")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InputError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result
