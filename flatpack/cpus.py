"""Timing a computation on every CPU this process may use, not on whichever it runs on.

On a virtual machine each vCPU's speed moves on its own: on this project's 2-core VM a conv
probe pinned to CPU 0 read 0.415-0.437 ms for five seconds while the same probe pinned to
CPU 1 read 0.326-0.337 ms, and then both read 0.33 again (BENCHMARKS.md, issue 19's seventh
pass). A measurement taken on one CPU reads that CPU's phase; a stage worker, which the
scheduler moves between CPUs, runs at their mix. The host profile and the calibration probes
therefore time their runs on each usable CPU in turn (``pinned``) and average the CPUs'
figures. Where a process cannot be pinned (no ``os.sched_setaffinity``: macOS, Windows) it
is measured where it runs.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")


def usable_cpus() -> tuple[int | None, ...]:
    """The CPUs this process may run on, in order; ``(None,)`` where it cannot be pinned."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return (None,)
    return tuple(sorted(os.sched_getaffinity(0))) or (None,)


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """The calling thread held to ``cpu`` for the block, then given back the CPUs it had
    (``None``: left where it is). The affinity is the calling thread's: other threads keep
    theirs."""
    if cpu is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def on_each_cpu(measure: Callable[[], T], cpus: Sequence[int | None] | None = None) -> list[T]:
    """``measure()`` run once pinned to each of ``cpus`` (default: every usable CPU), in order."""
    readings = []
    for cpu in usable_cpus() if cpus is None else cpus:
        with pinned(cpu):
            readings.append(measure())
    return readings


def runs_per_cpu(repeats: int, cpus: int) -> list[int]:
    """``repeats`` timed runs shared among ``cpus`` CPUs as evenly as they divide, the first
    CPUs taking the remainder; a CPU's share is at least 1, so each CPU is measured."""
    if repeats < 1 or cpus < 1:
        raise ValueError(f"runs_per_cpu needs repeats >= 1 and cpus >= 1, got {repeats} and {cpus}")
    share, extra = divmod(repeats, cpus)
    return [max(1, share + (1 if index < extra else 0)) for index in range(cpus)]
