"""``flatpack run --replan`` and the run directory: a switch saves the new plan's artifact
and only then points ``run.json`` at it and at the new store prefix, which ``flatpack resume``
reads; an earlier switch's artifact is removed."""

from __future__ import annotations

import torch
from torch import nn

import flatpack
from flatpack.backends.replan import PlanSwitch
from flatpack.job import _recording_switches
from flatpack.rundir import RunDirectory, RunRecord


def test_a_switch_points_the_run_record_at_the_new_plan_and_its_prefix(tmp_path):
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    one = flatpack.compile(model, (torch.randn(2, 4),), stages=1)
    two = flatpack.compile(model, (torch.randn(2, 4),), stages=2)
    directory = RunDirectory(tmp_path / "run")
    directory.write(RunRecord(run="run-abc", loss="mse", iterations=6))
    one.save(directory.compiled)
    on_switch = _recording_switches(directory)

    on_switch(PlanSwitch(2, one.plan, two.plan, 1.0, 0.5, 1.0, "run-abc-plan1"), two)
    record = directory.read()
    assert (record.run, record.compiled) == ("run-abc-plan1", "compiled-run-abc-plan1")
    assert flatpack.load(directory.root / record.compiled).digest == two.digest
    assert directory.compiled.is_dir()    # the first plan's artifact stays: the run started from it

    on_switch(PlanSwitch(5, two.plan, one.plan, 1.0, 0.5, 1.0, "run-abc-plan2"), one)
    record = directory.read()
    assert (record.run, record.compiled) == ("run-abc-plan2", "compiled-run-abc-plan2")
    assert not (directory.root / "compiled-run-abc-plan1").exists()
    assert flatpack.load(directory.root / record.compiled).digest == one.digest


def test_a_record_written_before_replan_existed_names_the_compiled_directory(tmp_path):
    directory = RunDirectory(tmp_path)
    (tmp_path / "run.json").write_text('{"run": "r", "loss": "mse", "iterations": 2, "version": 1}')
    assert directory.read().compiled == "compiled"
