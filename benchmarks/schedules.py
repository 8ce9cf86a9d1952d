"""The pipeline schedules on the local backend (issues 22 and 43): FuncPipe's synchronous
schedule, PipeDream's 1F1B with a flush per iteration, PipeDream's asynchronous 1F1B (no
flush, weight stashing) with replicated stages as 1F1B-RR, and PipeDream-2BW (two weight
versions, one step per iteration on the previous version's gradients), all on the same plan
of one straight pipeline of wide layers with per-stage replica degrees (``--stage-replicas``,
default 1,2,1), learning a teacher's labels.

    python benchmarks/schedules.py                      # 3 stages 1,2,1, 12 iterations (~4 min)
    python benchmarks/schedules.py --iterations 8 --width 512 --degrees 1,2

Per schedule, one train() call over the same batches from the same weights (the user's
Python path: ``flatpack.compile`` with fixed cuts and degrees, ``local.deploy``,
``Deployment.train``): the optimizer steps of the busiest stage, samples/s (the call's
samples over its wall time, cold start included), the median iteration time after the first
two, each stage's weight copies as the schedule keeps them (``Schedule.weight_versions`` of
the micro-batches in flight, times the stage's weight bytes: what the cost model prices),
each stage's peak resident memory (replica 0's VmHWM: torch, weights, optimizer state,
activations and stashed versions), the training loss of the last iteration and the held-out
loss after the run (two teacher batches through the inference path).

The statistical-efficiency caveat: the losses are after the same samples, not the same
optimizer steps or the same arithmetic. sync and 1f1b compute the same gradient (one step
per global batch); 1f1b-async steps a stage of d replicas M/d times per iteration on
gradients up to S - s - 1 micro-batches stale; 2bw steps once per iteration on a gradient one
iteration stale. One repeat per schedule, in sequence on one shared machine: read ratios,
not absolutes.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import flatpack
from flatpack import schedules
from flatpack.backends import local
from flatpack.evaluation import evaluate
from flatpack.partitioner.cost.pipedream import versions_in_flight
from flatpack.partitioner.solvers.wrappers import FixedCuts, WithTiers
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.timeline import summarize

SCHEDULES = ["sync", "1f1b", "1f1b-async", "2bw"]


def wide_mlp(width: int, layers: int, classes: int) -> nn.Module:
    """Wide linear layers (4·width² bytes of weights each): weight versions show in memory."""
    body = [module for _ in range(layers) for module in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(width, classes))


def teacher_batches(width: int, classes: int, batch: int, count: int, seed: int) -> list:
    """Inputs with the labels a fixed random linear teacher gives them: a task the model can learn."""
    teacher = torch.randn(width, classes, generator=torch.Generator().manual_seed(99))
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        inputs = torch.randn(batch, width, generator=generator)
        batches.append((inputs, (inputs @ teacher).argmax(dim=1)))
    return batches


def weight_copies_mib(compiled: flatpack.Compiled, schedule: str) -> list[float]:
    """Each stage's weight copies under ``schedule`` (its versions times its weight bytes), MiB."""
    problem, plan = compiled.problem, compiled.plan
    assert problem is not None, "flatpack.compile keeps the problem it solved"
    versions = [schedules.get(schedule).weight_versions(versions_in_flight(plan, s)) for s in range(len(plan.stages))]
    return [count * sum(layer.param_bytes for layer in problem.chain[stage.start:stage.end + 1]) / 2**20
            for count, stage in zip(versions, plan.stages)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--degrees", default="1,2,1", help="each stage's replicas (the stage count follows)")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    degrees = tuple(int(d) for d in args.degrees.split(","))
    torch.set_num_threads(1)
    classes = 10
    torch.manual_seed(0)
    model = wide_mlp(args.width, args.layers, classes)
    batches = teacher_batches(args.width, classes, args.batch, args.iterations, seed=1)
    held_out = teacher_batches(args.width, classes, args.batch, 2, seed=2)
    solver = WithTiers(FixedCuts(stages=len(degrees), stage_replicas=degrees))
    compiled = flatpack.compile(model, (batches[0][0],), solver=solver)
    optimizer = OptimizerSpec("adam", args.lr)
    weights_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    print(f"{len(degrees)} stages x replicas {args.degrees}, {weights_mib:.0f} MiB of weights, batch {args.batch} in "
          f"{args.micro_batches} micro-batches, {args.iterations} iterations, Adam lr {args.lr}\n")
    print("schedule | optimizer steps | samples/s | median iteration ms | weight copies MiB per stage | "
          "peak MiB per stage | last-iteration loss | held-out loss")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    for schedule in SCHEDULES:
        # a fresh deployment per schedule: every run starts from the compiled weights
        with local.deploy(compiled) as deployment:
            result = deployment.train(batches, iterations=args.iterations, optimizer=optimizer,
                                      micro_batches=args.micro_batches, schedule=schedule)
            held = evaluate(deployment.infer, held_out, "cross_entropy", iteration=args.iterations)
        peaks = " / ".join(f"{result.peak_bytes.get(f's{stage}r0', 0) / 2**20:.0f}" for stage in range(len(degrees)))
        copies = " / ".join(f"{mib:.0f}" for mib in weight_copies_mib(compiled, schedule))
        steps = args.iterations * max(schedules.get(schedule).optimizer_steps(args.micro_batches, d) for d in degrees)
        iteration_s = summarize(result.events, skip_first=2).iteration_s   # the period, warm-up left out
        if iteration_s is None:
            raise SystemExit(f"{schedule}: no iteration was timed; raise --iterations")
        print(f"{schedule} | {steps} | {result.samples_per_s:.1f} | {iteration_s * 1000:.1f} | {copies} | "
              f"{peaks} | {result.losses[-1]:.4f} | {held.loss:.4f}")


if __name__ == "__main__":
    main()
