"""Image classifiers in plain torch, laid out like torchvision's so parameter counts match.

Every builder takes ``size`` ("full": the paper's network at 224x224; "tiny": the same block
types and layer pattern with narrow channels at 32x32 or 64x64) and a batch size.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

# torchvision's VGG configurations: channel counts, "M" is a 2x2 max pool.
VGG_LAYERS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"],
}
RESNET_DEPTHS: dict[int, tuple[int, int, int, int]] = {
    34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
# Tiny models divide every channel count by this and keep the layer pattern.
TINY_WIDTH_DIVISOR = 8


class VGG(nn.Module):
    def __init__(self, layers: Sequence[int | str], pool: int = 7, hidden: int = 4096,
                 classes: int = 1000) -> None:
        super().__init__()
        modules: list[nn.Module] = []
        channels = 3
        for item in layers:
            if item == "M":
                modules.append(nn.MaxPool2d(2, 2))
            else:
                modules += [nn.Conv2d(channels, int(item), 3, padding=1), nn.ReLU()]
                channels = int(item)
        self.features = nn.Sequential(*modules)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden), nn.ReLU(), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class AlexNet(nn.Module):
    def __init__(self, widths: Sequence[int] = (64, 192, 384, 256, 256), pool: int = 6,
                 hidden: int = 4096, classes: int = 1000) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = widths
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c3, c4, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c4, c5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Dropout(), nn.Linear(c5 * pool * pool, hidden), nn.ReLU(),
            nn.Dropout(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
            nn.BatchNorm2d(cout)]


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(*_conv_bn(cin, cout, 1, stride))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions; output width ``planes``."""

    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int, inner_scale: float = 1.0) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(cin, planes, 3, stride), nn.ReLU(), *_conv_bn(planes, planes, 3))
        self.shortcut = _shortcut(cin, planes, stride)
        self.relu = nn.ReLU()  # a module, as torchvision's, so per-layer profilers see the block output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (stride here, as torchvision v1.5), 1x1 expand to ``4 * planes``.

    ``inner_scale`` widens only the two inner convolutions: that is WRN-50-k.
    """

    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int, inner_scale: float = 1.0) -> None:
        super().__init__()
        inner, cout = int(planes * inner_scale), planes * self.expansion
        self.body = nn.Sequential(*_conv_bn(cin, inner, 1), nn.ReLU(), *_conv_bn(inner, inner, 3, stride),
                                  nn.ReLU(), *_conv_bn(inner, cout, 1))
        self.shortcut = _shortcut(cin, cout, stride)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], depths: Sequence[int],
                 planes: Sequence[int] = (64, 128, 256, 512), stem: int = 64, inner_scale: float = 1.0,
                 classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, stem, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1))
        stages: list[nn.Module] = []
        cin = stem
        for index, (depth, width) in enumerate(zip(depths, planes)):
            blocks = []
            for b in range(depth):
                stride = 2 if index > 0 and b == 0 else 1
                blocks.append(block(cin, width, stride, inner_scale))
                cin = width * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.stages(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(features, 1), 1))


def _image(size: str, batch: int, full: int = 224, tiny: int = 32) -> tuple[torch.Tensor]:
    side = full if size == "full" else tiny
    return (torch.randn(batch, 3, side, side),)


def vgg(depth: int, size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    if size == "full":
        return VGG(VGG_LAYERS[depth]).eval(), _image(size, batch)
    # Twice the usual divisor: VGG's five pools leave 1x1 at 32x32, so 32 channels suffice.
    layers = [item if item == "M" else int(item) // (2 * TINY_WIDTH_DIVISOR) for item in VGG_LAYERS[depth]]
    return VGG(layers, pool=1, hidden=64, classes=10).eval(), _image(size, batch)


def alexnet(size: str = "tiny", batch: int = 1) -> tuple[nn.Module, tuple]:
    if size == "full":
        return AlexNet().eval(), _image(size, batch)
    # 64x64 is the smallest side that survives the stride-4 stem and three 3x3/2 pools.
    widths = [w // TINY_WIDTH_DIVISOR for w in (64, 192, 384, 256, 256)]
    return AlexNet(widths, pool=1, hidden=64, classes=10).eval(), _image(size, batch, tiny=64)


def _tiny_depths(depth: int) -> list[int]:
    # A quarter of the blocks per stage (at least one) keeps ResNet-101/152 deeper than ResNet-50.
    return [math.ceil(n / 4) for n in RESNET_DEPTHS[depth]]


def resnet(depth: int, size: str = "tiny", batch: int = 1, widen: int = 1) -> tuple[nn.Module, tuple]:
    """ResNet-``depth``; ``widen`` k > 1 gives Gillis's WRN-``depth``-k.

    WRN-34-k widens every stage of the basic-block net k times (the stem stays 64 wide);
    WRN-50-k widens only the bottleneck's inner convolutions, as torchvision's wide_resnet50_2.
    """
    block = BasicBlock if depth < 50 else Bottleneck
    divisor = 1 if size == "full" else TINY_WIDTH_DIVISOR
    planes = [p // divisor for p in (64, 128, 256, 512)]
    depths = RESNET_DEPTHS[depth] if size == "full" else _tiny_depths(depth)
    stem = 64 // divisor
    classes = 1000 if size == "full" else 10
    if block is BasicBlock:
        model = ResNet(block, depths, [p * widen for p in planes], stem, classes=classes)
    else:
        model = ResNet(block, depths, planes, stem, inner_scale=widen, classes=classes)
    return model.eval(), _image(size, batch)
