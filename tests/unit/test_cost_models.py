"""Cost models: the papers' worked figures and small cases computed by hand from their
formulas (FuncPipe App. B, Gillis §IV, Hydrozoa §3.3–3.4/App. A, PipeDream §5.3.1).

The test chain has three layers with round numbers. Compute seconds pass through
``Problem.layer_seconds``: the host ran one thread and every tier has at least one vCPU,
so a tier runs a layer in the profiled seconds (one test swaps in a calibration instead).
Sizes are in MiB and bandwidths in MiB/s, so 10 MiB at 100 MiB/s is 0.1 s.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from flatpack.errors import PlanError
from flatpack.ir.profile import HostInfo, LayerProfile, Linear
from flatpack.partitioner.cost import (CommDelay, ForkJoinPlan, Group, check_layers_fit, funcpipe, gillis, hydrozoa,
                                       pipedream, ring_allreduce_seconds, scatter_reduce_coefficients,
                                       scatter_reduce_seconds)
from flatpack.partitioner.cost.collectives import AllReduceTerms
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.workload import Workload
from flatpack.units import MIB
from flatpack.platform.catalog import Platform, Tier

HOST = HostInfo(device="cpu", threads=1, cpu="test", torch_version="test")
LATENCY = 0.01
BASE = 100 * MIB

# name, forward s, backward s, parameter MiB, saved MiB per sample, output MiB per sample
LAYERS = [("l0", 1.0, 2.0, 100, 5.0, 5.0), ("l1", 0.5, 1.0, 50, 2.5, 5.0), ("l2", 2.0, 4.0, 200, 10.0, 10.0)]


def layer(name, forward, backward, params_mib, saved_mib, output_mib, adam_mib=0):
    params = params_mib * MIB
    return LayerProfile(
        name=name, forward_s=Linear(0.0, forward), backward_s=Linear(0.0, backward), param_bytes=params,
        grad_bytes=params, buffer_bytes=0, saved_bytes=Linear(saved_mib * MIB), output_bytes=Linear(output_mib * MIB),
        peak_bytes=Linear(saved_mib * MIB), optimizer_state_bytes={"sgd": 0, "sgd-momentum": params,
                                                                   "adam": adam_mib * MIB or 2 * params},
    )


def platform(tiers=((512, 50), (1024, 100), (2048, 50)), slowdown=2.0, granularity=0.001, cap=None, **extra):
    """Tiers as (MiB, bandwidth MiB/s); price 1e-5 $/s per GiB of memory."""
    return Platform(
        name="test", kind="serverless",
        tiers=tuple(Tier(memory, 1.0, bandwidth * MIB, 1e-5 * memory / 1024) for memory, bandwidth in tiers),
        min_memory_mb=min(memory for memory, _ in tiers), max_memory_mb=max(memory for memory, _ in tiers),
        storage_latency_s=LATENCY, price_per_request=2e-7, billing_granularity_s=granularity, timeout_s=None,
        base_memory_bytes=BASE, overlap_slowdown=slowdown, aggregate_bandwidth_bytes_s=cap, **extra,
    )


def problem(workload=None, layers=LAYERS, target=None, **options):
    profiles = [layer(*spec) for spec in layers]
    chain = tuple(ChainLayer(p.name, p.param_bytes, 0, 0, p) for p in profiles)
    return Problem(chain, target or platform(), workload or Workload("train", batch=8, micro_batches=4,
                                                                      optimizer="sgd"),
                   host=HOST, options=ProblemOptions.of(options), input_bytes=Linear(0.0, 0.0))


def plan(*stages):
    """Stages as (start, end, memory_mb, replicas[, split]) tuples."""
    return Plan(tuple(StagePlan(*stage[:4], split=stage[4] if len(stage) > 4 else None) for stage in stages), 3)


TWO_STAGES = plan((0, 1, 1024, 2), (2, 2, 2048, 2))

# --- the synchronization formulas ------------------------------------------------------


def test_funcpipe_section_3_3_figures():
    """FuncPipe §3.3: at 70 MB/s, synchronizing a 280 MB model among 8
    workers takes 11 s with LambdaML's scatter-reduce (eq. 1) and 8 s pipelined (eq. 2),
    a 27% cut ("data transfer time": latency excluded)."""
    lambdaml = scatter_reduce_seconds(280e6, 8, 70e6, 0.0, "lambdaml")
    pipelined = scatter_reduce_seconds(280e6, 8, 70e6, 0.0, "pipelined")
    assert lambdaml == pytest.approx(11.0, rel=1e-12)
    assert pipelined == pytest.approx(8.0, rel=1e-12)
    assert round(100 * (1 - pipelined / lambdaml)) == 27
    # with the measured t_lat "< 40 ms": eq. 1 adds 4 t_lat, eq. 2 adds (2 + n) t_lat — still about 11 s and 8 s
    assert scatter_reduce_seconds(280e6, 8, 70e6, 0.04, "lambdaml") == pytest.approx(11.0 + 4 * 0.04)
    assert scatter_reduce_seconds(280e6, 8, 70e6, 0.04, "pipelined") == pytest.approx(8.0 + 10 * 0.04)


def test_scatter_reduce_coefficients_and_one_worker():
    assert scatter_reduce_coefficients("pipelined", 5) == (2.0, 7.0)       # (γ, δ) = (2, 2 + d), App. B
    assert scatter_reduce_coefficients("lambdaml", 4) == (2.5, 4.0)        # 3 − 2/n, 4
    assert scatter_reduce_seconds(1e9, 1, 1e6, 1.0) == 0.0                 # (1 − y₁) = 0
    with pytest.raises(PlanError, match="not one of"):
        scatter_reduce_seconds(1.0, 2, 1.0, 0.0, "allgather")


def test_ring_allreduce_matches_pipedream_and_hydrozoa_forms():
    # Hydrozoa §3.4 with α, β: 2(N − 1)(|p|/(N D) + α|p|/N + β)
    assert ring_allreduce_seconds(4e6, 4, 1e6, 1e-7, 0.01) == pytest.approx(2 * 3 * (1.0 + 0.1 + 0.01))
    # PipeDream §5.3.1: (1/m)·2(m − 1)|w|/B
    for m in (2, 3, 8):
        assert ring_allreduce_seconds(6e6, m, 2e6) == pytest.approx(2 * (m - 1) * 6e6 / 2e6 / m)
    assert ring_allreduce_seconds(6e6, 1, 2e6, 1.0, 1.0) == 0.0


# --- FuncPipe -------------------------------------------------------------------------


def test_funcpipe_hand_computed_two_stages():
    """3 layers, stages {l0, l1} on 1024 MB (100 MiB/s) and {l2} on 2048 MB (50 MiB/s),
    d = 2, M = 4 (µ = 2 micro-batches of 2 samples), β = 2, t_lat = 0.01 s, pipelined sync."""
    cost = funcpipe.iteration(problem(), TWO_STAGES)
    first, second = cost.stages
    assert (cost.replicas, cost.micro_batches_per_replica, cost.micro_batch_size) == (2, 2, 2.0)
    # t̂_fc = β Σ T_fc: 2·(1 + 0.5), 2·2; t̂_bc: 2·(2 + 1), 2·4
    assert (first.forward_s, second.forward_s, first.backward_s, second.backward_s) == (3.0, 4.0, 6.0, 8.0)
    # o = 10 MiB: t_fu = 10/100 + t_lat, t_fd = 10/50 + t_lat, t_bu = 10/50 + t_lat, t_bd = 10/100 + t_lat
    (cut,) = cost.boundaries
    assert cut.after_layer == 1 and cut.bytes == 10 * MIB
    assert cut.forward_upload_s == pytest.approx(0.11) and cut.forward_download_s == pytest.approx(0.21)
    assert cut.backward_upload_s == pytest.approx(0.21) and cut.backward_download_s == pytest.approx(0.11)
    # t_f^0 = 3 + 4 + 0.11 + 0.21; Δ_f = max(3, 4, 0.11, 0.21); t_f = t_f^0 + (µ − 1)Δ_f
    assert cost.first_forward_s == pytest.approx(7.32)
    assert cost.forward_lag_s == 4.0
    assert cost.forward_s == pytest.approx(11.32)
    # top stage: t_b = 8 + 1·8; bottom stage: t_b = 6 + 8 + 0.21 + 0.11 + 1·max(6, 8, 0.21, 0.11)
    assert second.backward_lag_s == 8.0 and second.backward_done_s == pytest.approx(16.0)
    assert first.backward_lag_s == 8.0 and first.backward_done_s == pytest.approx(22.32)
    # t_s = 2·ŝ/W + (2 + d)·t_lat: 2·150/100 + 0.04, 2·200/50 + 0.04
    assert first.sync_s == pytest.approx(3.04) and second.sync_s == pytest.approx(8.04)
    # eq. 7: t_f + max(22.32 + 3.04, 16 + 8.04)
    assert cost.iteration_s == pytest.approx(11.32 + 25.36)
    # eq. 3b: µâ + ŝ(4 − 2y₁) + s₀ = 2·(10 + 5) + 4·150 + 100 MiB; 2·20 + 4·200 + 100 MiB
    assert first.memory_needed_bytes == (30 + 600 + 100) * MIB
    assert second.memory_needed_bytes == (40 + 800 + 100) * MIB
    assert cost.fits and cost.unfit_stage is None
    # eq. 5, 6: c_mem = d Σ m; c_iter = t_iter · d · Σ (price of each tier)
    assert cost.memory_mb_total == 2 * (1024 + 2048)
    assert cost.dollars_per_iteration == pytest.approx(36.68 * 2 * (1e-5 + 2e-5))


def test_funcpipe_one_replica_has_no_sync_and_half_the_weight_memory():
    cost = funcpipe.iteration(problem(), plan((0, 1, 1024, 1), (2, 2, 2048, 1)))
    assert [stage.sync_s for stage in cost.stages] == [0.0, 0.0]
    assert cost.micro_batches_per_replica == 4
    # y₁ = 1: ŝ(4 − 2) = 2ŝ, and µ = 4 micro-batches of activations
    assert cost.stages[0].memory_needed_bytes == (4 * 15 + 2 * 150 + 100) * MIB
    assert cost.forward_s == pytest.approx(7.32 + 3 * 4.0)


def test_funcpipe_lambdaml_sync_and_optimizer_state():
    work = Workload("train", batch=8, micro_batches=4, optimizer="adam", sync="lambdaml")
    four = plan((0, 1, 1024, 4), (2, 2, 2048, 4))
    cost = funcpipe.iteration(problem(work), four)
    # eq. 1 with n = 4: 3·1.5 − 2·1.5/4 + 4·0.01
    assert cost.stages[0].sync_s == pytest.approx(3 * 1.5 - 2 * 1.5 / 4 + 0.04)
    # Adam's two moments (2ŝ) are reported beside eq. 3b's terms
    assert cost.stages[0].memory.optimizer == 300 * MIB
    assert cost.stages[0].memory_needed_bytes == (1 * 15 + 4 * 150 + 300 + 100) * MIB


def test_checkpoint_cost_uploads_weights_and_optimizer_state_and_picks_the_interval():
    work = Workload("train", batch=8, micro_batches=4, optimizer="adam")
    two = plan((0, 1, 1024, 1), (2, 2, 2048, 1))
    checkpoints = funcpipe.checkpoint_cost(problem(work), two)
    # weights + Adam's two moments: 3·150 MiB at 100 MiB/s, 3·200 MiB at 50 MiB/s, each + t_lat
    assert checkpoints.stage_bytes == (450 * MIB, 600 * MIB)
    assert checkpoints.stage_upload_s == pytest.approx((4.5 + LATENCY, 12.0 + LATENCY))
    assert checkpoints.upload_s == pytest.approx(12.01)
    # the shortest interval within 5% of a 40 s iteration: ceil(12.01 / 2) = 7, capped by the run
    assert checkpoints.interval_for(40.0, iterations=100) == 7
    assert checkpoints.overhead(40.0, 7) <= 0.05 < checkpoints.overhead(40.0, 6)
    assert checkpoints.interval_for(40.0, iterations=4) == 4
    # plain SGD keeps no state: the weights alone
    assert funcpipe.checkpoint_cost(problem(), two).stage_bytes == (150 * MIB, 200 * MIB)


def test_funcpipe_storage_cap_shares_bandwidth():
    # 100 MiB/s for the account, d·S = 4 workers: 25 MiB/s each
    cost = funcpipe.iteration(problem(target=platform(cap=100 * MIB)), TWO_STAGES)
    assert [stage.bandwidth_bytes_s for stage in cost.stages] == [25 * MIB, 25 * MIB]
    assert cost.boundaries[0].forward_upload_s == pytest.approx(10 / 25 + LATENCY)


def test_funcpipe_reports_the_stage_that_does_not_fit():
    cost = funcpipe.iteration(problem(), plan((0, 1, 1024, 2), (2, 2, 512, 2)))
    assert not cost.fits and cost.unfit_stage == 1
    assert cost.stages[1].memory.limit == 512 * MIB and cost.stages[1].memory_needed_bytes == 940 * MIB


def test_funcpipe_rejects_plans_it_cannot_price():
    with pytest.raises(PlanError, match="no memory tier"):
        funcpipe.iteration(problem(), plan((0, 1, None, 1), (2, 2, 1024, 1)))
    with pytest.raises(PlanError, match="at most 4 replicas"):
        funcpipe.iteration(problem(), plan((0, 2, 1024, 8)))
    with pytest.raises(PlanError, match="chain of 4 layers, this chain has 3"):
        funcpipe.iteration(problem(), Plan.from_cuts([1], 4))


def test_funcpipe_prices_stages_of_their_own_degrees_at_the_busiest_stage_s_pace():
    """A 1F1B-RR plan (``--stage-replicas 1,2``): µ is the single replica's, each stage
    syncs at its own degree, and the bill counts every stage's replicas."""
    uneven = funcpipe.iteration(problem(), plan((0, 1, 1024, 1), (2, 2, 1024, 2)))
    single = funcpipe.iteration(problem(), plan((0, 1, 1024, 1), (2, 2, 1024, 1)))
    assert uneven.micro_batches_per_replica == single.micro_batches_per_replica
    assert uneven.stages[0].sync_s == single.stages[0].sync_s == 0.0
    assert uneven.stages[1].sync_s > 0.0 == single.stages[1].sync_s
    assert uneven.memory_mb_total == 1024 + 2 * 1024


def test_the_schedule_says_how_many_weight_copies_funcpipe_prices():
    """1F1B's stash keeps a version per micro-batch in flight (S - s), 2BW two, a flush one."""
    two = plan((0, 0, 1024, 1), (1, 1, 1024, 1), (2, 2, 1024, 1))
    weights = {}
    for schedule in ("sync", "1f1b-async", "2bw"):
        workload = dataclasses.replace(problem().workload, schedule=schedule)
        cost = funcpipe.iteration(dataclasses.replace(problem(), workload=workload), two)
        weights[schedule] = [stage.memory.weights for stage in cost.stages]
    assert [a // b for a, b in zip(weights["1f1b-async"], weights["sync"])] == [3, 2, 1]
    assert [a // b for a, b in zip(weights["2bw"], weights["sync"])] == [2, 2, 1]


def test_every_model_reads_seconds_through_the_calibration():
    class Calibration:
        def seconds(self, index, memory_mb, micro_batch):
            return (10.0, 20.0) if memory_mb == 1024 else None

        def speed_ratio(self, memory_mb, threads):
            return None    # no target calibration: the host model for tiers without lines

    calibrated = dataclasses.replace(problem(), calibration=Calibration())
    cost = funcpipe.iteration(calibrated, TWO_STAGES)
    assert cost.stages[0].forward_s == 2 * (10.0 + 10.0)    # β·Σ calibrated seconds
    assert cost.stages[1].forward_s == 2 * 2.0               # no calibration for 2048 MB: the host model
    assert hydrozoa.iteration(calibrated, TWO_STAGES).shards[0].backward_s == 40.0
    assert pipedream.iteration(calibrated, TWO_STAGES).stages[0].compute_s == 60.0


def test_check_layers_fit_names_layer_bytes_limit_and_fix():
    # largest tier 1024 MiB; l2 needs µ·â + 2ŝ + s₀ = 4·(100·2) + 400 + 100 = 1300 MiB with d = 1
    layers = [*LAYERS[:2], ("big", 2.0, 4.0, 200, 100.0, 10.0)]
    target = platform(tiers=((512, 50), (1024, 100)))
    with pytest.raises(PlanError) as caught:
        check_layers_fit(problem(layers=layers, target=target))
    message = str(caught.value)
    assert "layer 2 (big)" in message and "layer 0" not in message and "layer 1 " not in message
    assert "1,300.0 MB" in message and str(1300 * MIB) in message
    assert "1024 MB" in message and str(1024 * MIB) in message
    # 5 samples would fit, but 4 micro-batches hold whole samples: the fix names 4
    assert "batch of at most 4 samples" in message and "larger memory tiers" in message
    # the fix it names works: a batch of 4 fits, the next one M divides (8) does not
    check_layers_fit(problem(Workload("train", batch=4, micro_batches=4, optimizer="sgd"), layers, target))
    with pytest.raises(PlanError):
        check_layers_fit(problem(Workload("train", batch=8, micro_batches=4, optimizer="sgd"), layers, target))


def test_check_layers_fit_when_weights_alone_are_too_big():
    layers = [*LAYERS[:2], ("huge", 2.0, 4.0, 600, 1.0, 1.0)]
    target = platform(tiers=((512, 50), (1024, 100)))
    with pytest.raises(PlanError, match=r"layer 2 \(huge\).*no batch size fits"):
        check_layers_fit(problem(layers=layers, target=target))
    check_layers_fit(problem())                              # the small chain fits
    with pytest.raises(PlanError, match="layer 2"):          # forced d = 2 adds the 2ŝ sync buffers
        check_layers_fit(problem(layers=[*LAYERS[:2], ("l2", 2.0, 4.0, 300, 10.0, 10.0)], target=target),
                         replicas=2)


# --- Gillis ---------------------------------------------------------------------------


def test_emg_expected_maximum_closed_forms():
    assert CommDelay(0.05, 0.01, 0.02).expected_max(1) == pytest.approx(0.07)          # µ + 1/λ
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert CommDelay(0.05, 0.0, 0.02).expected_max(4) == pytest.approx(0.05 + 0.02 * harmonic)
    # no tail: E[max of 2 normals] = µ + σ/√π
    assert CommDelay(0.05, 0.01, 0.0).expected_max(2) == pytest.approx(0.05 + 0.01 / math.sqrt(math.pi), rel=1e-6)


@pytest.mark.parametrize("delay, n", [
    (CommDelay(0.05, 0.01, 0.02), 8),      # λσ = 0.5
    (CommDelay(0.03, 0.005, 0.05), 16),    # heavy tail
    (CommDelay(0.2, 0.05, 0.001), 5),      # λσ = 50: the asymptotic branch of the CDF
])
def test_emg_expected_maximum_matches_monte_carlo(delay, n):
    rng = np.random.default_rng(20240501)
    samples = rng.normal(delay.mu_s, delay.sigma_s, (100_000, n)) + rng.exponential(delay.tail_s, (100_000, n))
    simulated = samples.max(axis=1)
    assert delay.expected_max(n) == pytest.approx(simulated.mean(), abs=4 * simulated.std() / math.sqrt(100_000))
    # and the CDF itself matches the sample's empirical CDF
    points = np.quantile(samples[:, 0], [0.1, 0.5, 0.9, 0.99])
    assert delay.cdf(points) == pytest.approx([0.1, 0.5, 0.9, 0.99], abs=0.005)


GILLIS_PLAN = ForkJoinPlan((Group(0, 1, workers=3, on_master=True), Group(2, 2, workers=0, on_master=True)), 1024, 3)
INFER = Workload("infer", batch=4, micro_batches=1)


def gillis_cost(granularity=0.001, tiers=((512, 50), (1024, 100), (2048, 50)), fork_join=GILLIS_PLAN):
    target = platform(tiers=tiers, granularity=granularity)
    return gillis.latency(problem(INFER, target=target), fork_join, CommDelay(0.05, 0.0, 0.02))


def test_gillis_hand_computed_fork_join():
    """Group {l0, l1} split over 3 workers + the master (p = 4), group {l2} on the master;
    batch 4 on 1024 MB (100 MiB/s); delays EMG with σ = 0, so E[max of 3] = µ + H₃/λ."""
    cost = gillis_cost()
    first, second = cost.groups
    assert first.partition_compute_s == pytest.approx((1.0 + 0.5) / 4)
    # the request input is not counted; the output is 5 MiB·4 samples = 20 MiB, 5 MiB per partition
    assert first.transfer_s == pytest.approx(3 * 5 / 100)
    assert first.delay_s == pytest.approx(0.05 + 0.02 * (1 + 1 / 2 + 1 / 3))
    assert first.latency_s == pytest.approx(0.15 + 0.375 + first.delay_s)
    assert first.worker_duration_s == pytest.approx(0.375 + 0.05)
    assert second.latency_s == 2.0 and second.workers == 0
    assert cost.latency_s == pytest.approx(first.latency_s + 2.0)
    assert cost.invocations == 4
    # weights: (100 + 50)/4 MiB of group 1 and 200 MiB of group 2 on the master, 924 MiB left
    assert cost.master_weight_bytes == int(37.5 * MIB) + 200 * MIB and cost.fits


def test_gillis_serves_with_the_no_grad_forward_when_it_was_measured():
    served = problem(INFER, target=platform())

    def served_no_grad(link: ChainLayer) -> ChainLayer:
        assert link.profile is not None, "the chain is built from profiles"
        return dataclasses.replace(link, profile=dataclasses.replace(link.profile, inference_s=Linear(0.0, 0.1)))

    chain = tuple(served_no_grad(link) for link in served.chain)
    cost = gillis.latency(dataclasses.replace(served, chain=chain), GILLIS_PLAN, CommDelay(0.05, 0.0, 0.02))
    first, second = cost.groups
    assert first.partition_compute_s == pytest.approx((0.1 + 0.1) / 4)
    assert second.latency_s == pytest.approx(0.1)


def test_gillis_billing_granularity():
    fine, coarse = gillis_cost(granularity=0.001), gillis_cost(granularity=0.1)
    assert fine.latency_s == pytest.approx(2.611667, abs=1e-6) and fine.groups[0].worker_duration_s == 0.425
    assert fine.billed_s == pytest.approx(2.612 + 3 * 0.425)  # ⌈T/1 ms⌉ + Σ ⌈T_w/1 ms⌉
    assert coarse.billed_s == pytest.approx(2.7 + 3 * 0.5)    # ⌈T/100 ms⌉ + Σ ⌈T_w/100 ms⌉
    assert coarse.duration_dollars == pytest.approx(4.2 * 1e-5)
    assert coarse.request_dollars == pytest.approx(4 * 2e-7)
    assert coarse.dollars_per_request == pytest.approx(4.2 * 1e-5 + 8e-7)


def test_gillis_memory_budget_and_plan_conversion():
    small = gillis_cost(tiers=((256, 100), (1024, 100)), fork_join=dataclasses.replace(GILLIS_PLAN, memory_mb=256))
    assert not small.fits and small.unfit == "master"        # 237.5 MiB of weights > 256 − 100 MiB
    assert "master" in gillis.describe_unfit(small)
    # without a problem to cost the splits, a replicated stage splits by batch (exact for any stage)
    converted = ForkJoinPlan.from_plan(plan((0, 1, 1024, 4), (2, 2, 1024, 1)))
    assert converted.groups == (Group(0, 1, 4, False, "batch"), Group(2, 2, 0, True))
    with pytest.raises(PlanError, match="one memory size"):
        ForkJoinPlan.from_plan(plan((0, 1, 1024, 4), (2, 2, 2048, 1)))
    with pytest.raises(PlanError, match="no memory tier"):
        gillis.latency(problem(INFER), plan((0, 2, None, 1)))
    with pytest.raises(PlanError, match="inference model"):
        gillis.latency(problem(), GILLIS_PLAN)


# --- Hydrozoa -------------------------------------------------------------------------


def test_hydrozoa_hand_computed_two_by_two():
    """A×B = 2×2: shards {l0, l1} (1024 MB, 100 MiB/s) and {l2} (2048 MB, 50 MiB/s); each
    group pipelines ⌈4/2⌉ = 2 micro-batches of 2 samples; β (per round) = 0.01 s."""
    cost = hydrozoa.iteration(problem(), TWO_STAGES, AllReduceTerms(beta_s=0.01))
    assert (cost.data_parallel, cost.model_parallel, cost.micro_batches) == (2, 2, 2)
    assert [s.forward_s for s in cost.shards] == [1.5, 2.0] and [s.backward_s for s in cost.shards] == [3.0, 4.0]
    assert cost.shards[1].comm_in_s == pytest.approx(10 / 50)       # a/D at the slower side
    assert cost.forward_lag_s == 2.0 and cost.backward_lag_s == 4.0  # t_k, r_1
    # Σ(f + b) + 2Σc + (M − 1)(t_k + r_1)
    assert cost.model_parallel_s == pytest.approx(10.5 + 0.4 + 6.0)
    # 2(A − 1)(|p|/(A D) + β): 2·(75/100 + 0.01), 2·(100/50 + 0.01)
    assert [s.allreduce_s for s in cost.shards] == pytest.approx([1.52, 4.02])
    assert cost.iteration_s == pytest.approx(16.9 + 4.02)
    assert cost.dollars_per_iteration == pytest.approx(20.92 * 2 * 3e-5)
    assert cost.shards[0].memory_needed_bytes == (2 * 15 + 2 * 150 + 100) * MIB


def test_hydrozoa_single_group_has_no_allreduce():
    cost = hydrozoa.iteration(problem(), plan((0, 1, 1024, 1), (2, 2, 2048, 1)), AllReduceTerms(1e-9, 0.5))
    assert cost.sync_s == 0.0 and cost.micro_batches == 4
    assert cost.iteration_s == pytest.approx(10.5 + 0.4 + 3 * 6.0)


# --- PipeDream ------------------------------------------------------------------------


def test_pipedream_hand_computed_replicated_stage():
    """Stage {l0, l1} replicated twice (1024 MB, 100 MiB/s), stage {l2} once (2048 MB,
    50 MiB/s); micro-batches of 2 samples, M = 4."""
    cost = pipedream.iteration(problem(), plan((0, 1, 1024, 2), (2, 2, 2048, 1)))
    first, second = cost.stages
    # (1/m) max(Σ T_l, 2(m − 1)|w|/B): (1/2) max(4.5, 2·150/100) ; (1/1) max(6, 0)
    assert first.sync_s == pytest.approx(1.5) and first.time_s == pytest.approx(2.25)
    assert second.time_s == 6.0
    assert cost.cuts[0].time_s == pytest.approx(2 * 10 / 50)        # 2 a_s / B
    assert cost.slowest_s == 6.0 and cost.bottleneck == "stage 1"
    assert cost.iteration_s == 24.0 and cost.workers == 3
    assert cost.dollars_per_iteration == pytest.approx(24.0 * (2 * 1e-5 + 2e-5))
    # in flight: ⌈(2 + 1)/2⌉ = 2 weight and activation versions on stage 0, 1 on the last
    assert (first.in_flight, second.in_flight) == (2, 1)
    assert first.memory_needed_bytes == (2 * 15 + 2 * 150 + 150 + 100) * MIB


def test_pipedream_sync_or_cut_can_be_the_bottleneck():
    assert pipedream.stage_seconds(4.5, 150 * MIB, 2, 10 * MIB) == pytest.approx(15.0)
    slow_cut = [*LAYERS[:1], ("l1", 0.5, 1.0, 50, 2.5, 500.0), LAYERS[2]]
    cost = pipedream.iteration(problem(layers=slow_cut), plan((0, 1, 1024, 1), (2, 2, 2048, 1)))
    assert cost.bottleneck == "cut after layer 1" and cost.slowest_s == pytest.approx(2 * 1000 / 50)


# --- all models -----------------------------------------------------------------------


def test_breakdowns_are_json():
    costs = [funcpipe.iteration(problem(), TWO_STAGES), hydrozoa.iteration(problem(), TWO_STAGES),
             pipedream.iteration(problem(), TWO_STAGES), gillis_cost()]
    for cost, model in zip(costs, ["funcpipe", "hydrozoa", "pipedream", "gillis"]):
        data = json.loads(json.dumps(cost.to_json(), allow_nan=False))
        assert data["model"] == model and data["fits"] is True


def _hand_written_emg_cdf(delay: CommDelay, x: np.ndarray) -> np.ndarray:
    """The EMG CDF this module computed by hand before it called ``scipy.stats.exponnorm``:
    Φ(z) − exp(−λσz + λ²σ²/2)·Φ(z − λσ), with the erfcx asymptote once exp(·) overflows."""
    erfc = np.vectorize(math.erfc, otypes=[float])
    z = (x - delay.mu_s) / delay.sigma_s
    normal = 0.5 * erfc(-z / math.sqrt(2))
    ls = delay.sigma_s / delay.tail_s
    t = (ls - z) / math.sqrt(2)
    term = np.empty_like(z)
    small = t <= 25.0
    term[small] = 0.5 * np.exp(-ls * z[small] + ls * ls / 2) * erfc(t[small])
    tb = t[~small]
    term[~small] = (0.5 * np.exp(-z[~small] ** 2 / 2) / (tb * math.sqrt(math.pi))
                    * (1 - 1 / (2 * tb ** 2) + 3 / (4 * tb ** 4)))
    return np.clip(normal - term, 0.0, 1.0)


@pytest.mark.parametrize("delay", [CommDelay(0.05, 0.01, 0.02), CommDelay(0.03, 0.005, 0.05),
                                   CommDelay(0.2, 0.05, 0.001), CommDelay(0.01, 0.002, 0.0004)])
def test_emg_cdf_from_scipy_exponnorm_equals_the_hand_written_one(delay):
    """Same parameters (µ, σ, 1/λ ↔ loc, scale, K = 1/(λσ)), same numbers, across the body
    and both tails, including λσ up to 125 where the hand-written form switched to its
    asymptote."""
    grid = np.linspace(delay.mu_s - 10 * delay.sigma_s, delay.mu_s + 10 * delay.sigma_s + 30 * delay.tail_s, 4001)
    np.testing.assert_allclose(delay.cdf(grid), _hand_written_emg_cdf(delay, grid), rtol=1e-9, atol=1e-12)


# --- Gillis: channel and batch splits ---------------------------------------------------

def _channel_problem(batch=4):
    """Layers l0, l1 (1.5 s of serving together, 150 MiB of weights, 5 MiB out per sample)
    with a channel split of the group l0..l1 as ``ir/channels.py`` would summarize it: the
    fewest channels 8 (layer "conv"), 140 MiB of sliced weights and 10 MiB every partition
    holds whole, 80% of the FLOPs split, the output half sliced, a quarter partial sums, a
    quarter whole; 1 MiB of request input per sample."""
    from flatpack.ir.channels import ChannelGroup

    shape = ChannelGroup(max_partitions=8, limiting_layer="conv", whole_bytes=10 * MIB, sliced=((8, 140 * MIB),),
                         split_flops_share=0.8, sliced_output_share=0.5, partial_output_share=0.25)
    served = problem(Workload("infer", batch=batch, micro_batches=1), target=platform())
    return dataclasses.replace(served, input_bytes=Linear(1.0 * MIB), channel_groups={(0, 1): shape})


def _group_cost(served, workers, split):
    tier = served.platform.tier(1024)
    forward = sum(served.layer_inference_seconds(i, tier, served.workload.batch) for i in (0, 1))
    delay = CommDelay(0.05, 0.0, 0.02).expected_max(workers)
    return gillis.group_cost(served, tier, Group(0, 1, workers, False, split), forward, 150 * MIB, delay)


def test_gillis_channel_split_terms_by_hand():
    """Three workers, batch 4 at 100 MiB/s: each partition repeats the 20% of FLOPs that see
    whole values and does a third of the rest; keeps 3 of the 8 channels of the sliced
    weights (channel_ranges: 3, 3, 2) plus the whole ones; receives the whole 4 MiB input
    and sends back a third of the 10 MiB sliced output, the 5 MiB partial sum, and
    (partition 0) the 5 MiB whole output."""
    cost = _group_cost(_channel_problem(), 3, "channel")
    assert cost.partition_compute_s == pytest.approx(1.5 * (0.8 / 3 + 0.2))
    assert cost.partition_weight_bytes == 10 * MIB + math.ceil(140 * MIB * 3 / 8)
    assert cost.worker_in_bytes == pytest.approx(4 * MIB)
    assert cost.worker_out_bytes == pytest.approx((10 / 3 + 5 + 5) * MIB)
    # the master's link: the input to each worker, each one's slice and partial sum, one whole output
    assert cost.transfer_s == pytest.approx((3 * (4 + 10 / 3 + 5) + 5) / 100)
    assert cost.latency_s == pytest.approx(cost.transfer_s + cost.partition_compute_s + cost.delay_s)
    assert cost.worker_duration_s == pytest.approx(cost.partition_compute_s + (4 + 10 / 3 + 10) / 100)


def test_gillis_batch_split_terms_by_hand_and_the_choice_between_splits():
    served = _channel_problem()
    cost = _group_cost(served, 3, "batch")
    assert cost.partition_compute_s == pytest.approx(0.5) and cost.partition_weight_bytes == 150 * MIB
    assert cost.transfer_s == pytest.approx(3 * (4 + 20) / 3 / 100)      # 1/3 of the input and output each
    assert cost.worker_duration_s == pytest.approx(0.5 + (4 + 20) / 3 / 100)
    # batch is faster here and fits 1024 MB; a one-sample request cannot split by batch
    assert gillis.choose_split(served, 0, 1, 3, 1024) == "batch"
    single = _channel_problem(batch=1)
    with pytest.raises(PlanError, match=r"at least 3 samples per request, this workload has 1"):
        _group_cost(single, 3, "batch")
    assert gillis.choose_split(single, 0, 1, 3, 1024) == "channel"
    # the plan says which: with_splits writes the choice, latency costs it, from_plan reads it back
    chosen = gillis.with_splits(single, plan((0, 1, 1024, 3), (2, 2, 1024, 1)))
    assert [stage.split for stage in chosen.stages] == ["channel", None]
    assert Plan.loads(chosen.dumps()) == chosen
    assert ForkJoinPlan.from_plan(chosen).groups[0].split == "channel"


def test_gillis_channel_split_refuses_more_partitions_than_channels_and_unsplittable_groups():
    served = _channel_problem(batch=1)
    with pytest.raises(PlanError, match=r"layer conv has 8 output channels, fewer than the 9 partitions.*at most 8"):
        _group_cost(served, 9, "channel")
    with pytest.raises(PlanError, match=r"layer conv has 8 output channels, fewer than the 9 partitions"):
        gillis.with_splits(served, plan((0, 1, 1024, 9, "channel"), (2, 2, 1024, 1)))
    # a plan whose split cannot run a group does not fit, and says why (solvers skip it)
    cost = gillis.latency(served, plan((0, 0, 1024, 1), (1, 2, 1024, 2, "channel")), CommDelay(0.05))
    assert not cost.fits
    assert re.search(r"group 1: layers 1\.\.2 \(l1 \.\. l2\) cannot be split by channel", gillis.describe_unfit(cost))
    cost = gillis.latency(served, plan((0, 0, 1024, 1), (1, 2, 1024, 2)), CommDelay(0.05))
    assert not cost.fits and "needs at least 2 samples per request" in gillis.describe_unfit(cost)
    with pytest.raises(PlanError, match=r"cannot be split over 2 workers — by channel: .*; by batch: "
                                        r".*needs at least 2 samples per request, this workload has 1"):
        gillis.choose_split(served, 1, 2, 2, 1024)
    with pytest.raises(PlanError, match=r"split 'rows'.*channel or batch"):
        plan((0, 1, 1024, 2, "rows"), (2, 2, 1024, 1)).check_against(3)


def test_stage_tensors_names_a_range_outside_the_chain():
    from flatpack.partitioner.cost.common import stage_tensors

    with pytest.raises(PlanError, match=r"stage 1\.\.3 is not a range of the chain's 3 layers; "
                                        r"give 0 <= start <= end <= 2"):
        stage_tensors(problem(), 1, 3)
    with pytest.raises(PlanError, match=r"stage 2\.\.1"):
        stage_tensors(problem(), 2, 1)
