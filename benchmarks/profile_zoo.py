"""Profile the zoo: per model, the chain before and after the passes, parameter and activation
bytes, the profiler's wall time, and the predicted single-stage forward+backward time
(the sum of the per-layer profile lines at the batch) next to the measured time of the
unpartitioned model on this host. Also the single stage's saved-activation bytes as the
cost models compute them (``stage_saved_bytes``) next to what autograd keeps for the whole
model.

    python benchmarks/profile_zoo.py                  # full-size models, batch 4
    python benchmarks/profile_zoo.py --size tiny      # the reduced models (quick)
    python benchmarks/profile_zoo.py --models vgg11,resnet50 --batch 8

The whole model is measured before and after profiling (median of ``--repeats`` runs each);
the smaller median is "measured", and "noise" is how far the two medians differ — on a
shared machine that spread is the floor under any prediction error.

The prediction goes through the same path the cost models use (``Problem.layer_seconds`` on
the ``local`` platform's largest tier); the profile is fitted over micro-batch sizes that
bracket the batch so that the line is interpolated, not extrapolated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.utils._pytree as pytree

import flatpack
from flatpack import zoo
from flatpack.cli import human_bytes
from flatpack.ir.graph import LayerGraph
from flatpack.ir.profile import stage_saved_bytes
from flatpack.ir.trace import trace
from flatpack.measure import saved_tensors
from flatpack.profiler import ProfileOptions

DEFAULT_MODELS = ("vgg11", "vgg16", "resnet50", "resnet101", "wrn50-2", "alexnet", "amoebanet-d18",
                  "bert-large", "gpt2", "rnn-3")


def measured_seconds(model: torch.nn.Module, inputs: tuple, repeats: int) -> float:
    """Median forward+backward of the whole model (backward of the sum of its outputs)."""
    def once() -> float:
        begin = time.perf_counter()
        outputs = model(*inputs)
        leaves = [v for v in pytree.tree_leaves(outputs)
                  if isinstance(v, torch.Tensor) and v.requires_grad]
        torch.autograd.backward(leaves, [torch.ones_like(v) for v in leaves])
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - begin

    once()
    return statistics.median(once() for _ in range(repeats))


def measured_saved_bytes(model: torch.nn.Module, inputs: tuple) -> int:
    """What autograd keeps for the whole model: unique storages, parameters excluded."""
    with saved_tensors(exclude=[*model.parameters(), *model.buffers()]) as saved:
        model(*inputs)
    return sum(saved.values())


def layers_before_passes(model: torch.nn.Module, inputs: tuple) -> int:
    """The chain the tracer makes, before any pass merges layers."""
    return len(LayerGraph.from_traced(trace(model, inputs, {})).layers)


def row(name: str, size: str, batch: int, repeats: int, cache_dir: str) -> dict:
    model, inputs = zoo.build(name, size, batch)
    model.train()
    before = layers_before_passes(model, inputs)
    measured_first = measured_seconds(model, inputs, repeats)
    sizes = tuple(sorted({max(1, batch // 2), batch, batch * 2}))
    options = ProfileOptions(batch_sizes=sizes, repeats=repeats, cache_dir=cache_dir, progress=sys.stderr.isatty())
    started = time.perf_counter()
    compiled = flatpack.compile(model, inputs, stages=1, profile=options, passes=zoo.entry(name).passes)
    profile_wall = time.perf_counter() - started
    problem = compiled.problem
    assert problem is not None and compiled.profile is not None, "compiled here with a profile"
    top_tier = max(problem.platform.tiers, key=lambda tier: tier.memory_mb)
    predicted = sum(sum(problem.layer_seconds(index, top_tier, batch)) for index in range(len(problem.chain)))
    measured_again = measured_seconds(model, inputs, repeats)
    measured = min(measured_first, measured_again)
    profile = compiled.profile
    saved_predicted = stage_saved_bytes(profile.layers, batch)
    saved_measured = measured_saved_bytes(model, inputs)
    return {
        "model": name, "layers": f"{before} → {len(profile.layers)}",
        "params": human_bytes(sum(layer.param_bytes for layer in profile.layers)),
        "saved/sample": human_bytes(saved_predicted / batch),
        "saved error": f"{(saved_predicted - saved_measured) / saved_measured * 100:+.1f}%",
        "profile s": f"{profile_wall:.1f}", "predicted s": f"{predicted:.3f}", "measured s": f"{measured:.3f}",
        "noise": f"{abs(measured_first - measured_again) / measured * 100:.0f}%",
        "time error": f"{(predicted - measured) / measured * 100:+.1f}%",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--size", default="full", choices=zoo.SIZES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, size={args.size}, batch={args.batch}, "
          f"repeats={args.repeats} (medians)")
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in args.models.split(","):
            rows.append(row(name, args.size, args.batch, args.repeats, cache_dir))
            print("  ".join(f"{key}={value}" for key, value in rows[-1].items()), flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for item in rows:
        print("| " + " | ".join(item[key] for key in keys) + " |")


if __name__ == "__main__":
    main()
