"""flatpack calibrate (issue 19, item 1): the calibration file's target figures, the EMG fit,
how a problem uses them, the calibration function itself (run in this process on a file
store), the cloud deploy bundle's function naming, and refusals before anything starts."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
from typing import Any, cast

import numpy as np
import pytest
from scipy.stats import exponnorm

from flatpack import cli
from flatpack.backends import aws_lambda, cloud, profiling
from flatpack.backends.target_calibration import calibrate_target, calibration_summary
from flatpack.errors import InputError
from flatpack.platform.calibration import Calibration, StoreLatency, TargetInfo, TierCalibration
from flatpack.runtime.calibrate_function import (CALIBRATE_KIND, CalibrateResult, CalibrateSpec, calibrate_role,
                                                 run_calibrate)
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store_url import open_store
from flatpack.runtime.throttle import DEFAULT_BURST_S
from tests.unit.test_cost_models import HOST, platform, problem


def target_calibration(**changes) -> Calibration:
    values: dict[str, Any] = dict(
        platform="test", layer_names=(),
        tiers={512: TierCalibration(compute_ratio={"conv": 3.0, "matmul": 4.0, "elementwise": 5.0},
                                    upload_bytes_s=10e6, download_bytes_s=40e6, invoke_cold_s=1.5, invoke_warm_s=0.5,
                                    optimizer_s_per_byte={"sgd": 1e-9, "adam": 4e-9}, burst_s=0.008)},
        target=TargetInfo("test", "2026-11-25T10:00:00+00:00", "a test CPU", "0.1.0", None, 1),
        store_latency=StoreLatency(2.0, 0.002, 0.0005, 100), poll_overhead_s=0.003, host_cores=2,
        collective={"skipped": "no GPU"})
    values.update(changes)
    return Calibration(**values)


def test_target_calibration_round_trips_with_a_stable_digest(tmp_path):
    calibration = target_calibration()
    path = calibration.save(tmp_path / "calibration.json")
    loaded = Calibration.load(path)
    assert loaded == calibration and loaded.target == calibration.target
    assert loaded.store_latency == calibration.store_latency and loaded.tiers[512] == calibration.tiers[512]
    assert loaded.digest == calibration.digest and len(loaded.digest) == 64
    assert target_calibration(poll_overhead_s=0.004).digest != calibration.digest
    data = json.loads(path.read_text())
    assert data["schema_version"] == 2 and data["target"]["host"] == "a test CPU"
    assert data["store_latency"]["distribution"] == "exponnorm"


def _save_repeatedly(path: str, times: int) -> None:
    calibration = target_calibration()
    for _ in range(times):
        calibration.save(path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks two writers")
def test_two_processes_saving_one_calibration_at_once_both_succeed(tmp_path):
    """Two demos that calibrate into the shared cache at once each write the same file."""
    path = tmp_path / "calibration.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_save_repeatedly, args=(str(path), 300)) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert [writer.exitcode for writer in writers] == [0, 0]
    assert Calibration.load(path) == target_calibration()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["calibration.json"]


def test_store_latency_fit_recovers_an_exponnorm():
    samples = np.asarray(exponnorm.rvs(2.0, loc=0.002, scale=0.0005, size=400, random_state=3), dtype=float)
    fitted = StoreLatency.fit(samples.tolist())
    assert fitted.samples == 400
    assert fitted.mean_s == pytest.approx(samples.mean(), rel=0.02)   # the MLE's mean is the sample mean's
    assert fitted.k == pytest.approx(2.0, rel=0.35) and fitted.loc == pytest.approx(0.002, rel=0.15)
    with pytest.raises(InputError, match="at least 8 measured requests, got 3"):
        StoreLatency.fit([0.001, 0.002, 0.003])


def test_a_target_calibration_sets_the_platform_figures_it_measured():
    tuned = target_calibration().apply(platform())
    assert tuned.storage_latency_s == pytest.approx(0.002 + 2.0 * 0.0005)   # the EMG's mean
    assert tuned.poll_overhead_s == 0.003 and tuned.host_cores == 2
    # one W for both directions: the harmonic mean, so that an up and a down take 2·o/W
    assert tuned.tier(512).bandwidth_bytes_s == pytest.approx(2 / (1 / 10e6 + 1 / 40e6))
    assert "measured inside the target" in tuned.sources["storage_latency_s"]


def test_host_seconds_map_to_a_tier_by_the_measured_ratio_at_the_same_thread_count():
    base = dataclasses.replace(problem(), platform=platform(tiers=((512, 50), (1024, 100))))
    calibrated = dataclasses.replace(base, calibration=target_calibration())
    tier = base.platform.tier(512)
    host_forward = base.layer_profile(0).forward_s.at(2)
    assert calibrated.layer_seconds(0, tier, 2)[0] == pytest.approx(host_forward * 4.0)   # median ratio
    other = base.platform.tier(1024)
    assert calibrated.layer_seconds(0, other, 2) == base.layer_seconds(0, other, 2)
    four_threads = dataclasses.replace(calibrated, host=dataclasses.replace(HOST, threads=4))
    assert four_threads.layer_seconds(0, tier, 2) == dataclasses.replace(base, host=four_threads.host) \
        .layer_seconds(0, tier, 2)   # measured at 1 thread: says nothing of 4
    assert calibrated.calibration is not None
    assert calibrated.calibration.optimizer_seconds(512, "adam", 1000) == pytest.approx(4e-6)
    assert calibrated.calibration.optimizer_seconds(512, "sgd-momentum", 1000) is None


def test_hostile_calibration_files():
    data = target_calibration().to_json()
    with pytest.raises(InputError, match="\"store_latency\" must be .*exponnorm"):
        Calibration.from_json({**data, "store_latency": {"distribution": "normal"}})
    with pytest.raises(InputError, match=r"tiers\[512\].compute_ratio.conv must be positive"):
        Calibration.from_json({**data, "tiers": {"512": {"compute_ratio": {"conv": 0}}}})
    with pytest.raises(InputError, match="target.threads must be a positive integer"):
        Calibration.from_json({**data, "target": {**data["target"], "threads": 0}})
    with pytest.raises(InputError, match="host_cores must be positive"):
        Calibration.from_json({**data, "host_cores": 0})


def test_the_calibration_function_measures_a_tier_in_this_process(tmp_path):
    store = open_store(f"file://{tmp_path}")
    keys = RunKeys("run-calibrate")
    spec = CalibrateSpec(run=keys.run, memory_mb=1024, vcpus=0.5, emulate_cpu=True, bandwidth_bytes_s=50e6,
                         round_trips=5, polls=2, probe_bytes=1 << 18, transfer_repeats=3, compute_repeats=1,
                         optimizer_parameters=1 << 12)
    cold, warm = calibrate_role(keys, 1024, 0), calibrate_role(keys, 1024, 1)
    assert cold.kind == CALIBRATE_KIND and cold.stage == 1024 and warm.start_iteration == 1
    assert run_calibrate(store, cold, spec.dumps(), started=1.0) == 0
    result = CalibrateResult.loads(store.get(keys.calibrate("result", 1024, 0)))
    assert set(result.compute_s) == {"conv", "matmul", "elementwise"} and min(result.compute_s.values()) > 0
    assert len(result.request_s) == 10 and len(result.poll_overhead_s) == 2
    # held to the tier's 50 MB/s as a stage's link is (unthrottled, 768 KiB each way takes ~1 ms here): a token
    # bucket lets each direction move at most rate × (elapsed + its burst), and refills while the other moves
    elapsed = sum(result.upload_s) + sum(result.download_s)
    assert elapsed + DEFAULT_BURST_S >= 3 * (1 << 18) / 50e6
    assert set(result.optimizer_s_per_byte) == {"sgd", "sgd-momentum", "adam"}
    assert "skipped" in result.collective
    assert run_calibrate(store, warm, spec.dumps(), started=2.0) == 0
    second = CalibrateResult.loads(store.get(keys.calibrate("result", 1024, 1)))
    # a warm start says when it was ready and times the compute and optimizer probes again (a second reading
    # of the tier's speed); the requests and transfers are the cold start's only
    assert second.started_at == 2.0 and set(second.compute_s) == set(result.compute_s)
    assert set(second.optimizer_s_per_byte) == set(result.optimizer_s_per_byte)
    assert second.request_s == [] and second.upload_s == []


def test_calibration_functions_ship_in_a_cloud_deploy_as_per_tier_functions():
    """Dry run: the cloud backends start one function per tier for a calibrate role, as for
    in-target profiling (the worker in every image dispatches the "calibrate" kind)."""
    role = calibrate_role(RunKeys("r"), 2048, 0)
    assert cloud.function_name("fp", role.kind, role.stage) == cloud.function_name("fp", "profile", 2048) == "fp-p02048"
    deploy, scratch = profiling._default_deploy("aws-lambda", False, (1024, 2048), "eu-west-1")
    assert scratch is None and deploy.func is aws_lambda.deploy
    assert deploy.keywords == {"profile_tiers": (1024, 2048), "region": "eu-west-1"}


def _no_deploy(compiled):
    raise AssertionError("deployed before the options were checked")


@pytest.mark.parametrize("options, message", [
    ({"round_trips": 2}, r"round_trips >= 4 .*got threads=1, round_trips=2"),
    ({"probe_bytes": 0}, "probe_bytes >= 1"),
    ({"region": "eu-west-1"}, "Leave --region out"),
    ({"tiers": (64,)}, "allows .* MB per worker, got 64 MB"),
    ({"tiers": (512, 512)}, "name a memory size twice"),
])
def test_bad_options_are_refused_before_anything_is_deployed(options, message):
    with pytest.raises(InputError, match=message):
        calibrate_target("local", deploy=_no_deploy, **options)


def test_unknown_target_names_the_known_ones(capsys):
    assert cli.main(["calibrate", "--target", "nowhere"]) == 2
    assert "aws-lambda" in capsys.readouterr().err


def test_summary_names_each_figure():
    text = calibration_summary(target_calibration())
    assert "EMG K=2" in text and "mean 3.000 ms" in text and "3.00/4.00/5.00" in text
    assert "not measured (no GPU)" in text and "host cores shared" in text


def test_run_refuses_a_calibration_of_another_target_before_anything_starts(tmp_path):
    from flatpack.job import JobOptions

    path = target_calibration(platform="aws-lambda").save(tmp_path / "lambda.json")
    with pytest.raises(InputError, match="measured on another target.*flatpack calibrate --target local"):
        JobOptions.of(calibration=path, out=tmp_path / "run").check()
    with pytest.raises(InputError, match="calibration file .*missing.json does not exist"):
        JobOptions.of(calibration=tmp_path / "missing.json", out=tmp_path / "run").check()


def test_gillis_takes_the_calibrated_store_latency_as_its_delay_distribution():
    from flatpack.partitioner.cost.gillis import CommDelay, _default_delay

    infer = dataclasses.replace(problem(), calibration=target_calibration())
    delay = _default_delay(infer)
    # exponnorm(K, loc, scale): µ = loc, σ = scale, 1/λ = K·scale; its mean is FuncPipe's t_lat
    assert delay == CommDelay(0.002, 0.0005, 2.0 * 0.0005)
    store_latency = target_calibration().store_latency
    assert store_latency is not None and delay.mean == pytest.approx(store_latency.mean_s)
    assert _default_delay(problem()) == CommDelay(problem().platform.storage_latency_s)
    explicit = dataclasses.replace(infer, options=infer.options.with_changes(comm_delay={"mu_s": 0.01}))
    assert _default_delay(explicit) == CommDelay(0.01)


def test_the_demos_cached_calibration_is_found_until_the_method_changes(tmp_path, monkeypatch):
    """`flatpack demo --calibration measure` measures this host into the cache and later demos
    find the file (tiers in any order); none is found before it, and a file measured by an
    earlier revision of calibrate's method is not found, though its schema still loads."""
    from flatpack.backends import target_calibration as module

    monkeypatch.setenv("FLATPACK_CACHE_DIR", str(tmp_path))
    measured: list[str] = []

    def fake_calibrate(target: str, *, tiers, out, report) -> Calibration:
        measured.append(str(out))
        calibration = target_calibration()
        calibration.save(out)
        return calibration

    monkeypatch.setattr(module, "calibrate_target", fake_calibrate)
    assert module.find_local_calibration((512, 1024)) is None and not measured
    first = module.measure_local_calibration((512, 1024))
    said: list[str] = []
    assert module.find_local_calibration((1024, 512), said.append) == first and first.is_file()
    assert len(measured) == 1 and "--calibration measure" in said[0]
    first.write_text("{not json")         # a damaged file is not a calibration: measured again when asked
    assert module.find_local_calibration((512, 1024)) is None
    module.measure_local_calibration((512, 1024))
    monkeypatch.setattr(module, "METHOD_REVISION", module.METHOD_REVISION + 1)
    assert module.find_local_calibration((512, 1024)) is None
    assert module.measure_local_calibration((512, 1024)) != first and len(measured) == 3


def test_a_tier_s_compute_ratio_is_the_median_of_its_invocations_each_beside_its_own_host_passes():
    """The cold and each warm function read the tier's speed; each reading is divided by the
    host's passes just before and after it (the host's speed moves between them), and the
    tier's figure is the readings' median: one reading on a slow moment does not move it."""
    from flatpack.backends import target_calibration as calibration_module

    def result(invocation: int, conv_s: float, adam: float) -> CalibrateResult:
        return CalibrateResult(512, invocation, 0.0, 1.0 + invocation, compute_s={"conv": conv_s},
                               request_s=[0.002] * 4 if invocation == 0 else [], upload_s=[0.102], download_s=[0.052],
                               probe_bytes=10_000_000 if invocation == 0 else 0,
                               optimizer_s_per_byte={"adam": adam})

    # readings 3.5, 3.0 and 4.8 (the last on a slow moment), the host slowing between them
    results = {(512, 0): result(0, 0.0035, 2e-9), (512, 1): result(1, 0.0060, 4e-9), (512, 2): result(2, 0.0048, 9e-9)}
    host_passes = {(512, 0): {"conv": 0.001}, (512, 1): {"conv": 0.002}, (512, 2): {"conv": 0.001}}
    launched = {(512, 0): 0.5, (512, 1): 1.5, (512, 2): 2.0}
    tier = calibration_module._tiers({512: 512}, results, launched, host_passes)[512]
    assert tier.compute_ratio == {"conv": pytest.approx(3.5)}
    assert tier.optimizer_s_per_byte == {"adam": pytest.approx(4e-9)}
    assert tier.invoke_cold_s == pytest.approx(0.5) and tier.invoke_warm_s == pytest.approx(0.5)
    # two readings: their mean
    del results[(512, 2)]
    two = calibration_module._tiers({512: 512}, results, launched, host_passes)[512]
    assert two.compute_ratio == {"conv": pytest.approx((3.5 + 3.0) / 2)} and two.optimizer_s_per_byte == {
        "adam": pytest.approx(3e-9)}
    # a warm function of an earlier flatpack reports no probes: the cold reading stands alone
    results[(512, 1)] = CalibrateResult(512, 1, 0.0, 2.0)
    alone = calibration_module._tiers({512: 512}, results, launched, host_passes)[512]
    assert alone.compute_ratio == {"conv": pytest.approx(3.5)} and alone.optimizer_s_per_byte == {"adam": 2e-9}


def test_a_tier_another_stands_for_keeps_its_own_link_and_takes_the_rest_from_its_representative():
    """4096 MB's function, of 2048 MB's CPU share, times its link alone (a ``link_only``
    result): its bandwidth is its own, fitted with 2048 MB's request time; its compute ratio,
    optimizer step and starts are 2048 MB's."""
    from flatpack.backends import target_calibration as calibration_module

    def probes(memory_mb: int, invocation: int, upload_s: float) -> CalibrateResult:
        return CalibrateResult(memory_mb, invocation, 0.0, 1.0 + invocation, compute_s={"conv": 0.002},
                               request_s=[0.002] * 4 if invocation == 0 else [],
                               upload_s=[upload_s] if invocation == 0 else [],
                               download_s=[upload_s] if invocation == 0 else [],
                               probe_bytes=10_000_000 if invocation == 0 else 0, optimizer_s_per_byte={"adam": 3e-9})

    results = {(2048, 0): probes(2048, 0, 0.202), (2048, 1): probes(2048, 1, 0.0), (2048, 2): probes(2048, 2, 0.0),
               # the link-only function: 10 MB in 0.102 s (twice 2048 MB's rate), nothing else
               (4096, 0): CalibrateResult(4096, 0, 0.0, 0.5, upload_s=[0.102], download_s=[0.102],
                                          probe_bytes=10_000_000)}
    launched = {(2048, 0): 0.25, (2048, 1): 1.5, (2048, 2): 2.5, (4096, 0): 0.4}
    host_passes = {(2048, invocation): {"conv": 0.001} for invocation in range(3)}
    tiers = calibration_module._tiers({2048: 2048, 4096: 2048}, results, launched, host_passes)
    large, larger = tiers[2048], tiers[4096]
    assert large.upload_bytes_s == pytest.approx(10_000_000 / 0.2)
    assert larger.upload_bytes_s == pytest.approx(10_000_000 / 0.1)     # its own link, less 2048 MB's t_lat
    assert larger.compute_ratio == large.compute_ratio == {"conv": pytest.approx(2.0)}
    assert larger.optimizer_s_per_byte == large.optimizer_s_per_byte
    assert larger.invoke_cold_s == large.invoke_cold_s == pytest.approx(0.75)
    assert larger.invoke_warm_s == large.invoke_warm_s == pytest.approx(0.5)


def test_a_link_only_function_times_its_link_and_nothing_else(tmp_path):
    """``CalibrateSpec.link_only``: the function puts and gets its two probe sizes through the
    tier's link and skips the compute, optimizer, request and poll probes."""
    from flatpack.runtime.calibrate_function import run_calibrate

    store = open_store(tmp_path.as_uri())
    keys = RunKeys("run-link")
    spec = CalibrateSpec(run=keys.run, memory_mb=4096, vcpus=2.0, emulate_cpu=True, bandwidth_bytes_s=None,
                         probe_bytes=1 << 16, link_only=True)
    role = calibrate_role(keys, 4096, 0)
    assert run_calibrate(store, role, spec.dumps(), 0.0) == 0
    result = CalibrateResult.loads(store.get(keys.calibrate("result", 4096, 0)))
    assert len(result.upload_s) == len(result.download_s) == spec.transfer_repeats
    assert len(result.small_upload_s) == spec.transfer_repeats and result.small_probe_bytes == (1 << 16) // 4
    assert not result.compute_s and not result.optimizer_s_per_byte
    assert not result.request_s and not result.poll_overhead_s


def test_a_link_s_rate_and_burst_come_from_transfers_of_two_sizes():
    """A token-bucket link: each transfer takes t_lat + n/W − b. The slope between two sizes
    is W whatever t_lat and b; b is the intercept. A small probe the burst covers whole is off
    the line, and so is a missing one: then W = n/(t − t_lat), b = 0."""
    from flatpack.backends.target_calibration import link_fit

    rate, burst, latency = 10e6, 0.010, 0.002

    def seconds(nbytes: int) -> list[float]:
        return [latency + max(0.0, nbytes / rate - burst)] * 3

    fitted_rate, fitted_burst = link_fit(4_000_000, seconds(4_000_000), 1_000_000, seconds(1_000_000), latency)
    assert fitted_rate == pytest.approx(rate) and fitted_burst == pytest.approx(burst)
    # the small probe all burst (50 KB in 5 ms < 10 ms): no fit, the large probe's own rate
    assert link_fit(4_000_000, seconds(4_000_000), 50_000, seconds(50_000), latency) == \
        (pytest.approx(4_000_000 / (0.4 - burst)), 0.0)
    # an earlier function's result (no small probe): the same
    assert link_fit(4_000_000, seconds(4_000_000), 0, [], latency)[1] == 0.0
    # a link with no burst fits b = 0
    flat = [latency + 4_000_000 / rate] * 3
    no_burst = link_fit(4_000_000, flat, 1_000_000, [latency + 0.1] * 3, latency)
    assert no_burst == (pytest.approx(rate), pytest.approx(0.0))


class _StubDeployment:
    """What calibrate_target uses of a deployment, the functions only recorded: ``launch``
    (a local deployment forks them) and ``launch_cold`` (a fresh interpreter)."""

    emulate_tiers = True

    def __init__(self, store_dir) -> None:
        self.store = open_store(store_dir.as_uri())
        self.keys = RunKeys("run-stub")
        self.workdir = store_dir
        self.started: list[tuple[int, int, str]] = []    # (MB, invocation, how)

    def _started(self, role, how: str) -> Any:
        self.started.append((role.stage, role.start_iteration, how))
        return _Ended()

    def launch(self, role) -> Any:
        return self._started(role, "launch")

    def launch_cold(self, role) -> Any:
        return self._started(role, "launch_cold")

    def teardown(self) -> None:
        pass


class _Ended:
    returncode = 0

    def poll(self) -> int:
        return 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def kill(self) -> None:
        pass


def test_the_cold_invocation_starts_a_fresh_interpreter_the_warm_ones_the_usual_way(tmp_path, monkeypatch):
    """The cold start calibrate records (``invoke_cold_s``) is a fresh interpreter's on the local
    backend, never the fork server's (docs/local-functions.md); the warm ones start as every
    local function does."""
    from flatpack.backends import target_calibration as calibration_module
    from flatpack.errors import RunFailure

    monkeypatch.setattr(calibration_module, "_on_host", lambda threads: {"matmul": 1.0})
    monkeypatch.setattr(profiling, "POLL_S", 0.0)
    deployment = _StubDeployment(tmp_path)
    with pytest.raises(RunFailure, match="wrote no result"):    # the stubs measure nothing
        calibrate_target("local", tiers=[512, 1024], deploy=lambda compiled: cast(Any, deployment),
                         task_iterations=0)
    warm = calibration_module.WARM_READINGS
    assert sorted(deployment.started) == sorted(
        [(mb, 0, "launch_cold") for mb in (512, 1024)]
        + [(mb, invocation, "launch") for mb in (512, 1024) for invocation in range(1, 1 + warm)])


def test_emulated_tiers_of_one_cpu_share_stand_for_each_other_and_platform_tiers_for_themselves():
    """``alike_tiers``: at one thread every local tier from 2048 MB (1.16 vCPU) on runs its
    compute unthrottled, so the smallest of them stands for the rest; at two threads a tier
    needs 2 vCPUs for that; a platform's tiers are measured each on its own."""
    from flatpack.backends.target_calibration import alike_tiers
    from flatpack.platform.catalog import get_platform

    local = get_platform("local")
    sizes = tuple(local.memory_choices)
    assert sizes[:3] == (512, 1024, 2048) and len(sizes) > 3
    one_thread = alike_tiers(local, sizes, threads=1, emulated=True)
    assert one_thread == {mb: (mb if mb < 2048 else 2048) for mb in sizes}
    two_threads = alike_tiers(local, sizes, threads=2, emulated=True)
    assert two_threads[2048] == 2048 and two_threads[3072] == 3072 and two_threads[max(sizes)] == 4096
    assert alike_tiers(local, sizes, threads=1, emulated=False) == {mb: mb for mb in sizes}


def test_a_tier_another_stands_for_starts_first_the_usual_way_and_takes_its_task_terms(tmp_path, monkeypatch):
    """The cold start and the probe pipelines run on the representative tier only (2048 MB
    for 4096 MB at one thread): 4096 MB's first invocation, which still measures its own link
    and requests, starts as a warm one does, and its task terms are 2048 MB's, measured once."""
    from flatpack.backends import target_calibration as calibration_module

    deployment = _StubDeployment(tmp_path)
    monkeypatch.setattr(calibration_module, "_on_host", lambda threads: {"matmul": 1.0})
    monkeypatch.setattr(profiling, "POLL_S", 0.0)
    with pytest.raises(Exception, match="wrote no result"):    # the stubs measure nothing
        calibrate_target("local", tiers=[512, 2048, 4096], deploy=lambda compiled: cast(Any, deployment),
                         task_iterations=0)
    first = sorted((mb, how) for mb, invocation, how in deployment.started if invocation == 0)
    assert first == [(512, "launch_cold"), (2048, "launch_cold"), (4096, "launch")]
    # 4096 MB's function times its link once; its warm start and compute are 2048 MB's
    assert sorted({mb for mb, invocation, _ in deployment.started if invocation > 0}) == [512, 2048]
    specs = {mb: CalibrateSpec.loads(deployment.store.get(deployment.keys.calibrate("spec", mb)))
             for mb in (512, 2048, 4096)}
    assert [specs[mb].link_only for mb in (512, 2048, 4096)] == [False, False, True]

    probed: list[int] = []

    def measure_tier(target, memory_mb, calibration, deploy, **options):
        probed.append(memory_mb)
        return {1: {"forward": memory_mb / 1e6}}

    monkeypatch.setattr(calibration_module.task_overheads, "measure_tier", measure_tier)
    monkeypatch.setattr(calibration_module.task_overheads, "measure_serving",
                        lambda target, memory_mb, calibration, deploy, **options: {1: {"request": 0.01}})
    base = target_calibration()
    any_tier = next(iter(base.tiers.values()))
    tiers = {mb: dataclasses.replace(any_tier) for mb in (512, 2048, 4096)}
    calibration = calibration_module._with_task_overheads(
        dataclasses.replace(base, tiers=tiers), "local", {512: 512, 2048: 2048, 4096: 2048},
        lambda compiled: cast(Any, deployment), 4, 10.0, lambda line: None)
    assert probed == [512, 2048]
    assert calibration.tiers[4096].task_overhead_s == calibration.tiers[2048].task_overhead_s == {
        1: {"forward": 2048 / 1e6, "request": 0.01}}
    assert calibration.tiers[512].task_overhead_s[1]["forward"] == 512 / 1e6


def test_the_calibration_s_deployments_share_one_store_server(monkeypatch):
    """Emulated tiers deploy the probe pipelines and serving probes on the one S3 server the
    calibration starts (a server of their own each cost 1-1.5 s); a cloud target's deploy is
    the backend's own, with no server here."""
    import contextlib

    from flatpack.backends import target_calibration as calibration_module

    with contextlib.ExitStack() as cleanup:
        deploy, scratch, pid = calibration_module._shared_store_deploy("local", False, (512,), None, cleanup)
        assert scratch is not None and pid is not None and os.path.exists(f"/proc/{pid}")
        keywords = cast(Any, deploy).keywords
        assert keywords["store_url"].startswith("s3://") and keywords["env"]
    # the server stops with the calibration
    assert not os.path.exists(f"/proc/{pid}")
    with contextlib.ExitStack() as cleanup:
        deploy, scratch, pid = calibration_module._shared_store_deploy("aws-lambda", False, (1024,), "eu-west-1",
                                                                      cleanup)
        assert scratch is None and pid is None and cast(Any, deploy).func is aws_lambda.deploy
