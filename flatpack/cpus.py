"""Timing a computation on each of the CPUs this process may use (up to ``MEASURED_CPUS``),
not on whichever it happens to run on.

On a virtual machine each vCPU's speed moves on its own: on this project's 2-core VM a conv
probe pinned to CPU 0 read 0.415-0.437 ms for five seconds while the same probe pinned to
CPU 1 read 0.326-0.337 ms, and then both read 0.33 again (BENCHMARKS.md, issue 19's seventh
pass). A measurement taken on one CPU reads that CPU's phase; a stage worker, which the
scheduler moves between CPUs, runs at their mix. The host profile and the calibration probes
therefore time their runs on each of those CPUs in turn (``pinned``) and average the CPUs'
figures. Where a process cannot be pinned (no ``os.sched_setaffinity``: macOS, Windows) it
is measured where it runs.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import time
from typing import Callable, Iterator, Sequence, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# At most this many CPUs are measured: the profile's runs and the probes' rounds are shared
# among them, and each CPU after the first costs a warm-up run, so a 64-CPU host must not
# time 64. Two cover the phases measured on the 2-core VM; on a larger host they are the
# first CPU and the middle one of its set, the same two for the profile and the calibration.
MEASURED_CPUS = 2


def usable_cpus(limit: int = MEASURED_CPUS) -> tuple[int | None, ...]:
    """Up to ``limit`` of the CPUs this process may run on, evenly spaced over the sorted
    set; ``(None,)`` where it cannot be pinned."""
    if not hasattr(os, "sched_getaffinity") or not hasattr(os, "sched_setaffinity"):
        return (None,)
    allowed = sorted(os.sched_getaffinity(0))
    if not allowed:
        return (None,)
    count = min(limit, len(allowed))
    return tuple(allowed[index * len(allowed) // count] for index in range(count))


def measured_cpus(threads: int) -> tuple[int | None, ...]:
    """The CPUs a measurement at ``threads`` compute threads is shared among: :func:`usable_cpus`
    at one thread; ``(None,)``, unpinned, with more, because the threads the pinned one starts
    (torch's intra-op pool) would inherit its one CPU and keep it after the pin is given back."""
    return usable_cpus() if threads == 1 else (None,)


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """The calling thread held to ``cpu`` for the block, then given back the CPUs it had
    (``None``: left where it is). The affinity is the calling thread's: other threads keep
    theirs. A CPU that cannot be pinned (taken offline, outside a cpuset changed meanwhile)
    is logged and the block runs where the thread is: a measurement is never lost to it."""
    if cpu is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as err:
        log.info("could not pin the measurement to CPU %d (%s); measuring where it runs", cpu, err)
        held = False
    else:
        held = True
    try:
        yield
    finally:
        if held:
            os.sched_setaffinity(0, previous)


def on_each_cpu(measure: Callable[[], T], cpus: Sequence[int | None]) -> list[T]:
    """``measure()`` run once pinned to each of ``cpus`` (:func:`measured_cpus`), in order."""
    readings = []
    for cpu in cpus:
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


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far, from ``/proc/PID/stat``;
    None where there is no procfs (macOS, Windows) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: fields 14 and 15
    # (utime, stime) count from after its closing parenthesis
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class HostCpuSampler:
    """The host's busy CPU seconds over time: ``/proc/stat``'s first line (every CPU's user,
    nice, system, irq and softirq time; not steal, which ran no process of this host),
    sampled every ``period_s`` on a thread for as long as the ``with`` block runs. What the
    host bound predicts for a local run (``analysis.host_load``), measured:
    ``benchmarks/fidelity.py`` prints it beside the bound's CPU.
    Samples nothing where there is no procfs."""

    def __init__(self, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []     # (time.time(), busy CPU seconds so far)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="host-cpu-sampler", daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _busy_s(self) -> float | None:
        try:
            with open("/proc/stat") as stat:
                fields = [int(value) for value in stat.readline().split()[1:8]]
        except (OSError, ValueError):
            return None
        return (sum(fields) - fields[3] - fields[4]) / self._tick    # all but idle and iowait

    def _sample(self) -> None:
        while not self._stop.is_set():
            busy = self._busy_s()
            if busy is None:
                return
            self.samples.append((time.time(), busy))
            self._stop.wait(self.period_s)

    def __enter__(self) -> HostCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def busy_s(self, start: float, end: float) -> float | None:
        """Busy CPU seconds (all cores together) from ``start`` to ``end`` (``time.time()``),
        the rate between the first and last samples inside the window times its length; None
        where fewer than two samples fall in it."""
        times = [when for when, _ in self.samples]
        first, last = bisect.bisect_left(times, start), bisect.bisect_right(times, end) - 1
        if last <= first:
            return None
        (t0, b0), (t1, b1) = self.samples[first], self.samples[last]
        return (b1 - b0) / (t1 - t0) * (end - start)
