"""The gpu-container calibration's arithmetic: the ring all-reduce inverted (fit_ring), the
file's collective section, and Hydrozoa's model and planner taking α, β from it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost import hydrozoa
from flatpack.partitioner.cost.collectives import (AllReduceTerms, fit_line, fit_ring, measured_terms,
                                                   ring_allreduce_seconds)
from flatpack.partitioner.cost.registry import cost_model_for
from flatpack.partitioner.solvers.hydrozoa_planner import sync_overheads
from flatpack.partitioner.workload import Workload
from flatpack.platform.calibration import Calibration, CollectiveFit, TargetInfo, TierCalibration
from tests.unit.test_cost_models import platform, plan, problem

SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
LATENCY, BANDWIDTH, ALPHA, BETA = 2.0e-4, 1.5e9, 2.0e-10, 3.0e-4
TRAIN = Workload("train", batch=8, micro_batches=4, optimizer="sgd")


def measured(workers: int, alpha: float = ALPHA, beta: float = BETA) -> tuple[list[float], list[float]]:
    """Seconds per size of a link and a ring all-reduce that follow the models exactly."""
    point_to_point = [LATENCY + n / BANDWIDTH for n in SIZES]
    all_reduce = [ring_allreduce_seconds(n, workers, BANDWIDTH, alpha, beta) for n in SIZES]
    return point_to_point, all_reduce


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_fit_ring_recovers_the_link_and_the_overheads_it_was_made_from(workers):
    point_to_point, all_reduce = measured(workers)
    terms = fit_ring(SIZES, point_to_point, {workers: all_reduce})
    assert terms["latency_s"] == pytest.approx(LATENCY, rel=1e-6)
    assert terms["bandwidth_bytes_s"] == pytest.approx(BANDWIDTH, rel=1e-6)
    assert terms["alpha_s_per_byte"] == pytest.approx(ALPHA, rel=1e-6)
    assert terms["beta_s"] == pytest.approx(BETA, rel=1e-6)
    assert terms["ring_error"] < 1e-6


def test_two_rank_counts_tell_the_copies_from_the_ring():
    """δ and γ do not grow with the workers, the ring's terms do: measured among 2, 3 and 4
    workers, all four are recovered, and a count never measured (8) is predicted."""
    per_call, copy = 1.5e-3, 4.0e-10
    terms = AllReduceTerms(ALPHA, BETA, per_call, copy)
    point_to_point = [LATENCY + n / BANDWIDTH for n in SIZES]
    fitted = fit_ring(SIZES, point_to_point, {k: [terms.seconds(n, k, BANDWIDTH) for n in SIZES] for k in (2, 3, 4)})
    for name, value in (("alpha_s_per_byte", ALPHA), ("beta_s", BETA), ("per_call_s", per_call),
                        ("copy_s_per_byte", copy)):
        assert fitted[name] == pytest.approx(value, rel=1e-6), name
    recovered = AllReduceTerms(fitted["alpha_s_per_byte"], fitted["beta_s"], fitted["per_call_s"],
                               fitted["copy_s_per_byte"])
    assert recovered.seconds(1 << 28, 8, BANDWIDTH) == pytest.approx(terms.seconds(1 << 28, 8, BANDWIDTH), rel=1e-6)
    assert recovered.seconds(1 << 28, 1, BANDWIDTH) == 0.0


def test_an_all_reduce_faster_than_the_ring_at_d_gets_alpha_zero_and_says_how_far_off_it_is():
    point_to_point, _ = measured(2)
    # half the ring's bytes: a backend that moves less than 2(N − 1)/N of the buffer
    all_reduce = [BETA * 2 + n / (2 * BANDWIDTH) for n in SIZES]
    terms = fit_ring(SIZES, point_to_point, {2: all_reduce})
    assert terms["alpha_s_per_byte"] == 0.0
    assert terms["ring_error"] == pytest.approx(max(
        abs(ring_allreduce_seconds(n, 2, terms["bandwidth_bytes_s"], 0.0, terms["beta_s"]) - t) / t
        for n, t in zip(SIZES, all_reduce)))
    assert terms["ring_error"] > 0.5


def test_fit_line_weighs_every_size_alike_so_the_small_sizes_fix_the_fixed_term():
    # 5 % noise on the largest size would swamp a 0.2 ms intercept under plain least squares
    seconds = [LATENCY + n / BANDWIDTH for n in SIZES]
    seconds[-1] *= 1.05
    fixed, per_byte = fit_line(SIZES, seconds)
    assert fixed == pytest.approx(LATENCY, rel=0.05)
    assert 1 / per_byte == pytest.approx(BANDWIDTH, rel=0.06)


@pytest.mark.parametrize("sizes,seconds,message", [
    ((4096,), (1e-3,), "two measured points or more"),
    ((4096, 8192), (1e-3, 0.0), "positive and finite"),
    ((4096, 8192), (1e-3,), "two measured points or more"),
])
def test_fit_line_refuses_what_gives_no_line(sizes, seconds, message):
    with pytest.raises(PlanError, match=message):
        fit_line(sizes, seconds)


def test_fit_ring_refuses_one_worker_and_times_that_do_not_grow():
    point_to_point, all_reduce = measured(2)
    with pytest.raises(PlanError, match="two workers or more"):
        fit_ring(SIZES, point_to_point, {1: all_reduce})
    with pytest.raises(PlanError, match="do not grow with the message size"):
        fit_ring(SIZES, [1e-3] * len(SIZES), {2: all_reduce})
    # flat times over sizes whose non-negative fit rounds to a slope of 1e-26 s/byte
    three = (1 << 12, 1 << 18, 1 << 24)
    with pytest.raises(PlanError, match="do not grow with the message size"):
        fit_ring(three, [1e-3] * 3, {2: [ring_allreduce_seconds(n, 2, BANDWIDTH) for n in three]})
    with pytest.raises(PlanError, match="one positive time per size"):
        fit_ring(SIZES, point_to_point, {2: all_reduce[:-1]})


def collective(workers: int = 2) -> CollectiveFit:
    point_to_point, all_reduce = measured(workers)
    return CollectiveFit(workers, "gloo", "cpu", "cpu", SIZES, tuple(point_to_point), {workers: tuple(all_reduce)},
                         **fit_ring(SIZES, point_to_point, {workers: all_reduce}))


def container_calibration(fit: CollectiveFit) -> Calibration:
    return Calibration(platform="test", layer_names=(),
                       tiers={1024: TierCalibration(bandwidth_bytes_s=fit.bandwidth_bytes_s)},
                       target=TargetInfo("test", "2026-11-27T00:00:00+00:00", "cpu", "0"),
                       storage_latency_s=fit.latency_s, collective=fit.to_json())


def test_the_collective_round_trips_through_the_file(tmp_path):
    calibration = container_calibration(collective())
    loaded = Calibration.load(calibration.save(tmp_path / "calibration.json"))
    assert loaded.collective_fit == collective()
    assert loaded.digest == calibration.digest


@pytest.mark.parametrize("change,message", [
    (lambda data: data.pop("beta_s"), "lacks beta_s"),
    (lambda data: data.update(ranks=1), "collective.ranks must be an integer of 2 or more"),
    (lambda data: data.update(alpha_s_per_byte=-1e-9), "collective.alpha_s_per_byte must be non-negative"),
    (lambda data: data.update(all_reduce_s={"2": [1e-3]}), "collective.all_reduce_s.2 must be a list of one number"),
    (lambda data: data.update(all_reduce_s={"9": [1e-3] * 6}), "all_reduce_s must map rank counts"),
    (lambda data: data.update(bandwidth_bytes_s=float("nan")), "bandwidth_bytes_s must be a finite number"),
])
def test_a_hostile_collective_section_is_refused_where_the_file_is_read(change, message):
    data = container_calibration(collective()).to_json()
    change(data["collective"])
    with pytest.raises(InputError, match=message):
        Calibration.from_json(json.loads(json.dumps(data)))


def test_a_skipped_collective_is_no_fit():
    calibration = dataclasses.replace(container_calibration(collective()), collective={"skipped": "no GPU"})
    assert calibration.collective_fit is None


def container_problem(**options):
    target = dataclasses.replace(platform(), kind="container")
    return problem(TRAIN, target=target, **options)


def test_hydrozoa_prices_the_all_reduce_with_the_calibrated_terms():
    fit = dataclasses.replace(collective(2), per_call_s=1e-3, copy_s_per_byte=1e-10)
    calibrated = dataclasses.replace(container_problem(), calibration=container_calibration(fit))
    uniform = plan((0, 1, 1024, 2), (2, 2, 2048, 2))
    assert sync_overheads(calibrated) == measured_terms(fit)
    cost = cost_model_for(calibrated).price(calibrated, uniform).detail
    assert isinstance(cost, hydrozoa.HybridCost)
    terms = measured_terms(fit)
    for shard in cost.shards:
        # 150 MiB and more, past the largest measured size (64 MiB): the equation with the new
        # δ and γ, scaled to meet the 64 MiB measurement
        assert shard.sync_bytes > SIZES[-1]
        bandwidth = calibrated.platform.tier(shard.memory_mb).bandwidth_bytes_s
        scale = fit.all_reduce_s[2][-1] / terms.equation_seconds(SIZES[-1], 2, bandwidth)
        assert shard.allreduce_s == pytest.approx(terms.equation_seconds(shard.sync_bytes, 2, bandwidth) * scale,
                                                  rel=1e-12)
    uncalibrated = cost_model_for(container_problem()).price(container_problem(), uniform).detail
    assert isinstance(uncalibrated, hydrozoa.HybridCost)
    assert cost.sync_s != pytest.approx(uncalibrated.sync_s, rel=1e-3)


def test_given_alpha_and_beta_win_over_the_calibration_and_no_calibration_means_zero():
    fit = collective(2)
    given = dataclasses.replace(container_problem(hydrozoa_alpha=1e-9, hydrozoa_beta=0.0),
                                calibration=container_calibration(fit))
    # a given α is the user's word: priced by the equation, not overruled by the measurements
    assert sync_overheads(given) == AllReduceTerms(1e-9, 0.0, fit.per_call_s, fit.copy_s_per_byte)
    assert sync_overheads(container_problem()) == AllReduceTerms()


# measured all-reduces off the equation in both directions, as gloo's are: the per-byte cost
# grows with the size (superlinear), and 4 workers are cheaper than the ring's 2(N − 1) says
EQUATION = AllReduceTerms(ALPHA, BETA, 1e-3, 0.0)
MEASURED = tuple((workers, tuple(EQUATION.equation_seconds(n, workers, BANDWIDTH) * (1 + index / 4) * scale
                                 for index, n in enumerate(SIZES)))
                 for workers, scale in ((2, 1.0), (4, 0.8)))
ANCHORED = dataclasses.replace(EQUATION, measured_sizes_bytes=SIZES, measured_s=MEASURED)


def test_anchored_terms_are_the_measurement_within_the_measured_sizes_and_counts():
    for workers, seconds in MEASURED:
        for n, measured_s in zip(SIZES, seconds):
            assert ANCHORED.seconds(n, workers, BANDWIDTH) == pytest.approx(measured_s, rel=1e-12)
        # between two measured sizes: the straight line between their measurements
        middle = (SIZES[3] + SIZES[4]) / 2
        assert ANCHORED.seconds(middle, workers, BANDWIDTH) == pytest.approx((seconds[3] + seconds[4]) / 2, rel=1e-12)
    assert ANCHORED.seconds(SIZES[-1], 1, BANDWIDTH) == 0.0


def test_anchored_terms_carry_the_equation_s_shape_beyond_the_measurements():
    two, four = (dict(MEASURED)[workers] for workers in (2, 4))

    def equation(n: float, workers: int) -> float:
        return EQUATION.equation_seconds(n, workers, BANDWIDTH)

    larger, smaller = SIZES[-1] * 4, SIZES[0] / 4
    # beyond the largest size and below the smallest: the equation, scaled to meet the edge
    assert ANCHORED.seconds(larger, 2, BANDWIDTH) == pytest.approx(
        equation(larger, 2) * two[-1] / equation(SIZES[-1], 2), rel=1e-12)
    assert ANCHORED.seconds(smaller, 2, BANDWIDTH) == pytest.approx(
        equation(smaller, 2) * two[0] / equation(SIZES[0], 2), rel=1e-12)
    # a count never measured: the nearest measured one (the larger on a tie), scaled by the ring
    for workers in (3, 8):
        assert ANCHORED.seconds(SIZES[2], workers, BANDWIDTH) == pytest.approx(
            equation(SIZES[2], workers) * four[2] / equation(SIZES[2], 4), rel=1e-12)
    # continuous at the edges, and never falling as the size grows
    assert ANCHORED.seconds(SIZES[-1] * (1 + 1e-9), 2, BANDWIDTH) == pytest.approx(two[-1], rel=1e-6)
    grid = [SIZES[0] / 8 * 1.5 ** step for step in range(40)]
    for workers in (2, 3, 4, 8):
        times = [ANCHORED.seconds(n, workers, BANDWIDTH) for n in grid]
        assert times == sorted(times)


def test_a_measured_dip_is_levelled_and_a_falling_table_is_refused():
    point_to_point, all_reduce = measured(2)
    dipped = [*all_reduce]
    dipped[1] = dipped[0] * 0.9     # 64 KB measured faster than 4 KB: noise at the fixed cost
    fit = CollectiveFit(2, "gloo", "cpu", "cpu", SIZES, tuple(point_to_point), {2: tuple(dipped)},
                        **fit_ring(SIZES, point_to_point, {2: dipped}))
    terms = measured_terms(fit)
    assert terms.seconds(SIZES[1], 2, BANDWIDTH) == pytest.approx(dipped[0], rel=1e-12)
    with pytest.raises(PlanError, match="does not fall as the size grows"):
        AllReduceTerms(measured_sizes_bytes=SIZES, measured_s=((2, tuple(dipped)),))
    with pytest.raises(PlanError, match="in increasing order"):
        AllReduceTerms(measured_sizes_bytes=SIZES[::-1], measured_s=((2, tuple(all_reduce)),))
    with pytest.raises(PlanError, match="among two workers or more"):
        AllReduceTerms(measured_sizes_bytes=SIZES, measured_s=((1, tuple(all_reduce)),))
