"""Every registry of named things — passes, solvers, cost models, platforms, backends, models, schedules — is one
:class:`flatpack.registry.Registry`: a name can be registered once, and an entry that knows its
own name is registered under it."""

from __future__ import annotations

import pytest

from flatpack.backends import BACKENDS
from flatpack.platform.catalog import PLATFORMS
from flatpack.ir.passes import PASSES
from flatpack.models import MODELS
from flatpack.partitioner.cost.registry import COST_MODEL_REGISTRY
from flatpack.partitioner.solvers import SOLVERS
from flatpack.registry import Registry
from flatpack.schedules import SCHEDULE_REGISTRY

REGISTRIES = {"pass": PASSES, "solver": SOLVERS, "cost model": COST_MODEL_REGISTRY, "platform": PLATFORMS,
              "backend": BACKENDS, "model": MODELS, "schedule": SCHEDULE_REGISTRY}


def entry_name(entry: object) -> str | None:
    """The name an entry gives itself: ``name`` (passes, solvers, cost models, platforms, models) or a
    backend module's ``NAME``."""
    return getattr(entry, "name", None) or getattr(entry, "NAME", None)


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_every_registry_is_the_one_helper(kind):
    registry = REGISTRIES[kind]
    assert isinstance(registry, Registry) and registry.kind == kind


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_each_key_is_its_entry_s_name(kind):
    registry = REGISTRIES[kind]
    named = 0
    for key in registry.names():
        name = entry_name(registry.make(key))
        if name is not None:
            named += 1
            assert name == key, f"{kind} registered as {key!r} calls itself {name!r}"
    assert named, f"no {kind} entry has a name to check"


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_a_taken_name_is_refused(kind):
    registry = REGISTRIES[kind]
    taken = registry.names()[0]
    with pytest.raises(registry.error, match=f"a {kind} named {taken!r} is already registered; pick another name"):
        registry.register(taken, lambda: None)


def test_unregister_removes_a_registered_name_and_refuses_built_ins_and_unknown_names():
    from flatpack.errors import InputError
    from flatpack.registry import Registry

    registry: Registry[object] = Registry("widget", InputError, {"builtin": "flatpack.errors:InputError"})
    registry.register("mine", object)
    registry.unregister("mine")
    assert registry.names() == ["builtin"]
    with pytest.raises(InputError, match="built-in widget"):
        registry.unregister("builtin")
    with pytest.raises(InputError, match="no widget named 'mine'"):
        registry.unregister("mine")
    registry.register("mine", object)      # the name is free again
