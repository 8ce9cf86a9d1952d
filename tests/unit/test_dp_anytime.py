"""dp's options on FuncPipe's model: the anytime time limit (best plan, proven lower bound,
gap), dp and its pre-issue-20 reference giving the same optimum, and the errors for bad options."""

from __future__ import annotations

import pytest

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, evaluate
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import make_platform, make_problem
from tests.unit.narrowing import cost_solver, solved

TIERS = [(256, 1, 20.0, 0.25e-5), (512, 2, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5)]


def chain_problem(count: int, **options):
    """``count`` layers whose times, sizes and activations vary along the chain."""
    layers = [(0.004 + 0.003 * (i % 5), 0.008 + 0.005 * (i % 3), 4.0 + 7.0 * (i % 4), 0.5 + (i % 3),
               0.2 + 0.3 * (i % 2)) for i in range(count)]
    options.setdefault("replicas", (1, 2, 4))
    return make_problem(layers, make_platform(TIERS), Workload("train", batch=16, micro_batches=4), **options)


def objective(problem, plan, goal):
    evaluation = evaluate(problem, plan)
    return goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)[0]


@pytest.mark.parametrize("pair", FUNCPIPE_WEIGHTS)
def test_out_of_time_dp_returns_its_best_plan_with_a_proven_bound(pair):
    """A limit already past when the search starts: the beam's plan, status feasible, and a
    lower bound no larger than the true optimum (exact dp's) and no larger than the plan's."""
    problem, goal = chain_problem(14), Goal(Weights(*pair))
    optimum = solved(cost_solver("dp").solve(problem, goal))
    hurried = solved(cost_solver("dp{time-limit-s=1e-9}").solve(problem, goal))
    facts = hurried.predictions
    assert facts["status"] == "feasible" and facts["configurations_unproven"] > 0
    assert facts["objective"] == pytest.approx(objective(problem, hurried, goal), rel=1e-12)
    assert 0 < facts["lower_bound"] <= optimum.predictions["objective"] * (1 + 1e-12)
    assert optimum.predictions["objective"] <= facts["objective"] * (1 + 1e-12)
    assert facts["gap"] == pytest.approx((facts["objective"] - facts["lower_bound"]) / facts["objective"])
    assert 0 <= facts["gap"] < 1


def test_a_generous_limit_proves_the_optimum_with_no_gap():
    problem, goal = chain_problem(6), Goal(Weights(1, 2 ** 19))
    plan = solved(cost_solver("dp{time-limit-s=600}").solve(problem, goal))
    expected = Brute().solve(problem, goal)
    assert plan.predictions["status"] == "optimal" and plan.predictions["gap"] == 0.0
    assert plan.predictions["lower_bound"] == plan.predictions["objective"]
    assert plan.predictions["objective"] == pytest.approx(objective(problem, expected, goal), rel=1e-9)


def test_dp_and_its_reference_reach_one_optimum_and_dp_keeps_fewer_labels():
    problem = chain_problem(16)
    goals = [Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]
    default = [solved(plan) for plan in cost_solver("dp").solve_all(problem, goals)]
    reference = [solved(plan) for plan in cost_solver("dp{reference=true}").solve_all(problem, goals)]
    for goal, new, old in zip(goals, default, reference):
        assert new.predictions["objective"] == pytest.approx(old.predictions["objective"], rel=1e-12), goal
    assert sum(p.predictions["labels_kept"] for p in default) < sum(p.predictions["labels_kept"] for p in reference)


@pytest.mark.parametrize("spec, words", [
    ("dp{time-limit-s=0}", ["time_limit_s", "positive", "0"]),
    ("dp{time-limit-s=-3}", ["time_limit_s", "positive", "-3"]),
    ("dp{time-limit-s=soon}", ["time_limit_s", "'soon'"]),
    ("dp{reference=maybe}", ["reference", "'maybe'", "true or false"]),
])
def test_bad_dp_options_are_refused_when_the_solver_is_made(spec, words):
    with pytest.raises(PlanError) as error:
        get_solver(spec)
    for word in words:
        assert word in str(error.value)


def test_funcpipe_only_options_are_refused_on_another_cost_model():
    problem = make_problem([(0.01, 0.02, 4.0, 1.0, 0.5)] * 3, make_platform(TIERS), Workload("infer", batch=1))
    with pytest.raises(PlanError, match="time_limit_s=5.*FuncPipe's training model only.*drop the option"):
        cost_solver("dp{time-limit-s=5}").solve(problem, Goal(Weights(1, 0)))
