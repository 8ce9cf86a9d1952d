"""Predicted against measured: what FuncPipe's model (``partitioner.cost.funcpipe``) says a
plan's training iteration takes, beside what the workers' timeline (``runtime.timeline``)
shows it took; and the model's predictions laid out as a timeline of their own
(:func:`predicted_schedule`) to draw beside the measured one.

Per stage the prediction is FuncPipe's per-micro-batch figures (FuncPipe
App. B): forward t̂_fc and backward t̂_bc; the forward-direction transfers, the upload t_fu
on the stage's output boundary and the download t_fd on its input boundary (the backward
direction is in the JSON form); the synchronization t_s; and the iteration total t_iter
(eq. 7). The measured transfer columns are the forward-direction ones too, so like is
compared with like.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from dataclasses import asdict, dataclass
from typing import Any, Iterable

from flatpack.analysis.host_load import HostLoad, host_load, shares_host
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.runtime.timeline import Event, Measured, summarize
from flatpack.schedules import DEFAULT_SCHEDULE, Schedule
from flatpack.schedules import get as schedule_named
from flatpack.table import format_table


@dataclass(frozen=True)
class StagePrediction:
    """FuncPipe's per-micro-batch seconds for one stage (``None``: no such transfer, e.g.
    no input boundary for stage 0)."""

    stage: int
    forward_s: float
    backward_s: float
    upload_s: float | None            # t_fu on the output boundary
    download_s: float | None          # t_fd on the input boundary
    backward_upload_s: float | None   # t_bu on the input boundary (gradient sent down)
    backward_download_s: float | None  # t_bd on the output boundary (gradient received)
    sync_s: float                     # t_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def predictions(cost: funcpipe.PipelineCost) -> tuple[StagePrediction, ...]:
    count = len(cost.stages)
    out = []
    for s, stage in enumerate(cost.stages):
        below = cost.boundaries[s - 1] if s > 0 else None
        above = cost.boundaries[s] if s < count - 1 else None
        out.append(StagePrediction(
            stage=s, forward_s=stage.forward_s, backward_s=stage.backward_s,
            upload_s=above.forward_upload_s if above else None,
            download_s=below.forward_download_s if below else None,
            backward_upload_s=below.backward_upload_s if below else None,
            backward_download_s=above.backward_download_s if above else None,
            sync_s=stage.sync_s,
        ))
    return tuple(out)


COLUMNS = (("forward", "forward_s", "forward_s"), ("backward", "backward_s", "backward_s"),
           ("upload", "upload_s", "forward_upload_s"), ("download", "download_s", "forward_download_s"),
           ("sync", "sync_s", "sync_s"))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


@dataclass(frozen=True)
class Comparison:
    predicted: tuple[StagePrediction, ...]
    measured: Measured
    predicted_iteration_s: float
    cost: funcpipe.PipelineCost

    @property
    def measured_iteration_s(self) -> float | None:
        return self.measured.iteration_s

    @property
    def iteration_error(self) -> float | None:
        """predicted/measured − 1 of the iteration time (negative: the model predicts too
        short), the error every fidelity figure quotes; None without a measurement."""
        if not self.measured.iteration_s:
            return None
        return self.predicted_iteration_s / self.measured.iteration_s - 1

    def table(self) -> str:
        """One row per stage, predicted and measured side by side (ms); then the iteration."""
        header = ["stage", *(["pred", "meas"] * len(COLUMNS))]
        groups = [("", 1), *((f"{name} ms", 2) for name, _, _ in COLUMNS)]
        rows = []
        for prediction in self.predicted:
            measured = (self.measured.stages[prediction.stage]
                        if prediction.stage < len(self.measured.stages) else None)
            row = [str(prediction.stage)]
            for _, predicted_name, measured_name in COLUMNS:
                row += [_ms(getattr(prediction, predicted_name)),
                        _ms(getattr(measured, measured_name) if measured else None)]
            rows.append(row)
        lines = format_table(header, rows, numeric=range(1, len(header)), groups=groups).splitlines()
        error = self.iteration_error
        lines.append(f"iteration: predicted {_ms(self.predicted_iteration_s)} ms, measured "
                     f"{_ms(self.measured_iteration_s)} ms, error "
                     + ("-" if error is None else f"{round(100 * error, 1) + 0.0:+.1f}%")   # + 0.0: no "-0.0%"
                     + f"  (median of {len(self.measured.kept)} iteration(s)"
                     + (f", first {self.measured.skipped} skipped" if self.measured.skipped else "") + ")")
        bound = self.cost.host_bound_s
        if bound is not None and bound >= self.predicted_iteration_s:
            lines.append(f"  the host bound sets the prediction: the iteration's CPU (workers, invoker, store) over "
                         f"the host's cores is {_ms(bound)} ms, longer than its critical path (analysis.host_load)")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": funcpipe.MODEL,
            "predicted": {"stages": [p.to_json() for p in self.predicted], "iteration_s": self.predicted_iteration_s,
                          "dollars_per_iteration": self.cost.dollars_per_iteration,
                          "host_bound_s": self.cost.host_bound_s},
            "measured": self.measured.to_json(),
            "iteration_error": self.iteration_error,
        }


def compare(problem: Problem, plan: Plan, events: Iterable[Event], *, skip_first: int = 1,
            reads_target: bool = True, schedule: str | Schedule = DEFAULT_SCHEDULE) -> Comparison:
    """The model's prediction for ``plan`` run under ``schedule`` (:func:`predicted_iteration`)
    beside the summary of a run's ``events`` (``reads_target``: the run's loss reads a
    target, :func:`funcpipe.predicted`)."""
    cost = predicted_iteration(problem, plan, reads_target=reads_target, schedule=schedule)
    return Comparison(predicted=predictions(cost), measured=summarize(events, skip_first=skip_first),
                      predicted_iteration_s=cost.iteration_s, cost=cost)


def predicted_iteration(problem: Problem, plan: Plan, *, reads_target: bool = True,
                        schedule: str | Schedule = DEFAULT_SCHEDULE) -> funcpipe.PipelineCost:
    """What one iteration of ``plan`` is predicted to take and cost under ``schedule``: the
    schedule's own prediction (``Schedule.iteration_s``) from FuncPipe's t_iter with the
    measured terms (:func:`funcpipe.predicted`) and, where the schedule asks for it, the span
    of :func:`predicted_schedule` under its order plus the iteration's own term o_it (1F1B
    with a flush: it has FuncPipe's bubble only while transfers are short beside the
    compute), dollars at that time (the other terms are FuncPipe's). On a host the workers
    share (the local backend, its request CPU calibrated), at least the host bound t_host
    (:mod:`flatpack.analysis.host_load`), dollars at that time."""
    schedule = schedule_named(schedule)
    cost = funcpipe.predicted(problem, plan, reads_target=reads_target)
    overheads = cost.overheads or funcpipe.Overheads()
    simulated: list[Event] = []

    def simulated_s() -> float:
        simulated[:] = _simulate(problem, cost, schedule)
        return max(max(event.end for event in simulated) + overheads.iteration_s,
                   funcpipe.prefetch_bound(cost.micro_batches_per_replica, overheads))

    iteration_s = schedule.iteration_s(cost.iteration_s, simulated_s)
    bound = None
    if shares_host(problem.platform):
        events = simulated or _simulate(problem, cost, schedule)
        load = host_load(problem, plan, dataclasses.replace(cost, iteration_s=iteration_s), events,
                         reads_target=reads_target)
        if load is not None:
            bound = load.bound_s
            iteration_s = max(iteration_s, bound)
    if iteration_s == cost.iteration_s:
        return dataclasses.replace(cost, host_bound_s=bound)
    return dataclasses.replace(cost, iteration_s=iteration_s, host_bound_s=bound,
                               dollars_per_iteration=cost.dollars_per_iteration * iteration_s / cost.iteration_s)


def predicted_host_load(problem: Problem, plan: Plan, *, reads_target: bool = True,
                        schedule: str | Schedule = DEFAULT_SCHEDULE) -> HostLoad | None:
    """The host load (:mod:`flatpack.analysis.host_load`) :func:`predicted_iteration` bounds
    ``plan``'s iteration by, term by term; None where the platform shares no host (or its
    request CPU was not measured). ``benchmarks/cpu_accounting.py`` sets it beside each
    process's measured CPU."""
    if not shares_host(problem.platform):
        return None
    schedule = schedule_named(schedule)
    cost = funcpipe.predicted(problem, plan, reads_target=reads_target)
    overheads = cost.overheads or funcpipe.Overheads()
    events = _simulate(problem, cost, schedule)
    iteration_s = schedule.iteration_s(cost.iteration_s, lambda: max(
        max(event.end for event in events) + overheads.iteration_s,
        funcpipe.prefetch_bound(cost.micro_batches_per_replica, overheads)))
    return host_load(problem, plan, dataclasses.replace(cost, iteration_s=iteration_s), events,
                     reads_target=reads_target)


def calibrate(problem: Problem, plan: Plan, events: Iterable[Event], iteration: int) -> tuple[Problem, float, float]:
    """The two figures FuncPipe's profiler measures in the target, taken from one
    ``iteration`` of a run: β (App. B: the slowdown of computation beside communication),
    the median ratio of measured to predicted forward and backward times; and t_lat, the
    median of an activation upload's time beyond its bytes at the stage's bandwidth
    (uploads, because a download's time includes waiting for its producer). Returns the
    problem with both, β and t_lat. Judge it on *other* iterations, so that the
    calibration is not tested on the data it came from."""
    chosen = [event for event in events if event.iteration == iteration]
    base = compare(problem, plan, chosen, skip_first=0)
    ratios = []
    for prediction in base.predicted:
        if prediction.stage >= len(base.measured.stages):
            continue
        measured = base.measured.stages[prediction.stage]
        for predicted_s, measured_s in ((prediction.forward_s, measured.forward_s),
                                        (prediction.backward_s, measured.backward_s)):
            if predicted_s and measured_s:
                ratios.append(measured_s / predicted_s)
    platform = problem.platform
    beta = platform.overlap_slowdown * statistics.median(ratios) if ratios else platform.overlap_slowdown
    overheads = [event.seconds - event.nbytes / base.cost.stages[event.stage].bandwidth_bytes_s
                 for event in chosen if event.kind == "upload" and event.micro_batch is not None]
    latency = max(statistics.median(overheads), 0.0) if overheads else platform.storage_latency_s
    tuned = dataclasses.replace(platform, overlap_slowdown=beta, storage_latency_s=latency)
    return dataclasses.replace(problem, platform=tuned), beta, latency


# --- the model's prediction as a timeline ---------------------------------------------


def predicted_schedule(problem: Problem, plan: Plan, *, reads_target: bool = True,
                       schedule: str | Schedule = DEFAULT_SCHEDULE) -> list[Event]:
    """One iteration of ``schedule`` (e.g. ``sync``: FuncPipe's; ``1f1b``: PipeDream's 1F1B
    with a flush), simulated with the model's predicted per-micro-batch durations, starting
    at time 0.

    Every replica r of every stage runs its compute tasks in the runtime's order
    (``Schedule.actions``) over the micro-batches m it owns (m % d == r): a forward
    downloads its input first (stage > 0) and uploads its output after (not the last stage);
    a backward downloads its output gradient first (not the last stage) and uploads its input
    gradient after (stage > 0), and waits, as the runtime's does, for its forward and that
    forward's upload; then synchronize (d > 1) and update (t_opt,s + o_step of the measured
    terms). A download waits for the upload it reads; each lane of a worker (compute,
    upload, download) runs one task at a time, in the order the tasks were issued. List
    scheduling: a task starts as soon as its lane and its inputs are ready.

    Synchronous: with one micro-batch per replica the span equals the model's t_iter exactly
    (the model's forward and backward are then the critical path); with more it is at most
    t_iter, since the model lets no stage start its backward before the whole pipeline's
    forward has drained. 1F1B: each backward on a stage waits for the round trip through
    the stages above, and the forwards issued after it wait for it, so with transfers as
    long as the compute its span exceeds the synchronous one; :func:`predicted_iteration`
    takes it as 1F1B's prediction.
    """
    return _simulate(problem, funcpipe.predicted(problem, plan, reads_target=reads_target), schedule)


def _simulate(problem: Problem, cost: funcpipe.PipelineCost, schedule: str | Schedule) -> list[Event]:
    """:func:`predicted_schedule` of the measured-terms ``cost`` already computed for the plan."""
    overheads = cost.overheads
    programs = _programs(cost, schedule_named(schedule), problem.workload.micro_batch_count)

    # per worker and lane, the tasks wait their turn; a task runs once the tasks it needs end
    queues = {(worker, lane): [t for t in tasks if t[2] == lane]
              for worker, tasks in programs.items() for lane in ("compute", "upload", "download")}
    position = dict.fromkeys(queues, 0)
    lane_free = dict.fromkeys(queues, 0.0)
    done: dict[tuple, float] = {}
    events: list[Event] = []
    pending = sum(len(q) for q in queues.values())
    while pending:
        # each lane runs its tasks in program order, so a task's start is fixed once the tasks
        # it needs have ended: max(its lane's previous end, their ends)
        ready = []
        for queue_key, queue in queues.items():
            if position[queue_key] == len(queue):
                continue
            key, kind, lane, m, seconds, nbytes, needs = queue[position[queue_key]]
            if all(need in done for need in needs):
                start = max([lane_free[queue_key], *(done[need] for need in needs)])
                ready.append((start, queue_key, key, kind, lane, m, seconds, nbytes))
        if not ready:
            raise RuntimeError("the predicted schedule deadlocked; this is a bug in predicted_schedule")
        start, queue_key, key, kind, lane, m, seconds, nbytes = min(ready, key=lambda t: (t[0], t[1]))
        (s, r), _ = queue_key
        if lane != "compute" and overheads is not None:
            # a token-bucket link banks its burst while idle: since its last transfer, or since
            # the last iteration for its first
            idle = start - lane_free[queue_key] if position[queue_key] else math.inf
            seconds -= overheads.burst_credit_s(nbytes, cost.stages[s].bandwidth_bytes_s, s, idle)
        end = start + seconds
        done[key] = end
        lane_free[queue_key] = end
        position[queue_key] += 1
        pending -= 1
        events.append(Event(s, r, 0, kind, start, end, micro_batch=m, nbytes=nbytes, lane=lane))
    events.sort(key=lambda e: (e.start, e.stage, e.replica, LANE_ORDER[e.lane]))
    return events


def _programs(cost: funcpipe.PipelineCost, schedule: Schedule, total: int) -> dict[tuple[int, int], list[tuple]]:
    """Each worker's (stage, replica) tasks in program order, the schedule's actions over the
    ``total`` micro-batches it owns with their transfers, then its sync and update: (key,
    kind, lane, micro_batch, seconds, nbytes, the keys of the tasks it needs)."""
    d, count, boundaries = cost.replicas, len(cost.stages), cost.boundaries
    programs: dict[tuple[int, int], list[tuple]] = {}
    for s, stage in enumerate(cost.stages):
        below = boundaries[s - 1] if s > 0 else None
        above = boundaries[s] if s < count - 1 else None
        for r in range(d):
            tasks: list[tuple] = []
            backwards = []
            for action in schedule.actions(s, count, list(range(r, total, d))):
                m = action.micro_batch
                if action.is_forward:
                    needs = []
                    if below:
                        tasks.append((("fd", s, m), "download", "download", m, below.forward_download_s,
                                      int(below.bytes), [("fu", s - 1, m)]))
                        needs = [("fd", s, m)]
                    tasks.append((("f", s, m), "forward", "compute", m, stage.forward_s, 0, needs))
                    if above:
                        tasks.append((("fu", s, m), "upload", "upload", m, above.forward_upload_s, int(above.bytes),
                                      [("f", s, m)]))
                    continue
                needs = [("f", s, m)]
                if above:
                    tasks.append((("bd", s, m), "download", "download", m, above.backward_download_s,
                                  int(above.bytes), [("bu", s + 1, m)]))
                    needs += [("fu", s, m), ("bd", s, m)]
                tasks.append((("b", s, m), "backward", "compute", m, stage.backward_s, 0, needs))
                backwards.append(("b", s, m))
                if below:
                    tasks.append((("bu", s, m), "upload", "upload", m, below.backward_upload_s, int(below.bytes),
                                  [("b", s, m)]))
            last = backwards
            if d > 1:
                tasks.append((("s", s, r), "sync", "compute", None, stage.sync_s, stage.sync_bytes, backwards))
                last = [("s", s, r)]
            step = cost.overheads.step(s) if cost.overheads is not None else 0.0
            tasks.append((("u", s, r), "update", "compute", None, step, 0, last))
            programs[(s, r)] = tasks
    return programs


LANE_ORDER = {"compute": 0, "upload": 1, "download": 2}
