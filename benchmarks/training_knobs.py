"""What the training knobs cost on the local backend (issue 22, items 1, 2, 5): the same
2-stage pipeline of zoo-free example models trained with Adam, then AdamW with the no-decay
group and a cosine schedule after a warm-up, then with global-norm clipping (one 8-byte store
object per stage and iteration, every stage waiting for every other's), then with
accumulation over 2 iterations; and a run evaluated every N iterations (calls of N, the
held-out batches through the inference path) against the same run without.

    python benchmarks/training_knobs.py                 # mlp and tiny-resnet, 12 iterations (~4 min)
    python benchmarks/training_knobs.py --iterations 6 --models mlp

Per configuration: the median iteration time over the iterations after the first two (an
iteration's end is its last task's end in the timeline; the first pays the cold start), and
for the evaluation rows the wall time of the whole train (and evaluate) sequence. One repeat
per configuration, configurations in sequence on one machine: read ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import time

import torch

import flatpack
from flatpack.backends import local
from flatpack.evaluation import evaluate
from flatpack.examples import EXAMPLES
from flatpack.job import synthetic_batches, without_dropout
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec
from flatpack.runtime.timeline import summarize


def configurations(iterations: int) -> dict[str, OptimizerSpec]:
    schedule = ScheduleSpec("cosine", warmup=2).with_length(iterations)
    adamw = OptimizerSpec("adamw", 1e-3, {"weight_decay": 0.01}, no_decay_bias_norm=True, schedule=schedule)
    return {"adam": OptimizerSpec("adam", 1e-3),
            "adamw + no-decay + cosine warm-up": adamw,
            "  + clip-grad-norm 1.0": OptimizerSpec(**{**adamw.__dict__, "clip_grad_norm": 1.0}),
            "  + clip + accumulate 2": OptimizerSpec(**{**adamw.__dict__, "clip_grad_norm": 1.0, "accumulate": 2,
                                                        "schedule": schedule.with_length(iterations // 2)})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "tiny-resnet"], choices=sorted(EXAMPLES))
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("model | configuration | median iteration ms | vs adam")
    print("--- | --- | --- | ---")
    walls = []
    for name in args.models:
        model, example = EXAMPLES[name]()
        without_dropout(model)
        inputs = example if isinstance(example, tuple) else (example,)
        batches, loss = synthetic_batches(model, inputs, 16, args.iterations, seed=0)
        held_out, _ = synthetic_batches(model, inputs, 16, 2, seed=1)
        compiled = flatpack.compile(model.train(), batches[0][0], stages=2)
        baseline = None
        with local.deploy(compiled) as deployment:
            # adam again last: how far the machine drifted over the rows
            for label, spec in [*configurations(args.iterations).items(),
                                ("adam (again)", configurations(args.iterations)["adam"])]:
                result = deployment.train(batches, iterations=args.iterations, optimizer=spec, loss=loss,
                                          micro_batches=4)
                seconds = summarize(result.events, skip_first=2).iteration_s
                if seconds is None:
                    raise SystemExit(f"{name} | {label}: no iteration was timed; raise --iterations")
                baseline = baseline or seconds
                print(f"{name} | {label} | {seconds * 1000:.1f} | {seconds / baseline:.2f}")
            spec = configurations(args.iterations)["  + clip-grad-norm 1.0"]
            started = time.perf_counter()
            deployment.train(batches, iterations=args.iterations, optimizer=spec, loss=loss, micro_batches=4)
            plain = time.perf_counter() - started
            started = time.perf_counter()
            for offset in range(0, args.iterations, args.eval_every):
                deployment.train(lambda index, at=offset: batches[at + index], iterations=args.eval_every,
                                 optimizer=spec, loss=loss, micro_batches=4, batch_offset=offset)
                evaluate(deployment.infer, held_out, loss, iteration=offset + args.eval_every)
            evaluated = time.perf_counter() - started
            walls.append((name, plain, evaluated))
    print(f"\nmodel | {args.iterations} iterations, s | evaluated every {args.eval_every}, s | ratio")
    print("--- | --- | --- | ---")
    for name, plain, evaluated in walls:
        print(f"{name} | {plain:.1f} | {evaluated:.1f} | {evaluated / plain:.2f}")


if __name__ == "__main__":
    main()
