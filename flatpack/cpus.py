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
from collections import defaultdict
from dataclasses import dataclass, field
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

# ProcessCpuSampler: how often it reads the run's processes, and the kinds it sums them by
PROCESS_PERIOD_S = 0.05
PROCESS_RESCAN = 5
PROCESS_KINDS = ("worker", "invoker", "store")
_CLOCK_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Reading:
    """One process's counters at one moment: CPU seconds (user, system), context switches
    (voluntary, involuntary), its main thread's CPU seconds, and the sampler thread's (the
    invoker's only)."""

    user_s: float
    system_s: float
    voluntary: int
    involuntary: int
    main_thread_s: float
    sampler_s: float = 0.0


def _stat_cpu_s(path: str) -> float | None:
    try:
        with open(path) as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICK


def _read(pid: int, sampler_tid: int | None) -> Reading | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
        with open(f"/proc/{pid}/status") as status:
            lines = dict(line.split(":", 1) for line in status.read().splitlines() if ":" in line)
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    main = _stat_cpu_s(f"/proc/{pid}/task/{pid}/stat") or 0.0
    sampler = _stat_cpu_s(f"/proc/{pid}/task/{sampler_tid}/stat") if sampler_tid is not None else None
    return Reading(int(fields[11]) / _CLOCK_TICK, int(fields[12]) / _CLOCK_TICK, int(lines["voluntary_ctxt_switches"]),
                   int(lines["nonvoluntary_ctxt_switches"]), main, sampler or 0.0)


def _descendants(root: int) -> Iterator[int]:
    """Every live process below ``root`` (by each process's parent in ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = defaultdict(list)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        children[int(text[text.rindex(")") + 2:].split()[1])].append(int(name))
    stack = list(children[root])
    while stack:
        pid = stack.pop()
        yield pid
        stack += children[pid]


def _kind(pid: int, own_cmdline: bytes) -> str | None:
    """"worker" for a stage worker, "store" for any other child; None while ``pid`` still
    runs this process's command line (forked, not yet exec'd: a worker read then would count
    as the store for the rest of the run)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read()
    except OSError:
        return "store"
    if raw == own_cmdline:
        return None
    return "worker" if b"flatpack.runtime.worker" in raw.split(b"\0") else "store"


@dataclass
class ProcessCpuSampler:
    """Every process of this run (this one, the invoker, and all below it), read every
    ``period_s`` on a thread while the ``with`` block runs."""

    period_s: float = PROCESS_PERIOD_S
    samples: list[tuple[float, dict[int, Reading]]] = field(default_factory=list)
    kinds: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-accounting", daemon=True)
        self._tid: int | None = None

    def _sample(self) -> None:
        self._tid = threading.get_native_id()
        me = os.getpid()
        self.kinds[me] = "invoker"
        known: list[int] = [me]
        with open(f"/proc/{me}/cmdline", "rb") as cmdline:
            own_cmdline = cmdline.read()
        while not self._stop.is_set():
            # the whole of /proc is walked for new processes every RESCAN-th sample only: a
            # walk reads every process's stat, and at every sample it cost the invoker 4 % of
            # a core (58 ms an iteration of a 2 x 2 plan, sampled every 50 ms)
            if len(self.samples) % PROCESS_RESCAN == 0:
                known = [me, *_descendants(me)]
            readings: dict[int, Reading] = {}
            for pid in known:
                if pid not in self.kinds:
                    kind = _kind(pid, own_cmdline)
                    if kind is not None:
                        self.kinds[pid] = kind
                reading = _read(pid, self._tid if pid == me else None)
                if reading is not None:
                    readings[pid] = reading
            self.samples.append((time.time(), readings))
            self._stop.wait(self.period_s)

    def __enter__(self) -> ProcessCpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float) -> dict[str, dict[str, float]]:
        """Per process kind, from ``start`` to ``end`` (``time.time()``): CPU seconds (user,
        system, main thread, other threads) and context switches, summed over its processes;
        each process's counters as the last sample at or before each end read them (one
        started later counts from 0; one that exited, to its last sample)."""
        times = [when for when, _ in self.samples]
        first, last = bisect.bisect_right(times, start), bisect.bisect_right(times, end)
        totals: dict[str, dict[str, float]] = {kind: defaultdict(float) for kind in PROCESS_KINDS}
        for pid in {pid for _, readings in self.samples[:last] for pid in readings}:
            before = _latest(self.samples[:first], pid) or Reading(0.0, 0.0, 0, 0, 0.0)
            after = _latest(self.samples[:last], pid) or before
            into = totals[self.kinds.get(pid, "store")]
            sampler = after.sampler_s - before.sampler_s
            cpu = after.user_s + after.system_s - before.user_s - before.system_s
            main = after.main_thread_s - before.main_thread_s
            if cpu <= 0 and after is before:
                continue
            into["processes"] += 1
            into["user_s"] += after.user_s - before.user_s
            into["system_s"] += after.system_s - before.system_s
            into["cpu_s"] += cpu - sampler
            into["main_thread_s"] += main
            into["other_threads_s"] += cpu - main - sampler
            into["voluntary"] += after.voluntary - before.voluntary
            into["involuntary"] += after.involuntary - before.involuntary
            into["sampler_s"] += sampler
        return {kind: dict(values) for kind, values in totals.items()}


def _latest(samples: list[tuple[float, dict[int, Reading]]], pid: int) -> Reading | None:
    """``pid``'s counters in the last of ``samples`` that read it."""
    for _, readings in reversed(samples):
        if pid in readings:
            return readings[pid]
    return None


def cores_obtained(processes: int, seconds: float) -> float | None:
    """The host's cores ``processes`` always-busy processes get together: each forked child
    spins for ``seconds`` of wall time, and their CPU seconds (``os.wait4``'s usage, user and
    system) are summed over the window from the first fork to the last exit. On a quiet host
    it reads the host's cores (fewer where ``processes`` is fewer); where other work shares
    the host it reads the share the kernel's scheduler gives these processes beside it, which
    is what a local run's workers, invoker and store get too (``analysis.host_load``). None
    where there is no ``fork``/``wait4`` (Windows). The children run only the spin loop and
    ``os._exit``: no lock or thread of the parent is touched after the fork."""
    if processes < 1 or seconds <= 0:
        raise ValueError(f"cores_obtained needs processes >= 1 and seconds > 0, got {processes} and {seconds}")
    if not hasattr(os, "fork") or not hasattr(os, "wait4"):
        return None
    children = []
    # over the window from the first fork to the last child's end, not ``seconds``: each child
    # spins ``seconds`` from its own start, and on a loaded host the forks are staggered, so
    # CPU seconds over ``seconds`` read more cores than the host has (test_request_cpu caught it)
    started = time.monotonic()
    try:
        for _ in range(processes):
            pid = os.fork()
            if pid == 0:     # the child: spin, then leave without running the parent's exit handlers
                # its own session, as the local backend starts each worker and the store
                # (start_new_session): where the kernel groups scheduling by session
                # (autogroup), each session gets a share, not each process, and forked
                # children left in this one read a sixth of what a run's processes got
                # (0.19 cores at a load average of 28, where a 1 x 1 plan's ran at full speed)
                os.setsid()
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    pass
                os._exit(0)
            children.append(pid)
    finally:
        used = 0.0
        for pid in children:
            _, _, usage = os.wait4(pid, 0)
            used += usage.ru_utime + usage.ru_stime
    return used / max(seconds, time.monotonic() - started)
