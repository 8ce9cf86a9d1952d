"""The batch rules, defined once: which values a batch is cut along, and how many samples a
batch has. A value belongs to the batch when it is a tensor whose first dimension is the
batch's size; anything else (a mask without a batch dimension, a size, a shared table) goes
whole to every piece. The runtimes' micro-batches (``runtime.spec.split_value``), the
fork-join's partitions (``runtime.forkjoin``) and the profiler's resized inputs all ask here."""

from __future__ import annotations

from typing import Any, Iterable

import torch


def has_batch_dimension(value: Any, batch: int) -> bool:
    """Whether ``value`` is cut with a batch of ``batch`` samples."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def batch_rows(values: Iterable[Any]) -> int | None:
    """Samples in a batch: the first dimension of its first tensor that has one; None when
    no value is such a tensor."""
    return next((int(value.shape[0]) for value in values if isinstance(value, torch.Tensor) and value.dim()), None)
