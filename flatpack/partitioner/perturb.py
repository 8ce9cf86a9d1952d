"""Randomly perturbed copies of a profiled problem: each layer's times and bytes scaled by
factors drawn log-uniformly from [low, high] (issue 42: a solver's time should not jump with
the profile; ``benchmarks/solvers.py --robustness`` and ``tests/unit/test_dp_robustness.py``
solve 20 such copies of one model and compare the slowest solve with the median).

A layer's forward, backward and serving seconds share one factor, and its bytes (parameters,
gradients, optimizer state, saved activations, boundary output, peak) another, so that each
layer stays self-consistent (a slower layer is slower in both passes; its gradients stay the
size of its weights) while the chain's shape — where the time and the memory sit — changes.
"""

from __future__ import annotations

import dataclasses
import math
import random

from flatpack.errors import InputError
from flatpack.ir.profile import LayerProfile
from flatpack.partitioner.problem import ChainLayer, Problem


def perturbed(problem: Problem, seed: int, low: float = 0.5, high: float = 2.0) -> Problem:
    """``problem`` with each layer's times scaled by one factor and its bytes by another, both
    drawn log-uniformly from [``low``, ``high``] by ``random.Random(seed)``."""
    if not 0 < low <= high:
        raise InputError(f"perturbation factors need 0 < low <= high, got low={low!r}, high={high!r}")
    if not problem.profiled:
        raise InputError("only a profiled problem can be perturbed: build it with a profile")
    draw = random.Random(seed)

    def factor() -> float:
        return math.exp(draw.uniform(math.log(low), math.log(high)))

    chain = tuple(_scaled_layer(layer, factor(), factor()) for layer in problem.chain)
    return dataclasses.replace(problem, chain=chain)


def _scaled_layer(layer: ChainLayer, time_factor: float, bytes_factor: float) -> ChainLayer:
    profile = layer.profile
    assert profile is not None, "perturbed() checks the problem is profiled"
    return dataclasses.replace(layer, param_bytes=round(layer.param_bytes * bytes_factor),
                               boundary_bytes=round(layer.boundary_bytes * bytes_factor),
                               profile=_scaled_profile(profile, time_factor, bytes_factor))


def _scaled_profile(profile: LayerProfile, time_factor: float, bytes_factor: float) -> LayerProfile:
    def whole(count: int) -> int:
        return round(count * bytes_factor)

    return dataclasses.replace(
        profile,
        forward_s=profile.forward_s.scaled(time_factor),
        backward_s=profile.backward_s.scaled(time_factor),
        inference_s=None if profile.inference_s is None else profile.inference_s.scaled(time_factor),
        param_bytes=whole(profile.param_bytes), grad_bytes=whole(profile.grad_bytes),
        buffer_bytes=whole(profile.buffer_bytes),
        saved_bytes=profile.saved_bytes.scaled(bytes_factor), output_bytes=profile.output_bytes.scaled(bytes_factor),
        peak_bytes=profile.peak_bytes.scaled(bytes_factor),
        optimizer_state_bytes={name: whole(count) for name, count in profile.optimizer_state_bytes.items()},
        saved_boundary_bytes={name: line.scaled(bytes_factor) for name, line in profile.saved_boundary_bytes.items()},
    )

