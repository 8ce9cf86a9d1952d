"""Asserts for what a unit test expects to be there, returning it with the narrower type pyright
needs: a solver's plan where one meets the goal, a cost solver made by name, and the profile,
graph and problem of a model compiled in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import CostSolver

if TYPE_CHECKING:
    from flatpack.compiler import Compiled
    from flatpack.ir.graph import LayerGraph
    from flatpack.ir.profile import ChainProfile
    from flatpack.partitioner.plan import Plan
    from flatpack.partitioner.problem import Problem


def solved(plan: Plan | None) -> Plan:
    """The plan a solver returned where the test expects one (None: no plan met the goal)."""
    assert plan is not None, "the solver found no plan where the test expects one"
    return plan


def cost_solver(spec: str) -> CostSolver:
    """The registered solver ``spec`` names, which the test expects to solve per goal
    (``solve``, ``solve_all``, ``front``)."""
    solver = get_solver(spec)
    assert isinstance(solver, CostSolver), f"{spec!r} made {type(solver).__name__}, not a CostSolver"
    return solver


def profile_of(compiled: Compiled) -> ChainProfile:
    """The profile of a model compiled with ``profile=...``."""
    assert compiled.profile is not None, "compiled with profile=... but no profile was attached"
    return compiled.profile


def graph_of(compiled: Compiled) -> LayerGraph:
    """The LayerGraph of a model compiled in this process (only ``flatpack.load`` has none)."""
    assert compiled.graph is not None, "compiled in this process but without its LayerGraph"
    return compiled.graph


def problem_of(compiled: Compiled) -> Problem:
    """The solver's Problem of a model compiled in this process (only ``flatpack.load`` has none)."""
    assert compiled.problem is not None, "compiled in this process but without its Problem"
    return compiled.problem
