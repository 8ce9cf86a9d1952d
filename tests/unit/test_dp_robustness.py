"""dp on perturbed profiles (issue 42): ``partitioner.perturb`` scales each layer's times and
bytes by factors in [0.5, 2]; over 20 perturbed copies of one chain, the work dp does (labels
built, a count, not a clock) on the slowest copy stays within 3× the median, and on every
copy dp's optimum equals its pre-issue-20 reference's (both exact, different pruning)."""

from __future__ import annotations

import math
import statistics

import pytest

from flatpack.errors import InputError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, evaluate
from flatpack.partitioner.perturb import perturbed
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.dp import Dp
from tests.unit.test_dp_anytime import chain_problem

COPIES = 20


def test_each_layer_is_scaled_within_the_bounds_times_and_bytes_apart():
    problem = chain_problem(12)
    copy = perturbed(problem, seed=3)
    time_factors, byte_factors = [], []
    for layer, scaled in zip(problem.chain, copy.chain):
        assert layer.profile is not None and scaled.profile is not None
        time_factor = scaled.profile.forward_s.per_sample / layer.profile.forward_s.per_sample
        byte_factor = scaled.profile.saved_bytes.per_sample / layer.profile.saved_bytes.per_sample
        assert 0.5 <= time_factor <= 2.0 and 0.5 <= byte_factor <= 2.0
        assert scaled.profile.backward_s.per_sample == pytest.approx(layer.profile.backward_s.per_sample * time_factor)
        assert scaled.profile.output_bytes.per_sample == pytest.approx(layer.profile.output_bytes.per_sample
                                                                       * byte_factor)
        time_factors.append(time_factor)
        byte_factors.append(byte_factor)
    assert len(set(time_factors)) == len(time_factors) and time_factors != byte_factors
    assert perturbed(problem, seed=3) == copy and perturbed(problem, seed=4) != copy


def test_bad_factors_are_refused():
    with pytest.raises(InputError, match="0 < low <= high"):
        perturbed(chain_problem(3), seed=0, low=2.0, high=0.5)


def test_dp_work_on_the_slowest_of_20_perturbed_profiles_is_within_3x_the_median():
    problem = chain_problem(12, replicas=(1, 2))
    labels = []
    for seed in range(COPIES):
        front = Dp().front(perturbed(problem, seed))
        labels.append(sum(plan.predictions["labels_built"] for plan in front.plans))
    assert max(labels) <= 3 * statistics.median(labels), labels


@pytest.mark.parametrize("seed", range(0, COPIES, 4))
def test_dp_equals_its_reference_on_perturbed_profiles(seed):
    problem = perturbed(chain_problem(8, replicas=(1, 2)), seed)
    goals = [Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]
    plans, references = Dp().solve_all(problem, goals), Dp(reference=True).solve_all(problem, goals)
    for goal, plan, reference in zip(goals, plans, references):
        assert plan is not None and reference is not None
        score, expected = goal.score(*_priced(problem, plan)), goal.score(*_priced(problem, reference))
        assert score is not None and expected is not None
        assert math.isclose(score[0], expected[0], rel_tol=1e-9), (goal, plan, reference)


def _priced(problem, plan) -> tuple[float, float, float]:
    evaluation = evaluate(problem, plan)
    return evaluation.time_s, evaluation.cost_units, evaluation.dollars
