"""Gradient-synchronization formulas shared by the cost models.

Every model that synchronizes replicas calls one of these, so a formula lives in one place:
FuncPipe's storage-based scatter-reduce (eq. 1 and eq. 2) and the ring all-reduce that
Hydrozoa and PipeDream both model.
"""

from __future__ import annotations

from flatpack.errors import PlanError
from flatpack.stage.settings import SYNC_METHODS


def _check(nbytes: float, workers: int, bandwidth_bytes_s: float) -> None:
    if workers < 1:
        raise PlanError(f"synchronization needs at least 1 worker, got {workers}")
    if nbytes < 0:
        raise PlanError(f"cannot synchronize a negative number of bytes ({nbytes})")
    if not bandwidth_bytes_s > 0:
        raise PlanError(f"synchronization needs a positive bandwidth, got {bandwidth_bytes_s!r} bytes/s")


def scatter_reduce_coefficients(method: str, workers: int) -> tuple[float, float]:
    """FuncPipe's (γ, δ) for t_s = γ·s/w + δ·t_lat (000_2f8f665d06f7d6de.txt, App. B eq. 12).

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

    000_2f8f665d06f7d6de.txt §3.3: eq. 1 (LambdaML) = 3·s/w − 2·s/(n·w) + 4·t_lat; eq. 2
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

    Reading chosen (002_ac11226e9c721a68.txt §3.4, "Hybrid-Parallelism Runtime Model"): the
    text says |p|/(B·D) "models the data transfer time for each of the 2(B − 1) rounds",
    while the printed equation multiplies by (B − 1); we follow the text and the standard
    ring algorithm (reduce-scatter then all-gather, N − 1 rounds each), which is also what
    PipeDream's volume gives: 004_623b02f6b92126b0.txt §5.3.1 counts 2(m − 1)·|w| bytes in
    all and divides the stage time by m, i.e. 2(m − 1)·|w|/(m·B) per replica — this
    function with α = β = 0. The ring runs among the data-parallel replicas of one shard
    (N = A in Hydrozoa's A×B notation; see hydrozoa.py).
    """
    _check(nbytes, workers, bandwidth_bytes_s)
    if workers == 1:
        return 0.0
    chunk = nbytes / workers
    return 2 * (workers - 1) * (chunk / bandwidth_bytes_s + per_byte_overhead_s * chunk + per_round_overhead_s)
