"""Gillis's RNN-k: k stacked LSTM layers of 2048 hidden units (Gillis §V, after Jozefowicz et al.).

Each layer is its own ``nn.LSTM`` module so a partitioner can cut between layers. The input
is a sequence of 2048-wide embeddings: there is no embedding table or softmax, because
Gillis's "up to 9 layers fit one 1.4 GB function" matches the LSTM weights alone
(9 x 134 MB). Gillis gives no sequence length; 20 steps is Jozefowicz et al.'s unroll.
"""

from __future__ import annotations

import torch
from torch import nn

FULL_HIDDEN = 2048
FULL_STEPS = 20


class StackedLSTM(nn.Module):
    def __init__(self, layers: int, hidden: int = FULL_HIDDEN) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x, _ = layer(x)
        return x


def rnn(layers: int, size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    """RNN-``layers`` on a (batch, steps, hidden) embedding sequence; tiny: 16 units, 5 steps."""
    hidden, steps = (FULL_HIDDEN, FULL_STEPS) if size == "full" else (16, 5)
    return StackedLSTM(layers, hidden).eval(), (torch.randn(batch, steps, hidden),)
