"""Solvers by name. A solver is an object with a ``name`` and ``__call__(Problem) -> Plan``.

Names map lazily to factories; registering a taken name is refused. A solver is named by a
string, with options as the pass pipelines take them: ``"rl{episodes=2000,seed=3}"``,
``"miqp{time-limit-s=30}"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

from flatpack.errors import PlanError
from flatpack.registry import Registry, parse_specs

if TYPE_CHECKING:   # the names alone are read where torch must not load (the command line's --help)
    from flatpack.partitioner.plan import Plan
    from flatpack.partitioner.problem import Problem

DEFAULT_SOLVER = "balanced"
# a training run's --pick: the solver's own choice (FuncPipe's recommendation for dp), or the
# fastest plan on dp's front (solvers.wrappers.FastestOnFront)
PICKS = ("recommended", "fastest")


@runtime_checkable
class Solver(Protocol):
    # read-only: a frozen dataclass's field or a property names a solver as well as an attribute
    @property
    def name(self) -> str: ...

    def __call__(self, problem: Problem) -> Plan: ...


SOLVERS: Registry[Solver] = Registry("solver", PlanError, {
    "balanced": "flatpack.partitioner.solvers.balanced:Balanced",
    "brute": "flatpack.partitioner.solvers.brute:Brute",
    "dp": "flatpack.partitioner.solvers.dp:Dp",
    "miqp": "flatpack.partitioner.solvers.miqp:Miqp",
    "hydrozoa": "flatpack.partitioner.solvers.hydrozoa_planner:Hydrozoa",
    "rl": "flatpack.partitioner.solvers.rl:Rl",
    "bayes": "flatpack.partitioner.solvers.bayes:Bayes",
})


def register_solver(name: str, factory: Callable[[], Solver]) -> None:
    """Registers a solver factory under ``name``; a name can be registered once."""
    SOLVERS.register(name, factory)


def available_solvers() -> list[str]:
    return SOLVERS.names()


def get_solver(solver: str | Solver | None) -> Solver:
    if solver is None:
        solver = DEFAULT_SOLVER
    if not isinstance(solver, str):
        if not callable(solver):
            raise PlanError(f"{solver!r} is neither a solver name nor a callable Problem -> Plan")
        return solver
    specs = parse_specs(solver, PlanError, "solver")
    if len(specs) != 1:
        raise PlanError(f"{solver!r} names {len(specs)} solvers; name one, with its options in braces: "
                        "'rl{episodes=2000,seed=3}'")
    name, options = specs[0]
    return SOLVERS.make(name, options)
