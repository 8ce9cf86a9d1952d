"""The runtime's timeline: what workers record (Recorder, Event, JSON), what it adds up to
(summarize), FuncPipe's prediction beside it (compare, predicted_schedule), the Gantt chart
and the live progress line. Synthetic events only: no worker processes."""

from __future__ import annotations

import io
import itertools
import json
import threading
import time

import pytest

from flatpack.analysis.report import compare, predicted_schedule
from flatpack.errors import InputError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload
from flatpack.progress import Progress, ProgressLine
from flatpack.runtime import timeline
from flatpack.runtime.timeline import Event, Recorder, dumps, loads, summarize
from tests.property.solver_strategies import make_platform, make_problem

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# --- Recorder, Event, JSON ----------------------------------------------------------------


def test_recorder_times_tasks_and_records_failures():
    recorder = Recorder(stage=1, replica=2, attempt=3)
    before = time.time()
    with recorder.task("forward", 5, micro_batch=4):
        pass
    with pytest.raises(RuntimeError, match="boom"):
        with recorder.task("upload", 5, micro_batch=4, nbytes=1024, lane="upload"):
            raise RuntimeError("boom")
    with recorder.task("update", 6):
        pass
    after = time.time()
    assert len(recorder) == 3
    forward, upload = recorder.drain(5)
    assert [e.kind for e in (forward, upload)] == ["forward", "upload"]
    assert before <= forward.start <= forward.end <= upload.start <= upload.end <= after
    assert (upload.stage, upload.replica, upload.attempt, upload.iteration) == (1, 2, 3, 5)
    assert (upload.micro_batch, upload.nbytes, upload.lane, upload.worker) == (4, 1024, "upload", "s1r2")
    assert upload.seconds == upload.end - upload.start >= 0
    (update,) = recorder.drain()
    assert update.iteration == 6 and update.micro_batch is None
    assert recorder.drain() == []
    with pytest.raises(ValueError, match="kind"):
        with recorder.task("nap", 0):
            pass
    with pytest.raises(ValueError, match="lane"):
        Event(0, 0, 0, "forward", 0.0, 1.0, lane="sideways")
    with pytest.raises(ValueError, match="before it starts"):
        Event(0, 0, 0, "forward", 1.0, 0.5)


def test_recorder_is_thread_safe():
    recorder = Recorder(0, 0)
    drained: list[Event] = []
    per_thread = 300

    def work(index: int) -> None:
        for m in range(per_thread):
            with recorder.task("download", index, micro_batch=m, lane="download"):
                pass

    def drain() -> None:
        for _ in range(50):
            drained.extend(recorder.drain())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)] + [threading.Thread(target=drain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    drained.extend(recorder.drain())
    assert len(drained) == 4 * per_thread
    assert sorted((e.iteration, e.micro_batch) for e in drained) == sorted(
        itertools.product(range(4), range(per_thread)))


def test_json_round_trip():
    events = [Event(0, 1, 2, "forward", 10.5, 11.25, micro_batch=3),
              Event(1, 0, 2, "sync", 12.0, 13.0, nbytes=4096, lane="upload", attempt=1)]
    data = dumps(events)
    assert isinstance(data, bytes) and json.loads(data)["version"] == timeline.FORMAT_VERSION
    assert loads(data) == events
    assert loads(data.decode()) == events
    assert [Event.from_json(e.to_json()) for e in events] == events
    assert loads(json.dumps([e.to_json() for e in events])) == events   # a bare list too
    with pytest.raises(ValueError, match="version"):
        loads(json.dumps({"version": 99, "events": []}))


# --- summarize --------------------------------------------------------------------------


def one_iteration(iteration: int, t0: float, forward: float, *, sync_chunks: bool = True) -> list[Event]:
    """Two stages, one replica, two micro-batches, on a clock starting at t0: stage 0
    forward → upload → stage 1 download → forward; backward in reverse; a sync on stage 0
    recorded both as one compute-lane span and as transfer chunks inside it."""
    e = []

    def add(stage, kind, start, seconds, m=None, lane="compute"):
        e.append(Event(stage, 0, iteration, kind, t0 + start, t0 + start + seconds, micro_batch=m, lane=lane))

    add(0, "forward", 0.0, forward, 0)
    add(0, "forward", forward, forward, 1)
    add(0, "upload", forward, 0.1, 0, "upload")
    add(0, "upload", 2 * forward, 0.3, 1, "upload")
    add(1, "download", forward + 0.1, 0.2, 0, "download")
    add(1, "download", 2 * forward + 0.3, 0.2, 1, "download")
    add(1, "forward", 2 * forward + 0.5, 1.0, 0)      # later than its download: fine
    add(1, "forward", 2 * forward + 1.5, 1.0, 1)
    b = 2 * forward + 2.5
    add(1, "backward", b, 2.0, 1)
    add(1, "backward", b + 2.0, 2.0, 0)
    add(1, "upload", b + 2.0, 0.5, 1, "upload")          # input gradients
    add(1, "upload", b + 4.0, 0.5, 0, "upload")
    add(0, "download", b + 2.5, 0.4, 1, "download")      # output gradients
    add(0, "download", b + 4.5, 0.4, 0, "download")
    add(0, "backward", b + 2.9, 3.0, 1)
    add(0, "backward", b + 5.9, 3.0, 0)
    s = b + 8.9
    add(0, "sync", s, 4.0)                               # the whole synchronization ...
    if sync_chunks:                                      # ... and its transfers inside it
        add(0, "sync", s, 1.0, lane="upload")
        add(0, "sync", s + 1.5, 1.5, lane="upload")
        add(0, "sync", s + 2.0, 2.0, lane="download")
    add(0, "update", s + 4.0, 0.25)
    add(1, "update", b + 4.0, 0.5)
    add(0, "checkpoint", s + 4.25, 10.0)                 # outside the iteration's time
    return e


def test_summarize_medians_per_stage():
    events = one_iteration(0, 100.0, 1.0)
    measured = summarize(events)
    first, second = measured.stages
    assert (first.forward_s, first.backward_s) == (1.0, 3.0)
    assert (second.forward_s, second.backward_s) == (1.0, 2.0)
    # stage 0 uploads activations 0.1 and 0.3 s: median 0.2; downloads gradients 0.4 s
    assert first.upload_s == pytest.approx(0.2) and first.forward_upload_s == pytest.approx(0.2)
    assert first.backward_upload_s is None and first.forward_download_s is None
    assert first.download_s == pytest.approx(0.4) and first.backward_download_s == pytest.approx(0.4)
    # stage 1 downloads inputs 0.2 s and uploads gradients 0.5 s
    assert second.forward_download_s == pytest.approx(0.2) and second.backward_upload_s == pytest.approx(0.5)
    assert second.forward_upload_s is None and second.backward_download_s is None
    assert (first.update_s, second.update_s) == (0.25, 0.5)
    assert (first.replicas, first.micro_batches) == (1, 2)
    # compute lane of stage 0: 2 forwards, 2 backwards, the sync and the update, no overlaps
    assert first.busy_s == pytest.approx(2 * 1.0 + 2 * 3.0 + 4.0 + 0.25)
    # the iteration: first forward to the last update; the checkpoint is left out
    (only,) = measured.iterations
    assert only.seconds == pytest.approx(2.0 + 2.5 + 8.9 + 4.0 + 0.25) == measured.iteration_s
    assert measured.kept == [0] and measured.skipped == 0   # one iteration only: nothing skipped
    json.dumps(measured.to_json())


def test_summarize_measures_sync_as_a_span_without_double_counting():
    with_chunks = summarize(one_iteration(0, 0.0, 1.0)).stages[0]
    without = summarize(one_iteration(0, 0.0, 1.0, sync_chunks=False)).stages[0]
    assert with_chunks.sync_s == pytest.approx(4.0) == without.sync_s   # not 4 + 1 + 1.5 + 2
    # only transfer-lane sync events (no compute-lane span): from the first start to the last end
    chunks = [e for e in one_iteration(0, 0.0, 1.0) if e.kind != "sync" or e.lane != "compute"]
    assert summarize(chunks).stages[0].sync_s == pytest.approx(4.0)
    assert summarize(chunks).stages[1].sync_s is None


def test_summarize_skips_warm_up_iterations():
    # iteration 0 is a slow warm-up; 1..3 have forwards of 1, 2 and 1.5 s
    events = [*one_iteration(0, 0.0, 9.0), *one_iteration(1, 100.0, 1.0), *one_iteration(2, 200.0, 2.0),
              *one_iteration(3, 300.0, 1.5)]
    measured = summarize(events)
    assert measured.kept == [1, 2, 3] and measured.skipped == 1
    assert measured.stages[0].forward_s == 1.5                    # median of 1,1,2,2,1.5,1.5
    span = 2.5 + 8.9 + 4.25
    assert measured.iteration_s == pytest.approx(2 * 1.5 + span)  # median of the three spans
    assert [it.kept for it in measured.iterations] == [False, True, True, True]
    everything = summarize(events, skip_first=0)
    assert everything.kept == [0, 1, 2, 3] and everything.stages[0].forward_s == 1.75
    assert summarize(events, skip_first=2).kept == [2, 3]
    assert summarize(events, skip_first=10).kept == [0, 1, 2, 3]   # no more than that many: keep all


def test_summarize_pools_replicas():
    events = one_iteration(0, 0.0, 1.0) + [
        Event(e.stage, 1, e.iteration, e.kind, e.start, e.start + 2 * e.seconds, e.micro_batch, e.nbytes, e.lane)
        for e in one_iteration(0, 0.0, 1.0) if e.kind == "forward"]
    first = summarize(events).stages[0]
    assert first.replicas == 2 and first.forward_s == 1.5 and first.micro_batches == 4
    assert summarize([]).stages == () and summarize([]).iteration_s is None


# --- compare and the predicted schedule on a profiled problem ------------------------------

# seconds and MiB per sample: forward, backward, parameters, saved, output
LAYERS = [(0.02, 0.04, 20.0, 1.0, 2.0), (0.01, 0.03, 5.0, 0.5, 1.0), (0.03, 0.05, 40.0, 1.0, 0.5),
          (0.01, 0.02, 10.0, 0.2, 0.1)]
# tiers (MiB, vCPUs, bandwidth MiB/s, $/s): different bandwidths make up- and downloads differ
TIERS = [(512, 1, 20.0, 0.5e-5), (1024, 2, 50.0, 1e-5), (2048, 2, 100.0, 2e-5)]


def training(micro_batches: int, batch: int = 24):
    return make_problem(LAYERS, make_platform(TIERS), Workload("train", batch=batch, micro_batches=micro_batches,
                                                                optimizer="sgd"))


def three_stages(replicas: int) -> Plan:
    return Plan((StagePlan(0, 0, 1024, replicas), StagePlan(1, 2, 2048, replicas), StagePlan(3, 3, 512, replicas)),
                len(LAYERS))


def test_compare_predicted_columns_are_funcpipes():
    problem, plan = training(6), three_stages(2)
    cost = funcpipe.predicted(problem, plan)    # FuncPipe's equations with the measured terms
    measured = [*one_iteration(0, 0.0, 0.05), *one_iteration(1, 50.0, 0.04)]
    comparison = compare(problem, plan, measured)
    assert comparison.predicted_iteration_s == cost.iteration_s
    first, middle, last = comparison.predicted
    for prediction, stage in zip(comparison.predicted, cost.stages):
        assert (prediction.forward_s, prediction.backward_s, prediction.sync_s) == (
            stage.forward_s, stage.backward_s, stage.sync_s)
    low, high = cost.boundaries
    assert (first.upload_s, first.download_s) == (low.forward_upload_s, None)
    assert (middle.download_s, middle.upload_s) == (low.forward_download_s, high.forward_upload_s)
    assert (last.download_s, last.upload_s) == (high.forward_download_s, None)
    assert (middle.backward_upload_s, middle.backward_download_s) == (low.backward_upload_s,
                                                                        high.backward_download_s)
    assert comparison.measured.kept == [1]
    measured_s = comparison.measured.iteration_s
    assert measured_s is not None, "a kept iteration was measured"
    expected = cost.iteration_s / measured_s - 1   # predicted/measured − 1
    assert comparison.iteration_error == pytest.approx(expected)
    table = comparison.table()
    lines = table.splitlines()
    assert all(name in lines[0] for name in ("forward", "backward", "upload", "download", "sync"))
    assert lines[1].split()[:3] == ["stage", "pred", "meas"] and set(lines[2]) == {"-", " "}
    assert lines[3].split()[:3] == ["0", f"{1e3 * first.forward_s:.1f}", "40.0"]   # stage 0 forward: pred, meas
    assert lines[5].split()[0] == "2" and lines[5].split()[2] == "-"               # no third stage measured
    assert lines[-1].startswith("iteration: predicted") and f"{100 * expected:+.1f}%" in lines[-1]
    document = json.loads(json.dumps(comparison.to_json()))
    assert document["predicted"]["iteration_s"] == cost.iteration_s
    assert document["iteration_error"] == pytest.approx(expected)


def check_schedule(problem, plan) -> tuple[float, funcpipe.PipelineCost, list[Event]]:
    cost = funcpipe.predicted(problem, plan)   # what predicted_schedule simulates
    events = predicted_schedule(problem, plan)
    d, total = cost.replicas, problem.workload.micro_batches
    # every worker runs what it owns, and each lane of a worker one task at a time
    for s, r in itertools.product(range(len(cost.stages)), range(d)):
        mine = [e for e in events if (e.stage, e.replica) == (s, r)]
        forwards = [e.micro_batch for e in mine if e.kind == "forward"]
        assert None not in forwards and sorted(m for m in forwards if m is not None) == list(range(r, total, d))
        for lane in timeline.LANES:
            on_lane = sorted((e for e in mine if e.lane == lane), key=lambda e: e.start)
            assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(on_lane))
        assert sum(e.kind == "sync" for e in mine) == (d > 1) and sum(e.kind == "update" for e in mine) == 1
    # a download starts after the upload it reads
    for e in events:
        if e.kind == "download":
            source = [u for u in events if u.kind == "upload" and u.micro_batch == e.micro_batch
                      and u.stage in (e.stage - 1, e.stage + 1)]
            assert any(u.end <= e.start + 1e-12 for u in source), e
    # fed back into summarize, the schedule measures what the model predicted
    measured = summarize(events)
    for stage, got in zip(cost.stages, measured.stages):
        assert got.forward_s == pytest.approx(stage.forward_s) and got.backward_s == pytest.approx(stage.backward_s)
        assert got.sync_s == (pytest.approx(stage.sync_s) if d > 1 else None)
    for b, boundary in enumerate(cost.boundaries):
        assert measured.stages[b].forward_upload_s == pytest.approx(boundary.forward_upload_s)
        assert measured.stages[b + 1].forward_download_s == pytest.approx(boundary.forward_download_s)
        assert measured.stages[b + 1].backward_upload_s == pytest.approx(boundary.backward_upload_s)
        assert measured.stages[b].backward_download_s == pytest.approx(boundary.backward_download_s)
    assert min(e.start for e in events) == 0.0
    assert measured.iteration_s is not None, "the predicted schedule has a whole iteration"
    return measured.iteration_s, cost, events


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_predicted_schedule_is_the_model_exactly_with_one_micro_batch_per_replica(replicas):
    """µ = 1: FuncPipe's t_iter = t_f^0 + max_s (t_b^s + t_s^s) is the schedule's critical path."""
    span, cost, _ = check_schedule(training(replicas), three_stages(replicas))
    assert cost.micro_batches_per_replica == 1
    critical = cost.first_forward_s + max(stage.backward_done_s + stage.sync_s for stage in cost.stages)
    assert span == pytest.approx(critical, rel=1e-12) and span == pytest.approx(cost.iteration_s, rel=1e-12)


@pytest.mark.parametrize(("replicas", "micro_batches"), [(1, 4), (2, 6), (3, 6), (2, 8)])
def test_predicted_schedule_is_within_the_model_with_more_micro_batches(replicas, micro_batches):
    problem = training(micro_batches)
    for plan in (three_stages(replicas), Plan((StagePlan(0, 3, 2048, replicas),), len(LAYERS)),
                 Plan((StagePlan(0, 1, 512, replicas), StagePlan(2, 3, 1024, replicas)), len(LAYERS))):
        span, cost, _ = check_schedule(problem, plan)
        assert cost.micro_batches_per_replica > 1
        assert span <= cost.iteration_s * (1 + 1e-12)
        # never shorter than one micro-batch's round trip followed by stage 0's sync
        first = cost.stages[0]
        round_trip = first.backward_done_s - (cost.micro_batches_per_replica - 1) * first.backward_lag_s
        assert span >= cost.first_forward_s + round_trip + first.sync_s - 1e-12


def test_compare_of_the_predicted_schedule_has_no_error():
    problem, plan = training(3), three_stages(3)
    comparison = compare(problem, plan, predicted_schedule(problem, plan))
    assert comparison.iteration_error == pytest.approx(0.0, abs=1e-12)
    assert "+0.0%" in comparison.table().splitlines()[-1]


# --- the Gantt chart ----------------------------------------------------------------------


def test_gantt_writes_png_with_and_without_prediction(tmp_path):
    pytest.importorskip("matplotlib")
    from flatpack.analysis import gantt

    problem, plan = training(4), three_stages(2)
    predicted = predicted_schedule(problem, plan)
    measured = [Event(e.stage, e.replica, it, e.kind, 1e9 + 10 * it + 1.1 * e.start, 1e9 + 10 * it + 1.1 * e.end,
                      e.micro_batch, e.nbytes, e.lane) for it in range(2) for e in predicted]
    alone = gantt.plot(measured, tmp_path / "measured.png", title="run")
    both = gantt.plot(measured, tmp_path / "both", predicted=predicted)
    assert both == tmp_path / "both.png"
    for path in (alone, both):
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000
    # issue 41: each panel on its own time axis (the prediction is one iteration, the run two),
    # titles that say how many iterations, and room for the labels of two workers
    drawn = gantt.figure(measured, predicted=predicted)
    top, bottom = drawn.axes[0], drawn.axes[1]
    assert top.get_xlim()[1] < bottom.get_xlim()[1] / 2
    assert "1 iteration;" in top.get_title(loc="left") and "2 iterations;" in bottom.get_title(loc="left")
    assert drawn.get_figheight() >= 2 * gantt.MIN_PANEL_INCHES
    with pytest.raises(InputError, match="no events"):
        gantt.plot([], tmp_path / "empty.png")
    with pytest.raises(InputError, match="does not exist"):
        gantt.plot(measured, tmp_path / "missing" / "x.png")


# --- the progress line --------------------------------------------------------------------


def test_progress_line_writes_plain_lines_off_a_terminal():
    now = [0.0]
    stream = io.StringIO()
    progress = ProgressLine(10, 32, 0.0001, stream, interval_s=0, clock=lambda: now[0])
    now[0] = 2.0
    progress.update(1, 0.9123456)
    now[0] = 3.0
    progress.update(3, 0.4213)     # rate: 3 · 32 / 3 s
    progress.close()
    assert stream.getvalue().splitlines() == [
        "iter 1/10  loss 0.9123  16.0 samples/s  $0.000200 so far",
        "iter 3/10  loss 0.4213  32.0 samples/s  $0.000300 so far",
    ]
    assert "\r" not in stream.getvalue() and progress.dollars == pytest.approx(0.0003)


def test_the_cost_so_far_never_decreases_across_segments():
    """Issue 41: the dollars so far fell at a checkpoint segment (0.000195 at iteration 4,
    0.000113 at 5), since the caller passed the segment's own elapsed time. The line keeps
    its own clock now."""
    now = [0.0]
    stream = io.StringIO()
    progress = ProgressLine(8, 16, 0.001, stream, interval_s=0, clock=lambda: now[0])
    for iteration in range(1, 9):
        now[0] += 0.5
        progress.update(iteration, 1.0)
    progress.close()
    dollars = [float(line.split("$")[1].split()[0]) for line in stream.getvalue().splitlines()]
    assert dollars == sorted(dollars) and len(set(dollars)) == 8


def test_plain_progress_lines_are_periodic_and_the_last_is_always_written():
    now = [0.0]
    stream = io.StringIO()
    with Progress(100, "profiling ", stream, interval_s=10, clock=lambda: now[0]) as progress:
        for step in range(1, 101):
            now[0] = step * 0.5          # 50 s in all: a line at 0.5 s, then one per 10 s
            progress.update(step, f"{step}/100")
    lines = stream.getvalue().splitlines()
    assert lines == ["profiling 1/100", "profiling 21/100", "profiling 41/100", "profiling 61/100",
                     "profiling 81/100", "profiling 100/100"]
    assert "\r" not in stream.getvalue()


def test_progress_is_a_bar_rewritten_in_place_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    now = [0.0]
    with ProgressLine(5, 10, 0.0, stream, start_iteration=2, clock=lambda: now[0]) as progress:
        assert progress.tty
        now[0] = 1.0
        progress.update(3, 12.5)
        now[0] = 4.0
        progress.update(4, None)
    text = stream.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1   # one line, rewritten
    assert text.rstrip().endswith("iter 4/5  loss -  5.0 samples/s  $0.000000 so far")


def test_the_chrome_trace_holds_every_task_as_a_complete_event_of_its_process(tmp_path):
    """timeline.json follows the Trace Event Format: a JSON object with traceEvents; metadata
    names each process and lane; every task is an "X" event with integer pid/tid and
    microsecond ts/dur from its process's first task; measured and predicted apart."""
    from flatpack.analysis import chrome_trace
    from flatpack.runtime.timeline import Event

    measured = [Event(0, 0, 0, "forward", 100.0, 100.5, micro_batch=0),
                Event(0, 0, 0, "upload", 100.5, 100.75, micro_batch=0, nbytes=4096, lane="upload"),
                Event(1, 0, 0, "download", 100.5, 100.8, micro_batch=0, nbytes=4096, lane="download"),
                Event(1, 0, 0, "forward", 100.8, 101.0, micro_batch=0)]
    predicted = [Event(0, 0, 0, "forward", 0.0, 0.4, micro_batch=0), Event(1, 0, 0, "forward", 0.6, 0.8, micro_batch=0)]
    path = chrome_trace.write(measured, tmp_path / "timeline.json", predicted=predicted)
    document = json.loads(path.read_text())
    assert set(document) == {"traceEvents", "displayTimeUnit"}
    events = document["traceEvents"]
    for event in events:
        assert event["ph"] in ("X", "M") and isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["name"], str)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert processes == {1: "measured", 2: "predicted (cost model)"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    tasks = [e for e in events if e["ph"] == "X"]
    assert len(tasks) == len(measured) + len(predicted)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in tasks)
    upload = next(e for e in tasks if e["cat"] == "upload")
    assert upload["ts"] == 500000.0 and upload["dur"] == 250000.0 and upload["args"]["bytes"] == 4096
    assert threads[(1, upload["tid"])] == "s0 r0 upload"
    second = next(e for e in tasks if e["pid"] == 2 and e["ts"] > 0)
    assert second["ts"] == 600000.0 and threads[(2, second["tid"])] == "s1 r0 compute"


def test_a_resumed_calls_progress_goes_on_from_where_the_run_stopped():
    """Issue 41: `resume` said "after iteration 9 ... trained 30 more" and restarted its
    progress at 1/30; a call after the run's first 10 iterations of 40 counts 11/40."""
    from flatpack.backends.functions import call_progress_line

    stream = io.StringIO()
    now = [0.0]
    line = call_progress_line(30, 10, 8, 0.0, stream)
    line.clock, line.started = (lambda: now[0]), 0.0
    now[0] = 2.0
    line.update(line.start_iteration + 1, 1.5)   # the call's first iteration, as the invoker counts it
    line.close()
    assert stream.getvalue().startswith("iter 11/40  loss 1.5000  4.0 samples/s")
