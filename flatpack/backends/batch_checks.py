"""Checks of a ``train()`` call's data and settings before anything is launched.

``FunctionDeployment.train`` calls :func:`check_training_call` before it starts a function:
each batch's inputs against the compiled example (which input, expected and got: shape
beyond the batch dimension and dtype), one batch size for every batch (and for every call:
replicas would otherwise average unequal shards), a batch that the runtime can cut into its
micro-batches, non-finite inputs (warn, stop or ignore) and the optimizer spec. A sequence
of batches is checked in full (shapes and dtypes are cheap); a function of the iteration is
asked for its first batch only, and :func:`check_batch` can check each later one as it is
uploaded.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from flatpack.batching import batch_rows
from flatpack.compiler import Compiled
from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec
from flatpack.stage.manifest import ValueEntry
from flatpack.stage.settings import NON_FINITE
from flatpack.stage.tensor_check import TensorSpec, check_tensor
from flatpack.table import plural


def example_inputs(compiled: Any) -> dict[str, ValueEntry]:
    """The compiled example's data inputs by name: ``kind``, ``shape`` (the batch first) and ``dtype``."""
    names = list(compiled.info.input_names)
    found: dict[str, ValueEntry] = {}
    for artifact in compiled.artifacts:
        for entry in artifact.manifest.inputs:
            if entry.name in names:
                found.setdefault(entry.name, entry)
    return found


def inputs_and_target(batch: Any, iteration: int) -> tuple[Any, Any]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise InputError(f"batch {iteration} must be (inputs, target), got {type(batch).__name__}")
    return batch[0], batch[1]


def batch_values(compiled: Compiled, batch: Any, iteration: int) -> tuple[dict[str, Any], Any, int]:
    """A global ``(inputs, target)`` batch as the runtimes take it: the input leaves by input
    name, the target, and the batch's rows (its first batched input's)."""
    inputs, target = inputs_and_target(batch, iteration)
    leaves = compiled.input_leaves(inputs)
    rows = batch_rows(leaves)
    if rows is None:
        raise InputError(f"batch {iteration}'s inputs have no batch dimension (no tensor with one); a pipeline cuts "
                         "the batch into micro-batches along the first dimension of its inputs")
    return dict(zip(compiled.info.input_names, leaves)), target, rows


def check_batch(compiled: Any, batch: Any, index: int, *, batch_size: int | None = None,
                non_finite: str = "warn") -> int:
    """Checks batch ``index`` (``(inputs, target)``) against the compiled example; returns
    its batch size. ``batch_size``: the size every batch must have (the first batch's)."""

    if non_finite not in NON_FINITE:
        raise InputError(f"non_finite must be one of {', '.join(NON_FINITE)}, got {non_finite!r}")
    try:
        values, target, rows = batch_values(compiled, batch, index)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - the inputs' structure does not match the model's signature
        raise InputError(f"batch {index}'s inputs do not match the compiled model's inputs "
                         f"({', '.join(compiled.info.input_names)}): {err}. Give inputs structured like the "
                         "example the model was compiled with") from None
    expected = example_inputs(compiled)
    for name, value in values.items():
        entry = expected.get(name)
        if entry is None or not entry.is_tensor:
            continue
        # the batch dimension is free; so are the others a graph traced with dynamic shapes leaves free
        check_tensor(name, value, TensorSpec.of_entry(entry, default_free=(0,)), where=f"batch {index}: ",
                     fix="Reshape or convert the input, or compile with an example of this shape.")
        if value.dim() and value.shape[0] != rows:
            raise InputError(f"batch {index}: input {name!r} has {value.shape[0]} rows but the batch has {rows}; "
                             "every batched input needs the same first dimension")
    if isinstance(target, torch.Tensor) and target.dim() and target.shape[0] != rows:
        raise InputError(f"batch {index}: the target has {target.shape[0]} rows but the inputs have {rows}; give "
                         "one target row per sample")
    if batch_size is not None and rows != batch_size:
        raise InputError(f"batch {index} has {plural(rows, 'sample')} but the run's batches have {batch_size}; "
                         "every batch of a run (and of later train() calls on the deployment) must have the same "
                         "size, or the replicas would average unequal shards. Drop or pad the last batch")
    if non_finite != "ignore":
        tensors = [(name, value) for name, value in values.items()]
        if isinstance(target, torch.Tensor):
            tensors.append(("the target", target))
        for name, value in tensors:
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
                message = (f"batch {index}: input {name!r} holds NaN or infinite values; the losses and weights "
                           "would become NaN. Clean the data, or pass non_finite='ignore' to train anyway")
                if non_finite == "error":
                    raise InputError(message)
                warnings.warn(message, RuntimeWarning, stacklevel=3)
    return rows


def check_training_call(compiled: Any, batches: Sequence[Any] | Callable[[int], Any], *, iterations: int,
                        micro_batches: int, optimizer: Any = None, previous_batch_size: int | None = None,
                        non_finite: str = "warn") -> int:
    """Everything about a ``train()`` call that can be checked before a function starts;
    returns the batch size. ``previous_batch_size``: the batch size of the deployment's
    earlier calls (None for the first)."""
    if optimizer is not None:
        OptimizerSpec.of(optimizer)
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise InputError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    degrees = [stage.replicas for stage in compiled.plan.stages]
    batch_for = batches if callable(batches) else batches.__getitem__
    count = 1 if callable(batches) else iterations
    size = previous_batch_size
    for index in range(count):
        size = check_batch(compiled, batch_for(index), index, batch_size=size, non_finite=non_finite)
    if size is not None and size < micro_batches:
        raise InputError(f"a batch of {plural(size, 'sample')} cannot be cut into "
                         f"{plural(micro_batches, 'micro-batch', 'micro-batches')}; use a batch of at least "
                         f"{plural(micro_batches, 'sample')} or fewer micro-batches")
    if max(degrees) > micro_batches:
        raise InputError(f"stage {degrees.index(max(degrees))} has {max(degrees)} replicas but an iteration has "
                         f"only {plural(micro_batches, 'micro-batch', 'micro-batches')}; use at least {max(degrees)} "
                         "micro-batches")
    return size if size is not None else 0
