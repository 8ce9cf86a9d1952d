"""Hydrozoa's hybrid-parallel training model (Hydrozoa §3.3, §3.4, App. A.1).

A strategy A×B is a plan of B shards (the stages) whose every stage has A replicas: A worker
groups each pipeline a share of the global batch through the B shards, then the A replicas
of each shard ring-all-reduce that shard's gradients directly (containers talk to each
other; no storage in between).

Readings chosen:

* §3.4 calls A the data-parallel and B the model-parallel degree, yet prints the all-reduce
  of shard j as (B − 1)(|p_j|/(B·D) + α|p_j|/B + β). The ring runs among the replicas of
  one shard, so its size is A (with B there, an unreplicated pipeline, A = 1, would pay for
  a synchronization it never does); and the text's "2(B − 1) rounds" gives the factor 2.
  We use 2(A − 1)(|p_j|/(A·D) + α|p_j|/A + β), ``collectives.ring_allreduce_seconds``.
* M, the micro-batches one worker group pipelines, is the workload's M shared among the A
  groups, ⌈M/A⌉ micro-batches of batch/M samples (as FuncPipe's µ).
* c_{p_i} = a_{p_{i−1}}/D uses the slower of the two shards' bandwidths.
* Memory: Hydrozoa sizes micro-batches to GPU memory (§3.3); we check every micro-batch's
  saved activations plus weights, gradients, optimizer state and s₀ against the tier, as
  FuncPipe's eq. 3b does, without the storage serialization buffers.
* Dollars: every worker is billed for the iteration at its tier's ``price_per_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatpack.errors import PlanError
from flatpack.partitioner.cost.collectives import AllReduceTerms, measured_terms
from flatpack.partitioner.cost.common import (MemoryNeed, check_training_plan, gradient_bytes, layer_times,
                                              micro_batches_per_replica, stage_memory, stage_tier, to_json,
                                              uniform_replicas)
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

MODEL = "hydrozoa"


@dataclass(frozen=True)
class ShardCost:
    index: int
    start: int
    end: int
    memory_mb: int
    forward_s: float       # f_{p}: Σ f_i over the shard, one micro-batch (§3.3)
    backward_s: float      # b_{p}
    comm_in_s: float       # c_{p}: activations from the previous shard (= gradients back); 0 for the first
    sync_bytes: int        # |p_j|
    allreduce_s: float     # T^(D)_j (§3.4)
    memory: MemoryNeed
    memory_needed_bytes: int
    fits: bool


@dataclass(frozen=True)
class HybridCost:
    data_parallel: int         # A
    model_parallel: int        # B
    micro_batches: int         # M per worker group
    micro_batch_size: float
    shards: tuple[ShardCost, ...]
    forward_lag_s: float       # t_k (App. A.1)
    backward_lag_s: float      # r_1
    model_parallel_s: float    # T^(M) = Σ(f + b) + 2Σc + (M − 1)(t_k + r_1)
    sync_s: float              # max_j T^(D)_j
    iteration_s: float         # T = max_ij T^(M) + T^(D)_j
    dollars_per_iteration: float
    fits: bool
    unfit_stage: int | None

    def to_json(self) -> dict:
        return to_json(self, MODEL)


def model_parallel_seconds(forward: list[float], backward: list[float], comm: list[float],
                           micro_batches: int) -> tuple[float, float, float]:
    """(T^(M), t_k, r_1) of one worker group (Hydrozoa App. A.1):
    t_k = max(max_j f_pj, max_{j≥2} c_pj) (the forward lag at the last shard k),
    r_1 = max(max_j b_pj, max_{j≥2} c_pj) (the backward lag at the first shard), and
    T^(M) = Σ(f_p + b_p) + 2·Σ_{i≥2} c_pi + (M − 1)(t_k + r_1) (§3.3).
    ``comm[0]`` is the first shard's and must be 0."""
    if comm and comm[0] != 0:
        raise PlanError("the first shard receives nothing from a previous shard; comm[0] must be 0")
    forward_lag = max([*forward, *comm])
    backward_lag = max([*backward, *comm])
    total = sum(forward) + sum(backward) + 2 * sum(comm) + (micro_batches - 1) * (forward_lag + backward_lag)
    return total, forward_lag, backward_lag


EQUATION_ONLY = AllReduceTerms()   # §3.4's ring with α = β = 0, nothing measured


def sync_overheads(problem: Problem, alpha: float | None = None, beta: float | None = None) -> AllReduceTerms:
    """The all-reduce's terms: where neither α nor β is given, what ``flatpack calibrate
    --target gpu-container`` measured (``problem.calibration``: the fitted α, β, δ, γ anchored
    to the all-reduces it timed, ``collectives.measured_terms``), else §3.4's equation alone
    (α = β = 0). A given α or β is priced by the equation, with the calibration's other
    terms, and not anchored: the measurements would overrule it within their sizes."""
    fit = problem.calibration.collective_fit if problem.calibration is not None else None
    if fit is None:
        return AllReduceTerms(alpha or 0.0, beta or 0.0)
    if alpha is None and beta is None:
        return measured_terms(fit)
    return AllReduceTerms(fit.alpha_s_per_byte if alpha is None else alpha, fit.beta_s if beta is None else beta,
                          fit.per_call_s, fit.copy_s_per_byte)


def iteration(problem: Problem, plan: Plan, sync: AllReduceTerms = EQUATION_ONLY) -> HybridCost:
    """Time, cost and memory of one iteration of the A×B strategy ``plan`` (B = its stages,
    A = their common replicas), Hydrozoa §3.4: T_ij = T^(M)_ij + T^(D)_ij,
    T = max_ij T_ij. ``sync`` prices T^(D): the paper's α and β, fitted by regression on a
    few runs (§3.4), and the measured additions (``collectives.AllReduceTerms``;
    :func:`sync_overheads` gives the problem's); the default is the equation with α = β = 0."""
    check_training_plan(problem, plan, "Hydrozoa")
    groups = uniform_replicas(plan, "Hydrozoa")
    micro_batches = micro_batches_per_replica(problem, groups)
    micro = problem.workload.micro_batch_size
    tiers = [stage_tier(problem, stage, index) for index, stage in enumerate(plan.stages)]

    times = [layer_times(problem, stage.start, stage.end, tier, micro) for stage, tier in zip(plan.stages, tiers)]
    forward = [fwd for fwd, _ in times]
    backward = [bwd for _, bwd in times]
    comm = [0.0] + [
        problem.boundary_bytes(plan.stages[j - 1].end, micro)
        / min(tiers[j - 1].bandwidth_bytes_s, tiers[j].bandwidth_bytes_s)
        for j in range(1, len(plan.stages))
    ]
    model_parallel, forward_lag, backward_lag = model_parallel_seconds(forward, backward, comm, micro_batches)

    shards = []
    for j, (stage, tier) in enumerate(zip(plan.stages, tiers)):
        grads = gradient_bytes(problem, stage.start, stage.end)
        allreduce = sync.seconds(grads, groups, tier.bandwidth_bytes_s)
        memory = stage_memory(problem, stage.start, stage.end, tier,
                              micro_batches_in_flight=micro_batches)
        shards.append(ShardCost(j, stage.start, stage.end, tier.memory_mb, forward[j], backward[j], comm[j], grads,
                                allreduce, memory, memory.total, memory.fits))

    slowest_sync = max(shard.allreduce_s for shard in shards)
    iteration_s = model_parallel + slowest_sync
    unfit = next((shard.index for shard in shards if not shard.fits), None)
    return HybridCost(
        data_parallel=groups, model_parallel=len(shards), micro_batches=micro_batches, micro_batch_size=micro,
        shards=tuple(shards), forward_lag_s=forward_lag, backward_lag_s=backward_lag,
        model_parallel_s=model_parallel, sync_s=slowest_sync, iteration_s=iteration_s,
        dollars_per_iteration=iteration_s * groups * sum(tier.price_per_s for tier in tiers),
        fits=unfit is None, unfit_stage=unfit,
    )
