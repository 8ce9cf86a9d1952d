"""Mixed precision in a training stage: what ``RunSpec.precision`` changes.

``bf16`` is PyTorch's autocast recipe: the parameters, their gradients and the optimizer
state stay float32 (the master weights), and inside the forward ``torch.autocast`` runs
matmuls and convolutions in bfloat16 while reductions, norms and losses stay float32.
What is particular to a pipeline is the boundary: the floating tensors one stage hands
the next (activations forward, their gradients back) travel as bfloat16, half the bytes
of float32, which the cost model counts (``Workload.boundary_scale``). bfloat16 has
float32's exponent range, so no loss scaling is needed (fp16 would need one).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, ContextManager, Mapping

import torch

from flatpack.runtime.spec import DATA_SOURCE, StageSpec
from flatpack.stage.tensor_check import TensorSpec, dtype_name

WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def autocast(precision: str, device_type: str = "cpu") -> ContextManager[Any]:
    """The context a stage's forward (and a recomputed forward) runs in."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def for_wire(values: dict[str, Any], precision: str) -> dict[str, Any]:
    """``values`` as they cross a stage boundary: float32 tensors in the precision's wire
    dtype (detached: what travels is data, not graph); integers, masks and other values as
    they are."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None:
        return values
    return {name: value.detach().to(dtype) if isinstance(value, torch.Tensor) and value.dtype == torch.float32
            else value for name, value in values.items()}



def received_specs(specs: Mapping[str, TensorSpec], stage: StageSpec, precision: str) -> dict[str, TensorSpec]:
    """What a stage's worker checks its inputs against: the manifest's specs, with the float32
    inputs another stage sends in the precision's wire dtype, since :func:`for_wire` cast them
    on the way (the model's own inputs, ``DATA_SOURCE``, arrive as the data has them)."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None:
        return dict(specs)
    received = {name for name in stage.inputs if stage.sources[name] != DATA_SOURCE}
    return {name: dataclasses.replace(spec, dtype=dtype_name(dtype))
            if name in received and spec.dtype == dtype_name(torch.float32) else spec
            for name, spec in specs.items()}
