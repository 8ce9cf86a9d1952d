"""Small hand-written models the unit tests share."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class Residual(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(x + self.second(torch.tanh(self.first(x))))


class ResidualStack(nn.Module):
    def __init__(self, width: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.blocks = nn.Sequential(*(Residual(width) for _ in range(blocks)))
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class Inception(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.a = nn.Conv2d(channels, channels, 1)
        self.b = nn.Conv2d(channels, channels, 3, padding=1)
        self.c = nn.Sequential(nn.Conv2d(channels, channels, 1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1))
        self.out = nn.Conv2d(3 * channels, channels, 1)

    def forward(self, x):
        return self.out(torch.cat([self.a(x), self.b(x), self.c(x)], dim=1))


class MaskedEncoder(nn.Module):
    """A mask computed once from an input and used by every layer, like BERT's attention mask."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, mask):
        keep = (mask > 0).unsqueeze(-1)
        for layer in self.layers:
            x = torch.where(keep, torch.tanh(layer(x)), x)
        return x


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)

    def forward(self, x):
        y = self.gate(x)
        if y.sum() > 0:
            return y * 2
        return y


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.router = DataDependent()

    def forward(self, x):
        return self.router(self.encoder(x))


class ConvBlocks(nn.Module):
    """Conv → batch norm → ReLU, a second conv plus a per-pixel term of the input (a whole
    value broadcast against split channels), pooling over space and a linear head: the ops
    a channel split cuts (``stage/channels.py``)."""

    def __init__(self, channels: int = 3, width: int = 8, out: int = 6, classes: int = 5) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(channels, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, out, 3, padding=1)
        self.head = nn.Linear(out, classes)

    def forward(self, x):
        y = torch.relu(self.bn(self.c1(x)))
        y = self.c2(y) + x.mean(1, keepdim=True)
        return self.head(torch.relu(y).mean((2, 3)))


class TinyTransformer(nn.Module):
    """Pre-norm transformer blocks (multi-head attention, then a GELU MLP, each with a
    residual) and a linear head."""

    def __init__(self, width: int = 8, heads: int = 2, blocks: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_TransformerBlock(width, heads) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        normed = self.ln1(x)
        x = x + self.attention(normed, normed, normed, need_weights=False)[0]
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))
