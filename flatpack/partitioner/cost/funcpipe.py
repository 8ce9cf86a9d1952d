"""FuncPipe's training-pipeline cost model (FuncPipe §3.4.2 and App. B).

A plan's stages are FuncPipe's partitions; every stage has the same data-parallel degree d
(FuncPipe enforces one d for all stages, §3.4.1), workers talk only through storage, and
each replica pipelines µ = M/d micro-batches forward, then backward, then scatter-reduces
its gradients with the other replicas of its stage.

Indices: the paper numbers layers 1..L bottom-up; here stages are 0..S−1 in chain order and
"boundary b" is the cut between stage b and stage b+1 (after layer ``stages[b].end``).

Readings chosen where the text is loose:

* App. B eq. 12 writes the synchronization of "the partition containing layer i" with ŝᵢ,
  the hat sum *up to* layer i, and evaluates it at the lowest layer of a partition, where
  that sum would hold one layer only; the remark that follows (t_s^i ≥ t_s^{i'} for i' ≥ i
  in the same partition) shows the intended quantity is the whole partition's size, which
  is what we use.
* eq. 6 prices memory linearly, c_iter = P·t_iter·c_mem; we charge each stage's tier its own
  ``price_per_s`` (the same figure when price is proportional to memory, as on Lambda, and
  right for tiers that are not).
* µ = ⌈M/d⌉ (see ``common.micro_batches_per_replica``).
* An account-wide storage bandwidth cap (Alibaba OSS, §5.7: 10 Gb/s in all) is not in the
  paper's equations; when the platform has one we give each worker at most its share,
  cap/(d·S), since every one of the d·S workers may be moving data at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost.collectives import scatter_reduce_seconds
from flatpack.partitioner.cost.pipedream import versions_in_flight
from flatpack.partitioner.cost.common import (MemoryNeed, check_training_plan, gradient_bytes, layer_times,
                                              memory_limit, micro_batches_per_replica, pacing_replicas,
                                              recompute_seconds, stage_memory, stage_tensors, stage_tier, to_json)
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.space import SearchSpace
from flatpack.units import mb

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

MODEL = "funcpipe"


@dataclass(frozen=True)
class StageCost:
    index: int
    start: int
    end: int
    memory_mb: int
    bandwidth_bytes_s: float   # W_j after any account-wide cap
    forward_s: float           # t̂_fc: β·Σ forward of the stage, one micro-batch (App. B eq. 8)
    backward_s: float          # t̂_bc: β·Σ backward of the stage, one micro-batch (eq. 10), plus its
                               # forward again when the stage recomputes
    recompute: bool            # activations recomputed in the backward instead of kept
    backward_lag_s: float      # Δ_b at the stage's lowest layer (eq. 11)
    backward_done_s: float     # t_b: from the end of the forward pass until this stage's backward ends
    sync_bytes: int            # ŝ: gradients scatter-reduced among the d replicas
    sync_s: float              # t_s (eq. 12)
    memory: MemoryNeed         # eq. 3b, by part
    memory_needed_bytes: int
    fits: bool


@dataclass(frozen=True)
class BoundaryCost:
    after_layer: int
    bytes: float               # o_i per micro-batch (= g_{i+1} going back)
    forward_upload_s: float    # t_fu (eq. 8): stage b uploads the output at its bandwidth
    forward_download_s: float  # t_fd: stage b+1 downloads it at its bandwidth
    backward_upload_s: float   # t_bu (App. B): stage b+1 uploads the gradient
    backward_download_s: float  # t_bd: stage b downloads it


@dataclass(frozen=True)
class PipelineCost:
    replicas: int                  # d
    micro_batches_per_replica: int  # µ
    micro_batch_size: float
    sync_method: str
    stages: tuple[StageCost, ...]
    boundaries: tuple[BoundaryCost, ...]
    first_forward_s: float         # t_f^0
    forward_lag_s: float           # Δ_f (eq. 9)
    forward_s: float               # t_f = t_f^0 + (µ − 1)·Δ_f
    iteration_s: float             # t_iter (eq. 7)
    memory_mb_total: int           # c_mem (eq. 5)
    dollars_per_iteration: float   # c_iter (eq. 6)
    fits: bool
    unfit_stage: int | None        # the first stage whose memory need exceeds its tier
    overheads: Overheads | None = None   # the measured terms added to the paper's (None: the paper's model)
    # t_host (analysis.host_load): a shared host's CPU over its cores, where it bounds the run's prediction
    host_bound_s: float | None = None

    def to_json(self) -> dict:
        return to_json(self, MODEL)


# A replica's scatter-reduce through storage moves its bytes in four transfers, each after its
# link waited for the other replicas: upload the shards the others reduce, download the
# shards of its own, upload its reduced shard, download the others' (FuncPipe
# §3.3, pipelined). A 2 x 2 resnet50 plan's replica uploaded its 257 KB shards in 8-11 ms after
# idling, where 257 KB at the 512 MB tier's 11.2 MB/s is 23 ms (BENCHMARKS.md, issue 19's
# eighth pass).
SYNC_PHASES = 4


@dataclass(frozen=True)
class Overheads:
    """What the local backend's and a cloud run's measurements say an iteration also costs,
    beyond FuncPipe's equations (issue 19; docs/cost_models.md, "Measured terms"). Each is a
    named term with a measured source; each is 0 where its source states nothing:

    * ``poll_s`` (t_poll): a download polls for a key its producer has not written yet
      (``Store.wait`` backs off up to 5 ms); the mean delay after the write, measured by
      ``flatpack calibrate``. Added to every download: t_fd, t_bd and the sync's.
    * ``input_s`` (t_in): the first stage downloads each micro-batch's input data,
      o_in/W_0 + t_lat + o_d. Prefetched an iteration ahead, it is on no micro-batch's path,
      but its lane runs one download at a time: t_iter is at least µ·t_in
      (:func:`prefetch_bound`). A one-stage plan's stage is also the last, and its prefetch
      reads the target too (+ ``target_s``).
    * ``target_s`` (t_tgt): the last stage reads each micro-batch's target (the loss's
      second argument) as a key of its own, one request after its activations in the same
      download task: t_lat + o_d of the last stage, added to the last boundary's t_fd (or to
      t_in with one stage). The labels' bytes (a few per sample) are not counted. 0 for a
      run whose model returns its own loss (``loss="output"``: no target key).
    * ``optimizer_s`` (t_opt,s): the optimizer step after the sync, per stage: the stage's
      parameter bytes times the step's seconds per byte measured on the tier.
    * ``marker_s`` (t_mark): the "computed" marker for the invoker's straggler watch goes
      out on the upload lane just before the sync's first upload: one request, when d > 1.
    * ``contention`` (κ): on the local backend, every worker and the store share the host's
      C cores: κ = (Σ over workers of min(v, threads) + 1 for the store) / C. A request's
      CPU work (client and server) stretches by max(1, κ), so t_lat, t_poll and t_mark do;
      compute, already stretched to 1/v by the tier's throttle, only when κ·v > 1.
    * the task terms, per stage, each the seconds a worker's task takes on its tier beyond
      what the equations give it, measured by ``flatpack calibrate`` running small probe
      pipelines on the tier with 1, 2 and 4 workers (``backends.task_overheads``; 0 where
      not measured) and read at the plan's worker count Σ d (on the local backend they share
      the host's cores, and every request and hand-off slows as they are added; the line
      through the counts measured replaces κ for these terms): ``forward_task_s`` (o_f:
      the micro-batch's seeded RNG, hand-offs between the worker's lanes, a cold cache after
      the lanes' other work) on t̂_fc, ``backward_task_s`` (o_b) on t̂_bc, ``upload_task_s``
      (o_u: serialization and the request beyond t_lat) on t_fu and t_bu,
      ``download_task_s`` (o_d: from the producer's upload to the tensor in hand, beyond
      t_lat + t_poll) on t_fd and t_bd, ``sync_task_s`` (o_sync: a synchronization's seconds
      beyond eq. 12's, when d > 1) on t_s, ``step_task_s`` (o_step: the sync's end, or the
      last backward or gradient upload, to the update's end beyond t_opt,s: the optimizer's
      per-tensor work, the marker, hand-offs) on t_opt,s, and ``iteration_s`` (o_it: an
      update's end to the next iteration's first forward on the first stage: the timeline
      and progress writes) once per iteration.
    * ``burst_s`` (b), per stage: transfer seconds the stage's link sends beyond its rate
      after idling (a token bucket's burst; the local backend's link banks 10 ms of its rate),
      fitted by ``flatpack calibrate`` from probes of two sizes. A token bucket banks it only
      while its link idles (:meth:`burst_credit_s`): the first micro-batch's transfers, on
      links idle since the last iteration, each take min(b, o/W) less (t_f⁰ and the first
      backward pass); the lags Δ_f, Δ_b do not change (the transfer that sets one keeps its
      link busy); each replica's scatter-reduce starts :data:`SYNC_PHASES` transfers on an
      idle link. ``report.predicted_schedule`` gives each transfer the credit its lane's idle
      time allows.
    """

    poll_s: float = 0.0
    input_s: float = 0.0
    target_s: float = 0.0
    optimizer_s: tuple[float, ...] = ()
    marker_s: float = 0.0
    contention: float = 1.0
    forward_task_s: tuple[float, ...] = ()
    backward_task_s: tuple[float, ...] = ()
    upload_task_s: tuple[float, ...] = ()
    download_task_s: tuple[float, ...] = ()
    sync_task_s: tuple[float, ...] = ()
    step_task_s: tuple[float, ...] = ()
    iteration_s: float = 0.0
    burst_s: tuple[float, ...] = ()

    def burst(self, stage: int) -> float:
        """``stage``'s link's burst b (0 where not measured)."""
        return self.burst_s[stage] if stage < len(self.burst_s) else 0.0

    def burst_credit_s(self, nbytes: float, bandwidth_bytes_s: float, stage: int, idle_s: float = math.inf) -> float:
        """What the burst takes off a transfer of ``nbytes`` on ``stage``'s link after it idled
        ``idle_s``: min(b, o/W, idle), since a token bucket banks its burst only while idle."""
        return min(self.burst(stage), nbytes / bandwidth_bytes_s, max(0.0, idle_s))

    def sync_burst_saving(self, moved_s: float, stage: int) -> float:
        """What the burst takes off a scatter-reduce whose bytes take ``moved_s`` at the
        link's rate: each of its :data:`SYNC_PHASES` transfers starts on an idle link."""
        return SYNC_PHASES * min(self.burst(stage), moved_s / SYNC_PHASES)

    def task(self, kind: str, stage: int) -> float:
        """The ``kind`` task term (forward, backward, upload, download, sync, step) of ``stage``;
        0 where nothing measured it."""
        values = getattr(self, f"{kind}_task_s")
        return values[stage] if stage < len(values) else 0.0

    def step(self, stage: int) -> float:
        """The update of ``stage`` after its sync: t_opt,s + o_step (0 where nothing measured
        them). ``iteration`` adds it to the stage's t_b + t_s, ``report.predicted_schedule``
        makes it the update task, and the probe pipeline's fit sets the update beside it."""
        optimizer = self.optimizer_s[stage] if stage < len(self.optimizer_s) else 0.0
        return optimizer + self.task("step", stage)

    @classmethod
    def of(cls, problem: Problem, plan: Plan, *, reads_target: bool = True) -> Overheads:
        """The terms for ``plan`` from the problem's platform (a calibration applied) and
        calibration; each term that nothing measured is 0. ``reads_target``: the last stage
        downloads a target per micro-batch (every loss but ``"output"``)."""
        replicas = pacing_replicas(plan)
        platform = problem.platform
        tiers = [stage_tier(problem, stage, index) for index, stage in enumerate(plan.stages)]
        bandwidth = _bandwidths(problem, tiers, replicas)
        contention = host_contention(problem, plan)
        latency = platform.storage_latency_s * contention
        calibration = problem.calibration
        optimizer = []
        for stage, tier in zip(plan.stages, tiers):
            seconds = None
            if calibration is not None:
                seconds = calibration.optimizer_seconds(tier.memory_mb, problem.workload.optimizer,
                                                        gradient_bytes(problem, stage.start, stage.end))
            optimizer.append((seconds or 0.0) * compute_stretch(contention, tier))
        workers = plan.workers

        def measured(kind: str, tier: Tier) -> float:
            return calibration.task_overhead(tier.memory_mb, kind, workers) if calibration is not None else 0.0

        tasks = {f"{kind}_task_s": tuple(measured(kind, tier) for tier in tiers)
                 for kind in ("forward", "backward", "upload", "download", "sync", "step")}
        burst = tuple(calibration.burst_seconds(tier.memory_mb) if calibration is not None else 0.0
                      for tier in tiers)
        # a request for a key already written: no poll, the download task's own term
        target_s = latency + tasks["download_task_s"][-1] if reads_target else 0.0
        input_s = 0.0
        if problem.input_bytes is not None:
            # the prefetch lane downloads µ inputs back to back: no idle, no burst
            input_s = (problem.boundary_bytes(-1, problem.workload.micro_batch_size) / bandwidth[0] + latency
                       + tasks["download_task_s"][0] + (target_s if len(plan.stages) == 1 else 0.0))
        return cls(poll_s=(platform.poll_overhead_s or 0.0) * contention, input_s=input_s, target_s=target_s,
                   optimizer_s=tuple(optimizer), marker_s=latency if replicas > 1 else 0.0, contention=contention,
                   iteration_s=measured("iteration", tiers[0]), burst_s=burst, **tasks)


def prefetch_bound(micro_batches: int, overheads: Overheads) -> float:
    """The least an iteration takes for the first stage's prefetch lane: µ downloads of t_in
    each, one at a time. The lane fetches an iteration ahead, so it overlaps the previous
    iteration and sets the pace only when it is the longer. Counted as a term of Δ_f
    instead (each forward waiting for its input), it put bert-large's and rnn-3's one-stage
    plans, whose compute is shorter than t_in, 50-100 % over their measured iterations."""
    return micro_batches * overheads.input_s


def compute_stretch(contention: float, tier: Tier) -> float:
    """What κ stretches a computation on ``tier`` by: max(1, κ·v). Its compute is already
    throttled to the tier's v of a core, so it waits for the host's cores only when κ·v > 1."""
    return max(1.0, contention * min(tier.vcpus, 1.0))


def host_contention(problem: Problem, plan: Plan) -> float:
    """κ of :class:`Overheads`: the CPU the plan's workers and the store ask of a host with
    ``platform.host_cores`` cores, over those cores, at least 1 (1 where the platform does
    not share a host: a cloud function's CPU is its own)."""
    cores = problem.platform.host_cores
    if cores is None or problem.platform.kind != "local":
        return 1.0
    threads = problem.options.threads
    demand = sum(stage.replicas * min(stage_tier(problem, stage, index).vcpus, threads)
                 for index, stage in enumerate(plan.stages)) + 1.0
    return max(1.0, demand / cores)


def _bandwidths(problem: Problem, tiers: list, replicas: int) -> list[float]:
    cap = problem.platform.aggregate_bandwidth_bytes_s
    if cap is None:
        return [tier.bandwidth_bytes_s for tier in tiers]
    share = cap / (replicas * len(tiers))
    return [min(tier.bandwidth_bytes_s, share) for tier in tiers]


def predicted(problem: Problem, plan: Plan, *, reads_target: bool = True) -> PipelineCost:
    """:func:`iteration` with the measured :class:`Overheads`: what a run is predicted to
    take (``flatpack run``'s report, the fidelity benchmark, ``plan --from-run``). The
    solvers search :func:`iteration`, the paper's model."""
    return iteration(problem, plan, Overheads.of(problem, plan, reads_target=reads_target))


def iteration(problem: Problem, plan: Plan, overheads: Overheads | None = None) -> PipelineCost:
    """Time, cost and memory of one training iteration of ``plan`` under FuncPipe's model.

    FuncPipe, App. B and §3.4.2:
    t_f = t_f^0 + (µ − 1)·Δ_f with t_f^0 = Σ t_fc + Σ (t_fu + t_fd) and
    Δ_f = max{t̂_fc, t_fu, t_fd} over all stages and boundaries (eq. 9);
    t_fc = β·T_fc; t_fu = o/W_lower + t_lat, t_fd = o/W_upper + t_lat (eq. 8);
    for a stage whose lowest layer is i: t_b = Σ_{k≥i} t_bc + Σ_{boundaries above} (t_bu + t_bd)
    + (µ − 1)·Δ_b with Δ_b = max{t̂_bc of this and later stages, t_bu, t_bd above} (eq. 11);
    t_bu = g/W_upper + t_lat, t_bd = g/W_lower + t_lat;
    t_s = (1 − y₁)·(γ·ŝ/W + δ·t_lat) (eq. 12) with (γ, δ) from the workload's sync method;
    t_iter = t_f + max over stages (t_b + t_s) (eq. 7);
    memory µ·â + ŝ(4 − 2y₁) + s₀ ≤ m (eq. 3b, see ``common.stage_memory``);
    c_mem = d·Σ m (eq. 5); c_iter = P·t_iter·c_mem (eq. 6).

    ``overheads``: the measured terms of :class:`Overheads`, each entering where it is
    spent: t_lat·κ for t_lat, + t_poll on every download, t_tgt on the last boundary's
    t_fd, κ on compute when κ·v > 1, t_s + t_mark, and t_iter = max(t_f + max_s (t_b + t_s +
    t_opt,s) + o_it, µ·t_in) (the first stage's prefetch lane, :func:`prefetch_bound`).
    None (the solvers' form): the paper's equations alone.
    """
    check_training_plan(problem, plan, "FuncPipe")
    replicas = pacing_replicas(plan)
    mu = micro_batches_per_replica(problem, replicas)
    micro = problem.workload.micro_batch_size
    platform = problem.platform
    extra = overheads or Overheads()
    latency = platform.storage_latency_s * extra.contention
    poll = extra.poll_s
    slowdown = platform.overlap_slowdown
    tiers = [stage_tier(problem, stage, index) for index, stage in enumerate(plan.stages)]
    bandwidth = _bandwidths(problem, tiers, replicas)
    count = len(plan.stages)

    compute = [layer_times(problem, stage.start, stage.end, tier, micro) for stage, tier in zip(plan.stages, tiers)]
    stretch = [compute_stretch(extra.contention, tier) for tier in tiers]
    forward = [slowdown * fwd * factor + extra.task("forward", s)
               for s, ((fwd, _), factor) in enumerate(zip(compute, stretch))]
    backward = [slowdown * recompute_seconds(fwd, bwd, stage.recompute) * factor + extra.task("backward", s)
                for s, ((fwd, bwd), stage, factor) in enumerate(zip(compute, plan.stages, stretch))]

    boundaries = _boundary_costs(problem, plan, micro, bandwidth, latency, poll, extra)

    # the first micro-batch's transfers start on links idle since the last iteration: each
    # less the burst (b), on the link of the stage on either side of its boundary; the later
    # ones wait on the lag Δ, which a burst does not shorten (the transfer that sets it keeps
    # its link busy, so it banks none). A pass crosses each boundary once each way.
    credits = [extra.burst_credit_s(bc.bytes, bandwidth[b], b) + extra.burst_credit_s(bc.bytes, bandwidth[b + 1], b + 1)
               for b, bc in enumerate(boundaries)]
    first_forward = (sum(forward) + sum(bc.forward_upload_s + bc.forward_download_s for bc in boundaries)
                     - sum(credits))
    forward_lag = max([*forward, *(bc.forward_upload_s for bc in boundaries),
                       *(bc.forward_download_s for bc in boundaries)])
    forward_total = first_forward + (mu - 1) * forward_lag

    stages = [_stage_cost(problem, s, stage, tier, forward[s], backward[s:], boundaries[s:], credits[s:],
                          bandwidth[s], mu=mu, replicas=stage.replicas, latency=latency, poll=poll, extra=extra,
                          weight_versions=weight_versions(problem, plan, s))
              for s, (stage, tier) in enumerate(zip(plan.stages, tiers))]

    optimizer = [extra.step(s) for s in range(count)]
    pipeline_s = forward_total + max(stage.backward_done_s + stage.sync_s + step
                                     for stage, step in zip(stages, optimizer)) + extra.iteration_s
    iteration_s = max(pipeline_s, prefetch_bound(mu, extra))
    memory_mb_total = sum(stage.replicas * tier.memory_mb for stage, tier in zip(plan.stages, tiers))
    dollars = iteration_s * sum(stage.replicas * tier.price_per_s for stage, tier in zip(plan.stages, tiers))
    unfit = next((stage.index for stage in stages if not stage.fits), None)
    return PipelineCost(
        replicas=replicas, micro_batches_per_replica=mu, micro_batch_size=micro, sync_method=problem.workload.sync,
        stages=tuple(stages), boundaries=tuple(boundaries), first_forward_s=first_forward, forward_lag_s=forward_lag,
        forward_s=forward_total, iteration_s=iteration_s, memory_mb_total=memory_mb_total,
        dollars_per_iteration=dollars, fits=unfit is None, unfit_stage=unfit, overheads=overheads,
    )


def weight_versions(problem: Problem, plan: Plan, stage: int) -> int:
    """Copies of its weights stage ``stage`` keeps under the workload's schedule, as the
    schedule says (``Schedule.weight_versions``: one under a flush; 1F1B's stash one per
    micro-batch in flight, PipeDream's count ``pipedream.versions_in_flight``; 2BW two)."""
    return problem.workload.schedule_object.weight_versions(versions_in_flight(plan, stage))


def _boundary_costs(problem: Problem, plan: Plan, micro: float, bandwidth: list[float], latency: float,
                    poll: float, extra: Overheads) -> list[BoundaryCost]:
    """Each boundary's four transfers (eq. 8): its activations up from the stage below and
    down into the stage above, its gradients back the other way; every download pays the
    poll overhead, the last boundary's forward download the target's hand-off."""
    count = len(plan.stages)
    boundaries = []
    for b in range(count - 1):
        nbytes = problem.boundary_bytes(plan.stages[b].end, micro)
        boundaries.append(BoundaryCost(
            after_layer=plan.stages[b].end, bytes=nbytes,
            forward_upload_s=nbytes / bandwidth[b] + latency + extra.task("upload", b),
            forward_download_s=(nbytes / bandwidth[b + 1] + latency + poll + extra.task("download", b + 1)
                                + (extra.target_s if b == count - 2 else 0.0)),
            backward_upload_s=nbytes / bandwidth[b + 1] + latency + extra.task("upload", b + 1),
            backward_download_s=nbytes / bandwidth[b] + latency + poll + extra.task("download", b),
        ))
    return boundaries


def _stage_cost(problem: Problem, index: int, stage: StagePlan, tier: Tier, forward_s: float,
                backward_from: list[float], above: list[BoundaryCost], credits_from: list[float], bandwidth: float,
                *, mu: int, replicas: int, latency: float, poll: float, extra: Overheads,
                weight_versions: int = 1) -> StageCost:
    """Stage ``index``'s backward (eq. 11: its own and every later stage's backward and the
    transfers above it, ``backward_from``, ``above`` and ``credits_from`` being those from
    this stage up), its gradients' sync (eq. 12) and its memory (eq. 3b, with the
    ``weight_versions`` copies of its weights an asynchronous schedule keeps)."""
    lag = max([*backward_from, *(bc.backward_upload_s for bc in above), *(bc.backward_download_s for bc in above)])
    done = (sum(backward_from) + sum(bc.backward_upload_s + bc.backward_download_s for bc in above)
            - sum(credits_from) + (mu - 1) * lag)
    grads = gradient_bytes(problem, stage.start, stage.end)
    sync = scatter_reduce_seconds(grads, replicas, bandwidth, latency + poll, problem.workload.sync)
    if replicas > 1:
        moved = scatter_reduce_seconds(grads, replicas, bandwidth, 0.0, problem.workload.sync)
        sync += extra.marker_s + extra.task("sync", index) - extra.sync_burst_saving(moved, index)
    memory = stage_memory(problem, stage.start, stage.end, tier, micro_batches_in_flight=mu,
                          sync_buffer_copies=2 if replicas > 1 else 0, recompute=stage.recompute,
                          weight_versions=weight_versions)
    return StageCost(
        index=index, start=stage.start, end=stage.end, memory_mb=tier.memory_mb, bandwidth_bytes_s=bandwidth,
        forward_s=forward_s, backward_s=backward_from[0], recompute=stage.recompute, backward_lag_s=lag,
        backward_done_s=done,
        sync_bytes=grads, sync_s=sync, memory=memory, memory_needed_bytes=memory.total, fits=memory.fits,
    )


@dataclass(frozen=True)
class CheckpointCost:
    """What one checkpoint of a plan costs: each stage's replica 0 uploads its weights,
    buffers and optimizer state (``training.StageTrainer.state_bytes``) at its bandwidth.
    Not in FuncPipe's model (the paper does not checkpoint); the upload runs on the report
    lane while the next iteration computes, so it delays no iteration while it is shorter
    than one, and it is charged here as link time amortized over the checkpoint interval."""

    stage_bytes: tuple[int, ...]
    stage_upload_s: tuple[float, ...]

    @property
    def bytes(self) -> int:
        return sum(self.stage_bytes)

    @property
    def upload_s(self) -> float:
        """The slowest stage's upload: the stages checkpoint in parallel."""
        return max(self.stage_upload_s)

    def overhead(self, iteration_s: float, every: int) -> float:
        """The checkpoint's link time per iteration as a share of one iteration."""
        return self.upload_s / (every * iteration_s) if iteration_s > 0 else 0.0

    def interval_for(self, iteration_s: float, iterations: int, overhead: float = 0.05) -> int:
        """The shortest checkpoint interval (in iterations, at most ``iterations``) whose
        amortized upload stays within ``overhead`` of an iteration: the default of
        ``flatpack run``, so a crash loses as little work as the link time allows."""
        if iteration_s <= 0 or self.upload_s <= 0:
            return 1
        return max(1, min(iterations, math.ceil(self.upload_s / (overhead * iteration_s))))


def checkpoint_cost(problem: Problem, plan: Plan) -> CheckpointCost:
    """:class:`CheckpointCost` of ``plan`` (tiers and bandwidths as :func:`iteration` uses)."""
    replicas = pacing_replicas(plan)
    tiers = [stage_tier(problem, stage, index) for index, stage in enumerate(plan.stages)]
    bandwidth = _bandwidths(problem, tiers, replicas)
    sizes, seconds = [], []
    for stage, link in zip(plan.stages, bandwidth):
        tensors = stage_tensors(problem, stage.start, stage.end)
        size = int(tensors.weights + tensors.optimizer)
        sizes.append(size)
        seconds.append(size / link + problem.platform.storage_latency_s)
    return CheckpointCost(tuple(sizes), tuple(seconds))


def layer_memory(problem: Problem, index: int, tier: Tier, replicas: int = 1) -> MemoryNeed:
    """Eq. 3b for a stage holding layer ``index`` alone on ``tier``, with d = ``replicas``."""
    mu = micro_batches_per_replica(problem, replicas)
    return stage_memory(problem, index, index, tier, micro_batches_in_flight=mu,
                        sync_buffer_copies=2 if replicas > 1 else 0)


def with_tiers(problem: Problem, plan: Plan) -> Plan:
    """``plan`` with a memory tier for every stage that has none (solvers that only cut, such
    as ``balanced``, leave ``memory_mb`` None, and no cost model can time or price such a
    stage): the smallest tier of the search space (``memory_mb`` option, else the platform's
    choices) whose eq. 3b need at the stage's degree fits, else the largest (the cost model
    then reports the stage as unfit). Stages that have a tier keep it."""

    if all(stage.memory_mb is not None for stage in plan.stages) or not problem.profiled:
        return plan   # unprofiled: no memory need to fit (and no cost model to feed)
    choices = sorted(SearchSpace.of(problem).memory_mb)
    stages = []
    for stage in plan.stages:
        if stage.memory_mb is None:
            mu = micro_batches_per_replica(problem, stage.replicas)
            copies = 2 if stage.replicas > 1 else 0
            fitting = ((size, recompute) for size in choices for recompute in problem.workload.recompute_choices
                       if stage_memory(problem, stage.start, stage.end, problem.platform.tier(size),
                                       micro_batches_in_flight=mu, sync_buffer_copies=copies,
                                       recompute=recompute).fits)
            size, recompute = next(fitting, (choices[-1], False))
            stage = dataclasses.replace(stage, memory_mb=size, recompute=recompute)
        stages.append(stage)
    return dataclasses.replace(plan, stages=tuple(stages))


def check_layers_fit(problem: Problem, replicas: int | None = None) -> None:
    """Raise PlanError, before any solving, when some layer cannot fit even alone on the
    platform's largest tier — FuncPipe's stated limitation (FuncPipe §4,
    "Limitation Discussion": no support for a layer larger than a function's memory).

    Uses eq. 3b on a one-layer stage with d = ``replicas`` (default 1, the least memory:
    no sync buffers) and
    µ = ⌈M/d⌉ micro-batches of batch/M samples. The message names each such layer, its need
    by part, the limit, and what would make it fit.
    """
    if replicas is None:
        replicas = 1
    platform = problem.platform
    largest = largest_tier(problem)
    limit, _ = memory_limit(problem, largest)
    workload = problem.workload
    mu = micro_batches_per_replica(problem, replicas)
    lines = []
    for index, layer in enumerate(problem.chain):
        need = layer_memory(problem, index, largest, replicas)
        if need.fits:
            continue
        lines.append(f"layer {index} ({layer.name}) needs {mb(need.total)} ({need.total} bytes): {need.describe()}; "
                     + _layer_fix(problem, index, need, mu))
    if not lines:
        return
    raise PlanError(
        f"{len(lines)} layer(s) do not fit even alone in the largest tier of {platform.name}, "
        f"{largest.label()}: {mb(limit)} ({limit} bytes) for a stage's tensors, with {mu} micro-batches of "
        f"{workload.micro_batch_size:g} samples in flight per worker and {replicas} replica(s):\n  "
        + "\n  ".join(lines)
        + "\nWhat would help: a smaller micro-batch (a smaller batch for the same micro_batches), an optimizer "
        "with less state, " + ("recomputing activations in the backward (Workload(recompute=\"auto\"), flatpack run "
                               "--recompute auto), " if workload.recompute == "never" else "")
        + "or a target with larger memory tiers; one layer cannot be split across workers (no tensor parallelism)."
    )


def largest_tier(problem: Problem) -> Tier:
    """The tier with the most memory for a stage's tensors: the listed tiers, and the
    platform's maximum size where the platform allows sizes beyond the listed ones."""
    platform = problem.platform
    candidates = list(platform.tiers)
    try:
        candidates.append(platform.tier(platform.max_memory_mb))
    except InputError:
        pass  # only the listed configurations exist
    return max(candidates, key=lambda tier: memory_limit(problem, tier))


def _layer_fix(problem: Problem, index: int, need: MemoryNeed, mu: int) -> str:
    """The largest batch at which the layer fits, or why no batch does: activations are µ
    micro-batches of batch/M samples each, so they grow with the batch; the rest does not."""
    workload = problem.workload
    saved = problem.layer_profile(index).saved_bytes
    room = need.limit - (need.total - need.activations) - mu * saved.fixed
    if saved.per_sample > 0 and room > 0:
        micro_batches = workload.micro_batch_count
        batch = int(room * micro_batches / (mu * saved.per_sample))
        batch -= batch % micro_batches   # micro-batches hold whole samples
        if batch >= micro_batches:
            return (f"it fits with a batch of at most {batch} samples at micro_batches={micro_batches} "
                    f"(micro-batches of {batch // micro_batches} samples)")
    fixed = need.total - need.activations
    return (f"its weights, gradients, optimizer state and runtime alone need {mb(fixed)}, so no batch size "
            "fits: it needs a target with larger tiers (or an optimizer with less state)"
            if fixed > need.limit else
            "no micro-batch of at least one sample fits: it needs a target with larger tiers")
