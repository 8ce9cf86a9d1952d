"""A run's timeline as a Chrome trace (``timeline.json``): the Trace Event Format that
Perfetto (ui.perfetto.dev) and chrome://tracing open, next to the Gantt PNG.

Measured and predicted are separate processes (pid 1 and 2) so the two can be lined up; each
worker lane — stage s, replica r, lane compute/upload/download/report — is a thread named
``s<s> r<r> <lane>``. Every task is a complete event (``"ph": "X"``) with microsecond
``ts``/``dur`` from the first event of its process, and its iteration, micro-batch, bytes
and attempt under ``args``. The format:
https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from flatpack.runtime.timeline import Event, Mark

MEASURED_PID, PREDICTED_PID = 1, 2


def trace_events(events: Sequence[Event], pid: int, process: str) -> list[dict[str, Any]]:
    """The trace events of one process: a name for it, a name for each lane, a complete event
    per task (microseconds from its first task)."""
    if not events:
        return []
    origin = min(event.start for event in events)
    lanes = sorted({(event.stage, event.replica, event.lane) for event in events})
    tid_of = {lane: index + 1 for index, lane in enumerate(lanes)}
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}}]
    for (stage, replica, lane), tid in tid_of.items():
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": f"s{stage} r{replica} {lane}"}})
        # lanes in stage, replica, lane order rather than by first appearance
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    for event in sorted(events, key=lambda e: (e.start, e.stage, e.replica)):
        name = event.kind if event.micro_batch is None else f"{event.kind} m{event.micro_batch}"
        args: dict[str, Any] = {"iteration": event.iteration, "attempt": event.attempt}
        if event.micro_batch is not None:
            args["micro_batch"] = event.micro_batch
        if event.nbytes:
            args["bytes"] = event.nbytes
        out.append({"ph": "X", "name": name, "cat": event.kind, "pid": pid,
                    "tid": tid_of[(event.stage, event.replica, event.lane)],
                    "ts": round((event.start - origin) * 1e6, 3), "dur": round((event.end - event.start) * 1e6, 3),
                    "args": args})
    return out


def mark_events(marks: Sequence[Mark], events: Sequence[Event], pid: int) -> list[dict[str, Any]]:
    """Each mark as a process-wide instant event (``"ph": "i"``, ``"s": "p"``) on ``events``'
    time axis, its label as the name."""
    if not events:
        return []
    origin = min(event.start for event in events)
    return [{"ph": "i", "s": "p", "name": mark.label, "cat": "decision", "pid": pid, "tid": 0,
             "ts": round((mark.at - origin) * 1e6, 3)} for mark in marks]


def write(events: Sequence[Event], path: str | os.PathLike, *, predicted: Sequence[Event] | None = None,
          marks: Sequence[Mark] = ()) -> Path:
    """Writes the measured ``events`` (and the ``predicted`` schedule, when given) as a
    Chrome trace at ``path``, with ``marks`` (a run's decisions) on the measured process;
    returns the path."""
    document = {"traceEvents": [*trace_events(events, MEASURED_PID, "measured"),
                                *mark_events(marks, events, MEASURED_PID),
                                *trace_events(predicted or (), PREDICTED_PID, "predicted (cost model)")],
                "displayTimeUnit": "ms"}
    path = Path(path)
    path.write_text(json.dumps(document) + "\n")
    return path
