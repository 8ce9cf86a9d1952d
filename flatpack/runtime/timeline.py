"""What stage workers record: one :class:`Event` per task (a forward or backward pass, an
upload or download, a synchronization, an update, a checkpoint or a load), and what the
events add up to per stage and per iteration (:func:`summarize`).

Times are ``time.time()`` seconds: every worker of a local run shares the host clock, so
events of different workers land on one time axis. A worker keeps a :class:`Recorder`,
drains it after each iteration and writes the events to the store (JSON, never pickle)
under ``RunKeys.timeline(stage, replica, iteration, attempt)``.

Lanes: a worker computes on one lane and moves data on two more (uploads and downloads run
beside computation). Transfers of activations and gradients are kinds "upload"/"download"
on the lanes of the same name, with their micro-batch set. Everything a synchronization
moves is kind "sync" on the upload or download lane, and the compute lane may carry one
"sync" event spanning the whole synchronization as well; so the synchronization time of a
replica is measured as the wall span from its first to its last "sync" event of the
iteration, never as a sum (which would count the overlap twice).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable, Iterator

KINDS = ("forward", "backward", "upload", "download", "sync", "update", "checkpoint", "load", "prefetch")
LANES = ("compute", "upload", "download")
# kinds outside an iteration's own work: a worker's start-up load, its checkpoints, and the
# first stage's download of the next iteration's data while this one runs
OUTSIDE_ITERATION = ("load", "checkpoint", "prefetch")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Event:
    """One task of one worker (stage, replica) in one iteration, from ``start`` to ``end``
    (``time.time()`` seconds). ``micro_batch`` is set for per-micro-batch tasks, ``nbytes``
    for transfers, ``attempt`` counts the worker's restarts."""

    stage: int
    replica: int
    iteration: int
    kind: str
    start: float
    end: float
    micro_batch: int | None = None
    nbytes: int = 0
    lane: str = "compute"
    attempt: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"event kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.lane not in LANES:
            raise ValueError(f"event lane {self.lane!r} is not one of {', '.join(LANES)}")
        if self.end < self.start:
            raise ValueError(f"a {self.kind} event ends ({self.end}) before it starts ({self.start})")

    @property
    def worker(self) -> str:
        return f"s{self.stage}r{self.replica}"

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Event:
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in known})


@dataclass(frozen=True)
class Mark:
    """A moment of the run that is no worker's task, drawn across every worker's row: a
    decision at an epoch boundary (``backends.elastic_policy``, ``backends.replan``) with what
    it decided, at ``at`` (``time.time()`` seconds, the events' clock)."""

    at: float
    label: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Collects one worker's events; safe to use from the worker's compute and transfer
    threads at once."""

    def __init__(self, stage: int, replica: int, attempt: int = 0) -> None:
        self.stage = stage
        self.replica = replica
        self.attempt = attempt
        self._events: list[Event] = []
        self._lock = threading.Lock()

    @contextmanager
    def task(self, kind: str, iteration: int, *, micro_batch: int | None = None, nbytes: int = 0,
             lane: str = "compute") -> Iterator[None]:
        """Times the body as one event; the event is recorded even when the body raises
        (the exception then propagates)."""
        if kind not in KINDS:   # fail before the body runs, not after
            raise ValueError(f"event kind {kind!r} is not one of {', '.join(KINDS)}")
        if lane not in LANES:
            raise ValueError(f"event lane {lane!r} is not one of {', '.join(LANES)}")
        start = time.time()
        try:
            yield
        finally:
            end = max(time.time(), start)
            self.add(Event(self.stage, self.replica, iteration, kind, start, end, micro_batch=micro_batch,
                           nbytes=nbytes, lane=lane, attempt=self.attempt))

    def add(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    def drain(self, iteration: int | None = None) -> list[Event]:
        """Removes and returns the recorded events (only those of ``iteration`` if given),
        in the order they were recorded."""
        with self._lock:
            if iteration is None:
                taken, self._events = self._events, []
            else:
                taken = [e for e in self._events if e.iteration == iteration]
                self._events = [e for e in self._events if e.iteration != iteration]
        return taken

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


def dumps(events: Iterable[Event], **extra: Any) -> bytes:
    """The events as JSON; ``extra``: further top-level entries (a run's decisions), which
    :func:`loads` leaves alone."""
    return json.dumps({"version": FORMAT_VERSION, "events": [e.to_json() for e in events], **extra},
                      separators=(",", ":")).encode()


def loads(data: bytes | str) -> list[Event]:
    document = json.loads(data)
    if isinstance(document, list):   # a bare list of events
        return [Event.from_json(item) for item in document]
    version = document.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(f"timeline format version {version!r} is not the supported {FORMAT_VERSION}")
    return [Event.from_json(item) for item in document["events"]]


# --- what the events add up to ---------------------------------------------------------


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    current: tuple[float, float] | None = None   # the union's interval being extended
    for start, end in sorted(intervals):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += current[1] - current[0]
    return total


@dataclass(frozen=True)
class StageSummary:
    """Measured figures of one stage, pooled over its replicas and the kept iterations
    (medians; ``None`` where the stage recorded no such event).

    ``forward_s``/``backward_s``: one micro-batch's compute. ``upload_s``/``download_s``:
    one activation or gradient transfer, both directions pooled; split by direction in
    ``forward_upload_s`` (activations sent to the next stage), ``backward_upload_s``
    (gradients sent to the previous stage), ``forward_download_s`` (inputs received) and
    ``backward_download_s`` (output gradients received). ``sync_s``: per replica and
    iteration, the wall span of its sync events. ``update_s``: per replica and iteration, the
    optimizer step. ``busy_s``: per replica and iteration, the time its compute lane is busy
    (union of its intervals); ``iteration_s`` of :class:`Measured` minus this is idle time.
    """

    stage: int
    replicas: int
    forward_s: float | None
    backward_s: float | None
    upload_s: float | None
    download_s: float | None
    forward_upload_s: float | None
    backward_upload_s: float | None
    forward_download_s: float | None
    backward_download_s: float | None
    sync_s: float | None
    update_s: float | None
    busy_s: float | None
    micro_batches: int   # forward events counted (over replicas and kept iterations)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class IterationSummary:
    iteration: int
    start: float
    end: float
    kept: bool   # False for the warm-up iterations summarize skipped

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds}


@dataclass(frozen=True)
class Measured:
    """What a run's timeline adds up to: ``stages[s]`` per stage (indexed by stage number),
    ``iterations`` every iteration seen, and ``iteration_s``, the median wall time of the
    kept ones (from the first event's start to the last event's end, all workers together,
    loads and checkpoints left out)."""

    stages: tuple[StageSummary, ...]
    iterations: tuple[IterationSummary, ...]
    iteration_s: float | None
    skipped: int = 0
    events: int = field(default=0)

    @property
    def kept(self) -> list[int]:
        return [it.iteration for it in self.iterations if it.kept]

    def to_json(self) -> dict[str, Any]:
        return {"stages": [s.to_json() for s in self.stages], "iterations": [i.to_json() for i in self.iterations],
                "iteration_s": self.iteration_s, "skipped": self.skipped, "events": self.events}


def _split_transfers(events: list[Event]) -> dict[str, list[float]]:
    """Activation/gradient transfers of one worker in one iteration, by direction.

    A download that ends before the forward pass of its micro-batch starts brought that
    pass's input; any other carried an output gradient. An upload that starts after the
    backward pass of its micro-batch ends sends an input gradient; any other sends the
    forward output. Without a matching pass (a worker that recorded no compute), the first
    transfer of a micro-batch in time counts as the forward one."""
    forward_start: dict[int, float] = {}
    backward_end: dict[int, float] = {}
    for e in events:
        if e.micro_batch is None:
            continue
        if e.kind == "forward":
            forward_start[e.micro_batch] = min(forward_start.get(e.micro_batch, e.start), e.start)
        elif e.kind == "backward":
            backward_end[e.micro_batch] = max(backward_end.get(e.micro_batch, e.end), e.end)
    out: dict[str, list[float]] = defaultdict(list)
    seen: set[tuple[str, int]] = set()
    for e in sorted(events, key=lambda e: e.start):
        if e.kind not in ("upload", "download") or e.micro_batch is None:
            continue
        m = e.micro_batch
        if e.kind == "download":
            forward = e.end <= forward_start[m] if m in forward_start else ("download", m) not in seen
        else:
            forward = e.start < backward_end[m] if m in backward_end else ("upload", m) not in seen
        seen.add((e.kind, m))
        out[("forward_" if forward else "backward_") + e.kind].append(e.seconds)
    return out


def summarize(events: Iterable[Event], *, skip_first: int = 1) -> Measured:
    """Per-stage medians and per-iteration wall times of a run's events.

    The first ``skip_first`` iterations (by number) are left out of every figure when more
    iterations than that exist: they include warm-up (first-touch allocation, lazy
    initialization). With only that many, all are kept.
    """
    events = list(events)
    by_iteration: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_iteration[e.iteration].append(e)
    numbers = sorted(by_iteration)
    skip = max(0, skip_first) if len(numbers) > max(0, skip_first) else 0
    kept_numbers = set(numbers[skip:])

    # An iteration starts when its first task does, but not before the previous iteration
    # ended: a later stage finishes its backward first and starts waiting for the next
    # iteration's inputs while earlier stages still work on this one. Measured so, an
    # iteration's seconds are the period between iterations, which t_iter predicts.
    iterations = []
    previous_end = float("-inf")
    for number in numbers:
        inside = [e for e in by_iteration[number] if e.kind not in OUTSIDE_ITERATION]
        if not inside:
            continue
        end = max(e.end for e in inside)
        start = max(min(e.start for e in inside), min(previous_end, end))
        iterations.append(IterationSummary(number, start, end, number in kept_numbers))
        previous_end = end
    iteration_s = _median([it.seconds for it in iterations if it.kept])

    # samples per stage, pooled over its replicas and the kept iterations
    samples: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    replicas: dict[int, set[int]] = defaultdict(set)
    per_worker: dict[tuple[int, int, int], list[Event]] = defaultdict(list)
    for e in events:
        replicas[e.stage].add(e.replica)
        if e.iteration in kept_numbers:
            per_worker[(e.stage, e.replica, e.iteration)].append(e)
    for (stage, _replica, _iteration), mine in per_worker.items():
        figures = samples[stage]
        for e in mine:
            if ((e.kind in ("forward", "backward") and e.lane == "compute")
                    or (e.kind in ("upload", "download") and e.micro_batch is not None)):
                figures[e.kind].append(e.seconds)
        for name, values in _split_transfers(mine).items():
            figures[name].extend(values)
        syncs = [e for e in mine if e.kind == "sync"]
        if syncs:
            figures["sync"].append(max(e.end for e in syncs) - min(e.start for e in syncs))
        updates = [e.seconds for e in mine if e.kind == "update"]
        if updates:
            figures["update"].append(sum(updates))
        compute = [(e.start, e.end) for e in mine if e.lane == "compute" and e.kind not in OUTSIDE_ITERATION]
        if compute:
            figures["busy"].append(_union_seconds(compute))

    stages = []
    for stage in range(max(replicas) + 1 if replicas else 0):
        figures = samples.get(stage, {})
        get = lambda name: _median(figures.get(name, []))  # noqa: E731
        stages.append(StageSummary(
            stage=stage, replicas=len(replicas.get(stage, ())), forward_s=get("forward"), backward_s=get("backward"),
            upload_s=get("upload"), download_s=get("download"), forward_upload_s=get("forward_upload"),
            backward_upload_s=get("backward_upload"), forward_download_s=get("forward_download"),
            backward_download_s=get("backward_download"), sync_s=get("sync"), update_s=get("update"),
            busy_s=get("busy"), micro_batches=len(figures.get("forward", [])),
        ))
    return Measured(stages=tuple(stages), iterations=tuple(iterations), iteration_s=iteration_s, skipped=skip,
                    events=len(events))
