"""dp's exactness at scale of instances (issue 20): on 200 generated FuncPipe training
problems of up to 6 layers — random layer profiles, 1–3 tiers, d ⊆ {1, 2, 4}, M from the
workload or the space — dp's optimum for every one of FuncPipe's four weight pairs and an
SLO equals brute force's, for dp and for its pre-issue-20 reference
(``dp{reference=true}``); and on chains too long for brute force, dp agrees with miqp
wherever CP-SAT proves its plan optimal."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, evaluate
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.brute import Brute, plan_count
from flatpack.partitioner.solvers.dp import Dp
from flatpack.partitioner.solvers.miqp import Miqp
from flatpack.partitioner.workload import Workload
from tests.property.solver_strategies import layer_specs, make_platform, make_problem, tiers

BRUTE_LIMIT = 6_000          # plans per instance: keeps the 200 instances within seconds each
WEIGHTED = [Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]
FILTERS = (Dp(), Dp(reference=True))


@st.composite
def exactness_problems(draw, max_layers: int = 6):
    """A training problem of 1..``max_layers`` layers whose space brute force prices in a
    fraction of a second: fewer tiers and degrees as the chain grows."""
    layers = draw(layer_specs(max_layers=max_layers))
    tier_range = (1, 3) if len(layers) <= 4 else (1, 2)
    cap = draw(st.sampled_from([None, None, 60.0, 150.0]))
    platform = make_platform(draw(tiers(tier_range)), cap_mib_s=cap)
    batch = draw(st.sampled_from([4, 8, 16]))
    micro = draw(st.sampled_from([m for m in (1, 2, 4) if m <= batch]))
    workload = Workload("train", batch=batch, micro_batches=micro,
                        optimizer=draw(st.sampled_from(["sgd", "sgd-momentum", "adam"])),
                        sync=draw(st.sampled_from(["pipelined", "lambdaml"])))
    space_kwargs = {"replicas": draw(st.sampled_from([(1,), (1, 2), (1, 2, 4)]))}
    if draw(st.booleans()):
        space_kwargs["micro_batches"] = tuple(m for m in (1, 2, 4) if m <= batch)
    problem = make_problem(layers, platform, workload, **space_kwargs)
    if plan_count(problem) > BRUTE_LIMIT:   # shrink the space rather than reject the draw
        problem = make_problem(layers, platform, workload, replicas=space_kwargs["replicas"][:1])
    return problem


def primary(problem, plan, goal) -> float:
    evaluation = evaluate(problem, plan)
    return goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exactness_problems(), st.floats(0.05, 20.0))
def test_dp_equals_brute_force_on_200_instances(problem, slo):
    goals = [*WEIGHTED, Goal(slo_s=slo)]
    try:
        expected = Brute(max_plans=4 * BRUTE_LIMIT).solve_all(problem, goals)
    except PlanError:
        for dp in FILTERS:
            try:
                dp.solve_all(problem, goals)
            except PlanError:
                continue
            raise AssertionError(f"{dp} found a plan where no plan fits") from None
        return
    for dp in FILTERS:
        found = dp.solve_all(problem, goals)
        for goal, best, plan in zip(goals, expected, found):
            if best is None:   # no plan meets the SLO
                assert plan is None, (dp, goal)
                continue
            assert plan is not None and plan.predictions["status"] == "optimal", (dp, goal)
            assert math.isclose(primary(problem, plan, goal), primary(problem, best, goal), rel_tol=1e-9), \
                (dp, goal, plan, best)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layer_specs(min_layers=7, max_layers=9), tiers((2, 3)), st.sampled_from(WEIGHTED))
def test_dp_equals_miqp_where_miqp_proves_optimality(layers, tier_specs, goal):
    """7–9 layers (past brute force's reach here), cold CP-SAT: it proves these in well under
    a second of its 60 s limit, so a missing proof is a failure, not a skip."""
    workload = Workload("train", batch=8, micro_batches=2, optimizer="sgd", sync="pipelined")
    problem = make_problem(layers, make_platform(tier_specs), workload, replicas=(1, 2))
    try:
        plan = Dp().solve(problem, goal)
    except PlanError:
        return
    proven = Miqp(hint=None, time_limit_s=60.0, workers=2).solve(problem, goal)
    assert proven is not None and proven.predictions["status"] == "optimal", proven
    value, bound = primary(problem, plan, goal), primary(problem, proven, goal)
    tolerance = proven.predictions["scaling_tolerance"]
    assert value <= bound * (1 + 1e-9)                       # dp is never worse than a proven optimum
    assert value >= bound * (1 - tolerance) * (1 - 1e-9)     # nor better than its (scaled) proof allows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exactness_problems(max_layers=5), st.sampled_from(WEIGHTED))
def test_out_of_time_dp_bound_never_exceeds_the_brute_force_optimum(problem, goal):
    """The anytime answer's lower bound is a proof: never above the true optimum, and the
    plan it comes with never below it."""
    try:
        best = Brute(max_plans=4 * BRUTE_LIMIT).solve(problem, goal)
    except PlanError:
        return
    plan = Dp(time_limit_s=1e-9).solve(problem, goal)
    assert plan is not None
    optimum = primary(problem, best, goal)
    assert plan.predictions["lower_bound"] <= optimum * (1 + 1e-9)
    assert primary(problem, plan, goal) >= optimum * (1 - 1e-9)
    assert plan.predictions["status"] in ("optimal", "feasible")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exactness_problems(max_layers=4))
def test_exact_front_is_every_non_dominated_point_of_brute_force(problem):
    """``Dp.exact_front``: the same (time, dollars) points as the non-dominated set of every
    plan brute force prices, each weight pair's optimum among them."""
    from flatpack.partitioner.pareto import non_dominated
    from flatpack.partitioner.solvers.brute import plans as every_plan
    from flatpack.partitioner.objective import annotate

    if plan_count(problem) > BRUTE_LIMIT:
        return
    priced = [annotate(plan, evaluation) for plan in every_plan(problem)
              if (evaluation := evaluate(problem, plan)).fits]
    if not priced:
        return
    expected = [(plan.predictions["time_s"], plan.predictions["dollars"]) for plan in non_dominated(priced)]
    front = Dp().exact_front(problem)
    found = [(plan.predictions["time_s"], plan.predictions["dollars"]) for plan in front.plans]
    assert len(found) == len(expected), (found, expected)
    for (time_found, dollars_found), (time_expected, dollars_expected) in zip(found, expected):
        assert math.isclose(time_found, time_expected, rel_tol=1e-9)
        assert math.isclose(dollars_found, dollars_expected, rel_tol=1e-9)
    tagged = {label for plan in front.plans for label in plan.predictions["weights"]}
    assert tagged == {goal.weights.label() for goal in WEIGHTED}


def _suffix(search, start: int, row: int) -> tuple:
    """The stages (start, end, memory MB, replicas) of label ``row`` of layer ``start``."""
    stages = []
    while row >= 0:
        labels = search.labels[start]
        end, option = int(labels.end[row]), int(labels.tier[row])
        stages.append((start, end, search.chain.tiers[option].memory_mb, search.chain.replicas))
        start, row = end + 1, int(labels.next_row[row])
    return tuple(stages)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(exactness_problems(max_layers=5), st.sampled_from(WEIGHTED))
def test_label_bound_never_exceeds_its_best_completion(problem, goal):
    """The bound dp prunes with (``_Search._lower_scores``: the prefix fronts, the prefix
    quantities at their least) is a lower bound: for every label an unpruned pass keeps, it
    is never above the best score of the plans brute force prices that end in the label's
    stages, at the label's (M, d). (A front that dropped a prefix whose forward bottleneck
    alone is smaller would break this where a label's synchronization dominates.)"""
    from flatpack.partitioner.objective import dollars_per_mb_s
    from flatpack.partitioner.solvers import funcpipe_dp
    from flatpack.partitioner.solvers.brute import plans as every_plan
    from flatpack.partitioner.space import SearchSpace

    space = SearchSpace.of(problem)
    try:
        configurations, chains = funcpipe_dp._tables(problem, space)
    except PlanError:
        return
    best: dict[tuple, float] = {}     # (M, S, suffix stages) → least score of a plan ending in them
    for plan in every_plan(problem, space):
        evaluation = evaluate(problem, plan)
        if not evaluation.fits:
            continue
        score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)[0]
        stages = tuple((stage.start, stage.end, stage.memory_mb, stage.replicas) for stage in plan.stages)
        for first in range(1, len(stages)):
            key = (plan.micro_batches, len(stages), stages[first:])
            best[key] = min(best.get(key, math.inf), score)
    unit = dollars_per_mb_s(problem.platform)
    for config in configurations:
        chain = chains[config]
        if chain.recompute.any():
            continue     # brute force prices no recomputing stage
        search = funcpipe_dp._Search(chain, funcpipe_dp._Objective(goal, chain.replicas, unit), math.inf, None,
                                     funcpipe_dp._Stats())
        search.run()
        for start in range(1, chain.layers):
            labels = search.labels[start]
            if not len(labels.tier):
                continue
            bounds = search._lower_scores(start, labels.values)[0]
            for row, bound in enumerate(bounds):
                suffix = _suffix(search, start, row)
                completions = [score for (micro, count, stages), score in best.items()
                               if micro == chain.micro_batches and stages == suffix
                               and (chain.stage_count is None or count == chain.stage_count)]
                if completions:
                    assert bound <= min(completions) * (1 + 1e-9), (config, start, suffix, bound, min(completions))
