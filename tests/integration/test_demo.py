"""``flatpack demo``, the README's main job, end to end: compile a zoo model, plan it,
train it on local functions through the local S3 server, report and verify."""

from __future__ import annotations

import pytest

from flatpack.cli import main

pytestmark = pytest.mark.slow


def test_demo_trains_on_local_functions_and_checks_equivalence(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--iterations", "3"]) == 0
    printed = capsys.readouterr().out
    assert "Pareto front" in printed and "recommended" in printed
    assert "iter 3/3" in printed
    assert "predicted (FuncPipe model) vs measured" in printed
    assert "equivalence with single-process training: passed" in printed
    assert (out / "timeline.png").stat().st_size > 10_000
    assert (out / "compiled" / "stage_000" / "stage.py").is_file()


def test_run_points_cloud_targets_at_deploy(capsys):
    assert main(["run", "mlp", "--target", "aws-lambda"]) == 2
    assert "flatpack deploy MODEL --target aws-lambda --out DIR" in capsys.readouterr().err
