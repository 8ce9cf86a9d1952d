"""The pipeline schedules on the local backend (issue 22, item 6): FuncPipe's synchronous
schedule, PipeDream's 1F1B with a flush per iteration, and PipeDream's asynchronous 1F1B
(no flush, an optimizer step per micro-batch, weight stashing), with and without vertical
sync, on one straight pipeline of wide layers (one replica per stage: the asynchronous
schedule's condition) learning a teacher's labels.

    python benchmarks/schedules.py                      # 3 stages, 12 iterations (~3 min)
    python benchmarks/schedules.py --iterations 6 --stages 2

Per schedule, one train() call over the same batches from the same weights: samples/s (the
call's samples over its wall time, cold start included), the median iteration time after the
first two, each stage's peak resident memory (the worker's VmHWM: the process with torch, its
weights, optimizer state, activations and, asynchronously, its stashed weight versions), the
training loss of the last iteration and the held-out loss after the run (two teacher batches
through the inference path).

The statistical-efficiency caveat: the losses are after the same samples, not the same
optimizer steps or the same arithmetic. sync and 1f1b compute the same gradient (one step
per global batch of B samples); 1f1b-async takes M steps of B/M samples per iteration, each
on a gradient computed with weights up to S - s - 1 steps old (stale, though consistent
within a stage thanks to stashing), at the same learning rate. Its loss after N samples can
be lower (more, smaller steps) or higher (staleness) than the flushed schedules'; neither is
the same training, and one seed on one model says little. One repeat per schedule, in
sequence on one shared machine: read ratios, not absolutes.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.evaluation import evaluate
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.timeline import summarize

SCHEDULES = [("sync", "sync", False), ("1f1b", "1f1b", False), ("1f1b-async", "1f1b-async", False),
             ("1f1b-async + vertical sync", "1f1b-async", True)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    classes = 10
    torch.manual_seed(0)
    model = wide_mlp(args.width, args.layers, classes)
    batches = teacher_batches(args.width, classes, args.batch, args.iterations, seed=1)
    held_out = teacher_batches(args.width, classes, args.batch, 2, seed=2)
    compiled = flatpack.compile(model, (batches[0][0],), stages=args.stages)
    optimizer = OptimizerSpec("adam", args.lr)
    weights_mib = sum(p.numel() * 4 for p in model.parameters()) / 2**20
    print(f"{args.stages} stages x 1 replica, {weights_mib:.0f} MiB of weights, batch {args.batch} in "
          f"{args.micro_batches} micro-batches, {args.iterations} iterations, Adam lr {args.lr}\n")
    print("schedule | optimizer steps | samples/s | median iteration ms | peak MiB per stage | "
          "last-iteration loss | held-out loss")
    print("--- | --- | --- | --- | --- | --- | ---")
    for label, schedule, vertical in SCHEDULES:
        # a fresh deployment per schedule: every run starts from the compiled weights
        with local.deploy(compiled) as deployment:
            result = deployment.train(batches, iterations=args.iterations, optimizer=optimizer,
                                      micro_batches=args.micro_batches, schedule=schedule, vertical_sync=vertical)
            held = evaluate(deployment.infer, held_out, "cross_entropy", iteration=args.iterations)
        peaks = " / ".join(f"{result.peak_bytes.get(f's{stage}r0', 0) / 2**20:.0f}" for stage in range(args.stages))
        steps = args.iterations * (args.micro_batches if schedule == "1f1b-async" else 1)
        iteration_s = summarize(result.events, skip_first=2).iteration_s   # the period, warm-up left out
        if iteration_s is None:
            raise SystemExit(f"{label}: no iteration was timed; raise --iterations")
        print(f"{label} | {steps} | {result.samples_per_s:.1f} | {iteration_s * 1000:.1f} | "
              f"{peaks} | {result.losses[-1]:.4f} | {held.loss:.4f}")


if __name__ == "__main__":
    main()
