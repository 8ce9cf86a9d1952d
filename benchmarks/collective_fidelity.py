"""Predicted vs measured gradient all-reduce of gpu-container runs: Hydrozoa's T^(D) with the
α, β and D that ``flatpack calibrate --target gpu-container`` fitted, and with the catalog's
figures (1 Gbit/s, α = β = 0), against the all-reduce the ranks of a real run time.

    python benchmarks/collective_fidelity.py                         # gloo on the CPU, 2 replicas
    python benchmarks/collective_fidelity.py --device cuda --replicas 2,3,4   # gloo ranks sharing one GPU
    python benchmarks/collective_fidelity.py --backend nccl --device cuda     # one GPU per rank

What runs. First the calibration (``calibrate_collective``: the probe ranks time messages and
all-reduces at 4 KB to 64 MB and the ring is fitted to them). Then, for each model size and
replica count, a one-stage plan of A replicas of an MLP (``--widths``: square layers of that
width, so the gradients are 4·layers·width² bytes) is deployed with the same backend and
device and trained for ``--iterations`` iterations on synthetic batches. The measured
all-reduce is each iteration's ``sync`` task (flatten, all-reduce, unflatten) of the replica
that reached it last (the others' include waiting for it), median over the iterations after
``--warmup``. Predicted: ``measured_terms(fit).seconds(|p|, A, D)``, which is what Hydrozoa's
model (``cost/hydrozoa.py``) charges the shard: the ring equation with the fitted α, β, δ, γ,
anchored to the calibration's measured all-reduces; the "equation" column is the fitted
equation alone (``equation_seconds``), the catalog column the ring at the catalog's 1 Gbit/s
with no overheads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import flatpack
from flatpack.backends import gpu_container
from flatpack.backends.collective_calibration import calibrate_collective, collective_summary
from flatpack.partitioner.cost.collectives import measured_terms, ring_allreduce_seconds
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.table import format_table
from flatpack.units import GBIT_S

OPTIMIZER = {"name": "sgd", "lr": 0.01}
LAYERS = 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--replicas", default="2", help="replica counts A to run, comma-separated")
    parser.add_argument("--widths", default="256,512,1024,2048",
                        help=f"MLP widths ({LAYERS} square layers each), comma-separated")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calibration-ranks", type=int, default=4,
                        help="the probe's ranks: all-reduces among 2 to this many are measured and fitted")
    return parser.parse_args(argv)


def mlp(width: int) -> nn.Module:
    return nn.Sequential(*(module for _ in range(LAYERS) for module in (nn.Linear(width, width), nn.ReLU())),
                         nn.Linear(width, 10))


def measured_sync_s(model: nn.Module, width: int, replicas: int, args: argparse.Namespace) -> float:
    example = (torch.randn(2, width),)
    base = flatpack.compile(model, example, stages=1, target="gpu-container")
    plan = Plan((StagePlan(0, base.plan.num_layers - 1, None, replicas),), base.plan.num_layers,
                micro_batches=replicas)
    compiled = flatpack.compile(model, example, plan=plan, target="gpu-container")
    with gpu_container.deploy(compiled, backend=args.backend, device=args.device) as deployment:
        result = deployment.train(None, iterations=args.iterations, batch=args.batch, micro_batches=replicas,
                                  warmup=args.warmup, optimizer=OPTIMIZER, timeout_s=540)
    last_to_arrive: dict[int, float] = {}
    for event in result.events:
        if event.kind == "sync" and event.iteration >= args.warmup:
            seconds = event.end - event.start
            last_to_arrive[event.iteration] = min(last_to_arrive.get(event.iteration, seconds), seconds)
    if not last_to_arrive:
        sys.exit("the run recorded no sync task after the warm-up: raise --iterations")
    return statistics.median(last_to_arrive.values())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        calibration = calibrate_collective("gpu-container", out=Path(scratch) / "calibration.json",
                                           ranks=args.calibration_ranks, backend=args.backend, device=args.device,
                                           report=print)
    fit = calibration.collective_fit
    assert fit is not None
    print(collective_summary(fit))
    terms = measured_terms(fit)
    print("sizes (bytes):       " + "  ".join(f"{n:>10}" for n in fit.sizes_bytes))
    print("message (ms):        " + "  ".join(f"{t * 1e3:>10.3f}" for t in fit.point_to_point_s))
    for count, seconds in sorted(fit.all_reduce_s.items()):
        print(f"all-reduce, {count} (ms): " + "  ".join(f"{t * 1e3:>10.3f}" for t in seconds))
    rows, errors, equation_errors, catalog_errors = [], [], [], []
    for replicas in (int(part) for part in args.replicas.split(",")):
        for width in (int(part) for part in args.widths.split(",")):
            torch.manual_seed(0)
            model = mlp(width)
            gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            predicted = terms.seconds(gradient_bytes, replicas, fit.bandwidth_bytes_s)
            equation = terms.equation_seconds(gradient_bytes, replicas, fit.bandwidth_bytes_s)
            catalog = ring_allreduce_seconds(gradient_bytes, replicas, GBIT_S)
            measured = measured_sync_s(model, width, replicas, args)
            errors.append(abs(predicted - measured) / measured)
            equation_errors.append(abs(equation - measured) / measured)
            catalog_errors.append(abs(catalog - measured) / measured)
            rows.append((f"mlp {width}", str(replicas), f"{gradient_bytes / 2**20:.1f}", f"{measured * 1e3:.2f}",
                         f"{predicted * 1e3:.2f}", f"{(predicted - measured) / measured:+.1%}",
                         f"{equation * 1e3:.2f}", f"{(equation - measured) / measured:+.1%}",
                         f"{catalog * 1e3:.2f}", f"{(catalog - measured) / measured:+.1%}"))
    print()
    print(format_table(["model", "A", "gradients MiB", "measured ms", "calibrated ms", "error", "equation ms",
                        "error", "catalog ms", "error"], rows, numeric=set(range(1, 10))))
    print(f"\nall-reduce MAPE: calibrated {statistics.mean(errors):.1%}, the fitted equation alone "
          f"{statistics.mean(equation_errors):.1%}, catalog (1 Gbit/s, alpha = beta = 0) "
          f"{statistics.mean(catalog_errors):.1%}; {args.backend} on {args.device} ({fit.device_name}), "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
