"""Mixed precision and recomputation, measured (issue 22, items 3 and 4).

Model: a small transformer encoder (an input projection, L ``nn.TransformerEncoderLayer``
blocks of width D with dropout, a classifier), cut by flatpack's dp solver or into two
balanced stages, trained on the local backend (one process per stage, the local S3 server
in between; 2 shared cores, so times are noisy: medians of the iterations after the first).

1. bf16 and fp16 against fp32, the same plan and batches: the bytes the stages move through the store
   per iteration (activations forward, their gradients back; measured from the upload
   events, and as the cost model predicts them), the median iteration time, the loss after
   the same samples; then what dp plans for each on AWS Lambda from the same profile.
2. Recomputation against keeping the activations: the largest micro-batch (samples) for which
   dp finds a plan on the smallest tier alone (512 MB, of which the runtime's 256 MB), by the
   cost model; then, at ``--measure-at`` samples per micro-batch, dp's plan trained with its
   stages recomputing and keeping their activations: each stage's predicted memory need
   against its function's measured peak (VmHWM, what Lambda reports as Max Memory Used).

    PYTHONPATH=. python benchmarks/precision_knobs.py [--width 128] [--layers 4] [--seq 64] [--no-recompute]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections import defaultdict

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.errors import PlanError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.objective import Weights
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import Goal
from flatpack.partitioner.solvers.dp import Dp
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions
from flatpack.stage.settings import PRECISIONS
from flatpack.runtime.s3server import LocalS3Server
from flatpack.units import MIB

SMALLEST_TIER = 512


class Encoder(nn.Module):
    def __init__(self, width: int, layers: int, features: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
                                    for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def batches(count: int, batch: int, seq: int) -> list:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, seq, 32, generator=generator), torch.randint(0, 10, (batch,), generator=generator))
            for _ in range(count)]


def per_iteration(result: local.TrainResult) -> tuple[float, float]:
    """Median seconds and bytes moved between stages per iteration, after the first."""
    spans: dict[int, list[float]] = defaultdict(list)
    moved: dict[int, int] = defaultdict(int)
    for event in result.events:
        if event.kind == "load":
            continue
        spans[event.iteration] += [event.start, event.end]
        if event.kind == "upload" and event.micro_batch is not None:
            moved[event.iteration] += event.nbytes
    later = sorted(spans)[1:] or sorted(spans)
    return (statistics.median(max(spans[i]) - min(spans[i]) for i in later),
            statistics.median(moved[i] for i in later))


def train(server, compiled, data, **options) -> local.TrainResult:
    with local.deploy(compiled, store_url=server.url(""), env=server.env()) as deployment:
        return deployment.train(data, iterations=len(data), optimizer={"name": "adam", "lr": 1e-3}, **options)


def plan_at(problem: Problem, size: int, micro_batches: int, recompute: str) -> tuple[Problem, Plan | None]:
    """dp's cheapest plan on the smallest tier alone at ``size`` samples per micro-batch, or None."""
    workload = Workload("train", batch=size * micro_batches, micro_batches=micro_batches, optimizer="adam",
                        recompute=recompute)
    candidate = dataclasses.replace(problem, workload=workload,
                                    options=problem.options.with_changes(memory_mb=(SMALLEST_TIER,), replicas=(1,)))
    try:
        return candidate, Dp().solve(candidate, Goal(Weights(1, 0)))
    except PlanError:
        return candidate, None


def largest_micro_batch(problem: Problem, micro_batches: int, recompute: str,
                        limit: int = 1 << 14) -> tuple[int, Plan | None]:
    """The most samples per micro-batch for which dp finds a plan on the smallest tier
    (doubling, then bisection: a stage's memory need grows with the micro-batch)."""
    low, high = 0, 1
    while high <= limit and plan_at(problem, high, micro_batches, recompute)[1] is not None:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        fits = plan_at(problem, middle, micro_batches, recompute)[1] is not None
        low, high = (middle, high) if fits else (low, middle)
    return low, plan_at(problem, low, micro_batches, recompute)[1] if low else None


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--measure-at", type=int, default=64, help="samples per micro-batch of the measured runs")
    parser.add_argument("--no-recompute", action="store_true", help="measure the precisions only (part 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Encoder(args.width, args.layers)
    data = batches(args.iterations, args.batch, args.seq)
    micro = args.batch // args.micro_batches
    profile = ProfileOptions(batch_sizes=(max(1, micro // 2), micro), repeats=3)
    workload = Workload("train", batch=args.batch, micro_batches=args.micro_batches, optimizer="adam")
    base = flatpack.compile(model, (data[0][0],), stages=2, profile=profile, workload=workload)
    assert base.problem is not None, "compiled with a workload"
    plan = dataclasses.replace(base.plan, micro_batches=args.micro_batches)
    print(f"model: {args.layers} encoder layers, width {args.width}, sequence {args.seq}; batch {args.batch} in "
          f"{args.micro_batches} micro-batches; 2 stages, layers {plan.ranges}; {args.iterations} iterations, Adam")
    server = LocalS3Server()
    server.start()
    try:
        print("\n1. bf16 and fp16 vs fp32 (same plan, same batches; fp16 with GradScaler's default loss scaling)")
        print(f"{'precision':>9}  {'moved/iter (measured)':>22}  {'predicted':>10}  {'iteration ms':>12}  "
              f"{'loss after':>10}")
        compiled = flatpack.compile(model, (data[0][0],), plan=plan)
        for precision in PRECISIONS:
            result = train(server, compiled, data, precision=precision)
            seconds, moved = per_iteration(result)
            problem = dataclasses.replace(base.problem, workload=dataclasses.replace(workload, precision=precision))
            predicted = 2 * args.micro_batches * sum(problem.boundary_bytes(cut, micro) for cut in plan.cuts)
            print(f"{precision:>9}  {moved / MIB:>18.2f} MiB  {predicted / MIB:>6.2f} MiB  {seconds * 1000:>12.0f}  "
                  f"{result.losses[-1]:>10.4f}")
        lambda_model = flatpack.compile(model, (data[0][0],), target="aws-lambda", solver="dp", profile=profile,
                                        workload=workload, replicas=(1,))
        print("   dp on aws-lambda from the same profile (fastest plan, one replica):")
        for precision in PRECISIONS:
            assert lambda_model.problem is not None, "compiled with a workload"
            problem = dataclasses.replace(lambda_model.problem,
                                          workload=dataclasses.replace(workload, precision=precision))
            chosen = Dp().solve(problem, Goal(Weights(0, 1)))
            if chosen is None:
                print(f"   {precision}: dp found no plan")
                continue
            cost = funcpipe.iteration(problem, chosen)
            print(f"   {precision}: {len(chosen.stages)} stages {chosen.ranges} on {list(chosen.memory_mb)} MB: "
                  f"predicted {cost.iteration_s * 1000:.0f} ms, ${cost.dollars_per_iteration:.3g} per iteration")
        if args.no_recompute:
            return

        print(f"\n2. recomputation: the largest micro-batch dp fits on the {SMALLEST_TIER} MB tier alone "
              f"(M = {args.micro_batches}, cost model)")
        largest = {}
        for recompute in ("never", "auto"):
            size, chosen = largest_micro_batch(base.problem, args.micro_batches, recompute)
            largest[recompute] = (size, chosen)
            stages = ([f"{s.start}..{s.end}{' R' if s.recompute else ''}" for s in chosen.stages] if chosen else [])
            print(f"   recompute {recompute:>5}: {size:>3} samples per micro-batch; plan {stages}")
        size = args.measure_at
        problem, chosen = plan_at(base.problem, size, args.micro_batches, "auto")
        if chosen is None or not any(stage.recompute for stage in chosen.stages):
            return
        print(f"   measured at {size} samples per micro-batch on dp's plan for recompute auto, with its stages "
              "recomputing and keeping their activations (tiers not enforced): the cost model's need of each "
              "stage's function against its peak memory (VmHWM)")
        sized = batches(2, size * args.micro_batches, args.seq)
        for recompute in (True, False):
            stages = tuple(dataclasses.replace(stage, recompute=recompute and stage.recompute)
                           for stage in chosen.stages)
            plan = dataclasses.replace(chosen, stages=stages)
            cost = funcpipe.iteration(problem, plan)
            unenforced = dataclasses.replace(plan, stages=tuple(dataclasses.replace(stage, memory_mb=None)
                                                                for stage in stages))
            result = train(server, flatpack.compile(model, (sized[0][0],), plan=unenforced), sized)
            pairs = ", ".join(f"{cost.stages[index].memory_needed_bytes / MIB:.0f}/"
                              f"{result.peak_bytes[f's{index}r0'] / MIB:.0f}" for index in range(len(stages)))
            print(f"   {'recompute' if recompute else 'keep     '}: predicted/measured MiB per stage {pairs}; "
                  f"iteration {per_iteration(result)[0] * 1000:.0f} ms")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
