"""Mixed precision in a training stage: what ``RunSpec.precision`` changes.

``bf16`` is PyTorch's autocast recipe: the parameters, their gradients and the optimizer
state stay float32 (the master weights), and inside the forward ``torch.autocast`` runs
matmuls and convolutions in bfloat16 while reductions, norms and losses stay float32.
What is particular to a pipeline is the boundary: the floating tensors one stage hands
the next (activations forward, their gradients back) travel as bfloat16, half the bytes
of float32, which the cost model counts (``Workload.boundary_scale``). bfloat16 has
float32's exponent range, so no loss scaling is needed.

``fp16`` is the same with float16, whose range ends at 65504 and whose smallest normal is
6e-5: small gradients would flush to zero, so the loss is scaled as
``torch.amp.GradScaler`` scales it (:class:`LossScaler`): the last stage multiplies its
loss by the scale, so every gradient (on the wire too) carries it; each stage unscales its
own; whether any gradient of any stage is infinite or NaN is one global answer
(``clipping.checked_step``); then every stage skips its step alike and every stage
updates its scale alike (halved after an overflow, doubled after ``growth_interval``
clean steps), so all stages always hold the same scale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ContextManager, Iterable

import torch

from flatpack.errors import InputError
from flatpack.stage.settings import SCALED_PRECISIONS


WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SCALED = SCALED_PRECISIONS   # the precisions that train with a loss scaler


def autocast(precision: str, device_type: str = "cpu") -> ContextManager[Any]:
    """The context a stage's forward (and a recomputed forward) runs in."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def wire_dtype(value: Any, precision: str) -> torch.dtype | None:
    """The dtype ``value`` crosses a stage boundary in: the precision's wire dtype for a
    float32 tensor; None (as it is) for integers, masks, other values and under fp32."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None or not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
        return None
    return dtype


def for_wire(values: dict[str, Any], precision: str) -> dict[str, Any]:
    """``values`` as they cross a stage boundary: float32 tensors in the precision's wire
    dtype (detached: what travels is data, not graph); integers, masks and other values as
    they are (under fp32: ``values`` itself)."""
    if WIRE_DTYPES[precision] is None:
        return values
    return {name: value if (dtype := wire_dtype(value, precision)) is None else value.detach().to(dtype)
            for name, value in values.items()}


def crossed(value: Any, precision: str) -> Any:
    """``value`` as :func:`for_wire` delivers it, but differentiable: what a single-process
    reference computes with where a stage reads another stage's output. Autograd's backward
    of the cast hands the producer the consumers' gradients summed in the wire dtype and
    then widened, as the producing stage receives and widens them (``backward_outputs``)."""
    dtype = wire_dtype(value, precision)
    return value if dtype is None else value.to(dtype)



@dataclass(frozen=True)
class LossScaling:
    """How an fp16 run scales its loss: ``torch.amp.GradScaler``'s settings, its defaults
    included. Plain data in the run's spec."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        if not number(self.init_scale) or self.init_scale <= 0:
            raise InputError(f"the loss scaler's init_scale must be a positive, finite number, got "
                             f"{self.init_scale!r}; GradScaler's default is {2.0 ** 16:g}")
        if not number(self.growth_factor) or self.growth_factor <= 1:
            raise InputError(f"the loss scaler's growth_factor must be a finite number above 1, got "
                             f"{self.growth_factor!r}; GradScaler's default is 2.0")
        if not number(self.backoff_factor) or not 0 < self.backoff_factor < 1:
            raise InputError(f"the loss scaler's backoff_factor must be between 0 and 1, got "
                             f"{self.backoff_factor!r}; GradScaler's default is 0.5")
        if not isinstance(self.growth_interval, int) or isinstance(self.growth_interval, bool) \
                or self.growth_interval < 1:
            raise InputError(f"the loss scaler's growth_interval must be a positive integer (clean steps before "
                             f"the scale grows), got {self.growth_interval!r}; GradScaler's default is 2000")

    @classmethod
    def of(cls, value: LossScaling | dict | None) -> LossScaling:
        """From plain data (the spec's JSON, ``train(loss_scaling={...})``) or as given."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InputError(f"loss_scaling must be a LossScaling or a dict of its settings, got "
                             f"{type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise InputError(f"loss_scaling has no setting {', '.join(unknown)}; the settings are "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))} (GradScaler's)")
        return cls(**value)

    def grad_scaler(self, device_type: str = "cpu") -> torch.amp.GradScaler:
        """The ``torch.amp.GradScaler`` a single process trains with under these settings."""
        return torch.amp.GradScaler(device_type, init_scale=self.init_scale, growth_factor=self.growth_factor,
                                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)


class LossScaler:
    """One stage's loss scale and clean-step count, kept and updated with the very ops
    ``torch.amp.GradScaler`` uses (``_amp_foreach_non_finite_check_and_unscale_``,
    ``_amp_update_scale_``), so that a stage's numbers are GradScaler's bit for bit."""

    def __init__(self, settings: LossScaling, device: torch.device | str = "cpu") -> None:
        self.settings = settings
        self.scale = torch.full((1,), settings.init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros(1, dtype=torch.int32, device=device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (``GradScaler.scale``)."""
        return loss * self.scale.to(loss.device)

    def unscale(self, grads: Iterable[torch.Tensor | None]) -> bool:
        """Divides the gradients by the scale in place (``GradScaler.unscale_``: times the
        float32 reciprocal of the float64 scale); whether any of them is infinite or NaN."""
        found = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        present = [grad for grad in grads if grad is not None]
        if present:
            inverse = self.scale.double().reciprocal().float()
            # the op GradScaler calls; torch's stub does not declare its re-export from torch._C
            torch._amp_foreach_non_finite_check_and_unscale_(  # pyright: ignore[reportPrivateImportUsage]
                present, found, inverse)
        return bool(found.item())

    def update(self, found_inf: bool) -> None:
        """``GradScaler.update`` after a step (``found_inf``: anywhere in the model)."""
        found = torch.full((1,), float(found_inf), dtype=torch.float32, device=self.scale.device)
        # as in unscale: GradScaler's op, undeclared in torch's stub
        torch._amp_update_scale_(self.scale, self.growth_tracker, found,  # pyright: ignore[reportPrivateImportUsage]
                                 self.settings.growth_factor, self.settings.backoff_factor,
                                 self.settings.growth_interval)

    def state(self) -> dict[str, float | int]:
        """What a checkpoint keeps (a float32 scale is exact as a JSON float)."""
        return {"scale": float(self.scale.item()), "growth_tracker": int(self.growth_tracker.item())}

    def load(self, state: dict[str, float | int]) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))


def loss_scaler(precision: str, settings: LossScaling, device: torch.device | str = "cpu") -> LossScaler | None:
    """A stage's loss scaler under ``precision`` (None where it trains without one)."""
    return LossScaler(settings, device) if precision in SCALED else None
