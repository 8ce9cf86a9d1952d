"""``flatpack plan``: the front as a table with the recommendation marked, the chosen plan
stage by stage, SLO and weighted modes, --json, --plot and the errors.

Runs in-process on the MLP of tests/models.py coarsened to 4 layers, with brute force over
a narrowed space (2 tiers, 2 degrees), so every solve prices ~100 plans; the profile is
measured once per module (repeats 1) and then read from a module-wide cache."""

from __future__ import annotations

import json
import re

import pytest

from flatpack.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FACTORY = '''
import torch
from tests.models import MLP

def build():
    torch.manual_seed(0)
    return MLP(width=256, depth=6), (torch.randn(8, 256),)
'''
PASSES = ["--passes", "fuse-elementwise,merge-branches,coarsen{max-layers=4,by=time}"]
SPACE = ["--target", "aws-lambda", "--batch", "64", "--solver", "brute", "--memory", "1024,2048",
         "--replicas", "1,2", "--batch-sizes", "1,2", "--repeats", "1"]


@pytest.fixture(scope="module")
def model_spec(tmp_path_factory):
    """MODEL as path/to/file.py:factory, and one profile cache for the module: the first
    run measures, the others reuse it."""
    directory = tmp_path_factory.mktemp("plan_cli")
    (directory / "mlp_factory.py").write_text(FACTORY)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLATPACK_CACHE_DIR", str(directory / "profiles"))
        yield f"{directory / 'mlp_factory.py'}:build"


@pytest.fixture
def plan(model_spec, capsys):
    """Runs ``flatpack plan MODEL ... extra`` in-process: (exit code, stdout, stderr)."""
    def run(*extra: str) -> tuple[int, str, str]:
        code = main(["plan", model_spec, *PASSES, *SPACE, *extra])
        captured = capsys.readouterr()
        return code, captured.out, captured.err
    return run


def json_report(plan, *extra: str) -> dict:
    code, out, err = plan("--json", "-", *extra)
    assert code == 0, err
    return json.loads(out)


def table_rows(out: str) -> list[str]:
    """The front table's rows: the lines after the rule under the header, up to a blank line."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#  stages"))
    rows = []
    for line in lines[header + 2:]:
        if not line.strip():
            break
        rows.append(line)
    return rows


def test_front_table_marks_the_recommendation_and_breaks_it_down(plan, tmp_path):
    out_json = tmp_path / "front.json"
    code, out, err = plan("--json", str(out_json))
    assert code == 0, err
    assert "on aws-lambda: train, batch 64" in out.splitlines()[0]
    assert "4 layers; solver brute" in out and "Pareto front:" in out
    header = next(line for line in out.splitlines() if line.startswith("#  stages"))
    for column in ("layers", "tiers MB", "replicas", "M", "time s", "$ per iteration", "MB·s"):
        assert column in header
    rows = table_rows(out)
    marked = [row for row in rows if "★ recommended" in row]
    assert len(marked) == 1

    data = json.loads(out_json.read_text())
    assert data["selection"] == "front" and data["solver"] == "brute" and data["layers"] == 4
    assert len(data["plans"]) == len(rows)
    chosen = data["chosen"]
    assert marked[0].split()[0] == str(chosen)
    assert f"plan {chosen} (recommended) by stage — FuncPipe model:" in out
    assert "$ per iteration  share" in out and "stage 0 memory:" in out
    times = [entry["predictions"]["time_s"] for entry in data["plans"]]
    assert times == sorted(times)
    assert all(entry["breakdown"]["model"] == "funcpipe" for entry in data["plans"])


def test_plot_writes_a_png(plan, tmp_path):
    pytest.importorskip("matplotlib")
    out_png = tmp_path / "front.png"
    code, out, err = plan("--plot", str(out_png))
    assert code == 0, err
    assert f"wrote {out_png}" in err and "wrote" not in out       # a diagnostic: stderr
    assert out_png.read_bytes()[:8] == PNG_SIGNATURE


def test_slo_picks_the_cheapest_plan_within_it(plan):
    fastest = json_report(plan, "--weights", "0,1")["plans"][0]["predictions"]
    slo = 1.5 * fastest["time_s"]
    data = json_report(plan, "--slo", f"{slo!r}")
    assert data["selection"] == "slo" and len(data["plans"]) == 1
    picked = data["plans"][0]["predictions"]
    assert picked["time_s"] <= slo and picked["dollars"] <= fastest["dollars"] * (1 + 1e-9)
    code, out, _ = plan("--slo", f"{slo!r}")
    assert code == 0 and "SLO mode" in out and f"★ cheapest within {slo:g} s" in out


def test_impossible_slo_names_the_fastest_time_and_plan(plan):
    fastest = json_report(plan, "--weights", "0,1")["plans"][0]
    code, out, err = plan("--slo", "1e-6")
    assert code == 2 and out == ""
    # a flat-slope profile warning may come first (the host's noise decides): the error is its own line
    assert any(line.startswith("flatpack: error: no plan meets the SLO of 1e-06 s") for line in err.splitlines())
    assert f"the fastest plan takes {fastest['predictions']['time_s']:.4g} s" in err
    stages = ", ".join(f"{s['start']}-{s['end']}@{s['memory_mb']}MBx{s['replicas']}" for s in fastest["stages"])
    assert stages in err


def test_weights_give_the_single_optimum(plan):
    code, out, err = plan("--weights", "1,2^16")
    assert code == 0, err
    assert "weighted mode" in out
    rows = table_rows(out)
    assert len(rows) == 1 and "★ optimum of weights (1, 2^16)" in rows[0]
    data = json_report(plan, "--weights", "1,65536")
    assert data["selection"] == "weights" and data["options"]["weights"] == [1.0, 65536.0]


def test_inference_uses_the_gillis_model(plan):
    code, out, err = plan("--mode", "infer", "--batch", "8", "--max-workers", "2")
    assert code == 0, err
    assert "infer, batch 8 per request" in out and "$ per request" in out
    assert re.search(r"by stage — Gillis model: .* per request", out)


@pytest.mark.parametrize("spec", ["rl{episodes=200,warm-start=false,seed=2}", "bayes{evaluations=12,seed=2}"])
def test_learning_solvers_are_selectable_by_name_with_options(plan, spec):
    data = json_report(plan, "--solver", spec, "--weights", "1,2^19")
    chosen = data["plans"][data["chosen"]]
    assert chosen["solver"] == spec.partition("{")[0] and chosen["predictions"]["status"] == "heuristic"
    assert chosen["predictions"]["seed"] == 2
    brute = json_report(plan, "--weights", "1,2^19")
    optimum = brute["plans"][brute["chosen"]]["predictions"]["objective"]
    assert chosen["predictions"]["objective"] >= optimum * (1 - 1e-9)


@pytest.mark.parametrize("extra,message", [
    (["--solver", "balanced"], "does not price plans with a cost model"),
    (["--memory", "128"], "fits the memory"),
    (["--weights", "1"], "--weights takes two numbers"),
    (["--plot", "front.jpg"], "end the file name with one of .png"),
    (["--mode", "infer", "--micro-batches", "4"], "--micro-batches applies to training"),
])
def test_errors_are_one_clear_line(plan, extra, message):
    code, _, err = plan(*extra)
    assert code == 2
    assert "flatpack: error:" in err and message in err


def test_unknown_model_suggests_close_names(capsys):
    assert main(["plan", "vgg-11", "--solver", "brute"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'vgg-11'; did you mean vgg11" in err
