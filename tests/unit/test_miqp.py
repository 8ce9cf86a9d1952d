"""miqp as a user meets it: registered by name, warm-started from the DP, what it reports
(status, gap, time limit, backend, scaling), what it does with a time limit too short to
prove anything, and its refusals (other cost models, nothing fits memory, bad options)."""

from __future__ import annotations

import pytest

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.objective import Weights, evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.solvers.miqp import Miqp, subproblems
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import make_platform, make_problem
from tests.unit.narrowing import solved

TIERS = [(256, 1, 20.0, 0.25e-5), (512, 2, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5)]
# forward s/sample, backward s/sample, params MiB, saved MiB/sample, output MiB/sample
LAYERS = [(0.01, 0.02, 40.0, 2.0, 1.0), (0.02, 0.04, 10.0, 4.0, 0.5), (0.01, 0.02, 80.0, 1.0, 0.2),
          (0.005, 0.01, 5.0, 0.5, 0.1)]
EIGHT_TIERS = [(128, 1, 20.0), (256, 1, 30.0), (512, 1, 40.0), (1024, 1, 50.0), (1536, 2, 60.0), (2048, 2, 70.0),
               (3072, 2, 80.0), (4096, 2, 90.0)]
GOAL = Goal(Weights(1.0, 2.0 ** 19))


def problem(workload=None, layers=LAYERS, tiers=TIERS, **options):
    options.setdefault("replicas", (1, 2, 4))
    return make_problem(layers, make_platform(tiers), workload or Workload("train", batch=16, micro_batches=4),
                        **options)


def long_chain(count: int = 20):
    """A chain too long to prove optimal in a few milliseconds, on 8 Lambda-like tiers."""
    layers = [(0.005 + 0.002 * (i % 7), 0.01 + 0.004 * (i % 5), 2.0 + (i % 4), 0.3, 0.2 + 0.1 * (i % 3))
              for i in range(count)]
    tiers = [(memory, vcpus, bandwidth, memory / 1024 * 1.67e-5) for memory, vcpus, bandwidth in EIGHT_TIERS]
    return problem(layers=layers, tiers=tiers)


def test_miqp_is_registered_and_matches_brute_force_with_the_dp_warm_start():
    solver = get_solver("miqp")
    assert isinstance(solver, Miqp)
    small = problem()
    expected = solved(Brute().solve(small, GOAL))
    found = solved(Miqp().solve(small, GOAL))
    assert found.predictions["status"] == "optimal" and found.predictions["gap"] == 0.0
    assert found.predictions["objective"] == pytest.approx(expected.predictions["cost_mb_s"] + 2.0 ** 19 *
                                                           expected.predictions["time_s"], rel=1e-9)
    assert found.predictions["hint"] == "dp"


def test_predictions_are_the_cost_models_and_carry_the_solver_facts():
    small = problem()
    found = solved(Miqp(hint=None, time_limit_s=20.0, workers=1).solve(small, GOAL))
    evaluation = evaluate(small, found)
    assert found.predictions["time_s"] == evaluation.time_s
    assert found.predictions["dollars"] == evaluation.dollars
    assert found.predictions["cost_model"] == "funcpipe" and found.predictions["fits"]
    facts = found.predictions
    assert facts["solver_backend"] == "cp-sat" and facts["time_limit_s"] == 20.0 and facts["workers"] == 1
    assert facts["status"] == "optimal" and facts["gap"] == 0.0 and facts["plan_source"] == "cp-sat"
    assert facts["subproblems"] == facts["subproblems_proven"] == len(subproblems(small))
    # the solver's own (integer, rounded-up) value is reported beside the cost model's
    assert isinstance(facts["objective_model"], int) and facts["objective_model"] > 0
    assert 0 < facts["scaling_tolerance"] < 1e-3
    assert facts["solve_s"] >= facts["search_s"] > 0


def test_a_time_limit_too_short_to_prove_returns_the_best_plan_with_its_gap():
    chain = long_chain()
    whole = Plan((StagePlan(0, len(chain.chain) - 1, 4096, 1),), len(chain.chain), "manual", micro_batches=4)
    assert evaluate(chain, whole).fits
    found = solved(Miqp(time_limit_s=0.05).solve_from(chain, GOAL, whole, "a single stage"))
    facts = found.predictions
    assert facts["status"] == "feasible"
    assert 0 < facts["gap"] <= 1 and facts["lower_bound"] < facts["objective"]
    assert facts["subproblems_proven"] < facts["subproblems"]
    assert evaluate(chain, found).fits


def test_a_cold_start_with_no_time_to_find_a_plan_says_what_to_do():
    chain = long_chain()
    try:
        found = solved(Miqp(hint=None, time_limit_s=0.01).solve(chain, GOAL))
    except PlanError as err:
        assert "time_limit_s" in str(err) and "solver='dp'" in str(err)
        return
    assert found.predictions["status"] in ("feasible", "optimal")
    assert found.predictions["status"] == "optimal" or found.predictions["gap"] > 0


def test_slo_mode_returns_the_cheapest_plan_within_the_slo_and_none_when_nothing_meets_it():
    small = problem()
    fastest = solved(Brute().solve(small, Goal(Weights(0.0, 1.0))))
    slo = fastest.predictions["time_s"] * 1.5
    expected = solved(Brute().solve(small, Goal(slo_s=slo)))
    found = solved(Miqp(hint=None).solve(small, Goal(slo_s=slo)))
    assert found.predictions["time_s"] <= slo
    assert found.predictions["dollars"] == pytest.approx(expected.predictions["dollars"], rel=1e-3)
    assert found.predictions["dollars"] >= expected.predictions["dollars"] * (1 - 1e-12)
    assert Miqp(hint=None).solve(small, Goal(slo_s=fastest.predictions["time_s"] * 0.5)) is None
    with pytest.raises(PlanError, match="no plan meets the SLO"):
        Miqp(hint=None).within_slo(small, fastest.predictions["time_s"] * 0.5)


def test_an_unknown_hint_solver_falls_back_to_a_cold_start_and_says_so():
    found = solved(Miqp(hint="no-such-solver").solve(problem(), GOAL))
    assert found.predictions["hint"].startswith("no-such-solver unavailable")
    assert found.predictions["status"] == "optimal"


def test_inference_and_container_problems_are_refused_with_a_pointer_to_dp():
    serving = problem(Workload("infer", batch=4))
    with pytest.raises(PlanError, match="solver='dp'"):
        Miqp().solve(serving, GOAL)
    containers = make_problem(LAYERS, make_platform(TIERS, kind="container"), Workload("train", batch=16))
    with pytest.raises(PlanError, match="hydrozoa model.*solver='dp'"):
        Miqp().solve(containers, GOAL)


def test_nothing_fits_memory_names_the_layer_and_the_tier_that_would_hold_it():
    huge = [(0.01, 0.02, 40.0, 2.0, 1.0), (0.02, 0.04, 300.0, 4.0, 0.5)]  # 300 MiB of parameters
    tight = problem(layers=huge, tiers=[(256, 1, 20.0, 0.25e-5), (2048, 2, 50.0, 2e-5)], memory_mb=(256,))
    with pytest.raises(PlanError) as caught:
        Miqp(hint=None).solve(tight, GOAL)
    message = str(caught.value)
    assert "no plan fits the memory of the allowed tiers [256] MB" in message
    assert "layer 1 (l1)" in message and "a tier of 2048 MB would hold it" in message
    hopeless = problem(layers=huge, tiers=[(256, 1, 20.0, 0.25e-5)])
    with pytest.raises(PlanError, match="no tier of the platform holds it"):
        Miqp(hint=None).solve(hopeless, GOAL)


@pytest.mark.parametrize("options, message", [
    ({"time_limit_s": 0}, "time_limit_s"),
    ({"workers": 0}, "workers"),
    ({"scale_bits": 70}, "scale_bits"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(InputError, match=message):
        Miqp(**options)


def test_symmetry_breaking_leaves_out_only_arcs_a_kept_arc_of_the_same_stage_beats():
    """A 2048 MB tier as fast (2 vCPUs) and as wide as the 1024 MB one but dearer, like
    Lambda's tiers past its plateaus: its arcs are left out, each with a stand-in of the same
    stage that is no worse in price or any time term; the dp warm start maps onto the kept
    arcs and miqp still reaches brute force's optimum."""
    from flatpack.partitioner.solvers.miqp import _ARC_TERMS

    chain = problem(tiers=[(512, 1, 50.0, 0.5e-5), (1024, 2, 100.0, 1e-5), (2048, 2, 100.0, 2e-5)])
    for full, reduced in zip(subproblems(chain, symmetry_breaking=False), subproblems(chain)):
        assert len(reduced.arcs) < len(full.arcs)
        kept = {(arc.start, arc.end, arc.memory_mb): arc for arc in reduced.arcs}
        stand_ins = dict(reduced.stand_ins)
        for arc in full.arcs:
            key = (arc.start, arc.end, arc.memory_mb)
            if key in kept:
                continue
            winner = kept[stand_ins[key]]
            assert (winner.start, winner.end) == (arc.start, arc.end)
            assert all(getattr(winner, term) <= getattr(arc, term) for term in _ARC_TERMS)
    found = solved(Miqp(time_limit_s=30.0).solve(chain, GOAL))
    truth = solved(Brute().solve(chain, GOAL))
    assert found.predictions["status"] == "optimal"
    assert found.predictions["objective"] == pytest.approx(truth.predictions["objective"], rel=1e-6)
