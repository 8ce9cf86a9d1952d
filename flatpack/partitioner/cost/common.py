"""What several cost models compute the same way: a stage's tier, its memory need, sums of
per-layer figures, and the JSON form of a breakdown."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from flatpack.errors import PlanError
from flatpack.ir.profile import Linear, SavedLineSum
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.units import MIB, mb

if TYPE_CHECKING:
    import numpy as np

    from flatpack.platform.catalog import Tier

# seconds as one number, or per layer as an array (the same arithmetic applies elementwise)
Seconds = TypeVar("Seconds", float, "np.ndarray")


def to_json(result: Any, model: str) -> dict[str, Any]:
    """A breakdown dataclass as JSON-ready data, tagged with the model that produced it."""
    return {"model": model, **asdict(result)}


def check_training_plan(problem: Problem, plan: Plan, model: str) -> None:
    """What every training model needs: a plan for this chain and a training workload."""
    plan.check_against(len(problem.chain))
    if problem.workload.mode != "train":
        raise PlanError(f"the {model} model is a training model; use the Gillis model for inference workloads")


def stage_tier(problem: Problem, stage: StagePlan, index: int) -> Tier:
    """The tier a stage runs on; cost models cannot price or time a stage without one."""
    if stage.memory_mb is None:
        raise PlanError(f"stage {index} (layers {stage.start}..{stage.end}) has no memory tier (memory_mb is "
                        "None); cost models need one: give every stage a memory_mb from the platform's tiers "
                        "or use a solver that chooses tiers")
    return problem.platform.tier(stage.memory_mb)


def uniform_replicas(plan: Plan, model: str) -> int:
    """The one data-parallel degree a model that replicates whole pipelines needs."""
    degrees = sorted({stage.replicas for stage in plan.stages})
    if len(degrees) != 1:
        raise PlanError(f"the {model} model replicates the whole pipeline, so every stage needs the same "
                        f"replicas; this plan has {degrees}. Use the PipeDream model for per-stage replicas")
    return degrees[0]


def pacing_replicas(plan: Plan) -> int:
    """The degree whose replicas pace a pipeline: the smallest, whose replicas each run the
    most micro-batches (µ = ⌈M/d⌉). A plan whose stages have their own degrees (PipeDream's
    1F1B-RR, ``flatpack run --stage-replicas``) is so priced by FuncPipe's model, which
    replicates whole pipelines: the pace at the busiest stage, each stage's sync at its own
    degree and the bill over every stage's replicas (``funcpipe.iteration``); the storage
    links' share and the memory are the busiest stage's (an approximation the model states)."""
    return min(stage.replicas for stage in plan.stages)


def micro_batches_per_replica(problem: Problem, replicas: int) -> int:
    """µ for the busiest replica: ⌈M/d⌉ (FuncPipe §3.4.1 writes µ = M/d, which assumes d | M;
    when it does not, the replica with the extra micro-batch sets the pace)."""
    total = problem.workload.micro_batch_count
    if replicas > total:
        raise PlanError(f"{replicas} replicas cannot share {total} micro-batches: some replicas would idle; "
                        f"use at most {total} replicas or more micro-batches")
    return math.ceil(total / replicas)


def layer_times(problem: Problem, start: int, end: int, tier: Tier, micro_batch: float) -> tuple[float, float]:
    """Forward and backward seconds of layers start..end for one micro-batch on ``tier``,
    through ``Problem.layer_seconds`` so that calibration applies."""
    forward = backward = 0.0
    for index in range(start, end + 1):
        fwd, bwd = problem.layer_seconds(index, tier, micro_batch)
        forward += fwd
        backward += bwd
    return forward, backward


def gradient_bytes(problem: Problem, start: int, end: int) -> int:
    """Bytes a stage synchronizes: its gradients (equal to its parameter bytes when every
    parameter trains; frozen parameters are not synchronized)."""
    return sum(problem.layer_profile(index).grad_bytes for index in range(start, end + 1))


@dataclass(frozen=True)
class MemoryNeed:
    """One worker's memory, by part, against its tier (bytes)."""

    activations: int     # activations kept for backward, for every micro-batch in flight
    weights: int         # parameters and buffers, times the weight versions kept
    gradients: int
    sync_buffers: int    # serialized gradients during synchronization
    optimizer: int       # optimizer state for the workload's optimizer
    base: int            # the runtime itself (FuncPipe's s0)
    limit: int           # the tier's memory

    @property
    def total(self) -> int:
        return self.activations + self.weights + self.gradients + self.sync_buffers + self.optimizer + self.base

    @property
    def fits(self) -> bool:
        return self.total <= self.limit

    def describe(self) -> str:
        return (f"activations {mb(self.activations)}, weights {mb(self.weights)}, gradients {mb(self.gradients)}, "
                f"sync buffers {mb(self.sync_buffers)}, optimizer state {mb(self.optimizer)}, "
                f"runtime {mb(self.base)}")


def memory_limit(problem: Problem, tier: Tier) -> tuple[int, int]:
    """(limit, runtime) bytes a stage's tensors are checked against: a CPU worker's memory
    with the runtime s₀ in it; on a GPU tier the device memory, with s₀ left to the host
    memory beside it (the tensors a stage trains with live on the device)."""
    if tier.gpus:
        return tier.gpu_memory_mb * MIB, 0
    return tier.memory_bytes, int(problem.platform.base_memory_bytes)


@dataclass(frozen=True)
class StageTensors:
    """What a stage's memory need is summed from: the activations it keeps per micro-batch
    (a line in samples), what it keeps per micro-batch when it recomputes them instead (its
    inputs, and its outputs until they are uploaded), and its weights (parameters and
    buffers), gradients and optimizer state in bytes."""

    saved: Linear
    weights: float
    gradients: float
    optimizer: float
    boundaries: Linear = Linear(0.0)


def stage_tensors(problem: Problem, start: int, end: int) -> StageTensors:
    """The :class:`StageTensors` of stage start..end (the last of :func:`stage_tensor_rows`
    from ``start``)."""
    if not 0 <= start <= end < len(problem.chain):
        raise PlanError(f"stage {start}..{end} is not a range of the chain's {len(problem.chain)} layers; "
                        f"give 0 <= start <= end <= {len(problem.chain) - 1}")
    return next(islice(stage_tensor_rows(problem, start), end - start, None))


def stage_tensor_rows(problem: Problem, start: int) -> Iterator[StageTensors]:
    """:class:`StageTensors` of the stages start..end for end = start, start + 1, … to the
    chain's last layer, each the one before plus one layer: dp's table of every stage costs
    one layer's sums per entry, not a pass per stage."""
    saved = SavedLineSum()
    weights = gradients = optimizer = 0.0
    factor = problem.workload.optimizer_state_factor
    for end in range(start, len(problem.chain)):
        profile = problem.layer_profile(end)
        saved.add(profile)
        weights += profile.param_bytes + profile.buffer_bytes
        gradients += profile.grad_bytes
        # the state of the optimizer the run names: its bytes per trainable byte (grad_bytes
        # are the trainable parameters' bytes), else the profiled state of a named one
        optimizer += (profile.grad_bytes * factor if factor is not None
                      else profile.optimizer_bytes(problem.workload.optimizer))
        yield StageTensors(saved.line, weights, gradients, optimizer, stage_boundaries(problem, start, end))


def stage_boundaries(problem: Problem, start: int, end: int) -> Linear:
    """Bytes per micro-batch of what crosses into and out of stage start..end: the model's
    inputs (as profiled) or the boundary before it, and the boundary after it, each in the
    workload's wire precision (``Workload.boundary_scale``)."""
    scale = problem.workload.boundary_scale
    inputs = (problem.input_bytes or Linear(0.0) if start == 0
              else problem.layer_profile(start - 1).output_bytes.scaled(scale))
    return inputs + problem.layer_profile(end).output_bytes.scaled(scale)


def activation_bytes(problem: Problem, tensors: StageTensors, micro_batches_in_flight: float,
                     recompute: bool = False) -> float:
    """Activations a worker holds: µ micro-batches' saved tensors; or, when the stage
    recomputes, µ micro-batches' inputs and outputs plus the saved tensors of the one
    micro-batch whose forward is running again for its backward (the compute lane runs one
    task at a time)."""
    micro = problem.workload.micro_batch_size
    if recompute:
        return micro_batches_in_flight * tensors.boundaries.at(micro) + tensors.saved.at(micro)
    return micro_batches_in_flight * tensors.saved.at(micro)


def memory_need(problem: Problem, tensors: StageTensors, tier: Tier, *, micro_batches_in_flight: float,
                weight_versions: int = 1, sync_buffer_copies: int = 0, recompute: bool = False) -> MemoryNeed:
    """:func:`stage_memory` from a stage's :class:`StageTensors` (solvers reuse the sums)."""
    limit, base = memory_limit(problem, tier)
    return MemoryNeed(
        activations=math.ceil(activation_bytes(problem, tensors, micro_batches_in_flight, recompute)),
        weights=int(tensors.weights * weight_versions),
        gradients=int(tensors.gradients),
        sync_buffers=int(tensors.gradients * sync_buffer_copies),
        optimizer=int(tensors.optimizer),
        base=base,
        limit=limit,
    )


def stage_memory(problem: Problem, start: int, end: int, tier: Tier, *, micro_batches_in_flight: float,
                 weight_versions: int = 1, sync_buffer_copies: int = 0, recompute: bool = False) -> MemoryNeed:
    """Memory of a worker holding layers start..end.

    The training form is FuncPipe's eq. 3b (FuncPipe §3.4.1),
    µ·â + ŝ·(4 − 2y₁) + s₀ ≤ m: ``micro_batches_in_flight`` = µ times the saved activations
    per micro-batch â, ŝ for weights, ŝ for gradients, 2(1 − y₁)·ŝ for serialized data while
    synchronizing (``sync_buffer_copies`` = 2 when d > 1), and s₀. Two additions the paper's
    constraint leaves out, reported as their own parts: buffers (e.g. BatchNorm statistics)
    count with the weights, and the optimizer's state (momentum, Adam's two moments) is
    added, since a worker that holds it runs out of memory without it. Gradient and sync
    terms use the profiled gradient bytes (= ŝ when every parameter trains).
    ``weight_versions`` > 1 is PipeDream's weight stashing. ``recompute``: the stage
    keeps no activations between forward and backward (:func:`activation_bytes`). The
    limit is :func:`memory_limit` of ``tier``.
    """
    return memory_need(problem, stage_tensors(problem, start, end), tier,
                       micro_batches_in_flight=micro_batches_in_flight, weight_versions=weight_versions,
                       sync_buffer_copies=sync_buffer_copies, recompute=recompute)


def recompute_seconds(forward_s: Seconds, backward_s: Seconds, recompute: bool) -> Seconds:
    """A stage's backward seconds for one micro-batch: with recomputation it runs its
    forward once more first (elementwise for arrays: per layer, as ``funcpipe_dp`` asks)."""
    return backward_s + forward_s if recompute else backward_s
