"""Optimizers and losses a run names: plain data that travels to every worker as JSON, so
that each stage builds the same optimizer over its own parameters and the last stage
applies the same loss (no pickled callables cross a process boundary)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import torch
from torch import nn

from flatpack.errors import InputError

OPTIMIZERS = ("sgd", "adam")
LOSSES = ("cross_entropy", "mse", "output")


@dataclass(frozen=True)
class OptimizerSpec:
    """``sgd`` (with ``momentum``, as FuncPipe trains) or ``adam``; the same spec builds the
    single-process reference, so both apply the very same update."""

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            import difflib

            close = difflib.get_close_matches(str(self.name), OPTIMIZERS, n=1, cutoff=0.4)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise InputError(f"optimizer {self.name!r} is not one of {', '.join(OPTIMIZERS)}{hint}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise InputError(f"the learning rate must be positive and finite, got {self.lr}")
        for key in ("momentum", "weight_decay", "eps"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise InputError(f"optimizer option {key!r} must be a finite number >= 0, got {value!r}")

    def build(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = list(parameters)
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
        return torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "OptimizerSpec":
        """The spec of an option dict; a key the spec has no field for, or a value of the
        wrong kind, is an InputError naming it and the valid ones (not a TypeError)."""
        import difflib
        from dataclasses import fields

        valid = [f.name for f in fields(cls)]
        unknown = [key for key in data if key not in valid]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise InputError(f"optimizer option {', '.join(hints)} is not known; the options are: "
                             f"{', '.join(valid)}")
        for key in ("lr", "momentum", "weight_decay", "eps"):
            value = data.get(key)
            if key in data and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise InputError(f"optimizer option {key!r} must be a number, got {value!r}")
        betas = data.get("betas", (0.9, 0.999))
        if (not isinstance(betas, (tuple, list)) or len(betas) != 2
                or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
            raise InputError(f"optimizer option 'betas' must be two numbers in [0, 1), got {betas!r}")
        return cls(**{**data, "betas": tuple(betas)})

    @classmethod
    def of(cls, value: "OptimizerSpec | str | dict") -> "OptimizerSpec":
        if isinstance(value, OptimizerSpec):
            return value
        if isinstance(value, str):
            return cls(name=value)
        if isinstance(value, dict):
            return cls.from_json(value)
        raise InputError(f"optimizer must be a name ({', '.join(OPTIMIZERS)}), a dict or an OptimizerSpec, "
                         f"got {type(value).__name__}")


def check_loss(name: str) -> str:
    """A loss a run can name: one of :data:`LOSSES`. A function named ``package.module:function``
    is refused: the loss travels to the workers in the run's settings, which live in the
    store, and a worker never imports code that data names (docs/security.md); a model that
    computes its own loss (``"output"``) covers any other loss."""
    if isinstance(name, str) and ":" in name:
        raise InputError(f"loss {name!r}: a loss function named by module is not supported: the workers would "
                         "import code named in the run's settings, which live in the store (docs/security.md). "
                         f"Use one of {', '.join(LOSSES)}, or wrap the model so that its forward returns the loss "
                         "('output')")
    if name not in LOSSES:
        raise InputError(f"loss {name!r} is not one of {', '.join(LOSSES)} ('output': the model returns its own "
                         "scalar loss)")
    return name


def loss_value(name: str, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """The mean loss of one batch or micro-batch; ``output`` is the model's first output."""
    if name == "output":
        return output.mean()
    if target is None:
        raise InputError(f"loss {name!r} needs targets: give (inputs, target) batches")
    if name == "cross_entropy":
        return nn.functional.cross_entropy(output, target)
    return nn.functional.mse_loss(output, target)
