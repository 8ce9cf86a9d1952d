"""miqp against brute force on random small problems: the same optimum (up to the integer
scaling it reports) for weighted and SLO goals, cold and warm-started, valid plans; and its
arc model, evaluated on any plan, is FuncPipe's cost model."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatpack.errors import PlanError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights, dollars_per_mb_s, evaluate, problem_for
from flatpack.partitioner.solvers.base import TIME_ONLY, Goal
from flatpack.partitioner.solvers.brute import Brute, plans
from flatpack.partitioner.solvers.miqp import Miqp, _CpModel, _Objective, _prepare, path_values, subproblems
from flatpack.partitioner.space import SearchSpace
from tests.property.solver_strategies import training_problems

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHTS = st.sampled_from([Goal(Weights(*pair)) for pair in (*FUNCPIPE_WEIGHTS, (0.0, 1.0))])
COLD = Miqp(hint=None, time_limit_s=30.0)


def primary(problem, plan, goal):
    evaluation = evaluate(problem, plan)
    return goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)[0]


def check_valid(problem, plan):
    """Stages tile the chain; tiers, d and M from the space; one d; every stage fits; the
    predictions are the cost model's evaluation of the plan."""
    space = SearchSpace.of(problem)
    plan.check_against(len(problem.chain))
    assert {stage.memory_mb for stage in plan.stages} <= set(space.memory_mb)
    assert len(set(plan.replicas)) == 1 and plan.replicas[0] in space.replicas_for(plan.micro_batches)
    assert plan.micro_batches in space.micro_batches
    evaluation = evaluate(problem, plan)
    assert evaluation.fits
    assert plan.predictions["time_s"] == evaluation.time_s
    assert plan.predictions["dollars"] == evaluation.dollars
    assert plan.solver == "miqp" and plan.predictions["solver_backend"] == "cp-sat"


def check_same_optimum(problem, goal, found, expected):
    """Optimal, and within the reported scaling tolerance of brute force's optimum (never
    better: brute force is the optimum)."""
    assert found.predictions["status"] == "optimal" and found.predictions["gap"] == 0.0
    best, value = primary(problem, expected, goal), primary(problem, found, goal)
    tolerance = found.predictions["scaling_tolerance"]
    assert 0 <= tolerance < 1e-3
    assert value >= best * (1 - 1e-12)
    assert value <= best * (1 + tolerance) * (1 + 1e-12)
    assert found.predictions["objective"] == pytest.approx(value, rel=1e-12)


@SETTINGS
@given(training_problems(), WEIGHTS)
def test_cold_miqp_reaches_the_brute_force_optimum(problem, goal):
    try:
        expected = Brute().solve(problem, goal)
    except PlanError:
        with pytest.raises(PlanError, match="no plan fits the memory"):
            COLD.solve(problem, goal)
        return
    found = COLD.solve(problem, goal)
    check_valid(problem, found)
    check_same_optimum(problem, goal, found, expected)


# SLO factors that are not dyadic fractions: plan times on the synthetic tiers stand in
# such ratios to each other (a tier with half the vCPUs takes exactly twice as long), and an
# SLO exactly at a plan's time is the rounding case the module docstring excludes (BUGS.md)
SLO_FACTORS = st.floats(1.0001, 4.0).filter(lambda factor: (factor * 1024) % 1 != 0)


@SETTINGS
@given(training_problems(), SLO_FACTORS)
def test_slo_mode_is_brute_forces_cheapest_plan_within_the_slo(problem, factor):
    """SLOs between the fastest plan's time and a few times it (never at a plan's time
    exactly: the model keeps the SLO on rounded-up times, see the module docstring)."""
    try:
        fastest = Brute().solve(problem, Goal(TIME_ONLY))
    except PlanError:
        return
    assert fastest is not None  # no SLO: brute force finds a plan or refuses the problem
    goal = Goal(slo_s=fastest.predictions["time_s"] * factor)
    expected = Brute().solve(problem, goal)
    found = COLD.solve(problem, goal)
    assert found is not None, "the SLO is above the fastest plan's time, so a plan meets it"
    check_valid(problem, found)
    assert found.predictions["time_s"] <= goal.slo_s
    check_same_optimum(problem, goal, found, expected)


@SETTINGS
@given(training_problems(), st.one_of(WEIGHTS, st.floats(0.02, 30.0).map(lambda slo: Goal(slo_s=slo))))
def test_warm_started_miqp_agrees_and_says_where_its_plan_came_from(problem, goal):
    try:
        expected = Brute().solve(problem, goal)
    except PlanError:
        return
    found = Miqp(hint="brute", time_limit_s=30.0).solve(problem, goal)
    if expected is None:
        assert found is None
        return
    assert found is not None
    check_valid(problem, found)
    check_same_optimum(problem, goal, found, expected)
    assert found.predictions["hint"] == "brute"
    assert found.predictions["plan_source"] in ("cp-sat", "hint (brute), not improved on")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(training_problems(max_layers=3), st.data())
def test_the_arc_model_evaluated_on_any_plan_is_funcpipes_cost_model(problem, data):
    """Floats: t_iter from the arc constants equals ``funcpipe.iteration``. Integers: CP-SAT
    with the plan's arcs fixed puts t_iter exactly where the warm start does (the rounded-up
    constants), which bounds the true time from above within the reported tolerance."""
    everything = list(itertools.islice(plans(problem), 2000))
    plan = data.draw(st.sampled_from(everything))
    scoped = problem_for(problem, plan)
    if not evaluate(problem, plan).fits:
        return
    truth = funcpipe.iteration(scoped, plan)
    part = next(part for part in subproblems(problem, symmetry_breaking=False)
                if part.contains(plan, plan.micro_batches))
    path = part.path_of(plan)
    assert path is not None
    values = path_values(path, part.per_replica)
    assert values.time == pytest.approx(truth.iteration_s, rel=1e-12)
    assert values.price * plan.replicas[0] * values.time == pytest.approx(truth.dollars_per_iteration, rel=1e-12)
    # with the dominated arcs left out, the plan maps onto stand-ins no slower and no dearer
    reduced = next(part for part in subproblems(problem) if part.contains(plan, plan.micro_batches))
    reduced_path = reduced.path_of(plan)
    assert reduced_path is not None
    stand_in = path_values(reduced_path, part.per_replica)
    assert stand_in.time <= values.time * (1 + 1e-12) and stand_in.price <= values.price

    goal = Goal(Weights(1.0, 2.0 ** 16))
    objective = _Objective.of(goal, part.replicas, dollars_per_mb_s(problem.platform))
    _, scaling, _ = _prepare(part, objective, None, 40)
    assert scaling is not None  # the plan's own arcs are in the part
    model = _CpModel(part, objective, scaling, None)
    chosen = {(arc.start, arc.end, arc.memory_mb) for arc in path}
    for variable, arc in zip(model.x, part.arcs):
        model.model.add(variable == int((arc.start, arc.end, arc.memory_mb) in chosen))
    status, solved = model.solve(10.0, 1, 0)
    assert status == "optimal" and solved is not None
    ticks = path_values(path, part.per_replica, scaling.ticks)
    assert solved["objective"] == ticks.time * model._price_units(path)
    assert truth.iteration_s <= ticks.time * scaling.tick_s <= truth.iteration_s * (1 + scaling.tolerance)
