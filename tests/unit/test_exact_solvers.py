"""The exact solvers as a user meets them: compile with solver="dp", fronts and FuncPipe's
recommendation, SLO mode, and the errors for problems with no answer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flatpack
from flatpack.errors import InputError, PlanError
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.pareto import Front, efficiency, recommend
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions
from tests.models import MLP
from tests.property.solver_strategies import make_platform, make_problem
from tests.unit.narrowing import cost_solver, problem_of, solved

TIERS = [(256, 1, 20.0, 0.25e-5), (512, 2, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5)]
# forward s/sample, backward s/sample, params MiB, saved MiB/sample, output MiB/sample
LAYERS = [(0.01, 0.02, 40.0, 2.0, 1.0), (0.02, 0.04, 10.0, 4.0, 0.5), (0.01, 0.02, 80.0, 1.0, 0.2),
          (0.005, 0.01, 5.0, 0.5, 0.1)]


def problem(workload=None, layers=LAYERS, tiers=TIERS, **options):
    options.setdefault("replicas", (1, 2, 4))
    return make_problem(layers, make_platform(tiers), workload or Workload("train", batch=16, micro_batches=4),
                        **options)


def predicted(plan, time_s, dollars):
    return plan.with_predictions(time_s=time_s, dollars=dollars)


def test_recommendation_is_the_fastest_plan_with_efficiency_at_least_0_8():
    """FuncPipe §5.1: δ = (t_cost/t_p − 1)/(c_p/c_cost − 1) against the cheapest plan."""
    base = Plan.from_ranges([(0, 0)], 1)
    cheapest = predicted(base, 10.0, 1.0)
    efficient = predicted(base, 5.0, 2.0)      # δ = 1/1 = 1
    fast = predicted(base, 2.0, 8.0)           # δ = 4/7 ≈ 0.57
    assert efficiency(efficient, cheapest) == pytest.approx(1.0)
    assert efficiency(fast, cheapest) == pytest.approx(4 / 7)
    plans = [fast, efficient, cheapest]
    assert recommend(plans) == 1
    assert recommend(plans, threshold=0.5) == 0
    front = Front.of([*plans, predicted(base, 11.0, 3.0)])   # dominated by the cheapest
    assert len(front.plans) == 3 and front.recommendation is efficient
    front.check()


def test_weights_trade_cost_for_time_along_the_front():
    dp = cost_solver("dp")
    cheap = solved(dp.solve(problem(), Goal(Weights(1, 0))))
    fast = solved(dp.solve(problem(), Goal(Weights(0, 1))))
    assert cheap.predictions["dollars"] <= fast.predictions["dollars"]
    assert fast.predictions["time_s"] <= cheap.predictions["time_s"]
    front = dp.front(problem(), [(1, 0), (1, 2 ** 16), (1, 2 ** 19), (1, 2 ** 22), (0, 1)])
    front.check()
    assert front.plans[-1].predictions["dollars"] == pytest.approx(cheap.predictions["dollars"])
    assert front.plans[0].predictions["time_s"] == pytest.approx(fast.predictions["time_s"])


def test_the_default_call_returns_the_recommended_plan_and_weights_or_slo_override_it():
    dp = cost_solver("dp")
    recommended = dp(problem())
    assert recommended.predictions["recommended"] is True
    assert recommended in dp.front(problem()).plans
    weighted = dp(problem(weights=(0, 1)))
    direct = solved(dp.solve(problem(), Goal(Weights(0, 1))))
    assert weighted.predictions["time_s"] == pytest.approx(direct.predictions["time_s"])
    slo = recommended.predictions["time_s"] * 1.5
    within = dp(problem(Workload("train", batch=16, micro_batches=4, slo_s=slo)))
    assert within.predictions["time_s"] <= slo
    assert within.predictions["dollars"] <= recommended.predictions["dollars"] + 1e-15


def test_an_unattainable_slo_names_the_fastest_plan_and_its_time():
    fastest = solved(cost_solver("dp").solve(problem(), Goal(Weights(0, 1))))
    with pytest.raises(PlanError, match=r"no plan meets the SLO of 0\.001 s: the fastest plan takes "
                                        rf"{fastest.predictions['time_s']:.4g} s .*stage"):
        get_solver("dp")(problem(Workload("train", batch=16, micro_batches=4, slo_s=0.001)))


def test_a_layer_that_fits_no_tier_is_named_with_its_bytes():
    huge = [*LAYERS[:2], (0.01, 0.02, 900.0, 1.0, 0.1)]
    with pytest.raises(PlanError, match=r"layer 2 \(l2\) needs .* bytes"):
        get_solver("dp")(problem(layers=huge))


def test_micro_batches_must_split_the_batch_into_whole_samples():
    with pytest.raises(InputError, match="use micro_batches=4 or 8"):
        Workload("train", batch=64, micro_batches=5)
    with pytest.raises(InputError, match="3 micro-batches cannot split a batch of 16"):
        get_solver("dp")(problem(micro_batches=(2, 3)))
    assert Workload("train", batch=6).micro_batches == 3


def test_dp_chooses_the_micro_batch_count_when_given_choices():
    plan = solved(cost_solver("dp").solve(problem(micro_batches=(1, 2, 4, 8)), Goal(Weights(0, 1))))
    assert plan.micro_batches in (1, 2, 4, 8)
    again = evaluate(problem(micro_batches=(1, 2, 4, 8)), plan)
    assert again.time_s == pytest.approx(plan.predictions["time_s"])


def test_brute_refuses_a_space_it_cannot_enumerate():
    brute = get_solver("brute")
    assert isinstance(brute, Brute)
    with pytest.raises(PlanError, match="brute force would price .* use solver='dp'"):
        dataclasses.replace(brute, max_plans=10).solve(problem(), Goal())


def test_compile_with_dp_emits_the_planned_stages_and_they_compute_the_model(tmp_path):
    torch.manual_seed(0)
    model = MLP(width=16, depth=4)
    x = torch.randn(8, 16)
    compiled = flatpack.compile(model, x, target="aws-lambda", solver="dp",
                                profile=ProfileOptions(batch_sizes=(1, 2), repeats=1, cache_dir=tmp_path),
                                workload=Workload("train", batch=8, micro_batches=2), replicas=(1, 2),
                                weights=(1, 2 ** 19))
    plan = compiled.plan
    assert plan.solver == "dp" and plan.predictions["status"] == "optimal"
    assert all(stage.memory_mb in problem_of(compiled).platform.memory_choices for stage in plan.stages)
    torch.testing.assert_close(compiled.as_module()(x), model(x))


def test_stage_plans_round_trip_with_tiers_replicas_and_micro_batches():
    plan = Plan((StagePlan(0, 1, 512, 2), StagePlan(2, 3, 1024, 2)), 4, "dp", micro_batches=8)
    assert Plan.loads(plan.dumps()) == plan
    with pytest.raises(PlanError, match="at least 1 micro-batch"):
        Plan((StagePlan(0, 3, 512),), 4, micro_batches=0).check_against(4)


@pytest.mark.parametrize("workload", [Workload("train", batch=16, micro_batches=4), Workload("infer", batch=4)],
                         ids=["funcpipe", "gillis"])
def test_every_solved_plan_states_its_goal_and_objective(workload):
    goal = Goal(Weights(1.0, 2.0 ** 16))
    plan = get_solver("dp")(problem(workload, weights=(1.0, 2.0 ** 16)))
    evaluation = evaluate(problem(workload), plan)
    assert plan.predictions["goal"] == goal.describe()
    assert plan.predictions["objective"] == pytest.approx(evaluation.objective(goal.weights), rel=1e-12)
