"""How steady this host's CPUs are: the noise floor under every predicted-vs-measured figure
(issue 44).

A prediction of a local run is made from figures measured earlier (the profile, `flatpack
calibrate`); the run is measured over a window of seconds (the fidelity benchmark keeps 10
iterations, 2-3 s; the demo about as long). If the host's CPUs run the same instructions
at a different speed from one second to the next, a measured iteration moves with them, and
no model of the run can follow: the error of a prediction that is exact at the host's usual
speed is then this benchmark's floor.

One process per CPU, pinned to it, runs a fixed probe over and over for ``--seconds``: a
pure-Python loop (100,000 multiply-adds: the interpreter's work, which the workers, the
invoker and the store's clients do between their tensors) and a 256 × 256 matmul at one
torch thread (a layer's work), interleaved, each timed by the wall clock and by the
process's CPU clock. Printed per CPU and probe:

* ``fast ms``: the probe's 10th-percentile time, the host's speed when nothing slows it;
* ``slow``: the share of the run's time spent in probes over 1.3 × ``fast``, and their
  median slowdown (a busy neighbour on the physical core shows as about 1.8-1.9 ×, with
  no steal time in ``/proc/stat``: the vCPU runs, slower);
* ``bursts``: how long such slow stretches last (the median and the longest);
* ``CPU/wall``: the probe's CPU seconds over its wall seconds (about 1: the slow probes
  are slow on the process's own clock too, so no CPU-time reading escapes them);
* the floor, per window length W (2.4 s: the fidelity benchmark's kept iterations; 10 s): the
  probe's mean speed over each window of W seconds, and the mean |speed / median speed − 1|
  over the windows, i.e. the mean absolute error of a prediction exact at the median speed,
  with the 10th and 90th percentiles.

    PYTHONPATH=. python benchmarks/host_speed.py [--seconds 60] [--json FILE]

``benchmarks/fidelity.py`` runs :func:`measure` before its cases and writes the result into
its raw table (``host_speed``), so each run's errors carry the floor of the host they ran on.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from flatpack.cpus import pinned

PYTHON_LOOP = 100_000
MATMUL_SIZE = 256
MATMUL_REPEATS = 20
SLOW_FACTOR = 1.3           # a probe this much over the fast time ran on a slowed CPU
WINDOWS_S = (2.4, 10.0)
PROBES = ("python", "matmul")


@dataclass(frozen=True)
class Floor:
    """The spread of a probe's mean speed over windows of ``window_s`` seconds."""

    window_s: float
    windows: int
    mean_abs_error: float      # mean |window speed / median window speed - 1|
    p10: float                 # window time over the median window's (below 1: faster)
    p90: float


@dataclass(frozen=True)
class ProbeSpeed:
    cpu: int
    probe: str
    runs: int
    fast_s: float
    slow_time_share: float
    slow_factor: float | None
    burst_median_s: float | None
    burst_max_s: float | None
    cpu_over_wall: float
    floors: tuple[Floor, ...]


def python_probe() -> None:
    """The interpreter's probe: ``PYTHON_LOOP`` multiply-adds."""
    total = 0
    for number in range(PYTHON_LOOP):
        total += number * number


def python_probe_mean_s(seconds_per_cpu: float = 1.0) -> dict[int, float]:
    """The mean wall seconds of :func:`python_probe` on each CPU in turn, ``seconds_per_cpu``
    each, in this thread (``flatpack.cpus.pinned`` to each CPU :func:`measure` probes, then
    given its CPUs back): a short reading of the interpreter's speed now, beside a longer
    :func:`measure`'s ``fast_s``."""
    means = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        with pinned(cpu):
            python_probe()
            runs = []
            began = time.perf_counter()
            while time.perf_counter() - began < seconds_per_cpu:
                started = time.perf_counter()
                python_probe()
                runs.append(time.perf_counter() - started)
        means[cpu] = statistics.fmean(runs)
    return means


def _run_probes(cpu: int, seconds: float, queue: Any) -> None:
    """In a child pinned to ``cpu``: (probe, start, wall s, CPU s) for every probe run."""
    import torch

    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    matrix = torch.randn(MATMUL_SIZE, MATMUL_SIZE)

    def matmul_probe() -> None:
        for _ in range(MATMUL_REPEATS):
            torch.mm(matrix, matrix)

    probes = {"python": python_probe, "matmul": matmul_probe}
    for probe in probes.values():    # warm: caches, the allocator, torch's first call
        probe()
    rows: list[tuple[str, float, float, float]] = []
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for name, probe in probes.items():
            wall, cpu_clock = time.perf_counter(), time.process_time()
            probe()
            rows.append((name, wall - began, time.perf_counter() - wall, time.process_time() - cpu_clock))
    queue.put((cpu, rows))


def _floor(rows: list[tuple[float, float]], window_s: float) -> Floor | None:
    """``rows``: (start, seconds) of one probe; the spread of its mean time per window."""
    if not rows:
        return None
    end = rows[-1][0]
    means = []
    start = 0.0
    while start + window_s <= end:
        inside = [seconds for at, seconds in rows if start <= at < start + window_s]
        if inside:
            means.append(statistics.mean(inside))
        start += window_s / 2       # half-overlapping windows
    if len(means) < 2:
        return None
    median = statistics.median(means)
    ratios = sorted(mean / median for mean in means)
    return Floor(window_s=window_s, windows=len(ratios), mean_abs_error=statistics.mean(abs(1 / r - 1) for r in ratios),
                 p10=ratios[len(ratios) // 10], p90=ratios[(9 * len(ratios)) // 10])


def summarize(cpu: int, probe: str, rows: list[tuple[float, float, float]]) -> ProbeSpeed:
    """One CPU's runs of one probe: (start, wall s, CPU s) each."""
    walls = [wall for _, wall, _ in rows]
    fast = sorted(walls)[len(walls) // 10]
    slow = [wall for wall in walls if wall > SLOW_FACTOR * fast]
    bursts, current = [], 0.0
    for wall in walls:
        if wall > SLOW_FACTOR * fast:
            current += wall
        elif current:
            bursts.append(current)
            current = 0.0
    if current:
        bursts.append(current)
    # only stretches long enough to cover several probes: one slow probe is a preemption
    bursts = [burst for burst in bursts if burst >= 0.1]
    timed = [(at, wall) for at, wall, _ in rows]
    floors = tuple(floor for window in WINDOWS_S if (floor := _floor(timed, window)) is not None)
    return ProbeSpeed(cpu=cpu, probe=probe, runs=len(rows), fast_s=fast, slow_time_share=sum(slow) / sum(walls),
                      slow_factor=statistics.median(slow) / fast if slow else None,
                      burst_median_s=statistics.median(bursts) if bursts else None,
                      burst_max_s=max(bursts) if bursts else None,
                      cpu_over_wall=sum(cpu for _, _, cpu in rows) / sum(walls), floors=floors)


def measure(seconds: float = 30.0, cpus: list[int] | None = None) -> list[ProbeSpeed]:
    """Every CPU of this process (or ``cpus``) probed at once for ``seconds``."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    context = multiprocessing.get_context("spawn")   # no torch state copied into the probes
    queue = context.Queue()
    children = [context.Process(target=_run_probes, args=(cpu, seconds, queue)) for cpu in cpus]
    for child in children:
        child.start()
    results = [queue.get(timeout=seconds + 120) for _ in children]
    for child in children:
        child.join()
    speeds = []
    for cpu, rows in sorted(results):
        for probe in PROBES:
            speeds.append(summarize(cpu, probe, [(at, wall, cpu_s) for name, at, wall, cpu_s in rows if name == probe]))
    return speeds


def as_json(speeds: list[ProbeSpeed]) -> list[dict[str, Any]]:
    return [asdict(speed) for speed in speeds]


def floor_of(speeds: list[dict[str, Any]] | list[ProbeSpeed], probe: str = "python",
             window_s: float = WINDOWS_S[0]) -> float | None:
    """The mean of the CPUs' floors for ``probe`` at ``window_s`` (None where not measured)."""
    rows = [asdict(speed) if isinstance(speed, ProbeSpeed) else speed for speed in speeds]
    values = [floor["mean_abs_error"] for row in rows if row["probe"] == probe
              for floor in row["floors"] if floor["window_s"] == window_s]
    return statistics.mean(values) if values else None


def table(speeds: list[ProbeSpeed]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f}"

    lines = ["| CPU | probe | runs | fast ms | slow: share of time, × | bursts: median, max s | CPU/wall | "
             + " | ".join(f"floor at {window:g} s: mean |error| (p10-p90)" for window in WINDOWS_S) + " |",
             "|---:|---|---:|---:|---|---|---:|" + "---|" * len(WINDOWS_S)]
    for speed in speeds:
        factor = "-" if speed.slow_factor is None else f"{speed.slow_factor:.2f}"
        bursts = "-" if speed.burst_median_s is None else f"{speed.burst_median_s:.2f}, {speed.burst_max_s:.2f}"
        floors = {floor.window_s: floor for floor in speed.floors}
        cells = [f"{floors[w].mean_abs_error * 100:.1f} % ({floors[w].p10:.2f}-{floors[w].p90:.2f})"
                 if w in floors else "-" for w in WINDOWS_S]
        lines.append(f"| {speed.cpu} | {speed.probe} | {speed.runs} | {ms(speed.fast_s)} | "
                     f"{speed.slow_time_share * 100:.0f} %, {factor} | {bursts} | {speed.cpu_over_wall:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long every CPU runs its probes")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    if args.seconds < 2 * max(WINDOWS_S):
        parser.error(f"--seconds {args.seconds:g}: give at least {2 * max(WINDOWS_S):g} (two windows of "
                     f"{max(WINDOWS_S):g} s)")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    speeds = measure(args.seconds)
    print(f"{started} UTC, {len(os.sched_getaffinity(0))} CPUs, {args.seconds:g} s, load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    print(table(speeds))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"started": started, "seconds": args.seconds, "speeds": as_json(speeds)}, out, indent=1)
            out.write("\n")


if __name__ == "__main__":
    sys.exit(main())
