"""A model with dropout on (p = 0.1), for ``flatpack run`` given as ``path/to/file.py:factory``."""

from __future__ import annotations

import torch
from torch import nn


def mlp_with_dropout() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(64, 10))
    return model, (torch.randn(8, 16),)
