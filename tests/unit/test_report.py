"""The plan reports: the front table, the per-stage breakdown of each cost model (whose
stage dollars must add up to the plan's), the JSON form and the plot."""

from __future__ import annotations

import json
import sys

import pytest

from flatpack.errors import InputError, PlanError
from flatpack.ir.profile import HostInfo, LayerProfile, Linear
from flatpack.partitioner import report
from flatpack.partitioner.objective import annotate, evaluate
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.pareto import Front
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.workload import Workload
from flatpack.platform.catalog import get_platform

MIB = 1024 * 1024
HOST = HostInfo(device="cpu", threads=2, cpu="test", torch_version="test")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def layer(name: str, forward: float, params_mib: float, output_mib: float) -> LayerProfile:
    """Seconds and MiB per sample; backward twice the forward."""
    params = int(params_mib * MIB)
    return LayerProfile(
        name=name, forward_s=Linear(forward, 1e-4), backward_s=Linear(2 * forward, 1e-4), param_bytes=params,
        grad_bytes=params, buffer_bytes=0, saved_bytes=Linear(output_mib * MIB), output_bytes=Linear(output_mib * MIB),
        peak_bytes=Linear(output_mib * MIB),
        optimizer_state_bytes={"sgd": 0, "sgd-momentum": params, "adam": 2 * params},
        inference_s=Linear(0.8 * forward, 1e-4),
    )


LAYERS = (layer("conv1", 2e-2, 0.1, 0.5), layer("conv2", 4e-2, 0.5, 0.25), layer("fc", 1e-2, 1.0, 0.01))


def problem(target: str = "aws-lambda", workload: Workload | None = None, **options) -> Problem:
    chain = tuple(ChainLayer(p.name, p.param_bytes, 0, 0, p) for p in LAYERS)
    return Problem(chain, get_platform(target), workload or Workload("train", batch=32, micro_batches=4), host=HOST,
                   options=ProblemOptions.of(options), input_bytes=Linear(0.1 * MIB))


def priced(problem_: Problem, *stages: tuple[int, int, int, int], micro_batches: int | None = 4) -> Plan:
    """A plan of (start, end, memory MB, replicas) stages, carrying its predictions."""
    plan = Plan(tuple(StagePlan(*stage) for stage in stages), len(problem_.chain), "test",
                micro_batches=micro_batches)
    return annotate(plan, evaluate(problem_, plan))


def dollar_cells(text: str, column: str) -> list[float]:
    """The numbers under ``column`` in the first table of ``text`` (rows up to a blank or
    indented-prose line)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if column in line and "layers" in line)
    header = lines[start]
    left = header.index(column)
    right = left + len(column)
    values = []
    for line in lines[start + 2:]:
        cell = line[left:right].strip()
        if not cell or not cell[0].isdigit():
            break
        values.append(float(cell))
    return values


@pytest.fixture
def lambda_front():
    prob = problem(memory_mb=(1024, 2048))
    plans = [priced(prob, (0, 2, 2048, 1)), priced(prob, (0, 2, 2048, 2)), priced(prob, (0, 2, 2048, 4)),
             priced(prob, (0, 2, 4096, 4)), priced(prob, (0, 1, 1024, 2), (2, 2, 1024, 2))]
    front = Front.of(plans)
    assert len(front.plans) == 4  # the two-stage plan is dominated: slower and dearer
    return prob, front


def test_front_table_has_aligned_columns_and_one_marker(lambda_front):
    prob, front = lambda_front
    selection = report.Selection.of_front(front)
    table = report.front_table(prob, selection)
    lines = table.splitlines()
    header = lines[0]
    for column in ("#", "stages", "layers", "tiers MB", "replicas", "M", "time s", "$ per iteration", "MB·s", "δ"):
        assert column in header
    assert set(lines[1].replace(" ", "")) == {"-"}
    rows = lines[2:]
    assert len(rows) == len(front.plans)
    marked = [row for row in rows if report.MARK in row]
    assert len(marked) == 1 and "recommended" in marked[0]
    assert marked[0].split()[0] == str(front.recommended)
    # numbers right-aligned under their header: each "time s" cell ends where the header does
    end = header.index("time s") + len("time s")
    for row, plan in zip(rows, front.plans):
        assert row[:end].endswith(f"{plan.predictions['time_s']:.4g}")
    # the fastest first
    times = [plan.predictions["time_s"] for plan in front.plans]
    assert times == sorted(times)


def test_table_shows_per_stage_tiers_and_a_common_replica_degree_once():
    prob = problem()
    plan = priced(prob, (0, 0, 1024, 2), (1, 2, 2048, 2))
    table = report.front_table(prob, report.Selection.of_weights(plan, "(1, 2^16)"))
    row = table.splitlines()[2]
    assert "0 1-2" in row and "1024 2048" in row
    assert " 2 " in row and "2 2" not in row
    assert "★ optimum of weights (1, 2^16)" in row
    assert "δ" not in table.splitlines()[0]


def test_funcpipe_breakdown_stage_dollars_add_up():
    prob = problem()
    plan = priced(prob, (0, 1, 1024, 2), (2, 2, 2048, 2))
    text = report.stage_breakdown(prob, plan)
    assert text.startswith("FuncPipe model:")
    cells = dollar_cells(text, "$ per iteration")
    assert len(cells) == 2
    assert sum(cells) == pytest.approx(plan.predictions["dollars"], rel=1e-3)
    assert "cut after layer 1" in text and "stage 1 memory: activations" in text
    assert "d = 2 replicas" in text and "µ = 2 per replica" in text


def test_gillis_breakdown_bills_master_and_workers():
    prob = problem(workload=Workload("infer", batch=8))
    plan = priced(prob, (0, 1, 2048, 3), (2, 2, 2048, 1), micro_batches=None)
    text = report.stage_breakdown(prob, plan)
    assert text.startswith("Gillis model:")
    assert "per request" in text and "3 workers" in text and "master" in text
    cells = dollar_cells(text, "$ per request")
    assert len(cells) == 3   # the master, then both groups
    assert sum(cells) == pytest.approx(plan.predictions["dollars"], rel=1e-3)  # cells print 4 digits


@pytest.mark.parametrize("cost_model,label", [(None, "Hydrozoa"), ("pipedream", "PipeDream")])
def test_container_breakdowns_stage_dollars_add_up(cost_model, label):
    options = {"cost_model": cost_model} if cost_model else {}
    prob = problem("gpu-container", **options)
    plan = priced(prob, (0, 1, 6144, 2), (2, 2, 6144, 2))
    text = report.stage_breakdown(prob, plan)
    assert text.startswith(f"{label} model:")
    cells = dollar_cells(text, "$ per iteration")
    assert len(cells) == 2
    assert sum(cells) == pytest.approx(plan.predictions["dollars"], rel=1e-3)


def test_text_report_explains_the_marker_and_breaks_down_the_chosen_plan(lambda_front):
    prob, front = lambda_front
    text = report.text_report(prob, report.Selection.of_front(front), "title line")
    assert text.startswith("title line\nPareto front:")
    assert f"plan {front.recommended} (recommended) by stage" in text
    assert "δ, is at least 0.8" in text


def test_slo_selection_says_how_close_to_the_bound():
    prob = problem()
    plan = priced(prob, (0, 2, 2048, 1))
    slo = 2 * plan.predictions["time_s"]
    text = report.text_report(prob, report.Selection.within_slo(plan, slo), "t")
    assert "SLO mode" in text and f"meets the SLO of {slo:g} s" in text and "50% of it" in text


def test_json_report_round_trips_with_breakdowns(lambda_front):
    prob, front = lambda_front
    data = json.loads(json.dumps(report.report_json(prob, report.Selection.of_front(front), {"model": "m"})))
    assert data["kind"] == "flatpack-plans" and data["model"] == "m" and data["selection"] == "front"
    assert data["chosen"] == front.recommended and data["unit"] == "iteration"
    assert len(data["plans"]) == len(front.plans)
    for entry, plan in zip(data["plans"], front.plans):
        assert Plan.from_json({key: value for key, value in entry.items() if key != "breakdown"}) == plan
        assert entry["breakdown"]["model"] == "funcpipe"
        assert entry["breakdown"]["iteration_s"] == pytest.approx(plan.predictions["time_s"])


def test_selection_refuses_bad_indices_and_kinds(lambda_front):
    _, front = lambda_front
    with pytest.raises(PlanError, match="outside"):
        report.Selection(front.plans, len(front.plans), "front", "recommended")
    with pytest.raises(PlanError, match="kind"):
        report.Selection(front.plans, 0, "best", "recommended")


def test_plot_writes_a_png(lambda_front, tmp_path):
    pytest.importorskip("matplotlib")
    from flatpack.partitioner import plot

    _, front = lambda_front
    out = plot.plot_selection(report.Selection.of_front(front), tmp_path / "front.png", title="test front")
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    pick = front.plans[-1]
    slo = plot.plot_selection(report.Selection.within_slo(pick, pick.predictions["time_s"] * 1.5),
                              tmp_path / "slo.svg", title="slo", context=front.plans)
    assert b"<svg" in slo.read_bytes()[:500]


def test_plot_refuses_unknown_formats_and_missing_directories(tmp_path):
    from flatpack.partitioner import plot

    with pytest.raises(InputError, match="image format"):
        plot.check_destination(tmp_path / "front.jpg")
    with pytest.raises(InputError, match="does not exist"):
        plot.check_destination(tmp_path / "missing" / "front.png")


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch):
    from flatpack.partitioner import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    with pytest.raises(InputError, match="pip install matplotlib"):
        plot.require_matplotlib()
