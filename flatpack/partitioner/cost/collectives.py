"""Gradient-synchronization formulas shared by the cost models.

Every model that synchronizes replicas calls one of these, so a formula lives in one place:
FuncPipe's storage-based scatter-reduce (eq. 1 and eq. 2) and the ring all-reduce that
Hydrozoa and PipeDream both model; and the inverse of the ring, which fits Hydrozoa's α, β to
measured all-reduces (``flatpack calibrate --target gpu-container``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from flatpack.errors import PlanError
from flatpack.platform.calibration import CollectiveFit
from flatpack.stage.settings import SYNC_METHODS


def _check(nbytes: float, workers: int, bandwidth_bytes_s: float) -> None:
    if workers < 1:
        raise PlanError(f"synchronization needs at least 1 worker, got {workers}")
    if nbytes < 0:
        raise PlanError(f"cannot synchronize a negative number of bytes ({nbytes})")
    if not bandwidth_bytes_s > 0:
        raise PlanError(f"synchronization needs a positive bandwidth, got {bandwidth_bytes_s!r} bytes/s")


def scatter_reduce_coefficients(method: str, workers: int) -> tuple[float, float]:
    """FuncPipe's (γ, δ) for t_s = γ·s/w + δ·t_lat (FuncPipe, App. B eq. 12).

    ``"pipelined"``: FuncPipe's pipelined scatter-reduce, γ = 2, δ = 2 + n (§3.3 eq. 2).
    ``"lambdaml"``: LambdaML's three-phase scatter-reduce, γ = 3 − 2/n, δ = 4 (§3.3 eq. 1,
    3·s/w − 2·s/(n·w) + 4·t_lat, rewritten in the same form).
    """
    if method not in SYNC_METHODS:
        raise PlanError(f"sync method {method!r} is not one of {', '.join(SYNC_METHODS)}")
    if workers < 1:
        raise PlanError(f"synchronization needs at least 1 worker, got {workers}")
    if method == "pipelined":
        return 2.0, 2.0 + workers
    return 3.0 - 2.0 / workers, 4.0


def scatter_reduce_seconds(nbytes: float, workers: int, bandwidth_bytes_s: float, latency_s: float,
                           method: str = "pipelined") -> float:
    """Seconds for ``workers`` replicas to scatter-reduce ``nbytes`` of gradients through
    storage, each at ``bandwidth_bytes_s`` with ``latency_s`` per storage access (t_lat).

    FuncPipe §3.3: eq. 1 (LambdaML) = 3·s/w − 2·s/(n·w) + 4·t_lat; eq. 2
    (pipelined) = 2·s/w + (2 + n)·t_lat. One worker has nothing to synchronize: 0 s (App. B
    eq. 12's factor (1 − y₁)).
    """
    _check(nbytes, workers, bandwidth_bytes_s)
    if workers == 1:
        return 0.0
    gamma, delta = scatter_reduce_coefficients(method, workers)
    return gamma * nbytes / bandwidth_bytes_s + delta * latency_s


def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_s: float,
                           per_byte_overhead_s: float = 0.0, per_round_overhead_s: float = 0.0) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``workers`` peers.

    2(N − 1)·(|p|/(N·D) + α·|p|/N + β): 2(N − 1) rounds, each moving a 1/N chunk at
    bandwidth D plus α per byte and β per round of (de)serialization overhead.

    Reading chosen (Hydrozoa §3.4, "Hybrid-Parallelism Runtime Model"): the
    text says |p|/(B·D) "models the data transfer time for each of the 2(B − 1) rounds",
    while the printed equation multiplies by (B − 1); we follow the text and the standard
    ring algorithm (reduce-scatter then all-gather, N − 1 rounds each), which is also what
    PipeDream's volume gives: the PipeDream dissertation §5.3.1 counts 2(m − 1)·|w| bytes in
    all and divides the stage time by m, i.e. 2(m − 1)·|w|/(m·B) per replica — this
    function with α = β = 0. The ring runs among the data-parallel replicas of one shard
    (N = A in Hydrozoa's A×B notation; see hydrozoa.py).
    """
    _check(nbytes, workers, bandwidth_bytes_s)
    if workers == 1:
        return 0.0
    chunk = nbytes / workers
    return 2 * (workers - 1) * (chunk / bandwidth_bytes_s + per_byte_overhead_s * chunk + per_round_overhead_s)


def _least_relative_squares(rows: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """The non-negative x that minimizes Σ((row·x − t)/t)² (scipy's non-negative least
    squares on rows and times each divided by its t): relative error, so that measured
    times four orders of magnitude apart weigh alike."""
    # start-up time: scipy.optimize takes a second to load, and only a calibration fits lines
    from scipy.optimize import nnls

    weights = 1.0 / np.array(seconds, dtype=float)
    solution, _ = nnls(np.array(rows, dtype=float) * weights[:, None], np.array(seconds, dtype=float) * weights)
    return [float(value) for value in solution]


def fit_line(sizes_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(fixed seconds, seconds per byte) of the line t = a + b·n through measured (n, t),
    both at least 0, by least squares on relative error (each residual divided by its t):
    the sizes span four orders of magnitude, and plain least squares would fit the largest
    few and leave the fixed term to their rounding (:func:`_least_relative_squares`)."""
    if len(sizes_bytes) != len(seconds) or len(seconds) < 2:
        raise PlanError(f"a line needs two measured points or more, got {len(sizes_bytes)} sizes and "
                        f"{len(seconds)} times")
    if any(t <= 0 or not math.isfinite(t) for t in seconds):
        raise PlanError(f"measured seconds must be positive and finite, got {list(seconds)}")
    fixed, per_byte = _least_relative_squares([[1.0, float(n)] for n in sizes_bytes], seconds)
    return fixed, per_byte


@dataclass(frozen=True)
class AllReduceTerms:
    """What a gradient all-reduce costs beyond its bytes on the wire at bandwidth D:
    Hydrozoa's α (seconds per byte of each round's chunk) and β (seconds per round), §3.4,
    and two measured additions that the ring does not split among the workers —
    ``per_call_s`` (δ, once per all-reduce) and ``copy_s_per_byte`` (γ, per byte of the
    whole buffer: flattening the gradients into one buffer, staging it through the host for
    gloo, copying the sum back into each gradient). All 0: the paper's equation alone.

    ``measured_s`` holds the all-reduces a calibration timed — (workers, seconds per size of
    ``measured_sizes_bytes``) — and anchors the equation to them (:meth:`seconds`): measured
    all-reduces do not follow one line over four orders of magnitude of sizes (gloo's cost
    per byte grows once a buffer leaves the caches: 16 MB in 14 ms, 64 MB in 100 ms, on the
    H100 machine of BENCHMARKS.md), and a line fitted to all of them misses some by 2×."""

    alpha_s_per_byte: float = 0.0
    beta_s: float = 0.0
    per_call_s: float = 0.0
    copy_s_per_byte: float = 0.0
    measured_sizes_bytes: tuple[int, ...] = ()
    measured_s: tuple[tuple[int, tuple[float, ...]], ...] = ()

    def __post_init__(self) -> None:
        if self.measured_s and (len(self.measured_sizes_bytes) < 2
                                or list(self.measured_sizes_bytes) != sorted(set(self.measured_sizes_bytes))
                                or any(len(seconds) != len(self.measured_sizes_bytes) or min(seconds) <= 0
                                       or list(seconds) != sorted(seconds) or workers < 2
                                       for workers, seconds in self.measured_s)):
            # non-decreasing in the size: the planner's bounds take one layer's all-reduce as a
            # floor under its stage's (hydrozoa_planner.ShardTables._bounds)
            raise PlanError("measured all-reduces need two sizes or more in increasing order and, among two workers "
                            "or more, one positive time per size that does not fall as the size grows, got sizes "
                            f"{list(self.measured_sizes_bytes)} and {list(self.measured_s)}")

    def equation_seconds(self, nbytes: float, workers: int, bandwidth_bytes_s: float) -> float:
        """T^(D) = 2(N − 1)(|p|/(N·D) + α|p|/N + β) + δ + γ|p|; 0 for one worker."""
        ring = ring_allreduce_seconds(nbytes, workers, bandwidth_bytes_s, self.alpha_s_per_byte, self.beta_s)
        if workers == 1:
            return ring
        return ring + self.per_call_s + self.copy_s_per_byte * nbytes

    def seconds(self, nbytes: float, workers: int, bandwidth_bytes_s: float) -> float:
        """The equation's T^(D), scaled so that it meets the measured all-reduces: T(|p|, N) ·
        M(|p|*, N*)/T(|p|*, N*), with N* the measured worker count nearest N (the larger on a
        tie), |p|* the size clamped into the measured range and M the measurements
        interpolated linearly between sizes. Among a measured count and within the measured
        sizes that is the measurement; beyond them the equation's shape continues from the
        nearest one. Without measurements, the equation alone."""
        equation = self.equation_seconds(nbytes, workers, bandwidth_bytes_s)
        if not self.measured_s or equation == 0.0:
            return equation
        nearest_workers, measured = min(self.measured_s, key=lambda item: (abs(item[0] - workers), -item[0]))
        sizes = self.measured_sizes_bytes
        anchor_bytes = min(max(float(nbytes), float(sizes[0])), float(sizes[-1]))
        anchor_equation = self.equation_seconds(anchor_bytes, nearest_workers, bandwidth_bytes_s)
        if anchor_equation <= 0.0:   # D infinite and no overheads: the equation has no shape to carry
            return equation
        return equation * float(np.interp(anchor_bytes, sizes, measured)) / anchor_equation


def fit_ring(sizes_bytes: Sequence[float], point_to_point_s: Sequence[float],
             all_reduce_s: Mapping[int, Sequence[float]]) -> dict[str, float]:
    """The link and the all-reduce's terms from measured seconds per message size:
    ``latency_s`` and ``bandwidth_bytes_s`` (D) of one point-to-point message, t = latency +
    n/D; then the :class:`AllReduceTerms` whose equation (:meth:`~AllReduceTerms.equation_seconds`) is closest (in
    relative error) to the all-reduces measured among each number of workers in
    ``all_reduce_s``. Measured among one number of workers only, the terms that do not
    depend on it cannot be told from the ring's, so δ = γ = 0 (Hydrozoa's form alone); among
    two or more, all four are fitted. α is the all-reduce's per-byte cost beyond the ring at
    D, so at least 0: where the all-reduce moves its bytes faster than the ring at D would
    (another algorithm), α = 0 and ``ring_error`` (the largest relative error over every
    size and count) says how far off the equation is; a plan is priced with the equation
    anchored to the measurements (:func:`measured_terms`), which meets every one."""
    counts = sorted(all_reduce_s)
    if not counts or counts[0] < 2:
        raise PlanError(f"an all-reduce's terms are measured among two workers or more, got counts {counts}")
    latency, per_byte = fit_line(sizes_bytes, point_to_point_s)
    # growth across the measured sizes under a billionth of the times is the solver's rounding
    # (flat times fit a slope of 1e-26 s/byte, a "bandwidth" of 1e26 bytes/s), not a link
    if per_byte * (max(sizes_bytes) - min(sizes_bytes)) <= 1e-9 * max(point_to_point_s):
        raise PlanError("the point-to-point times do not grow with the message size, so they give no bandwidth; "
                        f"measure larger messages (sizes {list(sizes_bytes)}, seconds {list(point_to_point_s)})")
    bandwidth = 1.0 / per_byte
    rows, times = [], []
    for workers in counts:
        seconds = all_reduce_s[workers]
        if len(seconds) != len(sizes_bytes) or any(t <= 0 or not math.isfinite(t) for t in seconds):
            raise PlanError(f"the all-reduces among {workers} workers need one positive time per size, got "
                            f"{list(seconds)}")
        rounds = 2 * (workers - 1)
        for n, t in zip(sizes_bytes, seconds):
            # unknowns: β, the ring's per-chunk-byte (1/D + α), δ, γ
            rows.append([rounds, rounds * n / workers, 1.0, float(n)][:2 if len(counts) == 1 else 4])
            times.append(float(t))
    solution = _least_relative_squares(rows, times)
    beta, chunk_per_byte = solution[0], solution[1]
    per_call, copy = (solution[2], solution[3]) if len(counts) > 1 else (0.0, 0.0)
    terms = AllReduceTerms(max(0.0, chunk_per_byte - 1.0 / bandwidth), beta, per_call, copy)
    ring_error = max(abs(terms.equation_seconds(n, workers, bandwidth) - t) / t
                     for workers in counts for n, t in zip(sizes_bytes, all_reduce_s[workers]))
    return {"latency_s": latency, "bandwidth_bytes_s": bandwidth, "alpha_s_per_byte": terms.alpha_s_per_byte,
            "beta_s": terms.beta_s, "per_call_s": terms.per_call_s, "copy_s_per_byte": terms.copy_s_per_byte,
            "ring_error": ring_error}


def measured_terms(fit: CollectiveFit) -> AllReduceTerms:
    """The all-reduce a calibration measured (``flatpack calibrate --target gpu-container``):
    its fitted α, β, δ, γ, anchored to the all-reduces it timed. A size measured faster than
    a smaller one (medians a few percent apart at the smallest sizes, where the fixed costs
    dominate) takes the smaller one's time: a larger all-reduce is never cheaper."""
    return AllReduceTerms(fit.alpha_s_per_byte, fit.beta_s, fit.per_call_s, fit.copy_s_per_byte,
                          measured_sizes_bytes=tuple(fit.sizes_bytes),
                          measured_s=tuple((workers, tuple(float(t) for t in np.maximum.accumulate(
                              fit.all_reduce_s[workers]))) for workers in sorted(fit.all_reduce_s)))
