"""Property: the exact DPs for Gillis's, PipeDream's and Hydrozoa's models equal brute force.

For random small problems (``solver_strategies``), each exact ``solve``

- at FuncPipe's four weight pairs, reaches brute force's least objective (relative 1e-9);
- for SLO goals (below every plan, at a plan's time exactly, between two, above all) finds a
  plan exactly when brute force does, at brute force's least dollars;
- raises PlanError exactly when no plan of the space fits memory;
- returns a plan that is valid, fits, lies in the search space, and whose predictions are
  ``evaluate(problem, plan)``.

Hydrozoa's planner (a heuristic) returns valid plans of the space that the exact DP never
beats by more than rounding in the other direction: dp ≤ heuristic.

Brute force here is ``brute.plans`` evaluated once per problem and scored for every goal.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Evaluation, Weights, cost_model_for, evaluate
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import gillis_dp, hydrozoa_planner, pipedream_dp
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import plans
from flatpack.partitioner.space import SearchSpace
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import (inference_problems, layer_specs, make_platform, make_problem, tiers,
                                              training_problems)

RELATIVE = 1e-9


@st.composite
def heavy_inference_problems(draw, max_layers: int = 4):
    """Fork-join serving where weights press on the master's memory: parameters scaled up
    so that the master cannot hold every group and some groups must go to workers."""
    scale = draw(st.sampled_from([4.0, 16.0]))
    layers = [(f, b, params * scale, *rest) for f, b, params, *rest in draw(layer_specs(max_layers=max_layers))]
    platform = make_platform(draw(tiers()))
    workload = Workload("infer", batch=draw(st.sampled_from([1, 4])))
    return make_problem(layers, platform, workload, max_workers=draw(st.sampled_from([2, 3, 5])))


def with_model(problem: Problem, model: str, **options) -> Problem:
    return dataclasses.replace(problem, options=problem.options.with_changes(cost_model=model, **options))


def brute_force(problem: Problem) -> list[tuple[Plan, Evaluation]]:
    """Every plan of the space that fits, with its evaluation."""
    priced = ((plan, evaluate(problem, plan)) for plan in plans(problem))
    return [(plan, evaluation) for plan, evaluation in priced if evaluation.fits]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RELATIVE * max(abs(a), abs(b))


def check_plan(problem: Problem, plan: Plan, solver: str = "dp") -> Evaluation:
    """Valid, fitting, drawn from the space, and carrying its own evaluation."""
    space = SearchSpace.of(problem)
    plan.check_against(len(problem.chain))
    assert plan.solver == solver
    assert all(stage.memory_mb in space.memory_mb for stage in plan.stages)
    if problem.workload.mode == "infer":
        assert plan.micro_batches is None
        assert len(set(plan.memory_mb)) == 1
        assert all(r == 1 or 2 <= r <= space.max_workers for r in plan.replicas)
    else:
        assert plan.micro_batches in space.micro_batches
        assert all(r in space.replicas_for(plan.micro_batches) for r in plan.replicas)
        if cost_model_for(problem).name == "hydrozoa":
            assert len(set(plan.replicas)) == 1
    evaluation = evaluate(problem, plan)
    assert evaluation.fits
    for key, value in evaluation.predictions().items():
        assert plan.predictions[key] == value, key
    return evaluation


def slo_goals(truth: list[tuple[Plan, Evaluation]], pick: int) -> list[float]:
    """SLOs below every plan, at one plan's time exactly, between two times, above all."""
    times = sorted({evaluation.time_s for _, evaluation in truth})
    exact = times[pick % len(times)]
    between = (times[0] + times[1]) / 2 if len(times) > 1 else times[0] * 1.5
    return [times[0] * 0.999, exact, between, times[-1] * 2]


def assert_equals_brute(problem: Problem, solve, pick: int) -> None:
    truth = brute_force(problem)
    total = sum(1 for _ in plans(problem))
    event(f"{len(problem.chain)} layers")
    event("every plan fits" if len(truth) == total else "no plan fits" if not truth else "some plans fit")
    if not truth:
        for weights in FUNCPIPE_WEIGHTS:
            with pytest.raises(PlanError):
                solve(problem, Goal(Weights(*weights)))
        return
    for weights in map(Weights.of, FUNCPIPE_WEIGHTS):
        plan = solve(problem, Goal(weights))
        evaluation = check_plan(problem, plan)
        best = min(evaluation.objective(weights) for _, evaluation in truth)
        assert close(evaluation.objective(weights), best), (weights, plan, best)
    for slo in slo_goals(truth, pick):
        plan = solve(problem, Goal(slo_s=slo))
        within = [evaluation.dollars for _, evaluation in truth if evaluation.time_s <= slo]
        if not within:
            assert plan is None, (slo, plan)
            continue
        assert plan is not None, slo
        evaluation = check_plan(problem, plan)
        assert evaluation.time_s <= slo
        assert close(evaluation.dollars, min(within)), (slo, plan, min(within))


@settings(max_examples=150, deadline=None)
@given(inference_problems(), st.integers(0, 1000))
def test_gillis_dp_equals_brute(problem, pick):
    assert_equals_brute(problem, lambda p, goal: gillis_dp.solve(p, goal), pick)


@settings(max_examples=100, deadline=None)
@given(heavy_inference_problems(), st.integers(0, 1000))
def test_gillis_dp_equals_brute_when_the_master_is_short_of_memory(problem, pick):
    assert_equals_brute(problem, lambda p, goal: gillis_dp.solve(p, goal), pick)


@settings(max_examples=120, deadline=None)
@given(training_problems(kind="container"), st.integers(0, 1000))
def test_pipedream_dp_equals_brute(problem, pick):
    assert_equals_brute(with_model(problem, "pipedream"), lambda p, goal: pipedream_dp.solve(p, goal), pick)


@settings(max_examples=150, deadline=None)
@given(training_problems(kind="container"), st.integers(0, 1000),
       st.sampled_from([(0.0, 0.0), (1e-9, 0.002)]))
def test_hydrozoa_dp_equals_brute(problem, pick, overheads):
    alpha, beta = overheads
    problem = with_model(problem, "hydrozoa", hydrozoa_alpha=alpha, hydrozoa_beta=beta)
    assert_equals_brute(problem, lambda p, goal: hydrozoa_planner.solve(p, goal), pick)


@settings(max_examples=60, deadline=None)
@given(training_problems(kind="container"), st.sampled_from(FUNCPIPE_WEIGHTS))
def test_hydrozoa_planner_is_never_better_than_the_exact_dp(problem, weights):
    problem = with_model(problem, "hydrozoa", micro_batches=SearchSpace.of(problem).micro_batches)
    goal = Goal(Weights.of(weights))
    try:
        exact = hydrozoa_planner.solve(problem, goal)
    except PlanError:
        return
    assert exact is not None  # weights and no SLO: the exact DP finds a plan or refuses the problem
    try:
        heuristic = hydrozoa_planner.Hydrozoa().solve(problem, goal)
    except PlanError:
        return  # the heuristic keeps one tier for all stages and may find nothing that fits
    assert heuristic is not None and heuristic.predictions["status"] == "heuristic"
    evaluation = check_plan(problem, heuristic, solver="hydrozoa")
    assert len(set(heuristic.memory_mb)) == 1
    best = evaluate(problem, exact).objective(goal.weights)
    assert best <= evaluation.objective(goal.weights) * (1 + RELATIVE) or math.isclose(
        best, evaluation.objective(goal.weights), rel_tol=RELATIVE)
