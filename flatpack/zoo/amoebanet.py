"""AmoebaNet-D as GPipe trained it, after torchgpipe's benchmark model (kakaobrain/torchgpipe).

``N`` normal cells in three groups of N/3, a reduction cell between groups, an ImageNet stem
(a stride-2 convolution and two reduction cells) and ``filters`` F: the first group's cells
are F wide, each reduction doubles that. The genotype and the normal cell's concat
[0, 3, 4, 6] follow TensorFlow's reference implementation, which reproduces GPipe's
parameter counts. Unlike torchgpipe, ``max_pool_3x3`` here is a max pool (torchgpipe's is
an average pool); parameters are the same either way.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def _relu_conv_bn(cin: int, cout: int, kernel: int | tuple[int, int] = 1,
                  stride: int | tuple[int, int] = 1, padding: int | tuple[int, int] = 0) -> list[nn.Module]:
    return [nn.ReLU(), nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout)]


class FactorizedReduce(nn.Module):
    """Halves the resolution with two offset stride-2 1x1 convolutions, so no pixel is dropped."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(cin, cout - cout // 2, 1, stride=2, bias=False)
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(x)
        return self.bn(torch.cat([self.conv1(x), self.conv2(self.pad(x[:, :, 1:, 1:]))], dim=1))


def none(c: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else FactorizedReduce(c, c)


def avg_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride, padding=1, count_include_pad=False)


def max_pool_3x3(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride, padding=1)


def max_pool_2x2(c: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(2, stride)


def conv_1x1(c: int, stride: int) -> nn.Module:
    return nn.Sequential(*_relu_conv_bn(c, c, 1, stride))


def conv_3x3(c: int, stride: int) -> nn.Module:
    return nn.Sequential(*_relu_conv_bn(c, c // 4), *_relu_conv_bn(c // 4, c // 4, 3, stride, 1),
                         *_relu_conv_bn(c // 4, c))


def conv_1x7_7x1(c: int, stride: int) -> nn.Module:
    q = c // 4
    return nn.Sequential(*_relu_conv_bn(c, q), *_relu_conv_bn(q, q, (1, 7), (1, stride), (0, 3)),
                         *_relu_conv_bn(q, q, (7, 1), (stride, 1), (3, 0)), *_relu_conv_bn(q, c))


Op = Callable[[int, int], nn.Module]
# (input state, operation) pairs; each two consecutive pairs are summed into a new state.
NORMAL_OPERATIONS: list[tuple[int, Op]] = [
    (1, conv_1x1), (1, max_pool_3x3), (1, none), (0, conv_1x7_7x1), (0, conv_1x1),
    (0, conv_1x7_7x1), (2, max_pool_3x3), (2, none), (1, avg_pool_3x3), (5, conv_1x1)]
NORMAL_CONCAT = [0, 3, 4, 6]
REDUCTION_OPERATIONS: list[tuple[int, Op]] = [
    (0, max_pool_2x2), (0, max_pool_3x3), (2, none), (1, conv_3x3), (2, conv_1x7_7x1),
    (2, max_pool_3x3), (3, none), (1, max_pool_2x2), (2, avg_pool_3x3), (3, conv_1x1)]
REDUCTION_CONCAT = [4, 5, 6]


class Cell(nn.Module):
    """One AmoebaNet cell: (output of the cell before last, output of the last cell) -> output."""

    def __init__(self, c_prev_prev: int, c_prev: int, c: int, reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        self.reduce_prev = nn.Sequential(*_relu_conv_bn(c_prev, c))
        self.reduce_prev_prev: nn.Module = nn.Identity()
        if reduction_prev:
            self.reduce_prev_prev = FactorizedReduce(c_prev_prev, c)
        elif c_prev_prev != c:
            self.reduce_prev_prev = nn.Sequential(*_relu_conv_bn(c_prev_prev, c))
        genotype = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
        self.indices = [index for index, _ in genotype]
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        # Only ops reading the cell inputs (states 0 and 1) reduce the resolution.
        self.operations = nn.ModuleList(op(c, 2 if reduction and index < 2 else 1) for index, op in genotype)
        self.out_channels = c * len(self.concat)

    def forward(self, prev_prev: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        states = [self.reduce_prev(prev), self.reduce_prev_prev(prev_prev)]
        for i in range(0, len(self.operations), 2):
            left = self.operations[i](states[self.indices[i]])
            right = self.operations[i + 1](states[self.indices[i + 1]])
            states.append(left + right)
        return torch.cat([states[i] for i in self.concat], dim=1)


class AmoebaNetD(nn.Module):
    def __init__(self, normal_cells: int = 18, filters: int = 256, classes: int = 1000) -> None:
        super().__init__()
        if normal_cells % 3:
            raise ValueError(f"AmoebaNet-D needs a multiple of 3 normal cells, got {normal_cells}")
        c = filters // 4
        self.stem = nn.Sequential(nn.ReLU(), nn.Conv2d(3, c, 3, stride=2, padding=1, bias=False),
                                  nn.BatchNorm2d(c))
        self._c_prev_prev = self._c_prev = self._c = c
        self._reduction_prev = False
        cells = [self._cell(True, 2), self._cell(True, 2)]  # the rest of the ImageNet stem
        for group in range(3):
            if group:
                cells.append(self._cell(True, 2))
            cells += [self._cell(False, 1) for _ in range(normal_cells // 3)]
        self.cells = nn.ModuleList(cells)
        self.fc = nn.Linear(self._c_prev, classes)

    def _cell(self, reduction: bool, scale: int) -> Cell:
        self._c *= scale
        cell = Cell(self._c_prev_prev, self._c_prev, self._c, reduction, self._reduction_prev)
        self._c_prev_prev, self._c_prev, self._reduction_prev = self._c_prev, cell.out_channels, reduction
        return cell

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prev_prev = prev = self.stem(x)
        for cell in self.cells:
            prev_prev, prev = prev, cell(prev_prev, prev)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(prev, 1), 1))


def amoebanet_d(normal_cells: int, size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    """AmoebaNet-D (N, F=256) at 224x224; tiny: N/6 normal cells, F=32, at 32x32."""
    if size == "full":
        return AmoebaNetD(normal_cells, 256).eval(), (torch.randn(batch, 3, 224, 224),)
    # One (D18) or two (D36) normal cells per group: same cell types and reductions, 5 pools to 1x1.
    return AmoebaNetD(normal_cells // 6, 32, classes=10).eval(), (torch.randn(batch, 3, 32, 32),)
