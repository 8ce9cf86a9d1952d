"""The exact solvers against brute force on random small problems (FuncPipe's training
model): the same optimum for every weight pair and SLO, valid plans drawn from the search
space, fronts whose points do not dominate each other."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, evaluate
from flatpack.partitioner.pareto import dominates
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import CostSolver, Goal
from flatpack.partitioner.space import SearchSpace
from tests.property.solver_strategies import training_problems

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOALS = st.one_of(st.sampled_from([Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]),
                  st.floats(0.02, 30.0).map(lambda slo: Goal(slo_s=slo)))


def cost_solver(name: str) -> CostSolver:
    """The solver registered as ``name``; these properties need its ``solve`` and ``front``."""
    solver = get_solver(name)
    assert isinstance(solver, CostSolver), f"solver {name!r} is not a CostSolver"
    return solver


def score(problem, plan, goal):
    evaluation = evaluate(problem, plan)
    return goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)


def check_valid(problem, plan):
    """Each layer in exactly one stage, in order; tiers, degrees and M from the space; every
    stage fits; one degree for the whole pipeline; predictions are the cost model's."""
    space = SearchSpace.of(problem)
    covered = [layer for stage in plan.stages for layer in range(stage.start, stage.end + 1)]
    assert covered == list(range(len(problem.chain)))
    assert {stage.memory_mb for stage in plan.stages} <= set(space.memory_mb)
    assert len(set(plan.replicas)) == 1 and plan.replicas[0] in space.replicas_for(plan.micro_batches)
    assert plan.micro_batches in space.micro_batches
    evaluation = evaluate(problem, plan)
    assert evaluation.fits and all(stage.fits for stage in evaluation.detail.stages)
    assert plan.predictions["time_s"] == pytest.approx(evaluation.time_s, rel=1e-12)
    assert plan.predictions["dollars"] == pytest.approx(evaluation.dollars, rel=1e-12)


@SETTINGS
@given(training_problems(), GOALS)
def test_dp_reaches_the_brute_force_optimum(problem, goal):
    brute, dp = cost_solver("brute"), cost_solver("dp")
    try:
        expected = brute.solve(problem, goal)
    except PlanError:
        with pytest.raises(PlanError):
            dp.solve(problem, goal)
        return
    found = dp.solve(problem, goal)
    if expected is None:  # no plan meets the SLO
        assert found is None
        return
    assert found is not None
    check_valid(problem, found)
    assert found.predictions["status"] == "optimal"
    assert math.isclose(score(problem, found, goal)[0], score(problem, expected, goal)[0], rel_tol=1e-9)
    assert math.isclose(found.predictions["objective"], score(problem, found, goal)[0], rel_tol=1e-9)


@SETTINGS
@given(training_problems(max_layers=3))
def test_dp_front_is_mutually_non_dominated_and_recommends_one_of_its_points(problem):
    try:
        front = cost_solver("dp").front(problem)
    except PlanError:
        return
    for a in front.plans:
        check_valid(problem, a)
        assert not any(dominates(b, a) for b in front.plans if b is not a)
    times = [plan.predictions["time_s"] for plan in front.plans]
    assert times == sorted(times)
    assert 0 <= front.recommended < len(front.plans)


@SETTINGS
@given(training_problems(max_layers=3), st.floats(0.02, 30.0))
def test_slo_mode_is_the_cheapest_plan_meeting_the_slo_or_names_the_fastest(problem, slo):
    brute, dp = cost_solver("brute"), cost_solver("dp")
    problem = problem.__class__(**{**problem.__dict__, "workload": problem.workload.__class__(
        **{**problem.workload.__dict__, "slo_s": slo})})
    try:
        expected = brute.solve(problem, Goal(slo_s=slo))
    except PlanError:
        return
    if expected is None:
        with pytest.raises(PlanError, match="no plan meets the SLO .* the fastest plan takes"):
            dp(problem)
        return
    plan = dp(problem)
    assert plan.predictions["time_s"] <= slo * (1 + 1e-12)
    assert math.isclose(plan.predictions["dollars"], expected.predictions["dollars"], rel_tol=1e-9)
