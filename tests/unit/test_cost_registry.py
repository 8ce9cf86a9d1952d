"""The cost-model registry (flatpack/partitioner/cost/registry.py): one entry per model, the
lookup every solver, report and the command line ask, and each model's typed options."""

from __future__ import annotations

import dataclasses

import pytest

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost import gillis, hydrozoa
from flatpack.partitioner.cost.collectives import AllReduceTerms
from flatpack.partitioner.cost.gillis import CommDelay
from flatpack.partitioner.cost.registry import (COST_MODEL_REGISTRY, COST_MODELS, DEFAULT_MODELS, CostModel,
                                                GillisModel, HydrozoaModel, cost_model_for, entry, label_of,
                                                models_pricing)
from flatpack.partitioner.objective import evaluate
from flatpack.partitioner.solvers.hydrozoa_planner import sync_overheads
from flatpack.partitioner.workload import MODES, Workload
from flatpack.platform.catalog import KINDS
from flatpack.schedules import SCHEDULES, get
from tests.unit.test_cost_models import TWO_STAGES, platform, plan, problem

TRAIN = Workload("train", batch=8, micro_batches=4, optimizer="sgd")
INFER = Workload("infer", batch=1)
# what cost_model_for resolved to before the registry (objective.py's if/else), for every
# workload kind × platform kind × cost_model option: a model name, or the start of the error
STORAGE_ONLY = "cannot price training on test: workers there share only storage"
CONTAINER = "cannot price GPU-container training; use hydrozoa or pipedream"
BEFORE = {
    ("train", "serverless"): {None: "funcpipe", "funcpipe": "funcpipe", "hydrozoa": STORAGE_ONLY,
                              "pipedream": STORAGE_ONLY, "gillis": STORAGE_ONLY, "bogus": STORAGE_ONLY},
    ("train", "local"): {None: "funcpipe", "funcpipe": "funcpipe", "hydrozoa": STORAGE_ONLY,
                         "pipedream": STORAGE_ONLY, "gillis": STORAGE_ONLY, "bogus": STORAGE_ONLY},
    ("train", "container"): {None: "hydrozoa", "funcpipe": "funcpipe", "hydrozoa": "hydrozoa",
                             "pipedream": "pipedream", "gillis": CONTAINER, "bogus": CONTAINER},
    **{("infer", kind): {option: "gillis" for option in (None, "funcpipe", "hydrozoa", "pipedream", "gillis", "bogus")}
       for kind in ("serverless", "local", "container")},
}


def problem_on(kind: str, workload: Workload, **options):
    return problem(workload, target=dataclasses.replace(platform(), kind=kind), **options)


def test_the_table_covers_every_workload_kind_and_platform_kind():
    assert set(BEFORE) == {(mode, kind) for mode in MODES for kind in KINDS} == set(DEFAULT_MODELS)


@pytest.mark.parametrize("mode,kind,option", [(mode, kind, option) for (mode, kind), row in BEFORE.items()
                                              for option in row])
def test_each_problem_resolves_to_the_model_it_resolved_to_before(mode, kind, option):
    expected = BEFORE[(mode, kind)][option]
    given = {} if option is None else {"cost_model": option}
    target = problem_on(kind, TRAIN if mode == "train" else INFER, **given)
    if expected in COST_MODELS:
        model = cost_model_for(target)
        assert isinstance(model, CostModel) and type(model) is entry(expected) and model.name == expected
        assert model.prices(mode, kind)
    else:
        with pytest.raises(InputError, match=f"cost_model {option!r} {expected}"):
            cost_model_for(target)


def test_a_model_that_cannot_predict_the_workload_s_schedule_is_refused_naming_one_that_can():
    asynchronous = dataclasses.replace(TRAIN, schedule="1f1b-async")
    assert cost_model_for(problem_on("serverless", asynchronous)).name == "funcpipe"
    for option in (None, "hydrozoa", "pipedream"):
        given = {} if option is None else {"cost_model": option}
        with pytest.raises(InputError, match=r"prices only schedules that flush every iteration, not the "
                                             r"asynchronous 1f1b-async; choose --cost-model funcpipe"):
            cost_model_for(problem_on("container", asynchronous, **given))
    assert cost_model_for(problem_on("container", asynchronous, cost_model="funcpipe")).name == "funcpipe"
    assert cost_model_for(problem_on("container", dataclasses.replace(TRAIN, schedule="1f1b"))).name == "hydrozoa"
    with pytest.raises(InputError, match="unknown schedule 'gpipe'; known schedules: 1f1b, 1f1b-async, 2bw, sync"):
        dataclasses.replace(TRAIN, schedule="gpipe")


def test_the_built_in_names_in_the_order_reports_list_them():
    # key == entry name and refusing a taken name: tests/unit/test_registries.py, as for every registry
    assert COST_MODELS == ("funcpipe", "hydrozoa", "pipedream", "gillis")
    assert COST_MODEL_REGISTRY.names() == sorted(COST_MODELS)


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(InputError, match="unknown cost model 'bogus'; known cost models: funcpipe, gillis, "
                                         "hydrozoa, pipedream"):
        entry("bogus")
    assert label_of("bogus") == "bogus"


def test_each_model_names_the_schedules_and_plan_shape_it_prices():
    for name in COST_MODELS:
        model = entry(name)
        assert model.modes and set(model.modes) <= set(MODES)
        assert model.platform_kinds and set(model.platform_kinds) <= set(KINDS)
    # every model prices a flush schedule; only FuncPipe's an asynchronous one (its t_iter bounds it)
    predicting = {name: [schedule for schedule in SCHEDULES if entry(name).predicts(get(schedule))]
                  for name in COST_MODELS}
    assert predicting == {"funcpipe": ["sync", "1f1b", "1f1b-async", "2bw"], "hydrozoa": ["sync", "1f1b"],
                          "pipedream": ["sync", "1f1b"], "gillis": ["sync", "1f1b"]}
    # the shapes brute force and the sampling solvers enumerate, as they did by name
    shapes = {name: (entry(name).tier_per_stage, entry(name).degree_per_stage) for name in COST_MODELS}
    assert shapes == {"funcpipe": (True, False), "hydrozoa": (True, False), "pipedream": (True, True),
                      "gillis": (False, True)}
    assert [label_of(name) for name in COST_MODELS] == ["FuncPipe", "Hydrozoa", "PipeDream", "Gillis"]


def test_models_pricing_container_training_are_the_command_line_s_choices():
    from flatpack.cli import build_parser
    from flatpack.cli.parser import declared, verb_parsers

    plan_parser = verb_parsers(build_parser())["plan"]
    choices = next(action.choices for action in declared(plan_parser) if action.dest == "cost_model")
    assert choices is not None and sorted(choices) == sorted(models_pricing("train", "container"))
    assert models_pricing("train", "serverless") == ["funcpipe"] == models_pricing("train", "local")
    assert models_pricing("infer", "container") == ["gillis"]


def test_hydrozoa_s_typed_options_come_from_the_problem_s_and_price_the_plan():
    target = problem_on("container", TRAIN, hydrozoa_alpha=1e-9, hydrozoa_beta=2e-3)
    model = cost_model_for(target)
    assert model == HydrozoaModel(alpha=1e-9, beta=2e-3)
    assert sync_overheads(target) == AllReduceTerms(1e-9, 2e-3)
    uniform = plan((0, 1, 1024, 2), (2, 2, 2048, 2))
    direct = hydrozoa.iteration(target, uniform, AllReduceTerms(1e-9, 2e-3))
    evaluation = evaluate(target, uniform)
    assert (evaluation.time_s, evaluation.dollars, evaluation.fits) == (direct.iteration_s,
                                                                        direct.dollars_per_iteration, direct.fits)
    # the overheads are read: without them the iteration is faster
    assert evaluate(problem_on("container", TRAIN), uniform).time_s < evaluation.time_s


def test_gillis_s_measured_delay_is_typed_where_it_is_given():
    target = problem_on("serverless", INFER, comm_delay={"mu_s": 0.02, "tail_s": 0.01})
    model = cost_model_for(target)
    assert isinstance(model, GillisModel) and model.comm_delay == CommDelay(0.02, 0.0, 0.01)
    one_stage = plan((0, 2, 1024, 2))
    assert evaluate(target, one_stage).time_s == gillis.latency(target, one_stage, CommDelay(0.02, 0.0, 0.01)).latency_s
    with pytest.raises(PlanError, match=r"must give mu_s and may give sigma_s and tail_s; unknown: mean"):
        cost_model_for(problem_on("serverless", INFER, comm_delay={"mean": 0.02}))
    with pytest.raises(PlanError, match="comm_delay must be a CommDelay or its fields as a dict"):
        cost_model_for(problem_on("serverless", INFER, comm_delay=0.02))


def test_a_training_problem_never_reads_gillis_s_options():
    # the delay is Gillis's alone: a training problem is priced without looking at it
    assert cost_model_for(problem_on("serverless", TRAIN, comm_delay=0.02)).name == "funcpipe"
    assert evaluate(problem_on("serverless", TRAIN, comm_delay=0.02), TWO_STAGES).model == "funcpipe"
