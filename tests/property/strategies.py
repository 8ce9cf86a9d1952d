"""Hypothesis strategies for random small models, pass pipelines and cut plans.

Strategies draw *specs* (frozen dataclasses of plain numbers and strings); ``build_case``
turns a spec into a model and its inputs with fixed seeds. Hypothesis therefore shrinks and
prints specs, and a printed spec rebuilds the same model bit for bit.

Families:

- ``VectorSpec`` (``family="vector"``): an MLP-like chain on ``(B, d)`` inputs, assembled
  from blocks: linear + activation (with in-place ``add_``/``mul_``/``+=`` on the fresh
  linear output and in-place activations), residual blocks, inception-like multi-branch
  blocks (concatenated), reuse of an earlier block's module (tied weights), a loop over one
  shared linear (``repeat`` is a Python int input), in-place writes through a view, a
  multi-output op (``chunk``), LayerNorm, dropout (eval), a mask input read by many blocks,
  a second data input injected late, free computations over parameters, a registered
  buffer and a plain tensor attribute (a traced constant), a size read from the input.
- ``VectorSpec`` with ``family="token"``: the same blocks on ``(B, T, d)`` after an
  embedding of integer ids plus a position embedding (``arange`` of the input's length),
  optional attention blocks, and an output projection tied to the embedding.
- ``CnnSpec``: a ResNet-like CNN (conv + BatchNorm + in-place ReLU, residual blocks with
  identity or 1x1 projection skips, inception-like blocks with pooling branches).

Every model is float64 (a ``float32`` block computes in float32). ``wrap_dict`` passes the
tensor inputs in one dict argument, which fx cannot trace, so those examples go through the
torch.export frontend.

The constructs behind the bugs in BUGS.md are generated too: namedtuple outputs (#1, #4),
buffers updated in the forward and read before the update (the ``stateful`` block: #3,
#5), a BatchNorm applied twice in train mode (the CNN ``twin`` block: #6), a parameter read
that fx cannot see (the ``param_by_name`` block, which sends the model to torch.export: #7).
Left out: ``BatchNorm(momentum=None)`` in train mode, which flatpack refuses by design (#3),
and models that compute nothing, which it refuses too (#8).
"""

from __future__ import annotations

import collections
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn

import flatpack
from flatpack.ir.passes.coarsen import Coarsen
from flatpack.ir.passes.fuse_elementwise import FuseElementwise
from flatpack.ir.passes.merge_branches import MergeBranches

DTYPE = torch.float64


def scaled(examples: int) -> int:
    """``examples`` under the ci profile (200 examples), proportionally fewer (at least 5) under
    dev and five times as many under soak (``benchmarks/property_trials.py``)."""
    return max(5, examples * settings().max_examples // 200)

# --------------------------------------------------------------------------------------------
# specs
# --------------------------------------------------------------------------------------------

# Activations applied to a freshly computed tensor. The in-place ones are safe for autograd
# because nothing that produced their input saved its output for backward.
ACTIVATIONS = ("none", "relu", "relu_module_inplace", "relu_fn_inplace", "relu_method_inplace",
               "leaky_inplace", "hardtanh_inplace", "tanh", "gelu", "sigmoid", "silu")
# In-place updates of a fresh linear output, before its activation.
INPLACE_OPS = ("add_", "mul_", "iadd", "imul", "clamp_")
BRANCH_KINDS = ("linear", "linear_act_linear", "act", "identity", "scaled")
VECTOR_BLOCKS = ("linear", "residual", "inception", "again", "loop", "view_inplace", "chunk",
                 "layernorm", "dropout", "mask", "inject", "param_only", "constant", "size", "float32",
                 "stateful", "param_by_name")
TOKEN_ONLY_BLOCKS = ("attention",)


@dataclass(frozen=True)
class Block:
    kind: str
    width: int = 4
    act: str = "none"
    inplace: tuple[str, ...] = ()
    branches: tuple[tuple[str, int], ...] = ()  # inception: (branch kind, width)
    ref: int = 0  # "again": which earlier block (mod count) to apply again
    style: str = ""  # residual: add | iadd | add_ ; attention: manual | sdpa


@dataclass(frozen=True)
class Inputs:
    """How the forward's optional arguments are given."""

    mask: str = "none"  # none | raw | derived (float, computed once) | bool (computed once)
    mask_grad: bool = True
    y: bool = False  # second data input, injected by "inject" blocks
    bias: str = "default"  # default (None by default) | none (explicit None) | tensor
    scale: float | None = None  # None: rely on the default 2.0
    repeat: int | None = None  # None: rely on the default 1
    x_grad: bool = True
    compile_style: str = "tuple"  # tuple | dict | mixed
    call_style: str = "tuple"  # tuple | dict | mixed: how the staged module is called


@dataclass(frozen=True)
class Outputs:
    kind: str = "tensor"  # tensor | tuple | dict | list | nested | namedtuple
    hidden_at: int | None = None  # also return the hidden state after this block
    echo_mask: bool = False  # return the mask input itself
    free_param: bool = False  # return a value computed from parameters alone
    constant: bool = False  # a Python constant in the output structure
    argmax: bool = False  # an integer tensor among the outputs


@dataclass(frozen=True)
class VectorSpec:
    family: str  # vector | token
    seed: int
    batch: int
    d_in: int  # vector: input width; token: embedding width
    seq: int  # token: sequence length
    vocab: int  # token: vocabulary size
    blocks: tuple[Block, ...]
    d_out: int
    head_tie: str  # token: untied | functional | assigned
    inputs: Inputs
    outputs: Outputs
    frozen: tuple[int, ...] = ()  # indices (mod count) of parameters set requires_grad=False
    unused_param: bool = False
    wrap_dict: bool = False


@dataclass(frozen=True)
class CnnBlock:
    kind: str  # conv | res | inception | twin (two convs through one shared BatchNorm)
    channels: int = 4
    stride: int = 1
    branches: tuple[tuple[str, int], ...] = ()  # inception: (conv1 | conv3 | maxpool | avgpool, width)
    style: str = "iadd"  # res: iadd | add


@dataclass(frozen=True)
class CnnSpec:
    seed: int
    batch: int
    in_ch: int
    size: int
    stem: int
    blocks: tuple[CnnBlock, ...]
    classes: int
    outputs: str  # tensor | tuple | dict
    scale: float | None = None
    pool: str | None = None  # a str constant input: avg | max (None: the default, avg)
    x_grad: bool = True
    train: bool = False
    wrap_dict: bool = False
    family: str = "cnn"


# --------------------------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------------------------

VectorOut = collections.namedtuple("VectorOut", ["logits", "extra"])


class Ctx:
    """Per-call values that blocks read: the mask, the second input, constants, a size."""

    def __init__(self, mask, mask_bool, y, scale, repeat, size):
        self.mask, self.mask_bool, self.y = mask, mask_bool, y
        self.scale, self.repeat, self.size = scale, repeat, size


def apply_act(act: str, h: torch.Tensor, module: nn.Module | None = None) -> torch.Tensor:
    if act == "none":
        return h
    if act == "relu":
        return F.relu(h)
    if act in ("relu_module_inplace", "leaky_inplace"):
        assert module is not None, f"activation {act!r} runs its module"
        return module(h)
    if act == "relu_fn_inplace":
        return F.relu(h, inplace=True)
    if act == "relu_method_inplace":
        return h.relu_()
    if act == "hardtanh_inplace":
        return F.hardtanh(h, -1.5, 1.5, inplace=True)
    if act == "tanh":
        return torch.tanh(h)
    if act == "gelu":
        return F.gelu(h)
    if act == "sigmoid":
        return torch.sigmoid(h)
    if act == "silu":
        return F.silu(h)
    raise AssertionError(act)


def act_module(act: str) -> nn.Module | None:
    if act == "relu_module_inplace":
        return nn.ReLU(inplace=True)
    if act == "leaky_inplace":
        return nn.LeakyReLU(0.1, inplace=True)
    return None


def apply_inplace(ops: tuple[str, ...], h: torch.Tensor, scale: float) -> torch.Tensor:
    """In-place updates of ``h``, which the caller guarantees is a fresh linear output."""
    for op in ops:
        if op == "add_":
            h.add_(0.25)
        elif op == "mul_":
            h.mul_(scale)
        elif op == "iadd":
            h += 0.5
        elif op == "imul":
            h *= -1.5
        elif op == "clamp_":
            # clamp's backward needs the input, which later ops overwrite: so clamp a clone
            h = h.clone().clamp_(-3.0, 3.0)
        else:
            raise AssertionError(op)
    return h


class LinearBlock(nn.Module):
    def __init__(self, d_in: int, block: Block) -> None:
        super().__init__()
        self.block = block
        self.lin = nn.Linear(d_in, block.width)
        self.act = act_module(block.act)

    def forward(self, h, ctx):
        h = apply_inplace(self.block.inplace, self.lin(h), ctx.scale)
        return apply_act(self.block.act, h, self.act)


class ResidualBlock(nn.Module):
    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.block = block
        self.lin1 = nn.Linear(d, block.width)
        self.lin2 = nn.Linear(block.width, d)
        self.act = act_module(block.act)

    def forward(self, h, ctx):
        branch = apply_act(self.block.act, apply_inplace(self.block.inplace, self.lin1(h), ctx.scale), self.act)
        branch = self.lin2(branch)
        if self.block.style == "iadd":
            branch += h
            return branch
        if self.block.style == "add_":
            return branch.add_(h)
        return h + branch


class InceptionBlock(nn.Module):
    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.block = block
        self.towers = nn.ModuleList()
        for kind, width in block.branches:
            if kind == "linear":
                self.towers.append(nn.Linear(d, width))
            elif kind == "linear_act_linear":
                self.towers.append(nn.Sequential(nn.Linear(d, width), nn.ReLU(inplace=True),
                                                 nn.Linear(width, width)))
            else:
                self.towers.append(nn.Identity())

    def forward(self, h, ctx):
        outs = []
        for (kind, _), tower in zip(self.block.branches, self.towers):
            if kind == "act":
                outs.append(torch.tanh(h))  # parameter-free branch; never in place (h is shared)
            elif kind == "identity":
                outs.append(h)
            elif kind == "scaled":
                outs.append(h * ctx.scale)
            else:
                outs.append(tower(h))
        return torch.cat(outs, dim=-1)


def inception_width(d: int, block: Block) -> int:
    return sum(d if kind in ("act", "identity", "scaled") else width for kind, width in block.branches)


class Again(nn.Module):
    """Applies an earlier block's module again (the same object: its weights are tied)."""

    def __init__(self, adapter: nn.Module, target: nn.Module) -> None:
        super().__init__()
        self.adapter = adapter
        self.target = target

    def forward(self, h, ctx):
        return self.target(self.adapter(h), ctx)


class LoopBlock(nn.Module):
    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.block = block
        self.lin = nn.Linear(d, d)
        self.act = act_module(block.act)

    def forward(self, h, ctx):
        for _ in range(ctx.repeat):
            h = apply_act(self.block.act, self.lin(h), self.act)
        return h


class ViewInplaceBlock(nn.Module):
    """Writes through a view of a fresh tensor, then reads the base."""

    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * block.width)

    def forward(self, h, ctx):
        h = self.lin(h)
        halves = h.unflatten(-1, (2, -1))
        halves.mul_(ctx.scale)
        halves[..., 0, :].add_(1.0)
        return h


class ChunkBlock(nn.Module):
    """A multi-output op (chunk) whose pieces are recombined."""

    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.lin = nn.Linear(d, 2 * block.width)

    def forward(self, h, ctx):
        parts = self.lin(h).chunk(2, dim=-1)
        return torch.cat([parts[1], parts[0] * torch.sigmoid(parts[1])], dim=-1)


class Simple(nn.Module):
    """Blocks without a sub-layer: layernorm, dropout, mask, inject, param_only, constant, size,
    stateful, param_by_name."""

    # buffers of the stateful kind, declared so that reads are typed as tensors, not Module
    calls: torch.Tensor
    ema: torch.Tensor

    def __init__(self, d: int, block: Block, d_y: int) -> None:
        super().__init__()
        self.kind = block.kind
        self.d = d
        if block.kind == "layernorm":
            self.norm = nn.LayerNorm(d)
        elif block.kind == "dropout":
            self.drop = nn.Dropout(0.5)
        elif block.kind == "inject":
            self.proj = nn.Linear(d_y, d)
        elif block.kind == "param_only":
            self.vec = nn.Parameter(torch.randn(d))
        elif block.kind == "constant":
            self.register_buffer("shift", torch.randn(d))
            self.register_buffer("nonpersistent", torch.randn(d), persistent=False)
            self.plain = torch.randn(d, dtype=DTYPE)  # a plain tensor attribute: traced as a constant
        elif block.kind == "stateful":
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
            self.register_buffer("ema", torch.randn(d))
        elif block.kind == "param_by_name":
            self.gain = nn.Parameter(torch.randn(d))

    def forward(self, h, ctx):
        kind = self.kind
        if kind == "layernorm":
            return self.norm(h)
        if kind == "dropout":
            return self.drop(h)
        if kind == "mask":
            if ctx.mask is None:
                return h
            return torch.where(ctx.mask, h, -h) if ctx.mask_bool else h * ctx.mask
        if kind == "inject":
            return h + self.proj(ctx.y) if ctx.y is not None else h
        if kind == "param_only":
            return h + torch.tanh(self.vec) * 0.5 + self.vec.sum()
        if kind == "constant":
            return (h + self.shift) * self.plain + self.nonpersistent
        if kind == "size":
            return h / ctx.size
        if kind == "stateful":
            before = self.ema * 1.0  # read before the in-place update, used after it
            self.calls.add_(1)
            self.ema.mul_(0.75).add_(h.detach().reshape(-1, self.d).mean(0) * 0.25)
            return h + before - self.ema
        if kind == "param_by_name":
            # fx sees the real tensor here, not an attribute read: flatpack hands the model to export
            gain = dict(self.named_parameters())["gain"]
            return h * torch.tanh(gain)
        raise AssertionError(kind)


class Attention(nn.Module):
    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.style = block.style
        self.d = d
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, h, ctx):
        q, k, v = self.q(h), self.k(h), self.v(h)
        bias = None
        if ctx.mask is not None and ctx.mask_bool:
            bias = (~ctx.mask).transpose(-1, -2).to(q.dtype) * -1e4  # (B, 1, T): masks keys
        elif ctx.mask is not None:
            bias = (1.0 - ctx.mask.transpose(-1, -2)) * -1e4
        if self.style == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
            if bias is not None:
                scores = scores + bias
            out = torch.softmax(scores, dim=-1) @ v
        return h + self.o(out)


class Float32Block(nn.Module):
    """A float32 island in the float64 model: values of both dtypes cross boundaries."""

    def __init__(self, d: int, block: Block) -> None:
        super().__init__()
        self.lin = nn.Linear(d, block.width)

    def forward(self, h, ctx):
        return torch.tanh(self.lin(h.to(torch.float32))).to(torch.float64)


class BlockNet(nn.Module):
    """The vector and token families."""

    def __init__(self, spec: VectorSpec) -> None:
        super().__init__()
        self.spec = spec
        d_y = 3
        if spec.family == "token":
            self.emb = nn.Embedding(spec.vocab, spec.d_in)
            self.pos = nn.Embedding(spec.seq, spec.d_in)
        d = spec.d_in
        self.blocks = nn.ModuleList()
        widths_in = []
        self.hidden_width = d
        for index, block in enumerate(spec.blocks):
            widths_in.append(d)
            module, d = self._make_block(index, block, d, d_y, widths_in)
            self.blocks.append(module)
            if spec.outputs.hidden_at is not None and index == spec.outputs.hidden_at % len(spec.blocks):
                self.hidden_width = d
        if spec.family == "token" and spec.head_tie != "untied":
            self.pre_head = nn.Linear(d, spec.d_in) if d != spec.d_in else nn.Identity()
            if spec.head_tie == "assigned":
                self.head = nn.Linear(spec.d_in, spec.vocab, bias=False)
                self.head.weight = self.emb.weight
        else:
            self.head = nn.Linear(d, spec.d_out)
        if spec.unused_param:
            self.unused = nn.Linear(2, 2)
        params = list(dict.fromkeys(self.parameters()))
        for index in spec.frozen:
            params[index % len(params)].requires_grad_(False)

    def _make_block(self, index: int, block: Block, d: int, d_y: int, widths_in: list[int]):
        kind = block.kind
        if kind == "linear":
            return LinearBlock(d, block), block.width
        if kind == "residual":
            return ResidualBlock(d, block), d
        if kind == "inception":
            return InceptionBlock(d, block), inception_width(d, block)
        if kind == "loop":
            return LoopBlock(d, block), d
        if kind in ("view_inplace", "chunk"):
            return (ViewInplaceBlock if kind == "view_inplace" else ChunkBlock)(d, block), 2 * block.width
        if kind == "attention":
            return Attention(d, block), d
        if kind == "float32":
            return Float32Block(d, block), block.width
        if kind == "again":
            candidates = [i for i, module in enumerate(self.blocks) if not isinstance(module, Again)
                          and not (isinstance(module, Simple) and module.kind not in self.REUSABLE)]
            if not candidates:
                fallback = Block("linear", width=block.width, act=block.act)
                return LinearBlock(d, fallback), block.width
            ref = candidates[block.ref % len(candidates)]
            target = self.blocks[ref]
            d_target = widths_in[ref]
            adapter = nn.Linear(d, d_target) if d != d_target else nn.Identity()
            return Again(adapter, target), self._out_width(target, d_target)
        return Simple(d, block, d_y), d

    REUSABLE = ("layernorm", "param_only", "constant", "stateful")  # Simple blocks with tensors to tie

    @staticmethod
    def _out_width(module: nn.Module, d: int) -> int:
        if isinstance(module, (ResidualBlock, LoopBlock, Attention, Simple)):
            return d
        if isinstance(module, (LinearBlock, Float32Block)):
            return module.lin.out_features
        if isinstance(module, (ViewInplaceBlock, ChunkBlock)):
            return module.lin.out_features
        if isinstance(module, InceptionBlock):
            return inception_width(d, module.block)
        raise AssertionError(type(module))

    def forward(self, x, y=None, mask=None, bias=None, scale: float = 2.0, repeat: int = 1):
        spec = self.spec
        if spec.family == "token":
            positions = torch.arange(x.shape[1], device=x.device)
            h = self.emb(x) + self.pos(positions)
            size = x.shape[1]
        else:
            h = x
            size = x.size(0)
        if mask is not None and spec.inputs.mask == "derived":
            mask = (mask > 0.3).to(h.dtype) * 0.5 + 0.5  # computed once, read by many blocks
        elif mask is not None and spec.inputs.mask == "bool":
            mask = mask > 0.3
        ctx = Ctx(mask, spec.inputs.mask == "bool", y, scale, repeat, size)
        hidden = None
        for index, block in enumerate(self.blocks):
            h = block(h, ctx)
            if spec.outputs.hidden_at is not None and index == spec.outputs.hidden_at % len(self.blocks):
                hidden = h
        if spec.family == "token" and spec.head_tie == "functional":
            out = F.linear(self.pre_head(h), self.emb.weight)
        elif spec.family == "token" and spec.head_tie == "assigned":
            out = self.head(self.pre_head(h))
        else:
            out = self.head(h)
        if bias is not None:
            out = out + bias
        return self._outputs(out, hidden, mask)

    def _outputs(self, out, hidden, mask):
        spec = self.spec.outputs
        extra: dict[str, Any] = {}
        if hidden is not None:
            extra["hidden"] = hidden
        if spec.echo_mask and mask is not None:
            extra["mask"] = mask
        if spec.free_param:
            # read through an attribute: fx sees ``self.parameters()`` only as constants
            weight = self.head.weight if hasattr(self, "head") else self.emb.weight
            extra["free"] = weight.t() * 2.0
        if spec.constant:
            extra["const"] = None
            extra["n"] = 3
        if spec.argmax:
            extra["argmax"] = out.argmax(-1)
        if spec.kind == "tensor" and not extra:
            return out
        if spec.kind == "dict":
            return {"logits": out, **extra}
        if spec.kind == "list":
            return [out, *extra.values()]
        if spec.kind == "namedtuple":
            return VectorOut(out, tuple(extra.values()))
        if spec.kind == "nested":
            return (out, {"extra": list(extra.values()), "logits": out})
        return (out, *extra.values())


class DictInputs(nn.Module):
    """Takes the tensor inputs in one dict, so that fx cannot trace it (export does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch, scale: float = 2.0, repeat: int = 1):
        return self.inner(batch["x"], batch.get("y"), batch.get("mask"), batch.get("bias"), scale, repeat)


class CnnDictInputs(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, batch, scale: float = 2.0, pool: str = "avg"):
        return self.inner(batch["x"], scale, pool)


def conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout))


class ConvBlock(nn.Module):
    def __init__(self, cin: int, block: CnnBlock) -> None:
        super().__init__()
        self.body = conv_bn(cin, block.channels, 3, block.stride)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x))


class ResBlock(nn.Module):
    def __init__(self, cin: int, block: CnnBlock) -> None:
        super().__init__()
        cout = block.channels
        self.style = block.style
        self.conv1 = conv_bn(cin, cout, 3, block.stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv_bn(cout, cout, 3)
        self.down = conv_bn(cin, cout, 1, block.stride) if (cin != cout or block.stride != 1) else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.conv2(self.relu(self.conv1(x)))
        if self.style == "iadd":
            out += identity
            return self.relu(out)
        return F.relu(out + identity)


class TwinCnn(nn.Module):
    """Two convolutions normalized by one BatchNorm, in the opposite order to their creation:
    in train mode both calls update the same running statistics, and the order matters."""

    def __init__(self, cin: int, block: CnnBlock) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(cin, block.channels, 3, block.stride, 1, bias=False)
        self.conv_b = nn.Conv2d(cin, block.channels, 1, block.stride, 0, bias=False)
        self.bn = nn.BatchNorm2d(block.channels)

    def forward(self, x):
        a = self.conv_a(x)
        b = self.conv_b(x)
        yb = self.bn(b)
        ya = self.bn(a)
        return F.relu(ya + yb)


class InceptionCnn(nn.Module):
    def __init__(self, cin: int, block: CnnBlock) -> None:
        super().__init__()
        self.kinds = [kind for kind, _ in block.branches]
        towers = []
        for kind, width in block.branches:
            if kind == "conv1":
                towers.append(nn.Sequential(conv_bn(cin, width, 1), nn.ReLU(inplace=True)))
            elif kind == "conv3":
                towers.append(nn.Sequential(conv_bn(cin, width, 1), nn.ReLU(inplace=True),
                                            conv_bn(width, width, 3), nn.ReLU(inplace=True)))
            elif kind == "maxpool":
                towers.append(nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_bn(cin, width, 1)))
            else:
                towers.append(nn.AvgPool2d(3, 1, 1))
        self.towers = nn.ModuleList(towers)

    def forward(self, x):
        return torch.cat([tower(x) for tower in self.towers], dim=1)


def cnn_inception_width(cin: int, block: CnnBlock) -> int:
    return sum(cin if kind == "avgpool" else width for kind, width in block.branches)


class Cnn(nn.Module):
    def __init__(self, spec: CnnSpec) -> None:
        super().__init__()
        self.spec = spec
        self.stem = nn.Sequential(conv_bn(spec.in_ch, spec.stem, 3), nn.ReLU(inplace=True))
        blocks = []
        c = spec.stem
        for block in spec.blocks:
            if block.kind == "conv":
                blocks.append(ConvBlock(c, block))
                c = block.channels
            elif block.kind == "res":
                blocks.append(ResBlock(c, block))
                c = block.channels
            elif block.kind == "twin":
                blocks.append(TwinCnn(c, block))
                c = block.channels
            else:
                blocks.append(InceptionCnn(c, block))
                c = cnn_inception_width(c, block)
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c, spec.classes)

    def forward(self, x, scale: float = 2.0, pool: str = "avg"):
        features = self.blocks(self.stem(x))
        if pool == "avg":
            pooled = torch.flatten(F.adaptive_avg_pool2d(features, 1), 1)
        else:
            pooled = torch.flatten(F.adaptive_max_pool2d(features, 1), 1)
        logits = self.fc(pooled) * scale
        if self.spec.outputs == "tuple":
            return logits, features
        if self.spec.outputs == "dict":
            return {"logits": logits, "pooled": pooled}
        return logits


# --------------------------------------------------------------------------------------------
# building a case
# --------------------------------------------------------------------------------------------

@dataclass
class Case:
    """A built model with the arguments of one call (tensors are the example values).

    ``make_call(batch, seed)`` builds another call of the same structure: other values, and
    another batch size.
    """

    spec: Any
    model: nn.Module
    make_call: Callable[[int, int], tuple[tuple, dict]]
    grad_inputs: list[str] = field(default_factory=list)  # names of tensor inputs that require grad
    call_style: str = "tuple"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.args, self.kwargs = self.make_call(self.spec.batch, 0)

    def compile_kwargs(self) -> dict:
        """``example_inputs`` (and ``example_kwargs``) for ``flatpack.compile``."""
        if not self.kwargs:
            if len(self.args) == 1 and isinstance(self.args[0], torch.Tensor):
                return {"example_inputs": self.args[0]}
            return {"example_inputs": self.args}
        if not self.args:
            return {"example_inputs": dict(self.kwargs)}
        return {"example_inputs": self.args, "example_kwargs": dict(self.kwargs)}

    def fresh_call(self, batch: int | None = None, seed: int = 0) -> tuple[tuple, dict, dict[str, torch.Tensor]]:
        """New leaf tensors for a call (the example's values by default), and those that require
        grad by name."""
        if batch is None:
            source_args, source_kwargs = self.args, self.kwargs
        else:
            source_args, source_kwargs = self.make_call(batch, seed)
        leaves: dict[str, torch.Tensor] = {}

        def copy(name: str, value: Any) -> Any:
            if isinstance(value, dict):
                return {key: copy(key, item) for key, item in value.items()}
            if not isinstance(value, torch.Tensor):
                return value
            fresh = value.detach().clone().requires_grad_(name in self.grad_inputs)
            leaves[name] = fresh
            return fresh

        names = list(_forward_names(self.model))
        args = tuple(copy(names[i], value) for i, value in enumerate(source_args))
        kwargs = {key: copy(key, value) for key, value in source_kwargs.items()}
        return args, kwargs, leaves

    def restyled(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The same call in ``call_style``: positional, by keyword, or mixed."""
        names = list(_forward_names(self.model))
        bound = dict(zip(names, args)) | kwargs
        ordered = [(name, bound[name]) for name in names if name in bound]
        # positional use needs every earlier parameter present
        prefix = 0
        while prefix < len(ordered) and ordered[prefix][0] == names[prefix]:
            prefix += 1
        if self.call_style == "tuple":
            cut = prefix
        elif self.call_style == "dict":
            cut = 0
        else:
            cut = min(prefix, 1)
        return tuple(v for _, v in ordered[:cut]), dict(ordered[cut:])


def _forward_names(model: nn.Module) -> list[str]:
    return list(inspect.signature(model.forward).parameters)


def _seeded_model(seed: int, make) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
        model = model.to(DTYPE)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                assert module.running_mean is not None and module.running_var is not None
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 1.5)
                module.weight.data.uniform_(0.5, 1.5)
                module.bias.data.uniform_(-0.5, 0.5)
            if isinstance(module, Float32Block):
                module.float()
    return model


def build_case(spec: VectorSpec | CnnSpec) -> Case:
    if isinstance(spec, CnnSpec):
        model = _seeded_model(spec.seed, lambda: Cnn(spec))
        if spec.wrap_dict:
            model = CnnDictInputs(model)
        model.train(spec.train)

        def cnn_call(batch: int, seed: int) -> tuple[tuple, dict]:
            generator = torch.Generator().manual_seed(spec.seed + 1 + 7919 * seed)
            x = torch.randn(batch, spec.in_ch, spec.size, spec.size, generator=generator, dtype=DTYPE)
            kwargs: dict[str, Any] = {} if spec.scale is None else {"scale": spec.scale}
            if spec.pool is not None:
                kwargs["pool"] = spec.pool
            return ({"x": x} if spec.wrap_dict else x,), kwargs

        return Case(spec, model, cnn_call, ["x"] if spec.x_grad else [], "tuple")

    model = _seeded_model(spec.seed, lambda: BlockNet(spec))
    model.eval()
    inputs = spec.inputs
    grad = ["x"] if inputs.x_grad and spec.family == "vector" else []
    grad += ["y"] if inputs.y else []
    grad += ["mask"] if inputs.mask != "none" and inputs.mask_grad else []
    grad += ["bias"] if inputs.bias == "tensor" else []
    if spec.wrap_dict:
        model = DictInputs(model)

    def vector_call(batch: int, seed: int) -> tuple[tuple, dict]:
        generator = torch.Generator().manual_seed(spec.seed + 1 + 7919 * seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator, dtype=DTYPE)

        lead = (batch, spec.seq) if spec.family == "token" else (batch,)
        if spec.family == "token":
            x = torch.randint(0, spec.vocab, lead, generator=generator)
        else:
            x = randn(*lead, spec.d_in)
        values: dict[str, Any] = {"x": x}
        if inputs.y:
            values["y"] = randn(*lead, 3)
        if inputs.mask != "none":
            values["mask"] = torch.rand(*lead, 1, generator=generator, dtype=DTYPE)
        if inputs.bias == "none":
            values["bias"] = None
        elif inputs.bias == "tensor":
            values["bias"] = randn(*lead, 1)
        constants: dict[str, Any] = {}
        if inputs.scale is not None:
            constants["scale"] = inputs.scale
        if inputs.repeat is not None:
            constants["repeat"] = inputs.repeat
        if spec.wrap_dict:
            return (values,), constants
        names = ["x", "y", "mask", "bias", "scale", "repeat"]
        everything = {**values, **constants}
        if inputs.compile_style == "dict":
            return (), everything
        # positional while the parameters are consecutive from the start, the rest by keyword
        args = []
        for name in names:
            if name not in everything:
                break
            args.append(everything.pop(name))
        if inputs.compile_style == "mixed" and len(args) > 1:
            everything = {**dict(zip(names[1:], args[1:])), **everything}
            args = args[:1]
        return tuple(args), everything

    return Case(spec, model, vector_call, grad, inputs.call_style)


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------

seeds = st.integers(0, 2**16)
widths = st.integers(2, 6)


@st.composite
def blocks(draw, family: str = "vector", kind: str | None = None) -> Block:
    kinds = VECTOR_BLOCKS + (TOKEN_ONLY_BLOCKS if family == "token" else ())
    kind = kind or draw(st.sampled_from(kinds))
    act = draw(st.sampled_from(ACTIVATIONS))
    inplace = tuple(draw(st.lists(st.sampled_from(INPLACE_OPS), max_size=3)))
    width = draw(widths)
    if kind == "inception":
        branches = tuple(draw(st.lists(st.tuples(st.sampled_from(BRANCH_KINDS), widths), min_size=2, max_size=4)))
        return Block(kind, width, branches=branches)
    if kind == "residual":
        return Block(kind, width, act, inplace, style=draw(st.sampled_from(("add", "iadd", "add_"))))
    if kind == "attention":
        return Block(kind, width, style=draw(st.sampled_from(("manual", "sdpa"))))
    if kind == "again":
        return Block(kind, width, act, ref=draw(st.integers(0, 7)))
    if kind in ("linear", "loop"):
        return Block(kind, width, act, inplace if kind == "linear" else ())
    return Block(kind, width)


@st.composite
def vector_specs(draw, family: str | None = None, wrap_dict: bool | None = None) -> VectorSpec:
    family = family or draw(st.sampled_from(("vector", "token")))
    # distinct kinds from a permutation (so that every kind shows up often), then a few repeats
    kinds = draw(st.permutations(VECTOR_BLOCKS + (TOKEN_ONLY_BLOCKS if family == "token" else ())))
    chosen = list(kinds[:draw(st.integers(1, 5))]) + draw(st.lists(st.sampled_from(kinds), max_size=2))
    block_list = tuple(draw(blocks(family, kind)) for kind in chosen)
    wrap = draw(st.integers(0, 3)) == 0 if wrap_dict is None else wrap_dict
    output_kinds = ("tensor", "tuple", "dict", "list", "nested", "namedtuple")
    inputs = Inputs(
        mask=draw(st.sampled_from(("none", "raw", "derived", "bool"))),
        mask_grad=draw(st.booleans()),
        y=draw(st.booleans()),
        bias=draw(st.sampled_from(("default", "none", "tensor"))),
        scale=draw(st.none() | st.sampled_from((0.5, -1.25, 3.0))),
        repeat=draw(st.none() | st.integers(0, 3)),
        x_grad=draw(st.booleans()),
        compile_style=draw(st.sampled_from(("tuple", "dict", "mixed"))),
        call_style=draw(st.sampled_from(("tuple", "dict", "mixed"))),
    )
    outputs = Outputs(
        kind=draw(st.sampled_from(output_kinds)),
        hidden_at=draw(st.none() | st.integers(0, 5)),
        echo_mask=draw(st.booleans()),
        free_param=draw(st.booleans()),
        constant=draw(st.booleans()),
        argmax=draw(st.booleans()),
    )
    return VectorSpec(
        family=family,
        seed=draw(seeds),
        batch=draw(st.integers(1, 3)),
        d_in=draw(widths),
        seq=draw(st.integers(1, 4)),
        vocab=draw(st.integers(3, 9)),
        blocks=block_list,
        d_out=draw(st.integers(1, 4)),
        head_tie=draw(st.sampled_from(("untied", "functional", "assigned"))),
        inputs=inputs,
        outputs=outputs,
        frozen=tuple(draw(st.lists(st.integers(0, 50), max_size=2))),
        unused_param=draw(st.booleans()),
        wrap_dict=wrap,
    )


@st.composite
def cnn_blocks(draw) -> CnnBlock:
    kind = draw(st.sampled_from(("conv", "res", "res", "inception", "twin")))
    channels = draw(st.integers(1, 5))
    if kind == "inception":
        branches = tuple(draw(st.lists(st.tuples(st.sampled_from(("conv1", "conv3", "maxpool", "avgpool")),
                                                 st.integers(1, 4)), min_size=2, max_size=4)))
        return CnnBlock(kind, channels, branches=branches)
    return CnnBlock(kind, channels, draw(st.sampled_from((1, 1, 2))), style=draw(st.sampled_from(("iadd", "add"))))


@st.composite
def cnn_specs(draw, train: bool = False) -> CnnSpec:
    return CnnSpec(
        seed=draw(seeds),
        batch=draw(st.integers(2, 3) if train else st.integers(1, 2)),
        in_ch=draw(st.integers(1, 3)),
        size=draw(st.integers(3, 6)),
        stem=draw(st.integers(1, 4)),
        blocks=tuple(draw(st.lists(cnn_blocks(), min_size=1, max_size=3))),
        classes=draw(st.integers(1, 4)),
        outputs=draw(st.sampled_from(("tensor", "tuple", "dict"))),
        scale=draw(st.none() | st.sampled_from((0.5, 3.0))),
        pool=draw(st.none() | st.sampled_from(("avg", "max"))),
        x_grad=draw(st.booleans()),
        train=train,
        wrap_dict=draw(st.integers(0, 4)) == 0,
    )


def model_specs() -> st.SearchStrategy:
    """Any model family, weighted towards the cheap ones."""
    return st.one_of(vector_specs("vector"), vector_specs("token"), cnn_specs())


# pass pipelines ------------------------------------------------------------------------------

@dataclass(frozen=True)
class PassStep:
    name: str  # fuse-elementwise | merge-branches | coarsen
    max_layers: int | None = None
    by: str | None = None

    def text(self) -> str:
        if self.name != "coarsen" or (self.max_layers is None and self.by is None):
            return self.name
        options = []
        if self.max_layers is not None:
            options.append(f"max-layers={self.max_layers}")
        if self.by is not None:
            options.append(f"by={self.by}")
        return f"coarsen{{{','.join(options)}}}"

    def as_object(self):
        if self.name == "fuse-elementwise":
            return FuseElementwise()
        if self.name == "merge-branches":
            return MergeBranches()
        kwargs = {}
        if self.max_layers is not None:
            kwargs["max_layers"] = self.max_layers
        if self.by is not None:
            kwargs["by"] = self.by
        return Coarsen(**kwargs)


@dataclass(frozen=True)
class Pipeline:
    steps: tuple[PassStep, ...]
    form: str  # string | names | objects

    @property
    def value(self) -> str | list:
        """What ``flatpack.compile(passes=...)`` receives."""
        if self.form == "string":
            return ",".join(step.text() for step in self.steps)
        if self.form == "names":
            return [step.text() for step in self.steps]
        return [step.as_object() for step in self.steps]


pass_steps = st.one_of(
    st.just(PassStep("fuse-elementwise")),
    st.just(PassStep("merge-branches")),
    st.builds(PassStep, st.just("coarsen"), st.none() | st.integers(1, 8),
              st.none() | st.sampled_from(("time", "params", "activation"))),
)


def pipelines(max_size: int = 4) -> st.SearchStrategy[Pipeline]:
    return st.builds(Pipeline, st.lists(pass_steps, max_size=max_size).map(tuple),
                     st.sampled_from(("string", "names", "objects")))


# plans ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanChoice:
    mode: str  # balanced | cuts
    stages: int = 1
    cuts: tuple[int, ...] = ()

    def compile_kwargs(self, num_layers: int) -> dict:
        if self.mode == "balanced":
            return {"stages": self.stages}
        return {"plan": flatpack.Plan.from_cuts(list(self.cuts), num_layers)}


def plans(num_layers: int) -> st.SearchStrategy[PlanChoice]:
    """A stage count for the balanced solver, or explicit cut positions (every layer, none, random)."""
    boundaries = list(range(num_layers - 1))
    return st.one_of(
        st.builds(PlanChoice, st.just("balanced"), st.integers(1, num_layers)),
        st.builds(PlanChoice, st.just("cuts"), st.just(1), st.just(tuple(boundaries))),
        st.builds(PlanChoice, st.just("cuts"), st.just(1),
                  st.lists(st.sampled_from(boundaries), unique=True).map(lambda c: tuple(sorted(c)))
                  if boundaries else st.just(())),
    )
