"""Gillis's fork-join inference model (001_af86584f8598a88a.txt §III-B, §IV-A, §IV-B, §IV-C).

A master function receives the request and walks the chain group by group. For each
group (consecutive layers fused so that partitions compute independently, §III-C) it
forks ``workers`` worker functions, each computing one partition of the group's output,
optionally computes one partition itself (``on_master``), and joins their results before
the next group. All functions have the same memory size M (§IV-B).

The plan data: :class:`Plan` says which layers form a group and a memory size, but not who
computes what, so this module has its own :class:`ForkJoinPlan` — per group its layer
range, its number of workers, whether the master computes a partition, and how the group
is split (``"channel"``: each partition keeps a subset of the filters, so 1/p of the
weights; ``"spatial"``: partitions split height/width and each keeps all the weights,
Fig. 2). ``ForkJoinPlan.from_plan`` reads a Plan as: a stage with one replica runs on the
master alone, a stage with r > 1 replicas is split channel-wise over r workers.

Readings chosen (the paper gives the model in words, not equations):

* A group's p = workers + on_master partitions each do 1/p of the group's forward time,
  the serving forward without an autograd graph (``Problem.layer_inference_seconds``)
  (even split; the redundant overlap of spatial splits, §III-C, is not modelled).
* Each worker exchanges 1/p of the group's input and output with the master; the master's
  link carries all n workers' shares, n·(in + out)/p at the tier's bandwidth, and the
  function-communication delay is the expected maximum of n i.i.d. exponentially modified
  Gaussian delays (§IV-A, "n-th order statistics"). Group latency =
  max(master's own partition, transfer + partition compute + E[max of n delays]).
* The first group's input is the request itself: the profiled size of the model's inputs.
* Memory is weights, as Gillis budgets it (§IV-B eq. 2, §V-A "maximum memory to host the
  model weights"): each worker's partition plus the runtime s₀ must fit M, and the master's
  partitions of all the groups it computes, plus s₀, must fit M.
* Billing (§IV-C): C = (⌈T/D⌉ + Σ_w ⌈T_w/D⌉)·D with T the master's duration (= the
  latency) and T_w a worker's duration, its partition's compute plus its own transfer; the
  invocation delay happens before the worker's handler runs and is not billed to it.
  Request charges, which Gillis ignores as small, are reported separately.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from flatpack.errors import PlanError
from flatpack.partitioner.cost.common import mb, memory_limit, to_json
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

if TYPE_CHECKING:
    from flatpack.backends.catalog import Platform

MODEL = "gillis"
SPLITS = ("channel", "spatial")
_GRID_POINTS = 20001
_erfc = np.vectorize(math.erfc, otypes=[float])


@dataclass(frozen=True)
class CommDelay:
    """One master↔worker communication delay, exponentially modified Gaussian
    (001_af86584f8598a88a.txt §IV-A): Normal(``mu_s``, ``sigma_s``²) plus an exponential
    tail of mean ``tail_s`` (= 1/λ)."""

    mu_s: float
    sigma_s: float = 0.0
    tail_s: float = 0.0

    def __post_init__(self) -> None:
        if self.sigma_s < 0 or self.tail_s < 0:
            raise PlanError(f"a communication delay needs sigma_s >= 0 and tail_s >= 0, got {self}")

    @property
    def mean(self) -> float:
        """E[X] = µ + 1/λ."""
        return self.mu_s + self.tail_s

    def cdf(self, x: np.ndarray | float) -> np.ndarray:
        """F(x) = Φ(z) − exp(−λ(x − µ) + λ²σ²/2)·Φ(z − λσ), z = (x − µ)/σ (the EMG CDF).

        The second term is evaluated as exp(−z²/2)·erfcx(t)/2, t = (λσ − z)/√2, once
        exp(·) would overflow against a vanishing erfc: the same number, without inf·0."""
        x = np.asarray(x, dtype=float)
        if self.sigma_s == 0:
            shifted = np.maximum(x - self.mu_s, 0.0)
            return 1.0 - np.exp(-shifted / self.tail_s) if self.tail_s > 0 else (x >= self.mu_s).astype(float)
        z = (x - self.mu_s) / self.sigma_s
        normal = 0.5 * _erfc(-z / math.sqrt(2))
        if self.tail_s == 0:
            return normal
        ls = self.sigma_s / self.tail_s  # λσ
        t = (ls - z) / math.sqrt(2)
        term = np.empty_like(z)
        small = t <= 25.0
        term[small] = 0.5 * np.exp(-ls * z[small] + ls * ls / 2) * _erfc(t[small])
        big = ~small
        tb = t[big]
        term[big] = (0.5 * np.exp(-z[big] ** 2 / 2) / (tb * math.sqrt(math.pi))
                     * (1 - 1 / (2 * tb ** 2) + 3 / (4 * tb ** 4)))
        return np.clip(normal - term, 0.0, 1.0)

    def expected_max(self, n: int) -> float:
        """E[max of n i.i.d. delays], the n-th order statistic Gillis uses for a fork of n
        workers (§IV-A): ∫ (1 − F(x)ⁿ) dx above a point where F ≈ 0, by the trapezoid rule.
        Closed forms where they exist: n = 1 gives µ + 1/λ; σ = 0 gives µ + Hₙ/λ."""
        if n < 1:
            raise PlanError(f"the expected maximum needs n >= 1 delays, got {n}")
        if n == 1:
            return self.mean
        if self.sigma_s == 0:
            return self.mu_s + self.tail_s * sum(1.0 / k for k in range(1, n + 1))
        low = self.mu_s - 12 * self.sigma_s
        # past this point 1 − F(x)ⁿ < n·e⁻⁴⁰: the integrand's tail is below double precision
        high = self.mu_s + 12 * self.sigma_s + self.tail_s * (math.log(n) + 40)
        grid = np.linspace(low, high, _GRID_POINTS)
        values = 1.0 - self.cdf(grid) ** n
        step = grid[1] - grid[0]
        return float(low + step * (values.sum() - (values[0] + values[-1]) / 2))


def billed_seconds(platform: "Platform", durations: Sequence[float]) -> float:
    """C = (⌈T/D⌉ + Σ_w ⌈T_w/D⌉)·D (001_af86584f8598a88a.txt §IV-C, "billed function
    duration"; D = 1 ms on Lambda, 100 ms on Google Cloud Functions at the time): the sum of
    each function's duration rounded up by ``Platform.billed_seconds``."""
    return sum(platform.billed_seconds(duration) for duration in durations)


@dataclass(frozen=True)
class Group:
    """Layers start..end fused into one group, split into ``workers`` worker partitions plus
    one on the master when ``on_master``; ``split`` as in the module docstring."""

    start: int
    end: int
    workers: int
    on_master: bool = False
    split: str = "channel"

    @property
    def partitions(self) -> int:
        return self.workers + int(self.on_master)


@dataclass(frozen=True)
class ForkJoinPlan:
    """Gillis's execution plan: the groups in chain order, and the one function memory size."""

    groups: tuple[Group, ...]
    memory_mb: int | None
    num_layers: int

    @classmethod
    def from_plan(cls, plan: Plan) -> "ForkJoinPlan":
        """One replica: the master runs the group alone; r > 1: r workers, split by channel."""
        sizes = {stage.memory_mb for stage in plan.stages}
        if len(sizes) != 1:
            raise PlanError(f"Gillis runs every function with one memory size; this plan has {sorted(sizes, key=str)}")
        groups = tuple(Group(stage.start, stage.end, 0, True) if stage.replicas == 1
                       else Group(stage.start, stage.end, stage.replicas, False) for stage in plan.stages)
        return cls(groups, sizes.pop(), plan.num_layers)

    def check_against(self, num_layers: int) -> None:
        if self.num_layers != num_layers:
            raise PlanError(f"the fork-join plan was made for a chain of {self.num_layers} layers, this chain has "
                            f"{num_layers}; re-plan after running the same passes")
        Plan.from_ranges([(group.start, group.end) for group in self.groups], num_layers)
        for index, group in enumerate(self.groups):
            if group.workers < 0 or group.partitions < 1:
                raise PlanError(f"group {index} has {group.workers} workers and on_master={group.on_master}; "
                                "a group needs at least one partition, on a worker or on the master")
            if group.split not in SPLITS:
                raise PlanError(f"group {index} split {group.split!r} is not one of {', '.join(SPLITS)}")


@dataclass(frozen=True)
class GroupCost:
    index: int
    start: int
    end: int
    workers: int
    on_master: bool
    partition_compute_s: float   # the group's forward time / p
    transfer_s: float            # all workers' shares over the master's link
    delay_s: float               # E[max of n communication delays]
    latency_s: float
    worker_duration_s: float     # billed per worker
    partition_weight_bytes: int


@dataclass(frozen=True)
class ForkJoinCost:
    groups: tuple[GroupCost, ...]
    memory_mb: int
    latency_s: float                 # T: the master's duration (§IV-B eq. 1)
    invocations: int                 # master + every worker
    granularity_s: float             # D
    billed_s: float                  # C (§IV-C)
    duration_dollars: float
    request_dollars: float
    dollars_per_request: float
    master_weight_bytes: int         # Σ of the master's partitions (§IV-B eq. 2)
    memory_limit_bytes: int          # M − s₀
    fits: bool
    unfit: str | None                # "master" or "group i", the first that does not fit

    def to_json(self) -> dict:
        return to_json(self, MODEL)


def _default_delay(problem: Problem) -> CommDelay:
    """Measured EMG parameters from ``problem.options["comm_delay"]``, else the platform's
    storage latency as a fixed delay (no spread: the order statistic is then the latency)."""
    delay = problem.options.get("comm_delay")
    if isinstance(delay, CommDelay):
        return delay
    if isinstance(delay, dict):
        return CommDelay(**delay)
    return CommDelay(problem.platform.storage_latency_s)


def latency(problem: Problem, plan: Plan | ForkJoinPlan, delay: CommDelay | None = None) -> ForkJoinCost:
    """Latency, billed duration and memory of one inference request under Gillis's model
    (001_af86584f8598a88a.txt §IV-A performance model, §IV-B eq. 1–2, §IV-C billed
    duration). See the module docstring for the readings chosen."""
    if problem.workload.mode != "infer":
        raise PlanError("the Gillis model is an inference model; use FuncPipe, Hydrozoa or PipeDream for training")
    fork_join = plan if isinstance(plan, ForkJoinPlan) else ForkJoinPlan.from_plan(plan)
    fork_join.check_against(len(problem.chain))
    if fork_join.memory_mb is None:
        raise PlanError("the fork-join plan has no memory tier (memory_mb is None); cost models need one")
    delay = delay or _default_delay(problem)
    platform = problem.platform
    tier = platform.tier(fork_join.memory_mb)
    bandwidth = tier.bandwidth_bytes_s
    batch = problem.workload.batch
    limit, runtime = memory_limit(problem, tier)
    budget = limit - runtime

    groups, durations = [], []
    master_weights = 0
    unfit = None
    for index, group in enumerate(fork_join.groups):
        forward = sum(problem.layer_inference_seconds(i, tier, batch) for i in range(group.start, group.end + 1))
        parts = group.partitions
        compute = forward / parts
        weights = sum(problem.layer_profile(i).param_bytes + problem.layer_profile(i).buffer_bytes
                      for i in range(group.start, group.end + 1))
        part_weights = math.ceil(weights / parts) if group.split == "channel" else weights
        if group.on_master:
            master_weights += part_weights
        if group.workers and part_weights > budget and unfit is None:
            unfit = f"group {index}"
        if group.workers == 0:
            transfer = fork_delay = worker_duration = 0.0
            group_latency = compute
        else:
            in_bytes = problem.boundary_bytes(group.start - 1, batch)
            share = (in_bytes + problem.boundary_bytes(group.end, batch)) / parts
            transfer = group.workers * share / bandwidth
            fork_delay = delay.expected_max(group.workers)
            worker_duration = compute + share / bandwidth
            group_latency = max(compute if group.on_master else 0.0, transfer + compute + fork_delay)
            durations.extend([worker_duration] * group.workers)
        groups.append(GroupCost(index, group.start, group.end, group.workers, group.on_master, compute, transfer,
                                fork_delay, group_latency, worker_duration, part_weights))

    if master_weights > budget and unfit is None:
        unfit = "master"
    total = sum(group.latency_s for group in groups)
    invocations = 1 + sum(group.workers for group in fork_join.groups)
    billed = billed_seconds(platform, [total, *durations])
    duration_dollars = billed * tier.price_per_s
    request_dollars = invocations * platform.price_per_request
    return ForkJoinCost(
        groups=tuple(groups), memory_mb=tier.memory_mb, latency_s=total, invocations=invocations,
        granularity_s=platform.billing_granularity_s, billed_s=billed, duration_dollars=duration_dollars,
        request_dollars=request_dollars, dollars_per_request=duration_dollars + request_dollars,
        master_weight_bytes=master_weights, memory_limit_bytes=budget, fits=unfit is None, unfit=unfit,
    )


def describe_unfit(cost: ForkJoinCost) -> str:
    """A sentence for errors and logs: what does not fit and by how much."""
    if cost.fits:
        return "every function fits"
    if cost.unfit == "master":
        return (f"the master's partitions need {mb(cost.master_weight_bytes)}, more than the "
                f"{mb(cost.memory_limit_bytes)} a {cost.memory_mb} MB function leaves for weights")
    return f"a worker partition of {cost.unfit} needs more than {mb(cost.memory_limit_bytes)} of weights"
