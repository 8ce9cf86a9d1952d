"""The ``rl`` solver (Gillis §IV-C) as a user meets it: it reaches the brute-force optimum of
tiny problems within a stated number of episodes, is reproducible under a seed, never
returns a plan that overflows memory or misses the SLO, keeps to its budgets, saves its
policy so that a second solve starts warm, and is selectable by name with options."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.errors import PlanError
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.solvers.rl import OOM_BUDGETS, Rl
from flatpack.partitioner.solvers.sampled import DecisionSpace, neighbours
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions
from tests.models import MLP
from tests.property.solver_strategies import make_platform, make_problem
from tests.unit.narrowing import solved

TIERS = [(256, 1, 20.0, 0.25e-5), (512, 2, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5)]
# forward s/sample, backward s/sample, params MiB, saved MiB/sample, output MiB/sample, fixed s
LAYERS = [(0.01, 0.02, 40.0, 2.0, 1.0, 0.0), (0.02, 0.04, 10.0, 4.0, 0.5, 0.0), (0.01, 0.02, 80.0, 1.0, 0.2, 0.01),
          (0.005, 0.01, 5.0, 0.5, 0.1, 0.0)]
# pure REINFORCE (no polish) reaches the optimum of these problems within this many episodes
EPISODES = 1500
GOALS = [Goal(Weights(1.0, 0.0)), Goal(Weights(1.0, 2.0 ** 16)), Goal(Weights(0.0, 1.0))]


def training():
    return make_problem(LAYERS, make_platform(TIERS), Workload("train", batch=16, micro_batches=4),
                        replicas=(1, 2, 4), micro_batches=(2, 4))


def inference():
    return make_problem(LAYERS, make_platform(TIERS), Workload("infer", batch=4), max_workers=3)


def rl(**options) -> Rl:
    return Rl(**{"episodes": EPISODES, "warm_start": False, "polish": False, **options})


def score(problem, goal, plan) -> tuple[float, float]:
    evaluation = evaluate(problem, plan)
    assert evaluation.fits
    scored = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
    assert scored is not None, "the plan misses the goal's SLO"
    return scored


@pytest.mark.parametrize("make", [training, inference], ids=["train", "infer"])
@pytest.mark.parametrize("goal", GOALS, ids=lambda goal: goal.describe())
def test_reinforce_alone_finds_the_brute_force_optimum_of_a_tiny_problem(make, goal):
    problem = make()
    optimum = solved(Brute().solve(problem, goal))
    plan = solved(rl().solve(problem, goal))
    assert plan.predictions["episodes"] <= EPISODES
    assert score(problem, goal, plan)[0] == pytest.approx(score(problem, goal, optimum)[0], rel=1e-9)
    assert plan.predictions["status"] == "heuristic" and plan.solver == "rl"


def test_cheapest_plan_within_an_slo_matches_brute_force_and_meets_the_slo():
    problem = inference()
    fastest = solved(Brute().solve(problem, Goal(Weights(0.0, 1.0)))).predictions["time_s"]
    slo_s = 1.3 * fastest
    goal = Goal(slo_s=slo_s)
    optimum = solved(Brute().solve(problem, goal))
    plan = solved(rl().solve(problem, goal))
    assert evaluate(problem, plan).time_s <= slo_s
    assert plan.predictions["dollars"] == pytest.approx(optimum.predictions["dollars"], rel=1e-9)


def test_the_same_seed_gives_the_same_plan_and_another_seed_may_not():
    problem = training()
    first, second = (solved(rl(episodes=300, seed=7).solve(problem, GOALS[1])) for _ in range(2))
    assert first == second
    for key in ("objective", "best_at_sample", "episodes", "distinct_plans"):
        assert first.predictions[key] == second.predictions[key]


def test_an_slo_no_plan_meets_gives_no_plan_and_the_error_says_the_solver_saw_none():
    problem = training()
    assert rl(episodes=200).solve(problem, Goal(slo_s=1e-6)) is None
    tight = make_problem(LAYERS, make_platform(TIERS), Workload("train", batch=16, micro_batches=4, slo_s=1e-6),
                         replicas=(1, 2))
    with pytest.raises(PlanError, match="'rl' saw no plan within the SLO .* fastest plan it found takes"):
        rl(episodes=200)(tight)


def test_a_platform_where_nothing_fits_is_an_error_not_a_plan():
    problem = make_problem([(0.01, 0.02, 900.0, 1.0, 1.0, 0.0)] * 2, make_platform(TIERS[:1]),
                           Workload("train", batch=16, micro_batches=4), replicas=(1,))
    with pytest.raises(PlanError, match="none fits the memory"):
        rl(episodes=100).solve(problem, GOALS[0])


def test_the_budgets_bound_the_run():
    problem = training()
    assert solved(rl(episodes=64, patience=10 ** 6).solve(problem, GOALS[0])).predictions["episodes"] == 64
    by_time = solved(rl(episodes=10 ** 9, patience=10 ** 9, time_limit_s=0.3).solve(problem, GOALS[0]))
    assert by_time.predictions["stopped_by"] == "time_limit_s"
    early = solved(rl(episodes=10 ** 9, patience=100).solve(problem, GOALS[0]))
    assert early.predictions["stopped_by"] == "patience"


def test_a_saved_policy_makes_the_second_solve_start_warm(tmp_path):
    problem = training()
    goal = GOALS[1]
    optimum = score(problem, goal, solved(Brute().solve(problem, goal)))[0]
    first = solved(rl(warm_start=True, policy_dir=str(tmp_path)).solve(problem, goal))
    assert first.predictions["warm_start"] is False and len(list(tmp_path.glob("rl-*.pt"))) == 1
    # the trained policy alone, with a budget of two updates, lands on the optimum again
    second = solved(rl(warm_start=True, policy_dir=str(tmp_path), episodes=32).solve(problem, goal))
    assert second.predictions["warm_start"] is True
    assert score(problem, goal, second)[0] == pytest.approx(optimum, rel=1e-9)
    cold = solved(rl(episodes=32, seed=1).solve(problem, goal))
    assert cold.predictions["warm_start"] is False


def test_polish_never_makes_the_plan_worse_and_ends_at_a_local_optimum():
    problem = training()
    goal = GOALS[0]
    plan = solved(rl(episodes=100, polish=True).solve(problem, goal))
    assert plan.predictions["objective"] <= plan.predictions["rl_objective"]
    found = score(problem, goal, plan)
    space = DecisionSpace.of(problem)
    for neighbour in neighbours(space, plan):
        evaluation = evaluate(problem, neighbour)
        if evaluation.fits:
            neighbour_score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
            assert neighbour_score is not None and neighbour_score >= found


def test_reward_is_gillis_eq_4():
    problem = inference()
    plan = solved(Brute().solve(problem, Goal(Weights(0.0, 1.0))))
    evaluation = evaluate(problem, plan)
    met = Goal(slo_s=evaluation.time_s * 2)
    cost = Rl._cost(problem, met, evaluation)
    assert cost is not None
    assert cost == pytest.approx(evaluation.cost_units / 256 * 1e3)   # billed ms of the 256 MB tier
    assert Rl._reward(met, evaluation, cost, budget=10 * cost) == pytest.approx(9 * cost)
    missed = Goal(slo_s=evaluation.time_s / 2)
    assert Rl._cost(problem, missed, evaluation) is None
    assert Rl._reward(missed, evaluation, None, budget=1.0) == pytest.approx(-evaluation.time_s / 2 * 1e3)
    overflow = type(evaluation)(**{**evaluation.__dict__, "fits": False})
    assert Rl._reward(met, overflow, None, budget=5.0) == -OOM_BUDGETS * 5.0
    assert Rl._reward(missed, overflow, None, budget=5.0, worst_miss=-800.0) == -OOM_BUDGETS * 800.0


def test_rl_is_selectable_by_name_with_options_in_compile(tmp_path):
    torch.manual_seed(0)
    model = MLP(width=16, depth=4)
    x = torch.randn(8, 16)
    compiled = flatpack.compile(model, x, target="aws-lambda", solver="rl{episodes=200,warm-start=false,seed=3}",
                                profile=ProfileOptions(batch_sizes=(1, 2), repeats=1, cache_dir=tmp_path),
                                workload=Workload("train", batch=8, micro_batches=2), replicas=(1, 2),
                                weights=(1, 2 ** 19))
    assert compiled.plan.solver == "rl" and compiled.plan.predictions["seed"] == 3
    torch.testing.assert_close(compiled.as_module()(x), model(x))
    with pytest.raises(PlanError, match="solver 'rl' has no option epochs; its options are: batch"):
        get_solver("rl{epochs=3}")
    with pytest.raises(PlanError, match="rl episodes must be > 0"):
        get_solver("rl{episodes=0}")


def test_a_micro_batch_count_that_idles_every_replica_is_not_offered():
    # replicas (2, 4) leave nothing to run at M = 1; rl must choose M from 2 and 4 only
    problem = make_problem(LAYERS, make_platform(TIERS), Workload("train", batch=16, micro_batches=4),
                           replicas=(2, 4), micro_batches=(1, 2, 4))
    assert DecisionSpace.of(problem).micro_batches == (2, 4)
    plan = solved(rl(episodes=200).solve(problem, GOALS[0]))
    assert plan.micro_batches in (2, 4) and all(stage.replicas <= plan.micro_batches for stage in plan.stages)
