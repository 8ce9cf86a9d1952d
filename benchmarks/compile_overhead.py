"""Compile time and in-process staging overhead on the built-in examples.

Prints, per model: the frontend, layers after the default passes, compile seconds (median
of --repeats), bytes crossing the cuts of a 3-stage balanced plan, and the forward time of
the original model versus the 3 stages chained in-process (median of --runs, same process,
interleaved), with their ratio. Run: python benchmarks/compile_overhead.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flatpack
from flatpack.cli import human_bytes
from flatpack.examples import EXAMPLES


def call(module, inputs):
    return module(**inputs) if isinstance(inputs, dict) else module(*inputs)


def median_seconds(fn, runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, stages={args.stages}")
    header = ("model", "frontend", "layers", "compile s", "cut bytes", "orig fwd ms", "staged fwd ms", "ratio")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    for name in args.models:
        model, inputs = EXAMPLES[name]()
        builds: list[flatpack.Compiled] = []  # the latest build only

        def build() -> None:
            builds[:] = [flatpack.compile(model, inputs, stages=args.stages)]

        compile_s = median_seconds(build, args.repeats)
        compiled = builds[-1]
        graph = compiled.graph
        assert graph is not None, "a model compiled in this process keeps its layer graph"
        staged = compiled.as_module()
        cut_bytes = sum(graph.boundary(cut).nbytes for cut in compiled.plan.cuts)
        original_ms, staged_ms = [], []
        with torch.no_grad():
            call(model, inputs)  # warm-up
            call(staged, inputs)
            for _ in range(args.runs):
                original_ms.append(median_seconds(lambda: call(model, inputs), 1) * 1e3)
                staged_ms.append(median_seconds(lambda: call(staged, inputs), 1) * 1e3)
        orig, stag = statistics.median(original_ms), statistics.median(staged_ms)
        print(f"{name} | {compiled.frontend} | {len(graph.layers)} | {compile_s:.2f} | "
              f"{human_bytes(cut_bytes)} | {orig:.2f} | {stag:.2f} | {stag / orig:.2f}")


if __name__ == "__main__":
    main()
