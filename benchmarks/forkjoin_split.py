"""Predicted versus measured fork-join request latency for Gillis's channel and batch splits
on the local backend.

A conv model and a transformer (width enough for the split to matter) are compiled with
plans that run one heavy group on the master alone, split by channel over p = 2, 3, 4
workers, and split by batch over 2; each plan is served as local functions (the master and
one process per worker, a real S3 server, the tier's CPU share and bandwidth emulated).
``cost/gillis.py``'s latency is printed beside the median measured request latency. With a
calibration (``flatpack calibrate --target local``, run first unless ``--calibration`` names
one, as ``benchmarks/fidelity.py`` does) the compute is the tier's measured ratio to this
host and the communication delay the EMG fitted to the store's requests; without one
(``--no-calibration``) the catalog's compute model and the store's round trip measured at
deploy. Every model is profiled afresh (a cached profile may have been measured while the
host was busy).

The last two columns divide each plan's latency by the same model's and batch's latency on
the master alone: how much the split is predicted to gain or lose against how much it
does, which cancels the scale of the compute model (issue 19's calibration, not this file).

The host has 2 cores shared with whatever else runs: p workers plus the master contend for
them, which the model does not count, so the measured figures are noisy and the larger p
are pessimistic. The rows are evidence of what the split costs here, not of a cloud.

    python benchmarks/forkjoin_split.py [--requests 9] [--quick] [--calibration FILE | --no-calibration]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.profiler import CACHE_ENV
from flatpack.partitioner.cost import CommDelay, gillis
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload

if __package__ in (None, ""):  # ``python benchmarks/forkjoin_split.py`` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.fidelity import calibrate

MEMORY_MB = 1024


class WideConv(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.c1 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn = nn.BatchNorm2d(2 * width)
        self.c2 = nn.Conv2d(2 * width, width, 3, padding=1)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = self.c2(torch.relu(self.bn(self.c1(y))))
        return self.head(torch.relu(y).mean((2, 3)))


class MlpTransformer(nn.Module):
    def __init__(self, width: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        normed = self.ln1(x)
        x = x + self.attention(normed, normed, normed, need_weights=False)[0]
        x = x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
        return self.head(x)


@dataclass(frozen=True)
class Model:
    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[int], torch.Tensor]


MODELS = (
    Model("conv", WideConv, lambda batch: torch.randn(batch, 3, 32, 32)),
    Model("transformer", MlpTransformer, lambda batch: torch.randn(batch, 64, 256)),
)


def heaviest_group(problem) -> tuple[int, int]:
    """The channel-splittable group with the most serving time."""
    tier = problem.platform.tier(MEMORY_MB)

    def seconds(group: tuple[int, int]) -> float:
        batch = problem.workload.batch
        return sum(problem.layer_inference_seconds(i, tier, batch) for i in range(group[0], group[1] + 1))

    return max(problem.channel_groups, key=seconds)


def plan_around(group: tuple[int, int], layers: int, replicas: int, split: str | None) -> Plan:
    start, end = group
    stages = [StagePlan(a, b, MEMORY_MB, 1) for a, b in ((0, start - 1),) if a <= b]
    stages.append(StagePlan(start, end, MEMORY_MB, replicas, split=split if replicas > 1 else None))
    stages += [StagePlan(a, b, MEMORY_MB, 1) for a, b in ((end + 1, layers - 1),) if a <= b]
    return Plan(tuple(stages), layers, "benchmark")


def measure(model_spec: Model, batch: int, replicas: int, split: str, requests: int,
            calibration: Path | None = None) -> dict:
    torch.manual_seed(0)
    model = model_spec.build().eval()
    workload = Workload("infer", batch=batch, micro_batches=1)
    example = (model_spec.sample(batch),)
    base = flatpack.compile(model, example, target="local", profile=True, workload=workload, stages=1,
                            calibration=calibration)
    assert base.graph is not None and base.problem is not None, "compiled in this process, with a workload"
    group = heaviest_group(base.problem)
    plan = plan_around(group, len(base.graph.layers), replicas, split)
    compiled = flatpack.compile(model, example, target="local", profile=True, workload=workload, plan=plan,
                                calibration=calibration)
    assert compiled.problem is not None, "compiled with a workload"
    latencies = []
    with local.deploy(compiled) as deployment:
        t_lat = deployment.measure_latency()
        for index in range(requests + 2):
            x = model_spec.sample(batch)
            with torch.no_grad():
                torch.testing.assert_close(deployment.infer(x), model(x), rtol=1e-4, atol=1e-4)
            if index >= 2:      # the first requests load the functions' modules
                latencies.append(deployment.last_latency_s)
        deployment.stop_inference()
    # calibrated: the EMG flatpack calibrate fitted (gillis's default delay); else the round trip
    predicted = gillis.latency(compiled.problem, compiled.plan,
                               None if calibration is not None else CommDelay(t_lat)).latency_s
    measured = statistics.median(latencies)
    return {"model": model_spec.name, "batch": batch, "group": group, "split": split if replicas > 1 else "master",
            "p": replicas, "predicted": predicted, "measured": measured, "error": predicted / measured - 1,
            "t_lat": t_lat}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=9, help="measured requests per plan (after 2 warm-ups)")
    parser.add_argument("--quick", action="store_true", help="the conv model, master alone and p = 2 only")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a file from `flatpack calibrate --target local` (default: run one first)")
    parser.add_argument("--no-calibration", action="store_true",
                        help="predict from the catalog's compute model and the measured round trip")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flatpack-forkjoin-") as scratch:
        os.environ[CACHE_ENV] = str(Path(scratch) / "profiles")
        calibration = None if args.no_calibration else args.calibration or calibrate(Path(scratch) / "calibration.json")
        rows = run(args, calibration)
    report(rows, args.requests)


SHAPES = ((1, 1, "channel"), (1, 2, "channel"), (1, 3, "channel"), (1, 4, "channel"), (4, 1, "channel"),
          (4, 2, "channel"), (4, 2, "batch"))


def run(args: argparse.Namespace, calibration: Path | None) -> list[dict]:
    shapes, models = SHAPES, MODELS
    if args.quick:
        shapes, models = shapes[:2], MODELS[:1]
    rows = []
    for model_spec in models:
        for batch, replicas, split in shapes:
            row = measure(model_spec, batch, replicas, split, args.requests, calibration)
            rows.append(row)
            print(f"  {row['model']} batch {batch} {row['split']} p={replicas}: predicted "
                  f"{row['predicted'] * 1000:.1f} ms, measured {row['measured'] * 1000:.1f} ms", file=sys.stderr,
                  flush=True)
    return rows


def report(rows: list[dict], requests: int) -> None:
    print(f"torch {torch.__version__}; tier {MEMORY_MB} MB of the local platform; median of {requests} requests; "
          f"1-minute load average {os.getloadavg()[0]:.1f} at the end\n")
    print("| model | batch | group (layers) | split | p | predicted ms | measured ms | error | "
          "predicted / master alone | measured / master alone |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    alone = {(row["model"], row["batch"]): row for row in rows if row["p"] == 1}
    for row in rows:
        base = alone.get((row["model"], row["batch"]))
        ratios = (f"{row['predicted'] / base['predicted']:.2f} | {row['measured'] / base['measured']:.2f}"
                  if base else "– | –")
        print(f"| {row['model']} | {row['batch']} | {row['group'][0]}..{row['group'][1]} | {row['split']} | "
              f"{row['p']} | {row['predicted'] * 1000:.1f} | {row['measured'] * 1000:.1f} | "
              f"{row['error'] * 100:+.1f}% | {ratios} |")
    errors = [abs(row["error"]) for row in rows]
    print(f"\nmean |error| {statistics.mean(errors) * 100:.1f}% over {len(rows)} plans "
          f"(median {statistics.median(errors) * 100:.1f}%)")


if __name__ == "__main__":
    main()
