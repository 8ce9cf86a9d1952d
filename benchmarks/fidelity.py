"""Predicted versus measured iteration time on the local backend.

For several zoo models (reduced size) and the plans ``dp`` picks for them on the ``local``
platform, the FuncPipe model's t_iter is set beside the median iteration measured when the
plan runs as local functions (one process per stage replica, a real S3 server, tiers
emulated: CPU share, bandwidth, memory). The error of each and the mean absolute percentage
error (MAPE) are printed. FuncPipe reports 11.3 % on AWS, Gillis under 6 % end to end.

Profiles are measured at one thread, as the workers compute. The machine has 2 cores, so
the plans are kept to tiers whose CPU shares sum to at most about 1.2 cores (512 MB tiers
are 0.29 vCPU, 1024 MB tiers 0.58): the local backend emulates a platform in miniature and
cannot emulate more CPU than the host has. The store's round trip is measured at deploy and
used as t_lat.

    python benchmarks/fidelity.py [--quick] [--iterations 6]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flatpack import zoo
from flatpack.job import JobOptions, run_training


@dataclass(frozen=True)
class Case:
    model: str
    batch: int
    micro_batches: int
    memory_mb: tuple[int, ...]
    replicas: tuple[int, ...]


CASES = (
    Case("vgg11", 64, 4, (512,), (1,)),
    Case("vgg16", 64, 4, (512,), (1,)),
    Case("vgg16", 64, 4, (512,), (1, 2)),
    Case("resnet50", 32, 4, (512,), (1,)),
    Case("amoebanet-d18", 32, 4, (512,), (1,)),
    Case("rnn-3", 64, 4, (512,), (1, 2)),
    Case("alexnet", 32, 4, (512, 1024), (1,)),
)
QUICK = CASES[:3]


def measure(case: Case, iterations: int) -> dict:
    model, example = zoo.build(case.model, "tiny")
    with tempfile.TemporaryDirectory(prefix="flatpack-fidelity-") as out:
        options = JobOptions(batch=case.batch, micro_batches=case.micro_batches, iterations=iterations,
                             optimizer="adam", lr=1e-3, solver="dp", replicas=case.replicas,
                             memory_mb=case.memory_mb, out=Path(out), verify=False,
                             passes="fuse-elementwise,merge-branches,coarsen{max-layers=8,by=time}")
        started = time.perf_counter()
        result = run_training(model, example, options, stream=io.StringIO())
        wall = time.perf_counter() - started
    comparison = result.comparison
    plan = result.compiled.plan
    return {"case": case, "predicted": comparison.predicted_iteration_s, "measured": comparison.measured_iteration_s,
            "error": comparison.iteration_error, "stages": len(plan.stages),
            "replicas": plan.stages[0].replicas, "tiers": sorted({s.memory_mb for s in plan.stages}),
            "wall": wall, "table": comparison.table()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three cases only")
    parser.add_argument("--iterations", type=int, default=6, help="iterations per case (the first is warm-up)")
    parser.add_argument("--verbose", action="store_true", help="print each case's per-stage table")
    args = parser.parse_args()
    rows = []
    for case in QUICK if args.quick else CASES:
        row = measure(case, args.iterations)
        rows.append(row)
        print(f"  {case.model}: predicted {row['predicted'] * 1000:.0f} ms, measured {row['measured'] * 1000:.0f} ms "
              f"({row['wall']:.0f} s)", file=sys.stderr, flush=True)
        if args.verbose:
            print(row["table"], file=sys.stderr)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} host threads; {args.iterations} iterations per case, "
          "median of all but the first\n")
    print("| model | batch | M | plan (stages × d, tiers MB) | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        case = row["case"]
        print(f"| {case.model} | {case.batch} | {case.micro_batches} | {row['stages']} × {row['replicas']}, "
              f"{','.join(map(str, row['tiers']))} | {row['predicted'] * 1000:.1f} | {row['measured'] * 1000:.1f} | "
              f"{row['error'] * 100:+.1f}% |")
    errors = [abs(row["error"]) for row in rows]
    print(f"\nMAPE {statistics.mean(errors) * 100:.1f}% over {len(rows)} cases "
          f"(median |error| {statistics.median(errors) * 100:.1f}%)")


if __name__ == "__main__":
    main()
