"""Where the test suite's CPU goes, by kind of process (issue 42): runs the README's test
command (``python -m pytest``, or the arguments after ``--``) while sampling every process's
CPU seconds from ``/proc`` four times a second, then prints the wall time, the CPU the
command and its children were charged (``RUSAGE_CHILDREN``) and a table by kind: the xdist
workers' own work, forked and fresh functions, fork servers, SeaweedFS, CLI subprocesses,
the stand-ins' zygotes and invocations, Ray, and the rest. A process that starts and ends
between two samples is missed (a few tenths of a second each at most); daemons that outlive
the command (kernel threads, the VM's agent) are counted from their first sample only.

    python benchmarks/suite_cpu.py                     # the README's command
    python benchmarks/suite_cpu.py -- tests/unit -n 0  # any pytest arguments

Linux only (procfs). Run it on an otherwise quiet host: it measures what the suite costs,
and the figures move with whatever else runs (and with the host's own speed: see
benchmarks/host_speed.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

SAMPLE_S = 0.25
# (kind, test on the command line or the process name), first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("xdist workers (the tests' own work)", "exec(eval(sys.stdin.readline()))"),
    ("fork servers", "flatpack.runtime.forkserver"),
    ("functions", "flatpack.runtime.worker"),
    ("stand-in zygotes and their invocations", "standins/zygote.py"),
    ("stand-in invocations, fresh", "standins/bootstrap.py"),
    ("gloo ranks and collective probes", "flatpack.runtime.distributed"),
    ("gloo ranks and collective probes", "flatpack.runtime.collective_probe"),
    ("CLI subprocesses", " -m flatpack "),
    ("Ray", "ray"),
    ("SeaweedFS", "weed"),
    ("pytest itself", "pytest"),
)


@dataclass
class Process:
    command: str
    name: str
    first_cpu_s: float
    cpu_s: float


def _stat(pid: str, ticks: int) -> tuple[str, str, float] | None:
    """(name, start time, CPU seconds) of a live process, from one read of its stat file."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], fields[19], (int(fields[11]) + int(fields[12])) / ticks


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def sample(seen: dict[str, Process], stop: threading.Event) -> None:
    """Every process's CPU seconds until ``stop``, by (pid, start time): a reused pid is a new
    entry. One read of each process's stat a sample; its command line once, when first seen."""
    ticks = os.sysconf("SC_CLK_TCK")
    while not stop.is_set():
        for pid in (entry for entry in os.listdir("/proc") if entry.isdigit()):
            reading = _stat(pid, ticks)
            if reading is None:
                continue
            name, started, cpu_s = reading
            key = f"{pid}:{started}"
            if key in seen:
                seen[key].cpu_s = cpu_s
            else:
                seen[key] = Process(_command(pid), name, cpu_s, cpu_s)
        stop.wait(SAMPLE_S)


def kind_of(process: Process) -> str:
    text = f"{process.command} {process.name}"
    return next((kind for kind, needle in KINDS if needle in text), "other")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pytest_args", nargs="*", help="arguments for pytest after --")
    args = parser.parse_args()
    if not os.path.isdir("/proc/self"):
        print("suite_cpu needs Linux's /proc", file=sys.stderr)
        return 2
    before = {pid for pid in os.listdir("/proc") if pid.isdigit()}
    seen: dict[str, Process] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(seen, stop), daemon=True)
    sampler.start()
    started = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", *args.pytest_args])
    wall_s = time.monotonic() - started
    stop.set()
    sampler.join()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for key, process in seen.items():
        # a process that was running before the command (a daemon) counts only what it did since
        spent = process.cpu_s - (process.first_cpu_s if key.split(":")[0] in before else 0.0)
        if spent <= 0:
            continue
        kind = kind_of(process) if key.split(":")[0] not in before else "already running (daemons, other work)"
        by_kind[kind][0] += 1
        by_kind[kind][1] += spent
    charged_s = children.ru_utime + children.ru_stime
    print(f"\npytest exited {code}; wall {int(wall_s // 60)}:{wall_s % 60:04.1f}; CPU charged to it {charged_s:.0f} s "
          f"(user {children.ru_utime:.0f}, system {children.ru_stime:.0f})")
    print(f"{'CPU s':>8}  {'processes':>9}  kind")
    for kind, (count, cpu_s) in sorted(by_kind.items(), key=lambda item: -item[1][1]):
        print(f"{cpu_s:>8.0f}  {int(count):>9}  {kind}")
    return code


if __name__ == "__main__":
    sys.exit(main())
