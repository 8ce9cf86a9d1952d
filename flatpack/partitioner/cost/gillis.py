"""Gillis's fork-join inference model (Gillis §III-B, §IV-A, §IV-B, §IV-C).

A master function receives the request and walks the chain group by group. For each
group (consecutive layers fused so that partitions compute independently, §III-C) it
forks ``workers`` worker functions, each computing one partition of the group's output,
optionally computes one partition itself (``on_master``), and joins their results before
the next group. All functions have the same memory size M (§IV-B).

The plan data: :class:`Plan` says which layers form a group and a memory size, but not who
computes what, so this module has its own :class:`ForkJoinPlan` — per group its layer
range, its number of workers, whether the master computes a partition, and how the group
is split (``StagePlan.split``, Gillis §II-C Fig. 2):

* ``"channel"``: every partition receives the group's whole input (broadcast) and keeps a
  slice of the filters of its conv and linear layers (``stage/channels.py`` has the rules the
  runtime applies: the next layer's input channels follow, partial sums are added by the
  master). A partition holds the sliced weights' largest share plus the weights every
  partition needs whole (``ChannelGroup.partition_bytes``); it repeats the ops that see
  only whole values, so its compute is forward·(s/p + 1 − s) with s the group's share of
  FLOPs that split; it sends back its slice of the sliced outputs, its full-size partial
  sums, and (partition 0 alone) the outputs every partition computes whole. Where the
  problem has no channel analysis (a hand-made chain), a channel split is Gillis's ideal
  one: all weights, FLOPs and outputs divided by p.
* ``"batch"``: every partition keeps all the weights and 1/p of the request's samples, of
  its input and of its output; it needs at least p samples.

``ForkJoinPlan.from_plan`` reads a Plan as: a stage with one replica runs on the master
alone, a stage with r > 1 replicas is split over r workers by its ``split``, or, left out,
by the split of lower latency that can run (:func:`choose_split`; without a problem to
cost it, by batch, which is exact for any stage).

Readings chosen (the paper gives the model in words, not equations):

* A group's p = workers + on_master partitions each do their share of the group's
  forward time, the serving forward without an autograd graph
  (``Problem.layer_inference_seconds``); the halo of Gillis's spatial split is not
  modelled, as the runtime does not split images.
* The master's link carries what every worker receives and sends back, at the tier's
  bandwidth, and the function-communication delay is the expected maximum of n i.i.d.
  exponentially modified Gaussian delays (§IV-A, "n-th order statistics"). Group latency =
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

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
from scipy import stats

from flatpack.errors import PlanError
from flatpack.partitioner.cost.common import memory_limit, to_json
from flatpack.units import mb
from flatpack.partitioner.plan import FORK_JOIN_SPLITS, Plan
from flatpack.partitioner.problem import Problem

if TYPE_CHECKING:
    from flatpack.platform.catalog import Platform, Tier
    from flatpack.ir.channels import ChannelGroup

MODEL = "gillis"
SPLITS = FORK_JOIN_SPLITS
_GRID_POINTS = 20001


@dataclass(frozen=True)
class CommDelay:
    """One master↔worker communication delay, exponentially modified Gaussian
    (Gillis §IV-A): Normal(``mu_s``, ``sigma_s``²) plus an exponential
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
        """F(x) = Φ(z) − exp(−λ(x − µ) + λ²σ²/2)·Φ(z − λσ), z = (x − µ)/σ: the EMG CDF, as
        ``scipy.stats.exponnorm`` (shape K = 1/(λσ), loc µ, scale σ) computes it; the
        degenerate σ = 0 (shifted exponential) and 1/λ = 0 (normal) cases by their own
        formulas, which exponnorm cannot take (K = ∞ or 0)."""
        x = np.asarray(x, dtype=float)
        if self.sigma_s == 0:
            shifted = np.maximum(x - self.mu_s, 0.0)
            return 1.0 - np.exp(-shifted / self.tail_s) if self.tail_s > 0 else (x >= self.mu_s).astype(float)
        if self.tail_s == 0:
            return stats.norm.cdf(x, loc=self.mu_s, scale=self.sigma_s)
        return stats.exponnorm.cdf(x, self.tail_s / self.sigma_s, loc=self.mu_s, scale=self.sigma_s)

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


def billed_seconds(platform: Platform, durations: Sequence[float]) -> float:
    """C = (⌈T/D⌉ + Σ_w ⌈T_w/D⌉)·D (Gillis §IV-C, "billed function
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
    def from_plan(cls, plan: Plan, problem: Problem | None = None) -> ForkJoinPlan:
        """One replica: the master runs the group alone; r > 1: r workers, split by the
        stage's ``split``, or when it has none by :func:`choose_split` on ``problem`` (by
        batch without one)."""
        sizes = {stage.memory_mb for stage in plan.stages}
        if len(sizes) != 1:
            raise PlanError(f"Gillis runs every function with one memory size; this plan has {sorted(sizes, key=str)}")
        memory_mb = sizes.pop()
        groups = []
        for stage in plan.stages:
            if stage.replicas == 1:
                groups.append(Group(stage.start, stage.end, 0, True))
                continue
            split = stage.split
            if split is None and problem is not None and memory_mb is not None:
                try:
                    split = choose_split(problem, stage.start, stage.end, stage.replicas, memory_mb)
                except PlanError:
                    split = None    # neither runs: ``latency`` reports the batch split's reason as unfit
            split = split or "batch"
            groups.append(Group(stage.start, stage.end, stage.replicas, False, split))
        return cls(tuple(groups), memory_mb, plan.num_layers)

    @property
    def min_request_samples(self) -> int:
        """The fewest samples a request may hold: a group split by batch gives each of its
        partitions one at least (both serving masters refuse fewer, before any function runs)."""
        return max([group.partitions for group in self.groups if group.workers and group.split == "batch"], default=1)

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
    split: str = "channel"
    worker_in_bytes: float = 0.0     # what the busiest worker receives
    worker_out_bytes: float = 0.0    # and sends back


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
    unfit: str | None                # the first that does not fit: "master", "group i" (its weights), or
                                     # "group i: why" (its split cannot run it)

    def to_json(self) -> dict:
        return to_json(self, MODEL)


def measured_delay(given: CommDelay | dict | None) -> CommDelay | None:
    """The ``comm_delay`` option as a :class:`CommDelay`: given as one, or as its fields
    (``{"mu_s": ..., "sigma_s": ..., "tail_s": ...}``, as JSON carries it); None: not measured."""
    if given is None or isinstance(given, CommDelay):
        return given
    if isinstance(given, dict):
        fields = [field.name for field in dataclasses.fields(CommDelay)]
        unknown = sorted(set(given) - set(fields))
        if unknown or "mu_s" not in given:
            raise PlanError(f"comm_delay {given!r} must give mu_s and may give sigma_s and tail_s"
                            + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
        return CommDelay(**given)
    raise PlanError(f"comm_delay must be a CommDelay or its fields as a dict (mu_s, sigma_s, tail_s), "
                    f"got {type(given).__name__}")


def _default_delay(problem: Problem) -> CommDelay:
    """Measured EMG parameters from ``problem.options.comm_delay``; else the EMG that
    ``flatpack calibrate`` fitted to the target's store requests (``scipy.stats.exponnorm``'s
    K, loc, scale: µ = loc, σ = scale, 1/λ = K·scale); else the platform's storage latency as
    a fixed delay (no spread: the order statistic is then the latency)."""
    delay = measured_delay(problem.options.comm_delay)
    if delay is not None:
        return delay
    fitted = getattr(problem.calibration, "store_latency", None)
    if fitted is not None:
        return CommDelay(fitted.loc, fitted.scale, fitted.k * fitted.scale)
    return CommDelay(problem.platform.storage_latency_s)


def _request_overhead(problem: Problem, tier: Tier, fork_join: ForkJoinPlan, invocations: int) -> float:
    """What a request costs beyond the paper's equations, as ``flatpack calibrate`` measured
    it on the tier (``backends.task_overheads.measure_serving``; 0 where nothing measured it):
    the request's own round trip once (its upload, the master's wait, the response's upload
    and the invoker's wait), and per split group the fork's puts and waits, read at the
    plan's number of functions."""
    calibration = problem.calibration
    if calibration is None:
        return 0.0
    forks = sum(1 for group in fork_join.groups if group.workers)
    return (calibration.task_overhead(tier.memory_mb, "request", invocations)
            + forks * calibration.task_overhead(tier.memory_mb, "fork", invocations))


def group_weight_bytes(problem: Problem, start: int, end: int) -> int:
    """Weights and buffers of layers start..end, whole."""
    return sum(problem.layer_profile(i).param_bytes + problem.layer_profile(i).buffer_bytes
               for i in range(start, end + 1))


def channel_group(problem: Problem, start: int, end: int, parts: int) -> ChannelGroup | None:
    """The channel split of layers start..end; None when the problem has no channel
    analysis (Gillis's ideal split). PlanError when the group has none, or fewer channels
    than ``parts``."""
    if problem.channel_groups is None:
        return None
    names = f"layers {start}..{end} ({problem.chain[start].name} .. {problem.chain[end].name})"
    shape = problem.channel_groups.get((start, end))
    if shape is None:
        raise PlanError(f"{names} cannot be split by channel: an op in it mixes or reshapes the split channels "
                        "(stage/channels.py lists the ops a channel split cuts) or an input is not a tensor; split "
                        "the group by batch, or group the layers differently")
    if parts > shape.max_partitions:
        raise PlanError(f"{names}: layer {shape.limiting_layer} has {shape.max_partitions} output channels, fewer "
                        f"than the {parts} partitions of a channel split; use at most {shape.max_partitions} "
                        "partitions, or split the group by batch")
    return shape


def group_cost(problem: Problem, tier: Tier, group: Group, forward_s: float, weight_bytes: int,
               fork_delay_s: float, index: int = 0) -> GroupCost:
    """One group's compute, transfer, latency, worker duration and partition weights under
    its split (module docstring); PlanError when the split cannot run this group."""
    parts = group.partitions
    if group.workers == 0:
        return GroupCost(index, group.start, group.end, 0, group.on_master, forward_s / parts, 0.0, 0.0,
                         forward_s / parts, 0.0, math.ceil(weight_bytes / parts) if parts > 1 else weight_bytes,
                         group.split)
    batch = problem.workload.batch
    in_bytes = problem.boundary_bytes(group.start - 1, batch)
    out_bytes = problem.boundary_bytes(group.end, batch)
    if group.split == "batch":
        if batch < parts:
            raise PlanError(f"layers {group.start}..{group.end}: a batch split over {parts} partitions needs at least "
                            f"{parts} samples per request, this workload has {batch}; split the group by channel, "
                            "or use fewer workers")
        compute = forward_s / parts
        part_weights = weight_bytes
        worker_in, worker_out = in_bytes / parts, out_bytes / parts
        master_link = group.workers * (worker_in + worker_out)
    else:
        shape = channel_group(problem, group.start, group.end, parts)
        if shape is None:   # Gillis's ideal split: everything divides
            compute = forward_s / parts
            part_weights = math.ceil(weight_bytes / parts)
            worker_in, worker_out = in_bytes, out_bytes / parts
            master_link = group.workers * (worker_in + worker_out)
        else:
            compute = forward_s * (shape.split_flops_share / parts + 1 - shape.split_flops_share)
            part_weights = shape.partition_bytes(parts)
            sliced = shape.sliced_output_share * out_bytes
            partial = shape.partial_output_share * out_bytes
            whole = shape.whole_output_share * out_bytes
            worker_in = in_bytes
            worker_out = sliced / parts + partial + whole      # partition 0, which also sends the whole outputs
            master_link = group.workers * (in_bytes + sliced / parts + partial) + whole
    bandwidth = tier.bandwidth_bytes_s
    transfer = master_link / bandwidth
    latency = max(compute if group.on_master else 0.0, transfer + compute + fork_delay_s)
    duration = compute + (worker_in + worker_out) / bandwidth
    return GroupCost(index, group.start, group.end, group.workers, group.on_master, compute, transfer, fork_delay_s,
                     latency, duration, part_weights, group.split, worker_in, worker_out)


def choose_split(problem: Problem, start: int, end: int, workers: int, memory_mb: int) -> str:
    """The split of lower latency for layers start..end over ``workers`` workers among those
    that can run them and whose partition fits a worker (the first that can run when none
    fits). PlanError naming each split's reason when neither can run."""
    tier = problem.platform.tier(memory_mb)
    limit, runtime = memory_limit(problem, tier)
    forward = sum(problem.layer_inference_seconds(i, tier, problem.workload.batch) for i in range(start, end + 1))
    weights = group_weight_bytes(problem, start, end)
    delay = _default_delay(problem).expected_max(workers)
    costs, reasons = [], []
    for split in SPLITS:
        try:
            costs.append(group_cost(problem, tier, Group(start, end, workers, False, split), forward, weights, delay))
        except PlanError as err:
            reasons.append(f"by {split}: {err}")
    if not costs:
        raise PlanError(f"layers {start}..{end} cannot be split over {workers} workers — " + "; ".join(reasons))
    fitting = [cost for cost in costs if cost.partition_weight_bytes <= limit - runtime] or costs
    return min(fitting, key=lambda cost: cost.latency_s).split


def with_splits(problem: Problem, plan: Plan) -> Plan:
    """The plan with the split of each replicated stage that has none written out, as
    :func:`choose_split` picks it, so that the plan says what the runtime will run. Only for
    a profiled inference problem and a one-size plan (Gillis's); other plans are returned as
    they are (their replicated stages, if served, split by batch). PlanError when a stage
    asks for a channel split its layers do not have (``channel_group``)."""
    if problem.workload.mode != "infer":
        return plan
    for stage in plan.stages:
        if stage.replicas > 1 and stage.split == "channel":
            channel_group(problem, stage.start, stage.end, stage.replicas)
    sizes = {stage.memory_mb for stage in plan.stages}
    if not problem.profiled or len(sizes) != 1 or None in sizes:
        return plan
    if all(stage.replicas == 1 or stage.split is not None for stage in plan.stages):
        return plan
    memory_mb = sizes.pop()
    assert memory_mb is not None  # the one size, not None (checked above)
    stages = tuple(stage if stage.replicas == 1 or stage.split is not None else
                   dataclasses.replace(stage, split=choose_split(problem, stage.start, stage.end, stage.replicas,
                                                                 memory_mb))
                   for stage in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def latency(problem: Problem, plan: Plan | ForkJoinPlan, delay: CommDelay | None = None) -> ForkJoinCost:
    """Latency, billed duration and memory of one inference request under Gillis's model
    (Gillis §IV-A performance model, §IV-B eq. 1–2, §IV-C billed
    duration). See the module docstring for the readings chosen."""
    if problem.workload.mode != "infer":
        raise PlanError("the Gillis model is an inference model; use FuncPipe, Hydrozoa or PipeDream for training")
    fork_join = plan if isinstance(plan, ForkJoinPlan) else ForkJoinPlan.from_plan(plan, problem)
    fork_join.check_against(len(problem.chain))
    if fork_join.memory_mb is None:
        raise PlanError("the fork-join plan has no memory tier (memory_mb is None); cost models need one")
    delay = delay or _default_delay(problem)
    platform = problem.platform
    tier = platform.tier(fork_join.memory_mb)
    batch = problem.workload.batch
    limit, runtime = memory_limit(problem, tier)
    budget = limit - runtime

    groups, durations = [], []
    master_weights = 0
    unfit = None
    for index, group in enumerate(fork_join.groups):
        forward = sum(problem.layer_inference_seconds(i, tier, batch) for i in range(group.start, group.end + 1))
        weights = group_weight_bytes(problem, group.start, group.end)
        fork_delay = delay.expected_max(group.workers) if group.workers else 0.0
        try:
            cost = group_cost(problem, tier, group, forward, weights, fork_delay, index)
        except PlanError as err:
            # a split that cannot run this group: the plan does not fit (solvers that price
            # whole plans skip it), its group counted as run whole on one worker
            unfit = unfit or f"group {index}: {err}"
            cost = GroupCost(index, group.start, group.end, group.workers, group.on_master, forward, 0.0, fork_delay,
                             forward + fork_delay, forward, weights, group.split)
        if group.on_master:
            master_weights += cost.partition_weight_bytes
        if group.workers and cost.partition_weight_bytes > budget and unfit is None:
            unfit = f"group {index}"
        durations.extend([cost.worker_duration_s] * group.workers)
        groups.append(cost)

    if master_weights > budget and unfit is None:
        unfit = "master"
    invocations = 1 + sum(group.workers for group in fork_join.groups)
    total = sum(group.latency_s for group in groups) + _request_overhead(problem, tier, fork_join, invocations)
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
    if cost.unfit and ":" in cost.unfit:     # a split that cannot run the group
        return cost.unfit
    if cost.unfit == "master":
        return (f"the master's partitions need {mb(cost.master_weight_bytes)}, more than the "
                f"{mb(cost.memory_limit_bytes)} a {cost.memory_mb} MB function leaves for weights")
    return f"a worker partition of {cost.unfit} needs more than {mb(cost.memory_limit_bytes)} of weights"
