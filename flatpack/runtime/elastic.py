"""Elasticity policies (Hydrozoa §3.5, dynamic worker scaling): functions of (epoch, the
stages' replica degrees) that return new degrees, or None to keep them. The local backend
asks its policy at every epoch boundary (``train(elastic=..., epoch_iterations=...)``),
retires or starts functions, re-deals the micro-batches and continues from the checkpoints.

A policy that decides from what the run measured, re-fitting the cost model at every
boundary, is ``backends.elastic_policy.ElasticPolicy`` (``flatpack run --elastic auto``): it
prices plans with the cost model, which a worker never imports, so it lives in the backends.
"""

from __future__ import annotations

from typing import Callable, Sequence

Policy = Callable[[int, tuple[int, ...]], Sequence[int] | None]
# what `--elastic auto` may minimize per iteration (backends.elastic_policy.ElasticPolicy.objective)
OBJECTIVES = ("time", "dollars")


def doubling(max_replicas: int, *, every: int = 1, stages: Sequence[int] | None = None) -> Policy:
    """AdaBatch-style growth: every ``every`` epochs, double the degree of ``stages`` (all by
    default) up to ``max_replicas`` — more replicas later in training, when larger
    effective batches are safe. The degree must stay at most the micro-batch count."""
    if max_replicas < 1 or every < 1:
        raise ValueError(f"max_replicas and every must be at least 1, got {max_replicas} and {every}")

    def policy(epoch: int, degrees: tuple[int, ...]) -> tuple[int, ...] | None:
        if epoch % every:
            return None
        chosen = range(len(degrees)) if stages is None else stages
        grown = tuple(min(max_replicas, 2 * d) if index in chosen else d for index, d in enumerate(degrees))
        return grown if grown != degrees else None

    return policy
