"""Schedules as registered, typed objects (issue 38, item 1; ``flatpack/schedules.py``): the
order of each schedule's actions, what each refuses, how each is predicted, and a toy
schedule added as one file plus its registration (``gpipe_schedule.py``) that trains on the
local backend to the weights ``sync`` gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatpack.errors import InputError
from flatpack.schedules import (PLUGINS_ENV, SCHEDULE_REGISTRY, SCHEDULES, Action, Computation, Layout, Schedule, Setup,
                                get, names, register_plugins)
from tests.unit.gpipe_schedule import GPipe

ROOT = Path(__file__).resolve().parents[2]
F, B = Computation.FORWARD, Computation.BACKWARD
# (stage, stages, the micro-batches the replica owns)
SHAPES = [(0, 1, [0, 1, 2]), (0, 3, [0, 1, 2, 3]), (1, 3, [0, 1, 2, 3]), (2, 3, [0, 1, 2, 3]), (0, 4, [0, 1]),
          (1, 2, [1, 3, 5]), (0, 2, [])]


def pairs(actions: list[Action]) -> list[tuple[str, int]]:
    return [(action.kind.value, action.micro_batch) for action in actions]


@pytest.fixture
def gpipe(monkeypatch):
    """The toy schedule registered here and, for the workers (processes of their own), named
    in the environment they inherit; unregistered afterwards, so no other test sees it."""
    SCHEDULE_REGISTRY.register(GPipe.name, GPipe)
    monkeypatch.setenv(PLUGINS_ENV, "tests.unit.gpipe_schedule:GPipe")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    yield get(GPipe.name)
    SCHEDULE_REGISTRY.unregister(GPipe.name)


# -- the order of actions ---------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("stage", "stages", "owned"), SHAPES)
def test_every_owned_micro_batch_is_forwarded_then_backwarded_exactly_once(name, stage, stages, owned):
    actions = get(name).actions(stage, stages, owned)
    assert all(isinstance(action, Action) and action.stage == stage and action.iteration == 0 for action in actions)
    assert sorted(pairs(actions)) == sorted([("F", m) for m in owned] + [("B", m) for m in owned])
    for index, action in enumerate(actions):
        if action.kind is B:
            assert ("F", action.micro_batch) in pairs(actions[:index]), f"{action}: a backward before its forward"


def test_sync_runs_all_forwards_then_the_backwards_in_reverse():
    assert pairs(get("sync").actions(0, 3, [0, 2, 4])) == [("F", 0), ("F", 2), ("F", 4), ("B", 4), ("B", 2), ("B", 0)]
    assert [str(action) for action in get("sync").actions(2, 3, [1])] == ["2F1", "2B1"]


@pytest.mark.parametrize("name", ["1f1b", "1f1b-async"])
@pytest.mark.parametrize(("stage", "stages", "owned"), SHAPES)
def test_1f1b_warms_up_stages_minus_stage_minus_one_deep_then_alternates(name, stage, stages, owned):
    order = pairs(get(name).actions(stage, stages, owned))
    warmup = min(stages - stage - 1, len(owned))
    assert order[:warmup] == [("F", m) for m in owned[:warmup]]
    steady = order[warmup:2 * len(owned) - warmup]
    assert [kind for kind, _ in steady] == ["F", "B"] * (len(owned) - warmup)
    assert [m for kind, m in order if kind == "B"] == list(owned), "backwards in forward order"
    in_flight = peak = 0
    for kind, _ in order:
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak <= warmup + 1, "1F1B keeps at most warmup + 1 micro-batches' activations"


@pytest.mark.parametrize("name", ["sync", "1f1b"])
def test_a_flush_schedule_s_call_repeats_its_iteration_and_steps_once_per_iteration(name):
    schedule = get(name)
    one = schedule.actions(1, 3, [0, 1, 2])
    call = schedule.call_actions(1, Layout.single(3, 3), [0, 1, 2], 3)
    assert [[(a.kind, a.micro_batch) for a in chunk] for chunk in call] == [[(a.kind, a.micro_batch) for a in one]] * 3
    assert [{a.iteration for a in chunk} for chunk in call] == [{0}, {1}, {2}]
    assert schedule.flush and schedule.optimizer_steps(4) == 1


def test_the_asynchronous_call_is_one_1f1b_sequence_sliced_where_each_iteration_s_first_forward_runs():
    schedule = get("1f1b-async")
    assert not schedule.flush and schedule.optimizer_steps(4) == 4
    for stage in range(3):
        call = schedule.call_actions(stage, Layout.single(3, 2), [0, 1], 3)
        flat = [action for chunk in call for action in chunk]
        sequence = [(a.kind.value, a.iteration * 2 + a.micro_batch) for a in flat]
        assert sequence == pairs(get("1f1b").actions(stage, 3, list(range(6))))
        for index, chunk in enumerate(call):
            assert (chunk[0].kind, chunk[0].iteration) == (F, index), "a slice starts with its iteration's forward"
            assert all(a.iteration == index for a in chunk if a.kind is F)
    with pytest.raises(NotImplementedError, match="flushes every iteration"):
        get("sync").weight_version(3, 0, Layout.single(2, 2))


# -- the registry -----------------------------------------------------------------------------

def test_the_registry_holds_the_built_ins_first_and_refuses_an_unknown_name():
    # key == entry name and a taken name refused: tests/unit/test_registries.py, as for every registry
    assert SCHEDULES == ("sync", "1f1b", "1f1b-async", "2bw") and names()[:4] == list(SCHEDULES)
    assert all(isinstance(get(name), Schedule) and get(name).description for name in SCHEDULES)
    schedule = get("1f1b")
    assert get(schedule) is schedule
    with pytest.raises(InputError, match="unknown schedule 'gpipe'; known schedules: 1f1b, 1f1b-async, 2bw, sync"):
        get("gpipe")


def test_the_schedule_module_and_the_command_line_import_no_torch():
    code = "import sys, flatpack.schedules, flatpack.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert result.stdout.strip() == "False"


def test_a_schedule_named_in_the_environment_is_registered_once(monkeypatch):
    try:
        assert register_plugins({PLUGINS_ENV: " tests.unit.gpipe_schedule:GPipe ,"}) == ["gpipe"]
        assert register_plugins({PLUGINS_ENV: "tests.unit.gpipe_schedule:GPipe"}) == ["gpipe"]   # no second entry
        assert type(get("gpipe")) is GPipe and "gpipe" in names()
    finally:
        if "gpipe" in SCHEDULE_REGISTRY.names():
            SCHEDULE_REGISTRY.unregister("gpipe")
    assert register_plugins({}) == []
    with pytest.raises(InputError, match="name each schedule class as module:Class"):
        register_plugins({PLUGINS_ENV: "tests.unit.gpipe_schedule"})
    with pytest.raises(InputError, match="not a Schedule subclass"):
        register_plugins({PLUGINS_ENV: "tests.unit.gpipe_schedule:Action"})


# -- what each schedule refuses, and its prediction -------------------------------------------

def test_a_flush_schedule_refuses_only_vertical_sync():
    everything = Setup(replicas=(2, 3), clip_grad_norm=1.0, accumulate=4, precision="fp16", shared=("w",),
                       time_limit_s=880.0, replan=True, elastic=True, ranks=True)
    for name in ("sync", "1f1b"):
        get(name).check(everything)
        with pytest.raises(InputError, match=f"vertical sync applies to the 1f1b-async schedule, not '{name}'"):
            get(name).check(Setup(vertical_sync=True))


@pytest.mark.parametrize(("setup", "words"), [
    (Setup(replicas=(1, 2), micro_batches=3), r"replica degrees \[1, 2\] do not all divide the 3 micro-batches"),
    (Setup(replicas=(1, 2), vertical_sync=True), r"stages of replica degrees \[1, 2\] step once per round of d"),
    (Setup(clip_grad_norm=1.0), r"--clip-grad-norm 1.0 needs every stage's gradient .* use --schedule 2bw"),
    (Setup(replan=True), "replan switches plans between epochs, and 1f1b-async has micro-batches in flight"),
    (Setup(elastic=True), "elastic re-scaling changes replica degrees between epochs"),
    (Setup(ranks=True), "GPU-container ranks run sync or 1f1b: use --schedule 1f1b for this target"),
    (Setup(precision="fp16"), "--precision fp16 skips a step .* use --precision bf16"),
])
def test_the_asynchronous_schedule_refuses_what_needs_every_stage_at_one_step(setup, words):
    with pytest.raises(InputError, match=words):
        get("1f1b-async").check(setup)
    get("1f1b-async").check(Setup(replicas=(1, 1), vertical_sync=True, precision="bf16"))
    # under vertical sync every stage steps on g after the first stage's backward of g: the global knobs run
    get("1f1b-async").check(Setup(replicas=(1, 1), vertical_sync=True, clip_grad_norm=1.0, shared=("w",)))
    get("2bw").check(Setup(replicas=(2, 1, 2), clip_grad_norm=1.0, accumulate=2, shared=("w",), micro_batches=3))


def test_each_schedule_predicts_its_iteration_from_the_bound_or_its_simulated_span():
    def never() -> float:
        raise AssertionError("simulated though the schedule predicts from FuncPipe's bound")

    assert get("sync").iteration_s(2.0, never) == 2.0
    assert get("1f1b-async").iteration_s(2.0, never) == 2.0
    assert get("1f1b").iteration_s(2.0, lambda: 3.5) == 3.5


def test_the_toy_schedule_is_simulated_by_the_plan_report_in_its_own_order(gpipe):
    from flatpack.analysis.report import predicted_iteration, predicted_schedule
    from tests.unit.test_cost_models import plan, problem

    single = plan((0, 1, 1024, 1), (2, 2, 2048, 1))
    events = predicted_schedule(problem(), single, schedule="gpipe")
    compute = [(event.kind[0].upper(), event.micro_batch) for event in events
               if event.stage == 1 and event.lane == "compute" and event.micro_batch is not None]
    assert compute == [("F", m) for m in range(4)] + [("B", m) for m in range(4)]
    span = max(event.end for event in events)
    assert predicted_iteration(problem(), single, schedule=gpipe).iteration_s >= span


# -- the toy schedule trains --------------------------------------------------------------------

@pytest.mark.slow
def test_a_schedule_added_in_one_file_trains_on_the_local_backend_to_sync_s_weights(gpipe):
    from flatpack.analysis.reference import train_single_process
    from flatpack.backends import local
    from tests.integration.test_local_training import batches, compiled_with, make_model

    data, optimizer = batches(2), {"name": "adam", "lr": 0.01}
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [2, 1], 4)
    results = {}
    for name in ("gpipe", "sync"):   # a deployment's second call would continue from the first's weights
        with local.deploy(compiled) as deployment:
            results[name] = deployment.train(data, iterations=2, optimizer=optimizer, schedule=name)
    reference, losses = train_single_process(make_model(), data, 2, optimizer=optimizer, micro_batches=4)
    toy, sync = results["gpipe"], results["sync"]
    assert set(toy.parameters) == set(sync.parameters) == set(reference.state_dict())
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(toy.parameters[name], sync.parameters[name], rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(toy.parameters[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert toy.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    # the toy's order ran: stage 1's backwards follow its forwards in micro-batch order
    computed = sorted((event.start, event.kind, event.micro_batch) for event in toy.events
                      if event.stage == 1 and event.iteration == 0 and event.kind in ("forward", "backward"))
    assert [(kind, m) for _, kind, m in computed] == [("forward", m) for m in range(4)] + [("backward", m)
                                                                                            for m in range(4)]
