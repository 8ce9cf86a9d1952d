"""The one check of a tensor input against what a model or a stage was compiled for.

Four places call it: a compiled model's forward (``compiler.check_inputs``), a ``train()``
call's batches before any function starts (``backends.batch_checks.check_batch``), a
``--data`` source against the model's example before compiling
(``data.check_against_example``), and a stage worker on every value it is given, before the
generated stage runs (``runtime.training``). Each error names the input, the shape or dtype
expected and the one given, and the fix; a wrong tensor never reaches generated code, where
it would fail with an error naming neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from flatpack.errors import InputError
from flatpack.stage.manifest import Manifest, ValueEntry

COMPILED_FOR = "the model was compiled for"


@dataclass(frozen=True)
class TensorSpec:
    """What a tensor input must be: the example's ``shape`` and ``dtype`` (``"float32"``), and
    ``free_dims``, the dimensions whose size may differ from the example's (``None``: every
    one may; only the number of dimensions is fixed)."""

    shape: tuple[int, ...]
    dtype: str
    free_dims: tuple[int, ...] | None = None

    @classmethod
    def from_json(cls, entry: Mapping[str, Any], default_free: tuple[int, ...] | None = None) -> TensorSpec:
        """From a manifest or ``input_specs`` entry (``shape``, ``dtype``, optional ``dynamic``:
        the free dimensions where the frontend knows them, else ``default_free``)."""
        dynamic = entry.get("dynamic")
        free = tuple(int(dim) for dim in dynamic) if dynamic is not None else default_free
        return cls(tuple(int(size) for size in entry["shape"]), str(entry["dtype"]), free)

    def to_json(self) -> dict[str, Any]:
        """The ``input_specs`` entry :meth:`from_json` reads back (``dynamic``: the free
        dimensions, null where every size may differ)."""
        return {"shape": list(self.shape), "dtype": self.dtype,
                "dynamic": None if self.free_dims is None else list(self.free_dims)}

    @classmethod
    def of_entry(cls, entry: ValueEntry, default_free: tuple[int, ...] | None = None) -> TensorSpec:
        """From a manifest's tensor input (its ``dynamic`` dimensions where the frontend knows
        them, else ``default_free``)."""
        return cls(entry.shape, entry.dtype, entry.dynamic if entry.dynamic is not None else default_free)

    @classmethod
    def of(cls, example: torch.Tensor, free_dims: tuple[int, ...] | None = None) -> TensorSpec:
        return cls(tuple(example.shape), dtype_name(example.dtype), free_dims)

    def describe(self) -> str:
        """``(2, 16) (dimension 0 may differ)``: the example's shape, and which sizes may differ."""
        if self.free_dims is None:
            free = "every size may differ"
        elif not self.free_dims:
            free = "no size may differ"
        else:
            dims = ", ".join(map(str, self.free_dims))
            free = f"dimension{'s' * (len(self.free_dims) > 1)} {dims} may differ"
        return f"{self.shape} ({free})"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def input_label(name: str | int) -> str:
    """``input 'input_ids'`` for a named input, ``input 0`` for a positional one."""
    return f"input {name}" if isinstance(name, int) else f"input {name!r}"


def check_tensor(name: str | int, value: Any, spec: TensorSpec, *, where: str = "", fix: str,
                 expected_by: str = COMPILED_FOR, exact_dtype: bool = True) -> None:
    """Raises InputError unless ``value`` is a tensor that ``spec`` admits. ``where`` prefixes
    the message (``"batch 3: "``, ``"stage 1: "``); ``fix`` ends it (what to do instead).
    ``exact_dtype=False`` admits another dtype of the same kind (int32 for int64), refusing
    only a floating-point mismatch (float64 numpy data for a float32 model)."""
    label = f"{where}{input_label(name)}"
    if value is None:
        raise InputError(f"{label} is missing; {expected_by} a {spec.dtype} tensor of shape {spec.describe()}. {fix}")
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{label} must be a {spec.dtype} tensor of shape {spec.describe()}, got "
                         f"{type(value).__name__}. {fix}")
    got_dtype = dtype_name(value.dtype)
    if got_dtype != spec.dtype:
        want = getattr(torch, spec.dtype, None)
        floating = value.is_floating_point() or (isinstance(want, torch.dtype) and want.is_floating_point)
        if exact_dtype or floating:
            raise InputError(f"{label} has dtype {got_dtype}, but {expected_by} {spec.dtype}; convert it with "
                             f".to(torch.{spec.dtype}) (numpy arrays default to float64: .astype('{spec.dtype}')). "
                             f"{fix}")
    got_shape = tuple(value.shape)
    if len(got_shape) != len(spec.shape):
        raise InputError(f"{label} has shape {got_shape}, {len(got_shape)} dimensions, but {expected_by} "
                         f"{len(spec.shape)}: {spec.describe()}. {fix}")
    if spec.free_dims is None:
        return
    fixed = [dim for dim, size in enumerate(spec.shape) if dim not in spec.free_dims and got_shape[dim] != size]
    if fixed:
        dims = ", ".join(f"dim {dim} must be {spec.shape[dim]}, got {got_shape[dim]}" for dim in fixed)
        raise InputError(f"{label} has shape {got_shape}, but {expected_by} {spec.describe()}: {dims}. {fix}")


STAGE_FIX = ("Every batch must have the shapes and dtypes of the example the model was compiled with (a batch "
             "function's later batches are checked only here).")


def stage_input_specs(manifest: Manifest) -> dict[str, TensorSpec]:
    """A stage's tensor inputs by name, from its manifest: the example's shape and dtype, and
    the dimensions export left free (unknown for fx graphs: then only rank and dtype)."""
    return {entry.name: TensorSpec.of_entry(entry)
            for entry in manifest.inputs if entry.is_tensor}


def check_stage_inputs(specs: Mapping[str, TensorSpec], values: Iterable[tuple[str, Any]], where: str) -> None:
    """What a stage worker (a function or a gpu-container rank) checks before running its
    stage on a micro-batch: every tensor input against :func:`stage_input_specs`."""
    for name, value in values:
        if name in specs:
            check_tensor(name, value, specs[name], where=where, fix=STAGE_FIX)
