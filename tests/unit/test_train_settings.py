"""One set of training settings from the Python API to the worker (issue 38, item 2):
``TrainSettings`` and ``RunControls`` (flatpack/runtime/settings.py), parsed once, recorded
with a call and repeated by resume; the number of micro-batches resolved in one function
(``Plan.micro_batches_for``); ``RunSpec.of`` building the workers' spec from the settings."""

from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import pytest

from flatpack.backends.functions import CallRecord, FunctionDeployment, resolve_settings
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.precision import LossScaling
from flatpack.runtime.settings import (RunControls, TrainOptions, TrainSettings, refuse_unhonoured, resolve_options,
                                       split_options)
from flatpack.runtime.spec import RunSpec, StageSpec

SETTINGS = TrainSettings(optimizer=OptimizerSpec.of({"name": "adam", "lr": 0.003, "clip_grad_norm": 1.0}), loss="mse",
                         micro_batches=4, schedule="1f1b", sync="lambdaml", threads=2, checkpoint_every=3,
                         precision="fp16",
                         loss_scaling=LossScaling.of({"init_scale": 1024.0, "growth_interval": 7}))


def plan(micro_batches: int | None) -> Plan:
    return Plan(stages=(StagePlan(0, 1, replicas=2), StagePlan(2, 3)), num_layers=4, solver="test",
                micro_batches=micro_batches)


def compiled(micro_batches: int | None, workload: Workload | None) -> typing.Any:
    return SimpleNamespace(plan=plan(micro_batches), problem=SimpleNamespace(workload=workload) if workload else None)


def test_the_settings_round_trip_through_the_call_record():
    assert isinstance(SETTINGS.optimizer, OptimizerSpec) and isinstance(SETTINGS.loss_scaling, LossScaling)
    record = CallRecord(5, 3, 4, 10, SETTINGS)
    loaded = CallRecord.loads(record.dumps())
    assert loaded == record and loaded.settings == SETTINGS
    assert loaded.settings.optimizer.lr == 0.003 and loaded.settings.loss_scaling.growth_interval == 7
    assert TrainSettings.from_json(TrainSettings().to_json()) == TrainSettings()


def test_an_unknown_option_is_refused_naming_the_known_ones():
    with pytest.raises(InputError, match=r"unknown options \['micro_batch'\]; it takes .*'micro_batches'"):
        split_options({"micro_batch": 4})
    # before anything of the deployment is touched
    with pytest.raises(InputError, match=r"train\(\) got unknown options \['iteration'\]"):
        FunctionDeployment.train(SimpleNamespace(), [], iteration=3)  # type: ignore[arg-type, call-arg]
    with pytest.raises(InputError, match="unknown fields \\['faults'\\]; known: .*'checkpoint_every'"):
        TrainSettings.from_json({"faults": []})


def test_keywords_go_on_top_of_the_settings_and_controls_given():
    settings, controls = resolve_options(SETTINGS, RunControls(timeout_s=5.0), {"micro_batches": 2, "iterations": 3})
    assert settings == SETTINGS.replace(micro_batches=2)
    assert controls == RunControls(timeout_s=5.0, iterations=3)
    assert split_options({}) == (TrainSettings(), RunControls())


def test_the_keyword_type_names_every_setting_and_control():
    fields = [f.name for cls in (TrainSettings, RunControls) for f in dataclasses.fields(cls)]
    assert list(typing.get_type_hints(TrainOptions)) == fields


@pytest.mark.parametrize("bad, words", [({"checkpoint_every": 0}, "checkpoint_every must be at least 1"),
                                        ({"micro_batches": 0}, "micro_batches must be a positive integer"),
                                        ({"threads": 0}, "threads must be a positive integer"),
                                        ({"loss": "no-such-loss"}, "no-such-loss")])
def test_bad_settings_are_refused_when_made(bad, words):
    with pytest.raises(InputError, match=words):
        TrainSettings(**bad)


def test_resume_repeats_the_recorded_settings_and_refuses_new_ones():
    record = CallRecord(0, 4, None, 0, SETTINGS)
    asked = []
    fake = SimpleNamespace(calls=lambda: [record], consistent_checkpoint=lambda: 1,
                           train=lambda batches, settings, controls: asked.append((settings, controls)))
    FunctionDeployment.resume(fake, [None] * 4, timeout_s=9.0)  # type: ignore[arg-type]
    assert asked == [(SETTINGS, RunControls(timeout_s=9.0, iterations=2, batch_offset=2))]
    with pytest.raises(InputError, match="resume\\(\\) repeats the settings the call recorded.*micro_batches"):
        FunctionDeployment.resume(fake, [None] * 4, micro_batches=8)  # type: ignore[arg-type]


def test_the_micro_batches_are_resolved_in_one_place():
    workload = Workload("train", batch=12, micro_batches=6)
    # the plan's when the call gives none, the explicit value otherwise
    assert plan(3).micro_batches_for(workload) == 3
    assert plan(3).micro_batches_for(workload, 2) == 2
    assert plan(None).micro_batches_for(workload) == 6
    assert plan(None).micro_batches_for(None) == 1
    # the backends resolve a call's settings through it, with the workload's sync
    assert resolve_settings(compiled(3, workload), TrainSettings()).micro_batches == 3
    assert resolve_settings(compiled(3, workload), TrainSettings(micro_batches=2)).micro_batches == 2
    resolved = resolve_settings(compiled(None, Workload("train", batch=12, micro_batches=6, sync="lambdaml")),
                                TrainSettings())
    assert (resolved.micro_batches, resolved.sync) == (6, "lambdaml")
    assert resolve_settings(compiled(None, None), TrainSettings()).micro_batch_count == 1
    with pytest.raises(ValueError, match="not resolved for a plan"):
        _ = TrainSettings().micro_batch_count


def test_the_run_spec_is_built_from_the_settings_and_the_controls_the_workers_act_on():
    stages = (StageSpec(0, 2, None, None, None, ("x",), ("h",), {"x": -1}, (1,)),
              StageSpec(1, 1, None, None, None, ("h",), ("y",), {"h": 0}, ()))
    controls = RunControls(wait_timeout_s=7.0, time_limit_s=None, faults=({"action": "raise"},))
    spec = RunSpec.of(SETTINGS.replace(precision="bf16"), controls, run="r", stages=stages, shared={}, batch=8,
                      loss_output="y", first_iteration=3, initial_checkpoint=2)
    assert (spec.micro_batches, spec.batch, spec.schedule, spec.sync, spec.threads) == (4, 8, "1f1b", "lambdaml", 2)
    assert (spec.optimizer, spec.loss, spec.checkpoint_every, spec.precision) == (SETTINGS.optimizer, "mse", 3,
                                                                                  "bf16")
    assert (spec.wait_timeout_s, spec.faults, spec.first_iteration, spec.initial_checkpoint) == (
        7.0, ({"action": "raise"},), 3, 2)
    assert RunSpec.loads(spec.dumps()) == spec
    with pytest.raises(ValueError, match="not resolved"):
        RunSpec.of(TrainSettings(), controls, run="r", stages=stages, shared={}, batch=8, loss_output="y")


def test_a_setting_a_backend_does_not_act_on_is_refused_not_ignored():
    refuse_unhonoured(SETTINGS.replace(checkpoint_every=1, sync=None), RunControls(timeout_s=3.0),
                      ("optimizer", "loss", "micro_batches", "schedule", "threads", "precision", "loss_scaling",
                       "timeout_s"), what="a test run", why="it is a test")
    with pytest.raises(InputError, match="a test run does not take checkpoint_every, faults \\(it is a test\\)"):
        refuse_unhonoured(TrainSettings(checkpoint_every=2), RunControls(faults=({},)), ("loss",),
                          what="a test run", why="it is a test")
