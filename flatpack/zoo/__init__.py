"""A model zoo for tests, demos and benchmarks: the papers' models in plain torch, no torchvision.

``build(name, size, batch) -> (model, example_inputs)``. ``size="full"`` is the network the
papers evaluate; ``size="tiny"`` keeps its block types and layer pattern with few channels,
blocks and a small input, so a trace and a forward/backward take well under a second on CPU.
Models come back in eval mode (dropout off), with seeded random weights; call ``.train()``
to train them. ``ZOO[name].paper`` holds the figures the papers print for the model.
docs/zoo.md compares them with ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import nn

from flatpack.errors import InputError
from flatpack.zoo import amoebanet, rnn, transformers_models, vision

SIZES = ("tiny", "full")
FUNCPIPE = "FuncPipe"
GILLIS = "Gillis"
HYDROZOA = "Hydrozoa"

Builder = Callable[[str, int], "tuple[nn.Module, tuple]"]


@dataclass(frozen=True)
class PaperFigure:
    """What one paper prints for a model; None where it prints nothing.

    FuncPipe's "MB" are MiB (2**20 bytes): ResNet-101's 44.5M fp32 parameters are 170 MiB.
    """

    source: str
    table: str
    paper_name: str
    params: int | None = None
    param_mib: float | None = None
    activation_mib_per_sample: float | None = None
    gflops: float | None = None
    input_shape: tuple[int, ...] | None = None
    note: str = ""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    summary: str
    builder: Builder = field(repr=False)
    input_shape: tuple[int, ...]  # one full-size sample
    paper: tuple[PaperFigure, ...] = ()
    passes: str | None = None  # the pass pipeline that gives the model's natural cuts (None: the default)


def _funcpipe(paper_name: str, param_mib: float, activation_mib: float) -> PaperFigure:
    return PaperFigure(FUNCPIPE, "Table 1", paper_name, param_mib=param_mib,
                       activation_mib_per_sample=activation_mib,
                       note="trained on CIFAR-10; the input resolution is not stated")


def _hydrozoa(paper_name: str, params: float, gflops: float) -> PaperFigure:
    return PaperFigure(HYDROZOA, "Table 2", paper_name, params=int(params), gflops=gflops,
                       input_shape=(3, 224, 224), note="CIFAR-10 scaled to 3x224x224 (§5.1)")


def _gillis(paper_name: str, note: str = "no size figures in the paper") -> PaperFigure:
    return PaperFigure(GILLIS, "§V Benchmarking Models", paper_name, note=note)


IMAGE = (3, 224, 224)
# Every AmoebaNet cell reads the two previous cells' outputs, so its natural cuts carry two
# tensors; the default merge-branches would fold the whole network into a few layers.
TWO_INPUT_CELLS = "fuse-elementwise,merge-branches{max-crossing=2}"


def _entries() -> list[ZooEntry]:
    entries = [
        ZooEntry(f"vgg{d}", f"VGG-{d}, torchvision layout (no batch norm)", partial(vision.vgg, d), IMAGE,
                 (_gillis(f"VGG-{d}"),) + ((_hydrozoa("VGG19", 143.7e6, 19.6),) if d == 19 else ()))
        for d in (11, 16, 19)]
    for depth in (34, 50, 101, 152):
        paper: tuple[PaperFigure, ...] = ()
        if depth in (34, 50, 101):
            paper += (_gillis(f"ResNet-{depth}"),)
        if depth == 101:
            paper += (_funcpipe("ResNet101", 170, 198),)
        if depth == 34:
            paper += (_hydrozoa("ResNet-34", 21.5e6, 3.7),)
        if depth == 152:
            paper += (_hydrozoa("ResNet-152", 58.5e6, 11.3),)
        entries.append(ZooEntry(f"resnet{depth}", f"ResNet-{depth} (v1.5), torchvision layout",
                                partial(vision.resnet, depth), IMAGE, paper))
    entries += [ZooEntry(f"wrn34-{k}", f"WRN-34-{k}: ResNet-34 with every stage {k}x wider",
                         partial(vision.resnet, 34, widen=k), IMAGE, (_gillis(f"WRN-34-{k}"),))
                for k in (3, 4, 5)]
    # Gillis benchmarks WRN-50-3..5 (§V) and motivates with WRN-50-1..5 (§II-B, Fig. 1).
    entries += [ZooEntry(f"wrn50-{k}", f"WRN-50-{k}: ResNet-50 with bottleneck inner width {k}x",
                         partial(vision.resnet, 50, widen=k), IMAGE,
                         (_gillis(f"WRN-50-{k}") if k > 2 else
                          PaperFigure(GILLIS, "§II-B, Fig. 1", "WResNet-50, k=2", note="no size figures"),))
                for k in (2, 3, 4, 5)]
    entries += [
        ZooEntry("amoebanet-d18", "AmoebaNet-D, 18 normal cells, 256 filters (GPipe/torchgpipe)",
                 partial(amoebanet.amoebanet_d, 18), IMAGE, (_funcpipe("AmoebaNet-D18", 476, 432),), TWO_INPUT_CELLS),
        ZooEntry("amoebanet-d36", "AmoebaNet-D, 36 normal cells, 256 filters (GPipe/torchgpipe)",
                 partial(amoebanet.amoebanet_d, 36), IMAGE, (_funcpipe("AmoebaNet-D36", 900, 697),), TWO_INPUT_CELLS),
        ZooEntry("bert-large", "BERT-Large BertModel: 24 layers, 1024 wide, 16 heads",
                 transformers_models.bert_large, (transformers_models.BERT_FULL_TOKENS,),
                 (_funcpipe("BERT-Large", 1153, 263),)),
        ZooEntry("gpt2", "GPT-2 124M, GPT2LMHeadModel with tied embeddings", transformers_models.gpt2,
                 (transformers_models.GPT2_FULL_TOKENS,)),
    ]
    entries += [ZooEntry(f"rnn-{k}", f"RNN-{k}: {k} stacked LSTM layers, 2048 hidden units",
                         partial(rnn.rnn, k), (rnn.FULL_STEPS, rnn.FULL_HIDDEN),
                         (_gillis(f"RNN-{k}", "2K hidden units; up to 9 layers fit one 1.4 GB function"),))
                for k in (3, 6, 9, 12)]
    entries.append(ZooEntry("alexnet", "AlexNet, torchvision layout", vision.alexnet, IMAGE,
                            (_hydrozoa("AlexNet", 57e6, 0.7),)))
    return entries


ZOO: dict[str, ZooEntry] = {entry.name: entry for entry in _entries()}


def zoo_names() -> list[str]:
    return list(ZOO)


def entry(name: str) -> ZooEntry:
    if name not in ZOO:
        raise InputError(f"unknown zoo model {name!r}; the zoo has: {', '.join(ZOO)}")
    return ZOO[name]


def build(name: str, size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    """Builds zoo model ``name`` at ``size`` ("tiny" or "full") with example inputs of ``batch`` samples.

    Weights and inputs are seeded, so two builds are equal; the global RNG is left as it was.
    Under ``with torch.device("meta"):`` the model costs no memory (for counting parameters).
    """
    zoo_entry = entry(name)
    if size not in SIZES:
        raise InputError(f"unknown zoo size {size!r}; sizes: {', '.join(SIZES)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise InputError(f"batch must be a positive int, got {batch!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return zoo_entry.builder(size, batch)


__all__ = ["SIZES", "ZOO", "PaperFigure", "ZooEntry", "build", "entry", "zoo_names"]
