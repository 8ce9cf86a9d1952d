"""Training throughput of the gpu-container backend (Hydrozoa's setting: stage replicas as
``torch.distributed`` ranks that send each other activations and gradients directly) next
to the same model trained in one process on one device.

    python benchmarks/gpu_pipeline.py                                  # resnet34 (87 MB of weights), auto backend
    python benchmarks/gpu_pipeline.py --backend nccl --stages 2 --replicas 1
    python benchmarks/gpu_pipeline.py --backend gloo --device cpu --stages 2 --replicas 2,1 --batch 16
    python benchmarks/gpu_pipeline.py --model resnet34 --size tiny --iterations 4   # a quick look on a CPU

What runs. The zoo model (``flatpack.zoo.build``; default ResNet-34, 21.8M parameters =
87 MB in fp32) is compiled into ``--stages`` stages by the ``balanced`` solver and given
``--replicas`` (one number for every stage, or one per stage). ``deploy`` writes what the
ranks load (the flatpack source and the stages) and ``train(None, batch=...)`` starts one
process per rank on 127.0.0.1, each training on synthetic batches generated from the stage
manifests' shapes (so the data path costs nothing). A rank's seconds per iteration are the
gaps between its iteration ends, and the pipeline's samples/s is the global batch over the slowest rank's median after
``--warmup`` iterations. The single-process row trains the original model on the same
device with the same optimizer (SGD with momentum) and batch, timed the same way.

What one GPU allows. NCCL needs a distinct GPU per rank (it refuses two ranks on one
device), so with ``--backend nccl`` a plan of more ranks than GPUs cannot run. The
benchmark then says so, runs NCCL on the largest plan the GPUs allow (1 stage × 1 replica
on one GPU: the backend's overhead over plain PyTorch, with no transfer at all) and runs the
requested plan with gloo on the GPU: every rank computes on the shared GPU and the
activations and gradients travel through the host (device → CPU → gloo over TCP → CPU →
device). That row measures the pipeline's schedule and transfers, not what NCCL across
several GPUs would give; the GPUs time-share among the ranks.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time

import torch
from torch import nn

import flatpack
from flatpack import zoo
from flatpack.backends import gpu_container
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.optim import OptimizerSpec
from flatpack.table import format_table

COMPILE_BATCH = 2     # the example batch the model is traced with; runs scale it to --batch
# both the single-process baseline and the pipeline train with it
OPTIMIZER = {"name": "sgd", "lr": 0.01, "momentum": 0.9}


@dataclasses.dataclass
class Row:
    what: str
    backend: str
    device: str
    ranks: str
    samples_per_s: float
    note: str = ""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="resnet34", help="a flatpack.zoo model (default resnet34)")
    parser.add_argument("--size", default="full", choices=zoo.SIZES)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="where ranks compute (default: cuda for nccl, "
                                                                   "else cpu)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--replicas", default="1", help="replicas of every stage (N) or of each (N,N,...)")
    parser.add_argument("--batch", type=int, default=32, help="global batch per iteration")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="iterations left out of the medians")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds one pipelined run may take")
    return parser.parse_args(argv)


def degrees_of(text: str, stages: int) -> tuple[int, ...]:
    values = tuple(int(part) for part in text.split(","))
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        sys.exit(f"--replicas lists {len(values)} degrees for {stages} stages")
    return values


def compile_plan(model: nn.Module, inputs: tuple, degrees: tuple[int, ...], micro_batches: int) -> flatpack.Compiled:
    base = flatpack.compile(model, inputs, stages=len(degrees), target="gpu-container")
    plan = Plan(tuple(StagePlan(start, end, None, degree) for (start, end), degree in zip(base.plan.ranges, degrees)),
                base.plan.num_layers, micro_batches=micro_batches)
    return flatpack.compile(model, inputs, plan=plan, target="gpu-container")


def single_process(model: nn.Module, inputs: tuple, args: argparse.Namespace, device: torch.device) -> float:
    """Samples/s of plain PyTorch training of the whole model on ``device``."""
    model = copy.deepcopy(model).to(device).eval()   # the model itself stays on the CPU for compiling
    optimizer = OptimizerSpec.of(OPTIMIZER).build(model.parameters())
    shape = (args.batch, *inputs[0].shape[1:])
    x = torch.randn(shape, device=device)
    with torch.no_grad():
        classes = model(x[:1]).shape[1]
    model.train()
    target = torch.randint(0, classes, (args.batch,), device=device)
    seconds = []
    # at least five timed iterations: one process has no start-up to hide, but its first steps are slow too
    for _ in range(args.warmup + max(5, args.iterations - args.warmup)):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), target).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - started)
    return args.batch / statistics.median(seconds[args.warmup:] or seconds)


def pipelined(compiled: flatpack.Compiled, args: argparse.Namespace, backend: str, device: str) -> tuple[float, float]:
    """(samples/s in steady state, wall seconds of the whole run including process start)."""
    with gpu_container.deploy(compiled, backend=backend, device=device) as deployment:
        result = deployment.train(None, iterations=args.iterations, batch=args.batch,
                                  micro_batches=args.micro_batches, warmup=args.warmup,
                                  optimizer=OPTIMIZER, timeout_s=args.timeout)
        return deployment.steady_samples_per_s(), result.wall_s


def describe(degrees: tuple[int, ...]) -> str:
    return f"{len(degrees)} stages x {list(degrees)} = {sum(degrees)} ranks"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --backend gloo --device cpu")
    degrees = degrees_of(args.replicas, args.stages)
    model, inputs = zoo.build(args.model, args.size, COMPILE_BATCH)
    parameters = sum(p.numel() for p in model.parameters())
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    name = torch.cuda.get_device_name(0) if gpus else "no GPU"
    print(f"{args.model} ({args.size}): {parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MiB fp32), "
          f"batch {args.batch} in {args.micro_batches} micro-batches, {args.iterations} iterations "
          f"(median after {args.warmup}); torch {torch.__version__}, {gpus} GPU(s) ({name})")

    rows = [Row("single process", "-", device, "1",
                single_process(model, inputs, args, torch.device("cuda" if device == "cuda" else "cpu")))]
    plans: list[tuple[tuple[int, ...], str, str, str]] = []
    if args.backend == "nccl" and sum(degrees) > gpus:
        print(f"\nNCCL needs one GPU per rank and refuses two ranks on one device: {describe(degrees)} cannot run "
              f"on {gpus} GPU(s). Running NCCL on 1 stage x 1 replica instead (no transfers: the backend's overhead), "
              f"and the requested plan with gloo, its ranks sharing the GPU and moving tensors through the host.")
        plans.append(((1,), "nccl", "cuda", "the most NCCL ranks one GPU holds"))
        plans.append((degrees, "gloo", "cuda", "ranks share the GPU; transfers via host + TCP"))
    else:
        plans.append((degrees, args.backend, device, ""))
    for plan_degrees, backend, plan_device, note in plans:
        compiled = compile_plan(model, inputs, plan_degrees, args.micro_batches)
        try:
            rate, wall = pipelined(compiled, args, backend, plan_device)
        except flatpack.FlatpackError as err:
            print(f"\n{describe(plan_degrees)} with {backend} failed: {err}")
            continue
        rows.append(Row(f"gpu-container {describe(plan_degrees)}", backend, plan_device, str(sum(plan_degrees)), rate,
                        f"{note + '; ' if note else ''}run {wall:.1f} s with start-up"))

    baseline = rows[0].samples_per_s
    print()
    print(format_table(["configuration", "backend", "device", "ranks", "samples/s", "vs single", "note"],
                       [(row.what, row.backend, row.device, row.ranks, f"{row.samples_per_s:.1f}",
                         f"{row.samples_per_s / baseline:.2f}x", row.note) for row in rows],
                       numeric={3, 4, 5}))


if __name__ == "__main__":
    main()
