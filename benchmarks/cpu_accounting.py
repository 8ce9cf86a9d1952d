"""Where a local run's host CPU goes, per process kind, beside what the host bound counts
(issue 44, step 1).

``benchmarks/fidelity.py`` sets the host bound's CPU (``analysis.host_load``) beside the
host's busy CPU from ``/proc/stat``: on a host other work shares, that figure is everyone's.
This benchmark reads each process of the run instead, from ``/proc/PID/stat`` (user and
system CPU) and ``/proc/PID/status`` (voluntary and involuntary context switches), sampled
every 50 ms (``cpus.ProcessCpuSampler``) while the plan trains, and reads them over the kept iterations' window,
so that other work on the host does not enter the figures (it enters only as the time a
process waits for a core, which is no CPU of its own). The processes, by kind:

* workers: ``python -m flatpack.runtime.worker``, one per stage replica; their main thread
  (the schedule, its polls) apart from their other threads (the lanes: compute, upload,
  download; torch's pool), read from ``/proc/PID/task``;
* invoker: this process (feeding the data, polling the reports), less the sampler's own
  thread;
* store: the S3 server (SeaweedFS's ``weed``) and anything else this process started.

Predicted, per iteration (``analysis.host_load``'s count at the calibration's figures):
the compute (layers and optimizer step, in the workers), each store request's CPU (client
and server together, so it is split between workers, invoker and store in the
measurement), the polls' misses and the invoker's lists, and the per-worker terms the count
adds (``HostLoad.worker_s``). Printed per plan: both tables, measured − predicted.

    PYTHONPATH=. python benchmarks/cpu_accounting.py [--calibration FILE] [--model vgg16]
        [--plans 2x1,2x2] [--iterations 7]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flatpack import zoo
from flatpack.analysis.report import predicted_host_load
from flatpack.cpus import ProcessCpuSampler
from flatpack.job import JobOptions, run_training

@dataclass(frozen=True)
class PlanShape:
    stages: int
    replicas: int

    @property
    def label(self) -> str:
        return f"{self.stages}x{self.replicas}"


def run_plan(model_name: str, shape: PlanShape, *, batch: int, micro_batches: int, iterations: int,
             memory_mb: int, calibration: Path | None, schedule: str) -> dict:
    """One plan trained on the local backend under the sampler: the predicted host load and
    the measured per-kind CPU, both per kept iteration."""
    from benchmarks.fidelity import Shape    # the fidelity benchmark's fixed-shape solver

    model, example = zoo.build(model_name, "tiny")
    with tempfile.TemporaryDirectory(prefix="flatpack-cpu-accounting-") as out:
        options = JobOptions.of(batch=batch, micro_batches=micro_batches, iterations=iterations, optimizer="adam",
                                lr=1e-3, solver=Shape(shape.stages, memory_mb, shape.replicas),  # pyright: ignore[reportArgumentType]
                                replicas=(shape.replicas,), memory_mb=(memory_mb,), out=Path(out), verify=False,
                                schedule=schedule, calibration=calibration,
                                passes="fuse-elementwise,merge-branches,coarsen{max-layers=8,by=time}")
        with ProcessCpuSampler() as sampler:
            result = run_training(model, example, options, stream=io.StringIO())
    comparison = result.comparison
    kept = [it for it in comparison.measured.iterations if it.kept]
    if not kept:
        raise RuntimeError(f"{model_name} {shape.label}: no kept iteration to account (give more --iterations)")
    start, end = min(it.start for it in kept), max(it.end for it in kept)
    measured = {kind: {key: value if key == "processes" else value / len(kept) for key, value in figures.items()}
                for kind, figures in sampler.window(start, end).items()}
    problem, plan = result.compiled.problem, result.compiled.plan
    load = predicted_host_load(problem, plan, schedule=schedule)
    return {"label": shape.label, "measured": measured, "load": load, "iteration_s": (end - start) / len(kept),
            "predicted_s": comparison.predicted_iteration_s, "measured_s": comparison.measured_iteration_s}


def report(row: dict) -> str:
    """One plan's table: measured per process kind, then the count's terms, in core-ms per
    iteration."""
    lines = [f"plan {row['label']}: measured {row['measured_s'] * 1000:.0f} ms an iteration (kept window "
             f"{row['iteration_s'] * 1000:.0f} ms), predicted {row['predicted_s'] * 1000:.0f} ms",
             "| process | n | core-ms | user | sys | main thread | other threads | vol. switches | invol. |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    total = 0.0
    for kind, figures in row["measured"].items():
        if not figures:
            continue
        total += figures["cpu_s"]
        lines.append(f"| {kind} | {figures['processes']:.0f} | {figures['cpu_s'] * 1000:.1f} | "
                     f"{figures['user_s'] * 1000:.1f} | {figures['system_s'] * 1000:.1f} | "
                     f"{figures['main_thread_s'] * 1000:.1f} | {figures['other_threads_s'] * 1000:.1f} | "
                     f"{figures['voluntary']:.0f} | {figures['involuntary']:.0f} |")
    lines.append(f"| all | | {total * 1000:.1f} | | | | | | |")
    load = row["load"]
    if load is None:
        lines.append("no host bound: the calibration has no request CPU")
        return "\n".join(lines)
    lines.append("")
    lines.append("| predicted term | core-ms |")
    lines.append("|---|---:|")
    for name, value in load.terms().items():
        lines.append(f"| {name} | {value * 1000:.1f} |")
    lines.append(f"| all | {load.cpu_s * 1000:.1f} |")
    lines.append(f"measured − predicted: {(total - load.cpu_s) * 1000:+.1f} core-ms "
                 f"({(total / load.cpu_s - 1) * 100:+.0f}%)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a file from `flatpack calibrate --target local` (default: run one first)")
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--plans", default="2x1,2x2", help="stages x replicas, comma-separated")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--memory-mb", type=int, default=512)
    parser.add_argument("--schedule", default="sync")
    parser.add_argument("--iterations", type=int, default=7)
    args = parser.parse_args()
    try:
        shapes = [PlanShape(*map(int, text.split("x"))) for text in args.plans.split(",")]
    except (TypeError, ValueError):
        parser.error(f"--plans {args.plans!r}: give stages x replicas, e.g. 2x1,2x2")
    if not os.path.isdir("/proc/self/task"):
        parser.error("this benchmark reads /proc: run it on Linux")
    with tempfile.TemporaryDirectory(prefix="flatpack-calibration-") as scratch:
        calibration = args.calibration
        if calibration is None:
            from benchmarks.fidelity import calibrate

            calibration = calibrate(Path(scratch) / "calibration.json")
        for shape in shapes:
            row = run_plan(args.model, shape, batch=args.batch, micro_batches=args.micro_batches,
                           iterations=args.iterations, memory_mb=args.memory_mb, calibration=calibration,
                           schedule=args.schedule)
            print(report(row), flush=True)
            print(f"(host load average {os.getloadavg()[0]:.1f})\n", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
