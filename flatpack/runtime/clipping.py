"""The global checks of a step across pipeline stages: global-norm gradient clipping (what
``torch.nn.utils.clip_grad_norm_`` does to the whole model, when each stage holds only its
own parameters) and an fp16 run's overflow check (``GradScaler``'s found-inf, for the whole
model). Both need one number from every stage, so they share one small reduction.

Every stage computes the squared norm of its gradients (each tensor's 2-norm in its own
dtype, as torch computes them, squared and summed in float64) and whether any of them is
infinite or NaN; replica 0 puts both in the store under the iteration
(``RunKeys.grad_norm``), and every replica of every stage reads all stages' values and sums
them in stage order: the same floats in the same order, so each stage derives the
bit-identical global answers, skips its step alike when any stage overflowed, and
otherwise scales its gradients by the same coefficient ``min(1, max_norm / (norm + 1e-6))``,
torch's. (The GPU-container ranks reduce the same two numbers with one all-reduce.)

Exactly-once effects under replay: a replayed stage recomputes the same gradients from the
same checkpoint and batches, so it writes the same bytes under the same key; the key lives in
the iteration's prefix, which the invoker keeps until a later checkpoint (docs/runtime.md).
A tied weight held by several stages carries the same summed gradient on each holder and is
counted once, at its first holder.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from flatpack.runtime.keys import Round, RunKeys
from flatpack.runtime.store import Store

if TYPE_CHECKING:
    from flatpack.runtime.precision import LossScaler

EPS = 1e-6   # torch.nn.utils.clip_grad_norm_'s


def squared_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """The sum of the squared 2-norms of ``grads`` (None: no gradient), in float64."""
    return math.fsum(float(torch.linalg.vector_norm(grad, 2)) ** 2 for grad in grads if grad is not None)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What torch multiplies the gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (total_norm + EPS))


def global_sums(store: Store, keys: RunKeys, iteration: int | Round, stage: int, stages: int, replica: int,
                own: Sequence[float], timeout_s: float) -> list[float]:
    """Publishes this stage's values (replica 0; every replica holds the same reduced
    gradients) and returns each summed over all ``stages``, in stage order."""
    layout = f"<{len(own)}d"
    if replica == 0:
        store.put(keys.grad_norm(iteration, stage), struct.pack(layout, *own))
    parts = [tuple(own) if other == stage else struct.unpack(layout, store.wait(keys.grad_norm(iteration, other),
                                                                                timeout_s))
             for other in range(stages)]
    return [math.fsum(part[index] for part in parts) for index in range(len(own))]


def global_norm(store: Store, keys: RunKeys, iteration: int, stage: int, stages: int, replica: int,
                own: float, timeout_s: float) -> float:
    """The global gradient norm over all ``stages`` from each one's squared norm ``own``."""
    return math.sqrt(global_sums(store, keys, iteration, stage, stages, replica, [own], timeout_s)[0])


def checked_step(params: Sequence[torch.Tensor], counted: Iterable[torch.Tensor | None],
                 max_norm: float | None, scaler: LossScaler | None,
                 reduce: Callable[[list[float]], list[float]]) -> bool:
    """What a stage does between its gradients (those of ``params``, all its trainable
    parameters) and its optimizer step: unscales them (fp16's ``scaler``), learns through
    ``reduce`` (each value summed over every stage, in one exchange) whether any stage
    overflowed and the global norm of the ``counted`` gradients (after unscaling), and clips
    to ``max_norm``; returns whether the step runs (False: some stage's gradient is infinite
    or NaN, and every stage skips alike, as ``GradScaler.step`` skips). Without a limit or a
    scaler nothing is reduced."""
    if max_norm is None and scaler is None:
        return True
    overflowed = scaler.unscale(param.grad for param in params) if scaler is not None else False
    squared, overflows = reduce([squared_norm(counted) if max_norm is not None else 0.0, float(overflowed)])
    if overflows:
        return False
    if max_norm is not None:
        scale_gradients(params, clip_coefficient(math.sqrt(squared), max_norm))
    return True


def scale_gradients(params: Iterable[torch.Tensor], coefficient: float) -> None:
    """Multiplies every gradient by ``coefficient`` (as a float32 scalar, like torch's clamped one)."""
    if coefficient >= 1.0:
        return
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                param.grad.mul_(torch.tensor(coefficient, dtype=torch.float32).to(param.grad.dtype))
