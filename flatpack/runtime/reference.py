"""Single-process training of the original model: what a pipelined run must equal.

The same optimizer spec and loss on the same global batches, the loss a mean over the
global batch. ``flatpack demo`` and the equivalence tests compare a run's final
parameters with these.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flatpack.runtime.optim import OptimizerSpec, loss_value


def first_output(output: Any) -> torch.Tensor:
    """The model's first tensor output (a tensor, the first of a tuple, or a ModelOutput's first field)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return first_output(next(iter(output.values())))
    if isinstance(output, (tuple, list)):
        return first_output(output[0])
    raise TypeError(f"cannot find a tensor in the model's output of type {type(output).__name__}")


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def train_single_process(model: nn.Module, batches: Sequence[Any] | Callable[[int], Any], iterations: int, *,
                         optimizer: OptimizerSpec | str | dict = "sgd", loss: str = "cross_entropy",
                         copy_model: bool = True) -> tuple[nn.Module, list[float]]:
    """Trains (a copy of) ``model`` for ``iterations`` global batches; returns it and the losses."""
    trained = copy.deepcopy(model) if copy_model else model
    trained.train()
    spec = OptimizerSpec.of(optimizer)
    opt = spec.build(p for p in trained.parameters() if p.requires_grad)
    batch_for = batches if callable(batches) else batches.__getitem__
    losses = []
    for iteration in range(iterations):
        inputs, target = batch_for(iteration)
        opt.zero_grad(set_to_none=True)
        value = loss_value(loss, first_output(call(trained, inputs)), target)
        value.backward()
        opt.step()
        losses.append(float(value.detach()))
    return trained, losses
