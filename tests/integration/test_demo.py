"""``flatpack demo``, the README's main job, end to end: compile a zoo model, plan it,
train it on local functions through the local S3 server, report and verify."""

from __future__ import annotations

import json

import pytest

from flatpack.cli import main

pytestmark = pytest.mark.slow


def test_demo_trains_on_local_functions_and_checks_equivalence(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--iterations", "3"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "Pareto front" in printed and "the plan that runs (fixed cuts: 2 stages)" in printed
    assert "no pipeline cut was exercised" not in printed
    assert "iter 3/3" in captured.err and "\r" not in captured.err     # progress: plain lines on stderr
    assert "predicted (FuncPipe model, the plan that ran" in printed
    assert "equivalence with single-process training: passed" in printed
    assert (out / "timeline.png").stat().st_size > 10_000
    trace = json.loads((out / "timeline.json").read_text())      # the Chrome trace beside it
    processes = {event["args"]["name"] for event in trace["traceEvents"] if event["name"] == "process_name"}
    assert processes == {"measured", "predicted (cost model)"}
    assert sum(event["ph"] == "X" and event["pid"] == 1 for event in trace["traceEvents"]) > 10
    assert (out / "compiled" / "stage_000" / "stage.py").is_file()


def test_run_points_cloud_targets_at_deploy(capsys):
    assert main(["run", "mlp", "--target", "aws-lambda"]) == 2
    assert "flatpack deploy MODEL --target aws-lambda --out DIR" in capsys.readouterr().err


def test_run_json_is_the_only_stdout_and_quiet_leaves_no_progress(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", "mlp", "--batch", "16", "--micro-batches", "2", "--iterations", "2", "--replicas", "1",
                 "--out", str(out), "--json", "-q"]) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["iterations"] == 2 and len(document["losses"]) == 2 and document["equivalent"] is True
    assert document["comparison"]["predicted"]["iteration_s"] > 0 and document["files"]
    # -q: no progress line on stderr (the text report went there instead of stdout, as --json asks)
    assert "iter 1/2" not in captured.err and "equivalence with single-process training: passed" in captured.err
