"""Plans round-trip through JSON; solvers are registered by name; balanced is exactly min-max."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.solvers import SOLVERS, get_solver, register_solver
from flatpack.partitioner.solvers.balanced import Balanced
from flatpack.platform.catalog import get_platform


def test_plan_json_round_trip():
    plan = Plan.from_cuts([1, 4], 7, "manual")
    assert plan.ranges == [(0, 1), (2, 4), (5, 6)] and plan.cuts == [1, 4]
    assert Plan.loads(plan.dumps()) == plan


def test_a_plan_runs_every_stage_s_replicas_as_its_workers():
    plan = Plan((StagePlan(0, 2, replicas=2), StagePlan(3, 6, replicas=3)), 7)
    assert plan.replicas == (2, 3) and plan.workers == 5


@pytest.mark.parametrize("stages, message", [
    ((StagePlan(0, 2), StagePlan(4, 6)), "must start at 3"),
    ((StagePlan(0, 2),), "the chain has 7 layers"),
    ((StagePlan(0, 6, replicas=0),), "at least 1"),
])
def test_bad_plans_are_rejected(stages, message):
    with pytest.raises(PlanError, match=message):
        Plan(stages, 7).check_against(7)


def test_plan_for_another_chain_is_rejected():
    with pytest.raises(PlanError, match="made for a chain of 5 layers"):
        Plan.from_cuts([1], 5).check_against(6)


def test_solver_registry_keys_are_names_and_duplicates_are_refused():
    for name in SOLVERS.names():
        assert get_solver(name).name == name
    with pytest.raises(PlanError, match="already registered"):
        register_solver("balanced", lambda: get_solver("balanced"))
    with pytest.raises(PlanError, match="unknown solver 'miqp2'"):
        get_solver("miqp2")


def brute_force(weights, stages):
    best = None
    for cuts in itertools.combinations(range(len(weights) - 1), stages - 1):
        bounds = [0, *(c + 1 for c in cuts), len(weights)]
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_is_min_max_optimal(weights, stages):
    problem = Problem(tuple(ChainLayer(f"l{i}", w, 0, 1) for i, w in enumerate(weights)), get_platform("local"),
                      stages=stages)
    if stages > len(weights):
        with pytest.raises(PlanError):
            Balanced()(problem)
        return
    plan = Balanced()(problem)
    assert len(plan.stages) == stages
    assert max(sum(weights[s.start:s.end + 1]) for s in plan.stages) == brute_force(weights, stages)
