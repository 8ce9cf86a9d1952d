"""The zoo's full-size models next to the papers' figures: prints the markdown table of docs/zoo.md.

For each model, built at full size, batch 1, training mode: parameters (count and fp32 MiB),
forward GMACs (torch.utils.flop_counter, halved: the papers count multiply-adds), and two
activation figures per sample from one forward pass:
- saved: what autograd keeps for backward, through saved_tensors_hooks: the unique storages
  saved (deduplicated by data_ptr), parameters and buffers excluded;
- layer outputs: the bytes of every leaf module's output (forward hooks), the way a
  per-layer profiler counts; functional ops between modules (a residual add) are missed.
Run: python benchmarks/zoo_table.py [NAME ...]
"""
from __future__ import annotations

import gc
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from flatpack.measure import saved_tensors
from flatpack.zoo import ZOO, build
from flatpack.units import MIB



def _tensor_bytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _lstm_flops(input_shape: torch.Size, w_ih: torch.Size, w_hh: torch.Size, *args: object,
                **kwargs: object) -> int:
    # CPU runs nn.LSTM as mkldnn_rnn_layer, which flop_counter has no formula for.
    steps_times_batch = input_shape[0] * input_shape[1]
    return 2 * steps_times_batch * w_ih[0] * (w_ih[1] + w_hh[1])


def measure(model: torch.nn.Module, inputs: tuple) -> tuple[int, int, int]:
    """(bytes autograd saves, bytes of leaf-module outputs, FLOPs) of one forward pass."""
    outputs = [0]

    def count_output(module: torch.nn.Module, args: object, output: object) -> None:
        outputs[0] += _tensor_bytes(output)

    hooks = [m.register_forward_hook(count_output) for m in model.modules() if not list(m.children())]
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten.mkldnn_rnn_layer: _lstm_flops})
    with saved_tensors(exclude=[*model.parameters(), *model.buffers()]) as saved, counter:
        output = model(*inputs)
    del output
    for hook in hooks:
        hook.remove()
    return sum(saved.values()), outputs[0], counter.get_total_flops()


def paper_cells(name: str) -> tuple[str, str, str, str]:
    """(params, param MB, activation MB/sample, sources) as the papers print them."""
    papers = ZOO[name].paper
    sources = "; ".join(f"{fig.source} {fig.table} ({fig.paper_name})" for fig in papers) or "none"
    figures = [fig for fig in papers if fig.params or fig.param_mib or fig.activation_mib_per_sample]
    if not figures:
        return "", "", "", sources
    fig = figures[0]
    params = f"{fig.params / 1e6:.1f}M" if fig.params else ""
    if fig.gflops:
        params += f" ({fig.gflops:g} G FLOPs)"
    return (params, f"{fig.param_mib:g}" if fig.param_mib else "",
            f"{fig.activation_mib_per_sample:g}" if fig.activation_mib_per_sample else "", sources)


def row(name: str) -> str:
    model, inputs = build(name, "full", batch=1)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    start = time.perf_counter()
    saved, outputs, flops = measure(model, inputs)
    seconds = time.perf_counter() - start
    del model, inputs
    gc.collect()
    shape = "x".join(map(str, ZOO[name].input_shape))
    p_params, p_mib, p_act, source = paper_cells(name)
    print(f"  {name}: forward {seconds:.1f}s", file=sys.stderr, flush=True)
    return (f"| {name} | {shape} | {params:,} | {param_bytes / MIB:.1f} | {flops / 2e9:.1f} | "
            f"{saved / MIB:.1f} | {outputs / MIB:.1f} | {p_params} | {p_mib} | {p_act} | {source} |")


def main(names: list[str]) -> None:
    print("| model | input / sample | params | param MiB (fp32) | fwd GMACs | saved for backward, "
          "MiB / sample (measured) | layer outputs, MiB / sample (measured) | paper params | "
          "paper param MB | paper activation MB / sample | paper source |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in names:
        print(row(name), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    main(sys.argv[1:] or list(ZOO))
