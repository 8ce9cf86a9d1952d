"""dp's price-banded bound and its configuration screen (issue 42) keep it exact: the priced
prefix fronts bound every prefix that fits, a configuration's screen never exceeds its optimum,
and dp's optima equal brute force's (small chains) and its pre-issue-20 reference's (larger
chains, FuncPipe's four weight pairs and an SLO), on the profiles as built and perturbed."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, dollars_per_mb_s, evaluate
from flatpack.partitioner.perturb import perturbed
from flatpack.partitioner.solvers import funcpipe_dp
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute
from flatpack.partitioner.solvers.dp import Dp
from flatpack.partitioner.space import SearchSpace
from flatpack.platform.catalog import get_platform
from tests.unit.test_dp_anytime import chain_problem

GOALS = [Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]


def on_lambda(problem, tiers: tuple[int, ...] = (512, 1024, 2048, 3072)):
    """``problem`` on aws-lambda's catalog, searching ``tiers`` of its eight: tiers priced by
    memory, so that many prefixes share a price (one band); four keep brute force short."""
    options = dataclasses.replace(problem.options, memory_mb=tiers)
    return dataclasses.replace(problem, platform=get_platform("aws-lambda"), options=options)


def score(problem, goal: Goal, plan) -> float:
    evaluation = evaluate(problem, plan)
    value = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
    assert value is not None
    return value[0]


def slo_goal(problem) -> Goal:
    """An SLO between the fastest and the slowest weight pair's optimum: it binds."""
    times = [evaluate(problem, plan).time_s for plan in Dp().solve_all(problem, GOALS) if plan is not None]
    return Goal(slo_s=(min(times) + max(times)) / 2)


def assert_same_optima(problem, goals, plans, expected) -> None:
    """The same objective for every goal; float sums may order differently when two plans tie,
    so equality is up to 1e-12 relative (no plan of these instances comes within 1e-9 of
    another's objective without being the same plan)."""
    for goal, plan, other in zip(goals, plans, expected):
        assert (plan is None) == (other is None), goal
        if plan is not None:
            assert math.isclose(score(problem, goal, plan), score(problem, goal, other), rel_tol=1e-12), (goal, plan,
                                                                                                        other)


def fitting_prefixes(chain, layers: int):
    """Every prefix of ``layers`` layers whose stages fit their options (all fitting options,
    not only those :func:`funcpipe_dp._undominated_tiers` keeps), as (W_p, Δ_f, Δ_b, P_p)
    computed from the chain's arrays stage by stage, independently of the fronts."""
    for cuts in itertools.product((False, True), repeat=layers - 1):
        bounds = [0] + [index + 1 for index, cut in enumerate(cuts) if cut] + [layers]
        stages = list(zip(bounds[:-1], [end - 1 for end in bounds[1:]]))
        if any(end - start >= len(chain.fits[start]) for start, end in stages):
            continue
        choices = [np.flatnonzero(chain.fits[start][end - start]) for start, end in stages]
        for options in itertools.product(*choices):
            work = lag_f = lag_b = price = 0.0
            for position, ((start, end), option) in enumerate(zip(stages, options)):
                forward, backward = (float(array[option]) for array in chain.stage_seconds(start, end))
                upload = float(chain.transfer(end, np.array([option]))[0])
                download = float(chain.transfer(start - 1, np.array([option]))[0]) if position else 0.0
                work += forward + backward + 2 * (upload + download)
                lag_f = max(lag_f, forward, upload, download)
                lag_b = max(lag_b, backward, upload, download)
                price += float(chain.price[option])
            yield np.array([work, lag_f, lag_b, price])


def bound_keys(rows: np.ndarray, chain) -> np.ndarray:
    """The sums of a prefix's numbers that the bound adds to a label's (``_lower_scores``):
    t_iter's lower bound is, term by term, a maximum of sums each holding one of W_p,
    W_p + (µ−1)·Δ_f, W_p + (µ−1)·Δ_b, W_p + (µ−1)·(Δ_f + Δ_b) or, where d > 1, (µ−1)·Δ_f;
    and the price P_p. A row no larger in each stands for the prefix in every bound."""
    work, lag_f, lag_b = rows[:, 0], (chain.mu - 1) * rows[:, 1], (chain.mu - 1) * rows[:, 2]
    keys = [work, work + lag_f, work + lag_b, work + lag_f + lag_b, rows[:, 3]]
    return np.stack(keys + ([lag_f] if chain.replicas > 1 else []), axis=1)


@pytest.mark.parametrize("make", [
    lambda: chain_problem(7, replicas=(1, 2)),
    lambda: on_lambda(perturbed(chain_problem(6, replicas=(1, 4)), 5), (512, 1024, 3072)),
])
def test_every_fitting_prefix_is_stood_for_by_a_row_of_its_priced_front(make):
    problem = make()
    _, chains = funcpipe_dp._tables(problem, SearchSpace.of(problem))
    checked = 0
    for chain in chains.values():
        fronts = chain.priced_prefix_fronts
        for layers in range(1, chain.layers):
            rows = bound_keys(fronts[layers], chain)
            for prefix in fitting_prefixes(chain, layers):
                keys = bound_keys(prefix[None, :], chain)[0]
                assert (rows <= keys + 1e-12 * np.abs(keys)).all(axis=1).any(), (layers, prefix, fronts[layers])
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_a_configurations_screen_never_exceeds_its_optimum(seed):
    problem = on_lambda(chain_problem(9, replicas=(1, 2, 4)))
    problem = problem if seed is None else perturbed(problem, seed)
    _, chains = funcpipe_dp._tables(problem, SearchSpace.of(problem))
    unit = dollars_per_mb_s(problem.platform)
    for goal in GOALS:
        for chain in chains.values():
            objective = funcpipe_dp._Objective(goal, chain.replicas, unit)
            stats = funcpipe_dp._Stats()
            screen = funcpipe_dp._Search(chain, objective, math.inf, None, stats).unsearched_bound()
            found = funcpipe_dp._Search(chain, objective, math.inf, None, stats).run()
            assert found is not None
            assert screen <= found[0] * (1 + 1e-12), (goal, chain.replicas)


@pytest.mark.parametrize("seed", [None, 0, 1])
@pytest.mark.parametrize("lambda_tiers", [False, True])
def test_dp_equals_brute_force_on_small_chains(seed, lambda_tiers):
    problem = chain_problem(5, replicas=(1, 2))
    problem = on_lambda(problem, (1024, 2048, 3072)) if lambda_tiers else problem
    problem = problem if seed is None else perturbed(problem, seed)
    goals = [*GOALS, slo_goal(problem)]
    assert_same_optima(problem, goals, Dp().solve_all(problem, goals), Brute().solve_all(problem, goals))


@pytest.mark.parametrize("seed", [None, 3, 7])
@pytest.mark.parametrize("lambda_tiers", [False, True])
def test_dp_equals_its_pre_issue_20_reference_on_longer_chains(seed, lambda_tiers):
    """The reference prunes with neither the banded fronts nor the screen (each prefix
    quantity at its own least), so agreeing with it checks both on chains brute force cannot
    enumerate."""
    problem = chain_problem(14, replicas=(1, 2, 4))
    problem = on_lambda(problem) if lambda_tiers else problem
    problem = problem if seed is None else perturbed(problem, seed)
    goals = [*GOALS, slo_goal(problem)]
    assert_same_optima(problem, goals, Dp().solve_all(problem, goals), Dp(reference=True).solve_all(problem, goals))
