"""Global-norm gradient clipping across pipeline stages: what
``torch.nn.utils.clip_grad_norm_`` does to the whole model, when each stage holds only its
own parameters.

Every stage computes the squared norm of its gradients (each tensor's 2-norm in its own
dtype, as torch computes them, squared and summed in float64), replica 0 puts it in the
store under the iteration (``RunKeys.grad_norm``), and every replica of every stage reads all
stages' values and sums them in stage order: the same floats in the same order, so each stage
derives the bit-identical global norm and scales its gradients by the same coefficient
``min(1, max_norm / (norm + 1e-6))``, torch's.

Exactly-once effects under replay: a replayed stage recomputes the same gradients from the
same checkpoint and batches, so it writes the same bytes under the same key; the key lives in
the iteration's prefix, which the invoker keeps until a later checkpoint (docs/runtime.md).
A tied weight held by several stages carries the same summed gradient on each holder and is
counted once, at its first holder.
"""

from __future__ import annotations

import math
import struct
from typing import Iterable

import torch

from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store

EPS = 1e-6   # torch.nn.utils.clip_grad_norm_'s


def squared_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """The sum of the squared 2-norms of ``grads`` (None: no gradient), in float64."""
    return math.fsum(float(torch.linalg.vector_norm(grad, 2)) ** 2 for grad in grads if grad is not None)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What torch multiplies the gradients by: ``max_norm / (norm + 1e-6)``, at most 1."""
    return min(1.0, max_norm / (total_norm + EPS))


def global_norm(store: Store, keys: RunKeys, iteration: int, stage: int, stages: int, replica: int,
                own: float, timeout_s: float) -> float:
    """Publishes this stage's squared norm (replica 0; every replica holds the same reduced
    gradients) and returns the global norm over all ``stages``."""
    if replica == 0:
        store.put(keys.grad_norm(iteration, stage), struct.pack("<d", own))
    parts = [own if other == stage else struct.unpack("<d", store.wait(keys.grad_norm(iteration, other),
                                                                       timeout_s))[0]
             for other in range(stages)]
    return math.sqrt(math.fsum(parts))


def scale_gradients(params: Iterable[torch.Tensor], coefficient: float) -> None:
    """Multiplies every gradient by ``coefficient`` (as a float32 scalar, like torch's clamped one)."""
    if coefficient >= 1.0:
        return
    with torch.no_grad():
        for param in params:
            if param.grad is not None:
                param.grad.mul_(torch.tensor(coefficient, dtype=torch.float32).to(param.grad.dtype))
