"""Solvers by name. A solver is an object with a ``name`` and ``__call__(Problem) -> Plan``.

Names map lazily to factories; registering a taken name is refused.
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol, runtime_checkable

from flatpack.errors import PlanError
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

DEFAULT_SOLVER = "balanced"


@runtime_checkable
class Solver(Protocol):
    name: str

    def __call__(self, problem: Problem) -> Plan: ...


_LAZY: dict[str, str] = {
    "balanced": "flatpack.partitioner.solvers.balanced:Balanced",
}
_FACTORIES: dict[str, Callable[[], Solver]] = {}


def register_solver(name: str, factory: Callable[[], Solver]) -> None:
    if name in _LAZY or name in _FACTORIES:
        raise PlanError(f"a solver named {name!r} is already registered; pick another name")
    _FACTORIES[name] = factory


def available_solvers() -> list[str]:
    return sorted({*_LAZY, *_FACTORIES})


def get_solver(solver: str | Solver | None) -> Solver:
    if solver is None:
        solver = DEFAULT_SOLVER
    if not isinstance(solver, str):
        if not callable(solver):
            raise PlanError(f"{solver!r} is neither a solver name nor a callable Problem -> Plan")
        return solver
    if solver in _FACTORIES:
        return _FACTORIES[solver]()
    if solver not in _LAZY:
        raise PlanError(f"unknown solver {solver!r}; known solvers: {', '.join(available_solvers())}")
    module_name, _, attribute = _LAZY[solver].partition(":")
    return getattr(importlib.import_module(module_name), attribute)()
