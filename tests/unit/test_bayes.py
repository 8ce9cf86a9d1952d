"""bayes, the GP-surrogate Bayesian optimizer: its plans fit and meet the SLO, a seed fixes
its answer, it prices at most its budget, it says so when it saw no plan, and it is never
better than the exact optimum."""

from __future__ import annotations

import logging
import time

import optuna
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.bayes import Bayes, Encoding
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.solvers.sampled import DecisionSpace
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import inference_problems, make_platform, make_problem, training_problems
from tests.unit.narrowing import solved

TIERS = [(256, 1, 20.0, 0.25e-5), (512, 2, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5)]
# forward s/sample, backward s/sample, params MiB, saved MiB/sample, output MiB/sample
LAYERS = [(0.01, 0.02, 40.0, 2.0, 1.0), (0.02, 0.04, 10.0, 4.0, 0.5), (0.01, 0.02, 80.0, 1.0, 0.2),
          (0.005, 0.01, 5.0, 0.5, 0.1)]
WEIGHTED = Goal(Weights(1.0, 2.0 ** 19))
SMALL = Bayes(evaluations=20, startup=8, seed=0)


def training(workload=None, layers=LAYERS, **options):
    options.setdefault("replicas", (1, 2, 4))
    options.setdefault("micro_batches", (1, 2, 4))
    return make_problem(layers, make_platform(TIERS), workload or Workload("train", batch=16, micro_batches=4),
                        **options)


def inference(**options):
    options.setdefault("max_workers", 3)
    return make_problem(LAYERS, make_platform(TIERS), Workload("infer", batch=4), **options)


def slo_between_fastest_and_cheapest(problem) -> float:
    fastest = solved(Brute().solve(problem, Goal(Weights(0.0, 1.0)))).predictions["time_s"]
    cheapest = solved(Brute().solve(problem, Goal(Weights(1.0, 0.0)))).predictions["time_s"]
    return (fastest * cheapest) ** 0.5


@pytest.mark.parametrize("make", [training, inference], ids=["funcpipe-training", "gillis-inference"])
def test_plans_fit_meet_the_slo_and_report_backend_and_budget(make):
    problem = make()
    plan = solved(SMALL.solve(problem, WEIGHTED))
    assert plan.solver == "bayes" and evaluate(problem, plan).fits
    assert plan.predictions["backend"].startswith("optuna") and "GPSampler" in plan.predictions["backend"]
    assert plan.predictions["evaluations"] == plan.predictions["samples"] == 20
    assert plan.predictions["evaluation_budget"] == 20 and plan.predictions["status"] == "heuristic"

    slo = slo_between_fastest_and_cheapest(problem)
    within = SMALL.solve(problem, Goal(slo_s=slo))
    assert within is not None
    evaluation = evaluate(problem, within)
    assert evaluation.fits and evaluation.time_s <= slo
    assert within.predictions["dollars"] == pytest.approx(evaluation.dollars)


def test_a_seed_fixes_the_plan():
    problem = training()
    first, second = (solved(Bayes(evaluations=16, startup=6, seed=3).solve(problem, WEIGHTED)) for _ in range(2))
    assert first == second and first.predictions["best_at_sample"] == second.predictions["best_at_sample"]


def test_the_time_limit_bounds_a_large_budget():
    started = time.perf_counter()
    plan = solved(Bayes(evaluations=100_000, startup=5, time_limit_s=0.5).solve(training(), WEIGHTED))
    assert time.perf_counter() - started < 5.0
    assert plan.predictions["evaluations"] < 100_000


def test_an_slo_nothing_meets_gives_no_plan_and_the_call_says_to_raise_the_budget():
    problem = training()
    assert Bayes(evaluations=12, startup=6).solve(problem, Goal(slo_s=1e-6)) is None
    tight = training(Workload("train", batch=16, micro_batches=4, slo_s=1e-6))
    with pytest.raises(PlanError, match=r"'bayes' saw no plan within the SLO of 1e-06 s in its budget"):
        Bayes(evaluations=12, startup=6)(tight)


def test_a_platform_where_nothing_fits_is_an_error_not_a_plan():
    huge = [(0.01, 0.02, 2000.0, 1.0, 0.1)] * 2
    with pytest.raises(PlanError, match=r"'bayes' priced 8 plans and none fits"):
        Bayes(evaluations=8, startup=4).solve(training(layers=huge), WEIGHTED)


def test_per_stage_degrees_under_pipedream_and_weights_through_the_registry():
    problem = make_problem(LAYERS, make_platform(TIERS, kind="container"), Workload("train", batch=16, micro_batches=4),
                           replicas=(1, 2, 4), cost_model="pipedream", weights=(1.0, 2.0 ** 19))
    plan = Bayes(evaluations=12, startup=6)(problem)
    assert evaluate(problem, plan).fits and plan.predictions["goal"] == "weights (1, 2^19)"
    registered = get_solver("bayes")
    assert isinstance(registered, Bayes) and registered.evaluations == Bayes().evaluations


def test_a_stage_takes_its_first_layers_slot_and_degrees_are_clamped_to_m():
    encoding = Encoding(DecisionSpace.of(training()))
    assert set(encoding.dimensions()) == {"cut0", "cut1", "cut2", "tier0", "tier1", "tier2", "tier3", "degree",
                                          "micro"}
    plan = encoding.plan({"cut1": 1, "tier0": 2, "tier1": 0, "tier2": 1, "tier3": 0, "degree": 2, "micro": 0},
                         "bayes")
    assert plan.ranges == [(0, 1), (2, 3)] and list(plan.memory_mb) == [1024, 512]
    assert [stage.replicas for stage in plan.stages] == [1, 1] and plan.micro_batches == 1   # d = 4 > M = 1
    gillis = Encoding(DecisionSpace.of(inference()))
    assert "tier" in gillis.dimensions() and "degree3" in gillis.dimensions()


def test_the_callers_logging_and_torch_threads_are_left_as_they_were():
    optuna.logging.set_verbosity(logging.INFO)
    threads = torch.get_num_threads()
    try:
        Bayes(evaluations=12, startup=6).solve(inference(), WEIGHTED)
        assert optuna.logging.get_verbosity() == logging.INFO and torch.get_num_threads() == threads
    finally:
        optuna.logging.set_verbosity(logging.WARNING)


@pytest.mark.parametrize("options, message", [
    ({"evaluations": 0}, "evaluations must be a positive integer"),
    ({"evaluations": 2.5}, "evaluations must be a positive integer"),
    ({"startup": True}, "startup must be a positive integer"),
    ({"time_limit_s": 0}, "time_limit_s must be > 0"),
    ({"time_limit_s": "1"}, "time_limit_s must be a number"),
    ({"seed": None}, "seed must be an integer"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(InputError, match=message):
        Bayes(**options)


@settings(max_examples=6, deadline=None)
@given(st.one_of(training_problems(max_layers=3), inference_problems(max_layers=3)))
def test_never_better_than_brute_and_always_fits(problem):
    try:
        optimum = solved(Brute().solve(problem, WEIGHTED))
    except PlanError:
        with pytest.raises(PlanError):
            Bayes(evaluations=10, startup=5).solve(problem, WEIGHTED)
        return
    try:
        plan = solved(Bayes(evaluations=10, startup=5).solve(problem, WEIGHTED))
    except PlanError as error:  # a sampler may see no fitting plan in 10; it must say so, not guess
        assert "none fits" in str(error)
        return
    assert evaluate(problem, plan).fits
    assert plan.predictions["objective"] >= optimum.predictions["objective"] * (1 - 1e-9)
