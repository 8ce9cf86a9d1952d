"""``rl`` on random small problems, training (FuncPipe's model) and fork-join inference
(Gillis's): it never claims a plan that overflows memory or misses the SLO, never beats
brute force (it prices plans with the same model), raises exactly when brute force finds
nothing that fits, and returns None only for SLOs it saw no plan meet."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, evaluate
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.solvers.rl import Rl
from tests.property.solver_strategies import inference_problems, training_problems

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
GOALS = st.one_of(st.sampled_from([Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]),
                  st.floats(0.02, 30.0).map(lambda slo: Goal(slo_s=slo)))


@SETTINGS
@given(st.one_of(training_problems(), inference_problems()), GOALS)
def test_rl_never_claims_an_invalid_plan_and_never_beats_brute_force(problem, goal):
    solver = Rl(episodes=160, warm_start=False)
    try:
        expected = Brute().solve(problem, goal)
    except PlanError:
        with pytest.raises(PlanError):
            solver.solve(problem, goal)
        return
    found = solver.solve(problem, goal)
    if found is None:
        assert goal.slo_s is not None
        return
    evaluation = evaluate(problem, found)
    assert evaluation.fits
    score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
    assert score is not None, "rl returned a plan that misses the SLO"
    assert expected is not None, "rl met an SLO that brute force says nobody meets"
    best = goal.score(*(lambda e: (e.time_s, e.cost_units, e.dollars))(evaluate(problem, expected)))
    assert score[0] >= best[0] * (1 - 1e-9)
    assert found.predictions["status"] == "heuristic"
    assert found.predictions["episodes"] <= 160
