"""The exact DPs for Gillis's, PipeDream's and Hydrozoa's models on small cases worked by
hand, their refusals, and Hydrozoa's planner (a heuristic) with its search trace."""

from __future__ import annotations

import math

import pytest

from flatpack.errors import PlanError
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.solvers import gillis_dp, hydrozoa_planner, pipedream_dp
from flatpack.partitioner.solvers.base import TIME_ONLY, Goal
from flatpack.partitioner.solvers.brute import plans
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import MIB, make_platform, make_problem
from tests.unit.narrowing import solved

COST_ONLY = Goal(Weights(1.0, 0.0))
FAST = Goal(TIME_ONLY)
PRICE = 1e-5
# one tier: 1024 MB, 2 vCPUs (the profiling host's speed), 100 MiB/s, PRICE dollars a second
ONE_TIER = [(1024, 2, 100.0, PRICE)]


# -- Gillis: fork-join inference ----------------------------------------------------------------

def gillis_problem(layers, tiers=ONE_TIER, max_workers=2):
    return make_problem(layers, make_platform(tiers), Workload("infer", batch=1), max_workers=max_workers)


def test_gillis_splits_a_heavy_layer_for_speed_and_keeps_it_on_the_master_for_cost():
    # one layer: 0.8 s of serving on the master alone; a one-sample request cannot split by
    # batch, so over 2 workers it splits by channel (Gillis's ideal split on a hand-made
    # chain): each computes 0.4 s, the master's link carries the 1 MiB input to each worker
    # (broadcast) and gets 1 MiB/2 back from each, 3 MiB at 100 MiB/s = 0.03 s, and the fork
    # waits the 0.01 s storage latency: 0.44 s
    problem = gillis_problem([(1.0, 0.0, 10.0, 0.0, 1.0)])
    fast = solved(gillis_dp.solve(problem, FAST))
    assert fast.replicas == (2,) and fast.predictions["time_s"] == pytest.approx(0.44)
    assert fast.stages[0].split == "channel"
    cheap = solved(gillis_dp.solve(problem, COST_ONLY))
    assert cheap.replicas == (1,) and cheap.predictions["time_s"] == pytest.approx(0.8)
    # master 0.8 s + requests, against master 0.44 s + two workers of 0.4 + 1.5/100 s + three requests
    assert cheap.predictions["dollars"] == pytest.approx(0.8 * PRICE + 2e-7)
    assert fast.predictions["dollars"] == pytest.approx((0.44 + 2 * 0.415) * PRICE + 3 * 2e-7)
    for plan in (fast, cheap):
        assert plan.solver == "dp" and plan.predictions["status"] == "optimal" and plan.micro_batches is None


def test_gillis_slo_picks_the_cheapest_plan_in_time_and_none_when_nothing_is():
    problem = gillis_problem([(1.0, 0.0, 10.0, 0.0, 1.0)])
    assert solved(gillis_dp.solve(problem, Goal(slo_s=1.0))).replicas == (1,)
    assert solved(gillis_dp.solve(problem, Goal(slo_s=0.5))).replicas == (2,)
    assert solved(gillis_dp.solve(problem, Goal(slo_s=0.44 + 1e-12))).replicas == (2,)
    assert gillis_dp.solve(problem, Goal(slo_s=0.4)) is None


def test_gillis_sends_groups_to_workers_when_the_master_cannot_hold_every_weight():
    # 256 MB leaves 192 MiB for weights: two 120 MiB layers cannot both stay on the master,
    # though keeping everything there would be cheapest
    layers = [(0.1, 0.0, 120.0, 0.0, 0.5), (0.1, 0.0, 120.0, 0.0, 0.5)]
    problem = gillis_problem(layers, tiers=[(256, 2, 100.0, PRICE)])
    plan = solved(gillis_dp.solve(problem, COST_ONLY))
    assert 1 in plan.replicas and any(r > 1 for r in plan.replicas)
    assert evaluate(problem, plan).detail.master_weight_bytes <= 192 * MIB


def test_gillis_refuses_when_a_layer_fits_no_function_even_split():
    problem = gillis_problem([(0.1, 0.0, 300.0, 0.0, 0.5)], tiers=[(128, 2, 100.0, PRICE)], max_workers=2)
    with pytest.raises(PlanError, match=r"layers 0 \(l0\) cannot be split over up to 2 workers.*300\.0 MB"
                                        r".*max_workers"):
        gillis_dp.solve(problem, FAST)
    with pytest.raises(PlanError, match="plans inference"):
        gillis_dp.solve(training_problem([(0.1, 0.2, 1.0, 1.0, 1.0)], "pipedream"), FAST)


# -- PipeDream: per-stage replicas and tiers ----------------------------------------------------

def training_problem(layers, model, tiers=ONE_TIER, replicas=(1, 2), batch=4, micro_batches=4, **options):
    return make_problem(layers, make_platform(tiers, kind="container"),
                        Workload("train", batch=batch, micro_batches=micro_batches, optimizer="sgd"),
                        cost_model=model, replicas=replicas, **options)


# two layers of 0.1 s forward and 0.2 s backward per sample, no weights, 1 MiB between them;
# micro-batches of one sample
TWO_LAYERS = [(0.1, 0.2, 0.0, 1.0, 1.0), (0.1, 0.2, 0.0, 1.0, 1.0)]


def test_pipedream_fastest_plan_replicates_each_of_two_stages():
    # each stage 0.3 s, halved by two replicas; the cut takes 2 × 1 MiB / 100 MiB/s = 0.02 s:
    # A = 0.15 s, M·A = 0.6 s on four workers
    problem = training_problem(TWO_LAYERS, "pipedream")
    plan = solved(pipedream_dp.solve(problem, FAST))
    assert plan.ranges == [(0, 0), (1, 1)] and plan.replicas == (2, 2) and plan.micro_batches == 4
    assert plan.predictions["time_s"] == pytest.approx(0.6)
    assert plan.predictions["dollars"] == pytest.approx(0.6 * 4 * PRICE)
    # every plan costs M·A·P = 2.4·PRICE or more here (halving A doubles the workers)
    assert solved(pipedream_dp.solve(problem, COST_ONLY)).predictions["dollars"] == pytest.approx(2.4 * PRICE)


def test_pipedream_weight_stashing_keeps_an_activation_heavy_first_stage_whole():
    # layer 0 keeps 100 MiB of activations per micro-batch; a first stage of a pipeline keeps
    # two versions (200 MiB + 64 MiB runtime > 256 MB), so only one stage fits
    layers = [(0.1, 0.2, 0.0, 100.0, 1.0), (0.1, 0.2, 0.0, 1.0, 1.0)]
    problem = training_problem(layers, "pipedream", tiers=[(256, 2, 100.0, PRICE)])
    plan = solved(pipedream_dp.solve(problem, FAST))
    assert plan.ranges == [(0, 1)] and plan.replicas == (2,)
    assert plan.predictions["time_s"] == pytest.approx(4 * 0.3)


def test_pipedream_slo():
    problem = training_problem(TWO_LAYERS, "pipedream")
    fastest = solved(pipedream_dp.solve(problem, FAST)).predictions["time_s"]   # 0.6 s, give or take rounding
    assert solved(pipedream_dp.solve(problem, Goal(slo_s=fastest))).predictions["time_s"] == fastest
    assert solved(pipedream_dp.solve(problem, Goal(slo_s=1.2))).predictions["dollars"] == pytest.approx(2.4 * PRICE)
    assert pipedream_dp.solve(problem, Goal(slo_s=0.59)) is None


def test_pipedream_refuses_a_layer_that_fits_no_tier():
    problem = training_problem([(0.1, 0.2, 0.0, 500.0, 1.0)], "pipedream", tiers=[(256, 2, 100.0, PRICE)])
    with pytest.raises(PlanError, match=r"layer 0 \(l0\) alone needs .* MB .*activations .*256 MB.*memory_mb"):
        pipedream_dp.solve(problem, FAST)
    with pytest.raises(PlanError, match="plans training"):
        pipedream_dp.solve(gillis_problem([(1.0, 0.0, 10.0, 0.0, 1.0)]), FAST)


# -- Hydrozoa: uniform replicas, per-stage tiers ------------------------------------------------

def test_hydrozoa_dp_worked_case():
    # µ = 4 micro-batches per group. One stage: Σ(f + b) = 0.6, t_k = 0.2, r_1 = 0.4,
    # T = 0.6 + 3·0.6 = 2.4 s. Two stages: 0.6 + 2·0.01 + 3·(0.1 + 0.2) = 1.52 s, on twice
    # the workers: faster, but dearer (3.04 against 2.4 worker-seconds)
    problem = training_problem(TWO_LAYERS, "hydrozoa", replicas=(1,))
    fast = solved(hydrozoa_planner.solve(problem, FAST))
    assert fast.ranges == [(0, 0), (1, 1)] and fast.predictions["time_s"] == pytest.approx(1.52)
    cheap = solved(hydrozoa_planner.solve(problem, COST_ONLY))
    assert cheap.ranges == [(0, 1)] and cheap.predictions["dollars"] == pytest.approx(2.4 * PRICE)
    assert solved(hydrozoa_planner.solve(problem, Goal(slo_s=2.0))).ranges == [(0, 0), (1, 1)]
    assert solved(hydrozoa_planner.solve(problem, Goal(slo_s=3.0))).ranges == [(0, 1)]
    assert hydrozoa_planner.solve(problem, Goal(slo_s=1.5)) is None
    assert fast.solver == "dp" and fast.predictions["status"] == "optimal"


def test_hydrozoa_dp_mixes_tiers_per_stage():
    # a slow cheap tier and a fast one at four times the price: at weights (1, 2^16) the heavy
    # first layer is worth the fast tier and the light second one is not
    tiers = [(1024, 1, 100.0, PRICE), (2048, 2, 100.0, 4 * PRICE)]
    layers = [(0.1, 0.2, 0.0, 1.0, 0.01), (0.01, 0.02, 0.0, 1.0, 0.01)]
    problem = training_problem(layers, "hydrozoa", tiers=tiers, replicas=(1,))
    weights = Weights(1.0, 2.0 ** 16)
    plan = solved(hydrozoa_planner.solve(problem, Goal(weights)))
    assert plan.ranges == [(0, 0), (1, 1)] and plan.memory_mb == (2048, 1024)
    fitting = [candidate for candidate in plans(problem) if evaluate(problem, candidate).fits]
    best = min(evaluate(problem, candidate).objective(weights) for candidate in fitting)
    assert evaluate(problem, plan).objective(weights) == pytest.approx(best, rel=1e-9)


def test_hydrozoa_dp_refuses_a_layer_that_fits_no_tier():
    problem = training_problem([(0.1, 0.2, 0.0, 500.0, 1.0)], "hydrozoa", tiers=[(256, 2, 100.0, PRICE)])
    with pytest.raises(PlanError, match=r"layer 0 \(l0\) alone needs .* MB .*M = 4 and A = 2.*memory_mb"):
        hydrozoa_planner.solve(problem, FAST)


# -- Hydrozoa's planner ------------------------------------------------------------------------

def test_hydrozoa_planner_returns_a_strategy_with_its_search():
    problem = training_problem(TWO_LAYERS, "hydrozoa", replicas=(1, 2, 4), batch=8, micro_batches=4)
    plan = solved(hydrozoa_planner.Hydrozoa().solve(problem, FAST))
    assert plan.solver == "hydrozoa" and plan.predictions["status"] == "heuristic"
    assert plan.predictions["strategy"] == f"{plan.replicas[0]}x{len(plan.stages)}"
    search = plan.predictions["search"]
    assert [entry["micro_batches"] for entry in search] == [8, 4, 2, 1]   # sizes 1, 2, 4, 8
    assert all(entry["phase"] == "size" and entry["fits"] for entry in search)
    # the plan is the fastest strategy the search considered
    considered = [strategy["time_s"] for entry in search for strategy in entry["alg1"]]
    assert plan.predictions["time_s"] == pytest.approx(min(considered))
    assert evaluate(problem, plan).time_s == plan.predictions["time_s"]


def test_hydrozoa_planner_stops_when_micro_batches_outgrow_memory_and_searches_the_count():
    # 35 MiB of activations per sample on 256 MB (192 MiB after the runtime): a worker group
    # holds at most 5 samples in flight. A batch of 24 in M micro-batches over A groups (the
    # largest degree <= M fits best) keeps ⌈M/A⌉·24/M samples a group: M = 24 → 2, M = 12
    # → 4, M = 6 → 8 (too many, so the sizes stop), and between 6 and 12 the binary search
    # tries the divisor 8 → 3, which fits
    layers = [(0.01, 0.02, 0.0, 35.0, 0.1)]
    problem = training_problem(layers, "hydrozoa", tiers=[(256, 2, 100.0, PRICE)], replicas=(1, 2, 4, 8, 16),
                               batch=24, micro_batches=4)
    plan = solved(hydrozoa_planner.Hydrozoa().solve(problem, FAST))
    search = [(entry["phase"], entry["micro_batches"], entry["fits"]) for entry in plan.predictions["search"]]
    assert search == [("size", 24, True), ("size", 12, True), ("size", 6, False), ("count", 8, True)]
    assert evaluate(problem, plan).fits and plan.micro_batches in (24, 12, 8)


def test_hydrozoa_planner_within_an_slo_and_its_refusal():
    problem = training_problem(TWO_LAYERS, "hydrozoa", replicas=(1,))
    assert hydrozoa_planner.Hydrozoa().solve(problem, Goal(slo_s=1e-3)) is None
    within = hydrozoa_planner.Hydrozoa().solve(problem, Goal(slo_s=10.0))
    assert within is not None and within.predictions["time_s"] <= 10.0
    heavy = training_problem([(0.1, 0.2, 0.0, 500.0, 1.0)], "hydrozoa", tiers=[(256, 2, 100.0, PRICE)])
    with pytest.raises(PlanError, match="no strategy that fits memory.*solver='dp'"):
        hydrozoa_planner.Hydrozoa().solve(heavy, FAST)


def test_hydrozoa_planner_is_a_cost_solver():
    problem = training_problem(TWO_LAYERS, "hydrozoa", replicas=(1,), weights=(1.0, 2.0 ** 16))
    plan = hydrozoa_planner.Hydrozoa()(problem)
    assert plan.predictions["goal"] == "weights (1, 2^16)" and not math.isnan(plan.predictions["time_s"])
