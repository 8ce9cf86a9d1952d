"""PipeDream's pipeline model (the PipeDream dissertation Ch. 5, §5.3.1–§5.3.3).

In steady state a 1F1B pipeline advances at the pace of its slowest stage; a stage may be
replicated over m workers (data parallelism within the stage, each replica taking every
m-th micro-batch), so stages here may have different ``replicas``. One level of topology:
every worker talks at its tier's bandwidth.

§5.3.1: T(i→j, m) = (1/m)·max(Σ T_l, 2(m − 1)·Σ|w_l|/B) for a stage replicated m times
(T_l: forward + backward of layer l), and the pipeline's time per micro-batch is
A = max(T(stage), 2·a_s/B for each cut s) over stages and cuts.

Readings chosen:

* (1/m)·2(m − 1)|w|/B is the per-replica time of a ring all-reduce of |w| among m
  (2(m − 1) rounds of |w|/m each), so the sync term is
  ``collectives.ring_allreduce_seconds(|w|, m, B)`` — the same function Hydrozoa's model
  calls; |w| is the stage's gradient bytes (= its weights when all train).
* PipeDream's "minibatch" (what flows through the pipeline) is our micro-batch of batch/M
  samples, and an iteration is the workload's M micro-batches: M·A in steady state
  (PipeDream has no flush, so fill and drain are not charged).
* A cut between stages with different bandwidths uses the slower one.
* Memory (§5.3.3): a stage keeps one (weights, activations) version per in-flight
  micro-batch. The input stage admits NOAM = ⌈workers / input-stage replicas⌉; a stage s
  sees ⌈(workers in stages s..) / replicas_s⌉ in flight (S − s in a straight pipeline).
  Plus gradients, optimizer state and s₀, checked against the stage's tier.
* Dollars: every worker is billed for the iteration at its tier's ``price_per_s``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flatpack.partitioner.cost.collectives import ring_allreduce_seconds
from flatpack.partitioner.cost.common import (MemoryNeed, check_training_plan, gradient_bytes, layer_times,
                                              stage_memory, stage_tier, to_json)
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

MODEL = "pipedream"


@dataclass(frozen=True)
class StageCost:
    index: int
    start: int
    end: int
    memory_mb: int
    replicas: int
    compute_s: float         # Σ T_l (forward + backward), one micro-batch
    sync_bytes: int          # Σ |w_l|
    sync_s: float            # (1/m)·2(m − 1)·Σ|w_l|/B
    time_s: float            # T(i→j, m) = max(compute/m, sync)
    in_flight: int           # weight/activation versions kept (§5.3.3)
    memory: MemoryNeed
    memory_needed_bytes: int
    fits: bool


@dataclass(frozen=True)
class CutCost:
    after_layer: int
    bytes: float             # a_s per micro-batch
    time_s: float            # 2·a_s/B (activations forward, gradients back)


@dataclass(frozen=True)
class PipeDreamCost:
    stages: tuple[StageCost, ...]
    cuts: tuple[CutCost, ...]
    micro_batch_size: float
    micro_batches: int
    slowest_s: float              # A: steady-state seconds per micro-batch
    bottleneck: str               # "stage i" or "cut after layer j"
    iteration_s: float            # M·A
    workers: int
    dollars_per_iteration: float
    fits: bool
    unfit_stage: int | None

    def to_json(self) -> dict:
        return to_json(self, MODEL)


def stage_seconds(compute_s: float, sync_bytes: float, replicas: int, bandwidth_bytes_s: float) -> float:
    """T(i→j, m) = (1/m)·max(compute, 2(m − 1)·|w|/B) (the PipeDream dissertation §5.3.1)."""
    return max(compute_s / replicas, ring_allreduce_seconds(sync_bytes, replicas, bandwidth_bytes_s))


def versions_in_flight(plan: Plan, stage: int) -> int:
    """Micro-batches (and weight versions) stage ``stage`` holds at once (§5.3.3): the
    workers from it to the end over its replicas, S − s in a straight pipeline. The
    ``1f1b-async`` runtime holds exactly these (``runtime.stashing.WeightStash``)."""
    return math.ceil(sum(later.replicas for later in plan.stages[stage:]) / plan.stages[stage].replicas)


def iteration(problem: Problem, plan: Plan) -> PipeDreamCost:
    """Steady-state time per micro-batch (the slowest stage or cut), time and dollars per
    iteration of M micro-batches, and per-stage memory of ``plan`` under PipeDream's model
    (the PipeDream dissertation §5.3.1; see the module docstring for the readings)."""
    check_training_plan(problem, plan, "PipeDream")
    micro = problem.workload.micro_batch_size
    tiers = [stage_tier(problem, stage, index) for index, stage in enumerate(plan.stages)]
    workers = plan.workers

    stages = []
    for s, (stage, tier) in enumerate(zip(plan.stages, tiers)):
        fwd, bwd = layer_times(problem, stage.start, stage.end, tier, micro)
        grads = gradient_bytes(problem, stage.start, stage.end)
        sync = ring_allreduce_seconds(grads, stage.replicas, tier.bandwidth_bytes_s)
        in_flight = versions_in_flight(plan, s)
        memory = stage_memory(problem, stage.start, stage.end, tier,
                              micro_batches_in_flight=in_flight, weight_versions=in_flight)
        stages.append(StageCost(s, stage.start, stage.end, tier.memory_mb, stage.replicas, fwd + bwd, grads, sync,
                                stage_seconds(fwd + bwd, grads, stage.replicas, tier.bandwidth_bytes_s), in_flight,
                                memory, memory.total, memory.fits))

    cuts = []
    for s in range(len(plan.stages) - 1):
        nbytes = problem.boundary_bytes(plan.stages[s].end, micro)
        bandwidth = min(tiers[s].bandwidth_bytes_s, tiers[s + 1].bandwidth_bytes_s)
        cuts.append(CutCost(plan.stages[s].end, nbytes, 2 * nbytes / bandwidth))

    candidates = [(stage.time_s, f"stage {stage.index}") for stage in stages]
    candidates += [(cut.time_s, f"cut after layer {cut.after_layer}") for cut in cuts]
    slowest, bottleneck = max(candidates, key=lambda item: item[0])
    iteration_s = problem.workload.micro_batches * slowest
    dollars = iteration_s * sum(stage.replicas * tier.price_per_s for stage, tier in zip(plan.stages, tiers))
    unfit = next((stage.index for stage in stages if not stage.fits), None)
    return PipeDreamCost(
        stages=tuple(stages), cuts=tuple(cuts), micro_batch_size=micro,
        micro_batches=problem.workload.micro_batch_count,
        slowest_s=slowest, bottleneck=bottleneck, iteration_s=iteration_s, workers=workers,
        dollars_per_iteration=dollars, fits=unfit is None, unfit_stage=unfit,
    )
