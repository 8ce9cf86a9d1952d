"""The platform catalog, the host-to-tier compute model and calibration files."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from flatpack.backends import TARGETS
from flatpack.errors import InputError
from flatpack.ir.profile import HostInfo, LayerProfile, Linear
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.platform.calibration import SCHEMA_VERSION, Calibration, TierCalibration
from flatpack.platform.catalog import (BUILTIN_PLATFORMS, MB_S, PLATFORMS, Platform, describe_platforms, get_platform,
                                       register_platform)

CPU1 = HostInfo(device="cpu", threads=1, cpu="test cpu", torch_version="2.13.0")
CPU2 = HostInfo(device="cpu", threads=2, cpu="test cpu", torch_version="2.13.0")


@pytest.fixture
def lam() -> Platform:
    return get_platform("aws-lambda")


# -- tiers -----------------------------------------------------------------------------------

def test_lambda_vcpu_share_is_proportional_to_memory(lam):
    assert lam.tier(1769).vcpus == pytest.approx(1.0)
    assert lam.tier(3538).vcpus == pytest.approx(2.0)
    top = lam.tier(10240)
    # 10240/1769 = 5.79 vCPU-seconds per second; the documented 6 vCPUs is a cap that never binds
    assert top.vcpus == pytest.approx(10240 / 1769)
    assert top.vcpus <= lam.scaling.max_vcpus == 6
    assert lam.tier(128).vcpus == pytest.approx(128 / 1769)


def test_lambda_memory_range_and_steps(lam):
    assert lam.tier(128).memory_mb == 128
    assert lam.tier(1000).memory_mb == 1000          # 1 MB increments
    for bad in (127, 10241, 0, -512):
        with pytest.raises(InputError, match="128-10240 MB"):
            lam.tier(bad)
    for bad in (1024.0, 1024.5, "1024", True):
        with pytest.raises(InputError, match="whole number of MB"):
            lam.tier(bad)


def test_lambda_default_tiers_are_funcpipes_eight(lam):
    assert lam.memory_choices == (512, 1024, 2048, 3072, 4096, 6144, 8192, 10240)
    assert all(lam.tier(tier.memory_mb) == tier for tier in lam.tiers)


def test_lambda_price_per_second(lam):
    assert lam.tier(1024).price_per_s == pytest.approx(0.0000166667)
    assert lam.tier(512).price_per_s == pytest.approx(0.0000166667 / 2)
    assert lam.tier(10240).price_per_hour == pytest.approx(0.60, rel=1e-4)   # Hydrozoa §5.2's figure
    assert lam.price_per_request == pytest.approx(0.20 / 1e6)


def test_lambda_bandwidth(lam):
    assert lam.tier(10240).bandwidth_bytes_s == pytest.approx(70 * MB_S)
    assert lam.tier(3008).bandwidth_bytes_s == pytest.approx(70 * MB_S)
    assert lam.tier(1504).bandwidth_bytes_s == pytest.approx(35 * MB_S)
    widths = [tier.bandwidth_bytes_s for tier in lam.tiers]
    assert widths == sorted(widths)


def test_lambda_limits(lam):
    assert lam.timeout_s == 900
    assert lam.package_limit_bytes == 250 * 2**20
    assert lam.image_limit_bytes == 10 * 2**30
    assert lam.ephemeral_storage_bytes == 10240 * 2**20
    assert lam.storage_latency_s == pytest.approx(0.040)
    assert lam.billing_granularity_s == pytest.approx(0.001)
    assert not lam.direct_networking


def test_alibaba_tiers_and_prices():
    fc = get_platform("alibaba-fc")
    tier = fc.tier(512)
    assert tier.vcpus == pytest.approx(0.25)
    assert tier.price_per_s == pytest.approx(0.000020 * (0.25 * 1 + 0.5 * 0.15))
    assert fc.tier(32768).vcpus == 16
    assert fc.tier(128).vcpus == pytest.approx(0.05)
    assert fc.max_memory_mb == 32768
    assert fc.aggregate_bandwidth_bytes_s == pytest.approx(10e9 / 8)
    assert fc.price_per_request == pytest.approx(75 / 10_000 * 0.000020)
    with pytest.raises(InputError, match="steps of 64 MB"):
        fc.tier(1000)
    with pytest.raises(InputError, match="128-32768 MB"):
        fc.tier(65536)


def test_gpu_container_configurations():
    gpu = get_platform("gpu-container")
    k80 = gpu.tier(6144)
    assert (k80.gpu_model, k80.gpus, k80.vcpus) == ("K80", 1, 4)
    assert k80.price_per_hour == pytest.approx(4 * 0.03165 + 6 * 0.00425 + 0.36)   # $0.512/h, Hydrozoa §5.3
    assert gpu.tier(16384).gpu_model == "V100"
    assert gpu.direct_networking and gpu.billing_granularity_s == 1
    with pytest.raises(InputError, match="6144 MB .*K80.*16384 MB .*V100"):
        gpu.tier(8192)


def test_local_mimics_lambda_within_this_host(lam):
    local = get_platform("local")
    assert local.memory_choices == lam.memory_choices
    cpus = os.cpu_count() or 1
    for mine, theirs in zip(local.tiers, lam.tiers):
        assert mine.bandwidth_bytes_s == theirs.bandwidth_bytes_s
        assert mine.price_per_s == theirs.price_per_s
        assert mine.vcpus == pytest.approx(min(theirs.vcpus, cpus))
    assert local.tier(1769).vcpus == pytest.approx(min(1.0, cpus))


# -- registry --------------------------------------------------------------------------------

def test_targets_are_the_builtin_platforms():
    assert TARGETS == ("local", "aws-lambda", "alibaba-fc", "gpu-container", "ray")
    assert set(TARGETS) == set(BUILTIN_PLATFORMS)
    assert all(get_platform(name).name == name for name in TARGETS)


def test_unknown_platform_lists_known_names():
    with pytest.raises(InputError) as error:
        get_platform("aws-lamda")
    assert "aws-lamda" in str(error.value)
    for name in TARGETS:
        assert name in str(error.value)
    with pytest.raises(InputError, match="known platforms"):
        # a caller without type checking may pass None: the error must still name the platforms
        get_platform(None)  # pyright: ignore[reportArgumentType]


def test_register_platform_refuses_duplicates(lam):
    mine = Platform.from_json({**lam.to_json(), "name": "test-catalog-custom"})
    try:
        register_platform(mine)
        assert get_platform("test-catalog-custom") is mine
        with pytest.raises(InputError, match="already registered"):
            register_platform(mine)
    finally:
        if "test-catalog-custom" in PLATFORMS.names():
            PLATFORMS.unregister("test-catalog-custom")
    with pytest.raises(InputError, match="already registered"):
        register_platform(Platform.from_json(lam.to_json()))
    with pytest.raises(InputError, match="expects a Platform"):
        register_platform(lam.to_json())


def test_bad_platform_definitions_are_refused(lam):
    data = lam.to_json()
    with pytest.raises(InputError, match="kind"):
        Platform.from_json({**data, "kind": "mainframe"})
    with pytest.raises(InputError, match="β|beta|overlap_slowdown"):
        Platform.from_json({**data, "overlap_slowdown": 0.5})
    with pytest.raises(InputError, match="outside its memory range"):
        Platform.from_json({**data, "max_memory_mb": 4096})
    with pytest.raises(InputError, match="lacks"):
        Platform.from_json({"name": "x"})


# -- sources and serialisation ---------------------------------------------------------------

@pytest.mark.parametrize("name", TARGETS)
def test_every_number_has_a_source(name):
    platform = get_platform(name)
    assert platform.missing_sources() == []
    assert "tier.price_per_s" in platform.numeric_fields()


def test_missing_sources_are_reported(lam):
    sources = dict(lam.sources)
    del sources["storage_latency_s"], sources["scaling.mb_per_vcpu"]
    stripped = Platform.from_json({**lam.to_json(), "sources": sources})
    assert stripped.missing_sources() == ["storage_latency_s", "scaling.mb_per_vcpu"]


@pytest.mark.parametrize("name", TARGETS)
def test_platform_json_round_trip(name):
    platform = get_platform(name)
    text = json.dumps(platform.to_json())
    again = Platform.from_json(json.loads(text))
    assert again == platform
    assert again.sources == platform.sources
    assert again.tier(platform.tiers[0].memory_mb) == platform.tiers[0]


def test_describe_prints_every_platform():
    text = describe_platforms()
    for name in TARGETS:
        assert name in text
    assert "10240" in text and "K80" in text


def test_billing_rounds_up_to_the_granularity(lam):
    assert lam.billed_seconds(1.0004) == pytest.approx(1.001)
    assert lam.billed_seconds(1.0) == pytest.approx(1.0)
    assert get_platform("alibaba-fc").billed_seconds(0.25) == pytest.approx(0.3)
    assert get_platform("gpu-container").billed_seconds(0.2) == pytest.approx(1.0)
    tier = lam.tier(2048)
    assert lam.cost(2.0, tier, requests=3) == pytest.approx(3 * (2.0 * 2 * 0.0000166667 + 0.2e-6))


# -- compute-time model ----------------------------------------------------------------------

def test_compute_seconds_cpu_share(lam):
    # one vCPU on a one-thread profile: the host's time
    assert lam.compute_seconds(1.0, CPU1, lam.tier(1769)) == pytest.approx(1.0)
    # a two-thread profile on one vCPU: twice as long
    assert lam.compute_seconds(1.0, CPU2, lam.tier(1769)) == pytest.approx(2.0)
    # 512 MB is 512/1769 of a vCPU: 3.455x the one-thread time
    assert lam.compute_seconds(1.0, CPU1, lam.tier(512)) == pytest.approx(1769 / 512)
    # more vCPUs than profiled threads do not help: the stage keeps the thread count
    assert lam.compute_seconds(1.0, CPU2, lam.tier(10240)) == pytest.approx(1.0)
    assert lam.compute_seconds(0.0, CPU1, lam.tier(512)) == 0.0
    with pytest.raises(InputError, match="non-negative"):
        lam.compute_seconds(-1.0, CPU1, lam.tier(512))


def test_compute_seconds_cpu_speed_ratio(lam):
    faster = Platform.from_json({**lam.to_json(), "name": "fast", "cpu_speed_ratio": 2.0})
    assert faster.compute_seconds(1.0, CPU1, faster.tier(1769)) == pytest.approx(0.5)


def test_compute_seconds_gpu_tiers():
    gpu = get_platform("gpu-container")
    k80, v100 = gpu.tier(6144), gpu.tier(16384)
    assert gpu.compute_seconds(1.15, CPU1, k80) == pytest.approx(0.01)        # one K80 ~ 115 vCPUs
    assert gpu.compute_seconds(4.6, CPU2, v100) == pytest.approx(0.02)        # 2 threads x 4.6 s / 460
    on_v100 = HostInfo(device="cuda", threads=1, cpu="x", torch_version="2.13.0", gpu="Tesla V100-SXM2-16GB")
    assert gpu.compute_seconds(1.0, on_v100, k80) == pytest.approx(4.0)
    assert gpu.compute_seconds(1.0, on_v100, v100) == pytest.approx(1.0)
    on_h100 = HostInfo(device="cuda", threads=1, cpu="x", torch_version="2.13.0", gpu="NVIDIA H100 80GB HBM3")
    with pytest.raises(InputError, match="calibration"):
        gpu.compute_seconds(1.0, on_h100, k80)
    with pytest.raises(InputError, match="no GPU-to-CPU model"):
        get_platform("aws-lambda").compute_seconds(1.0, on_v100, get_platform("aws-lambda").tier(1024))


# -- calibration -----------------------------------------------------------------------------

LAYERS = ("conv1", "block1", "fc")


def _calibration(**changes) -> Calibration:
    tiers = {
        1024: TierCalibration((Linear(0.01, 0.1), Linear(0.02, 0.0), Linear(0.0, 0.05)),
                              (Linear(0.02, 0.2), Linear(0.04, 0.0), Linear(0.0, 0.1)), bandwidth_bytes_s=25e6),
        4096: TierCalibration((Linear(0.005, 0.05),) * 3, (Linear(0.01, 0.1),) * 3),
    }
    values: dict[str, Any] = dict(platform="aws-lambda", layer_names=LAYERS, tiers=tiers, graph_hash="abc123",
                  storage_latency_s=0.03, overlap_slowdown=1.1, provenance={"measured": "2026-11-20"})
    values.update(changes)
    return Calibration(**values)


def test_calibration_round_trip(tmp_path):
    calibration = _calibration()
    path = calibration.save(tmp_path / "calibration.json")
    data = json.loads(path.read_text())
    assert data["format"] == "flatpack-calibration" and data["schema_version"] == SCHEMA_VERSION
    assert data["tiers"]["1024"]["forward_s"][0] == [0.01, 0.1]
    assert Calibration.load(path) == calibration
    assert Calibration.from_json(calibration.to_json()) == calibration
    assert Calibration.from_json({**calibration.to_json(), "graph_hash": None}).graph_hash is None


def test_calibration_seconds_exact_tier_only():
    calibration = _calibration()
    assert calibration.seconds(0, 1024, 4) == pytest.approx((0.14, 0.28))
    assert calibration.seconds(2, 1024, 4) == pytest.approx((0.05, 0.1))
    assert calibration.seconds(0, 2048, 4) is None      # between calibrated tiers: the model answers
    with pytest.raises(InputError, match="outside the calibrated chain"):
        calibration.seconds(3, 1024, 4)


def _profile(name: str) -> LayerProfile:
    zero = Linear(0.0, 0.0)
    return LayerProfile(name=name, forward_s=Linear(0.1, 0.0), backward_s=Linear(0.2, 0.0), param_bytes=0,
                        grad_bytes=0, buffer_bytes=0, saved_bytes=zero, output_bytes=zero, peak_bytes=zero)


def test_calibration_overrides_the_model_in_problem(lam):
    chain = tuple(ChainLayer(name, 0, 0, 0, _profile(name)) for name in LAYERS)
    problem = Problem(chain, lam, host=CPU1, calibration=_calibration())
    assert problem.layer_seconds(0, lam.tier(1024), 4) == pytest.approx((0.14, 0.28))
    # 512 MB was not calibrated: host seconds (0.4, 0.8) through the model, 1769/512 times longer
    assert problem.layer_seconds(0, lam.tier(512), 4) == pytest.approx((0.4 * 1769 / 512, 0.8 * 1769 / 512))
    # 2048 MB has more than one vCPU for a one-thread profile: the host's seconds
    assert problem.layer_seconds(0, lam.tier(2048), 4) == pytest.approx((0.4, 0.8))


def test_calibration_applies_bandwidth_latency_and_beta(lam):
    calibrated = _calibration().apply(lam)
    assert calibrated.tier(1024).bandwidth_bytes_s == 25e6
    assert next(t for t in calibrated.tiers if t.memory_mb == 1024).bandwidth_bytes_s == 25e6
    assert calibrated.tier(2048).bandwidth_bytes_s == lam.tier(2048).bandwidth_bytes_s
    assert (calibrated.storage_latency_s, calibrated.overlap_slowdown) == (0.03, 1.1)
    assert calibrated.missing_sources() == []
    assert "calibration" in calibrated.sources["storage_latency_s"]
    with pytest.raises(InputError, match="measured on 'aws-lambda'"):
        _calibration().apply(get_platform("alibaba-fc"))


def test_calibration_matching_chain_passes():
    _calibration().check_against(list(LAYERS), "abc123", "aws-lambda")
    _calibration().check_against(list(LAYERS), None)
    _calibration(graph_hash=None).check_against(list(LAYERS), "anything")


def test_calibration_wrong_layer_name():
    with pytest.raises(InputError) as error:
        _calibration().check_against(["conv1", "block2", "fc"], "abc123")
    message = str(error.value)
    assert "layer 1" in message and "'block2'" in message and "'block1'" in message
    assert "re-run calibration" in message


def test_calibration_wrong_layer_count():
    with pytest.raises(InputError, match="covers 3 layers but the chain has 4.*layer 3: expected 'head'"):
        _calibration().check_against([*LAYERS, "head"], "abc123")
    with pytest.raises(InputError, match="covers 3 layers but the chain has 2.*layer 2: expected nothing, "
                                         "found 'fc'"):
        _calibration().check_against(list(LAYERS[:2]), "abc123")


def test_calibration_wrong_hash():
    with pytest.raises(InputError, match="graph 'abc123'.*'def456'.*re-run calibration"):
        _calibration().check_against(list(LAYERS), "def456")


def test_calibration_wrong_platform():
    with pytest.raises(InputError, match="measured on 'aws-lambda' but the target is 'alibaba-fc'"):
        _calibration().check_against(list(LAYERS), "abc123", "alibaba-fc")


def test_calibration_wrong_schema_version_and_format():
    data = _calibration().to_json()
    with pytest.raises(InputError, match="schema version 3 is not supported.*versions 1, 2"):
        Calibration.from_json({**data, "schema_version": 3})
    assert Calibration.from_json({**data, "schema_version": 1}) == _calibration()   # version 1 files still load
    with pytest.raises(InputError, match="schema version None"):
        Calibration.from_json({k: v for k, v in data.items() if k != "schema_version"})
    with pytest.raises(InputError, match="not a flatpack calibration file"):
        Calibration.from_json({**data, "format": "something-else"})
    with pytest.raises(InputError, match="not a flatpack calibration file"):
        Calibration.from_json([1, 2, 3])


def test_calibration_malformed_contents():
    data = _calibration().to_json()
    short = json.loads(json.dumps(data))
    short["tiers"]["1024"]["forward_s"].pop()
    with pytest.raises(InputError, match=r"tiers\[1024\].forward_s has 2 lines but the file names 3 layers"):
        Calibration.from_json(short)
    negative = json.loads(json.dumps(data))
    negative["tiers"]["4096"]["backward_s"][1] = [-0.1, 0.0]
    with pytest.raises(InputError, match=r"tiers\[4096\].backward_s\[1\]\[0\] must be non-negative"):
        Calibration.from_json(negative)
    with pytest.raises(InputError, match="tier key 'big'"):
        Calibration.from_json({**data, "tiers": {"big": data["tiers"]["1024"]}})
    with pytest.raises(InputError, match="lacks layers"):
        Calibration.from_json({k: v for k, v in data.items() if k != "layers"} | {"schema_version": 1})
    with pytest.raises(InputError, match="at least one layer, or is a target calibration"):
        Calibration.from_json({k: v for k, v in data.items() if k != "layers"})
    with pytest.raises(InputError, match="beta"):
        Calibration.from_json({**data, "overlap_slowdown": 0.9})


def test_calibration_unreadable_files(tmp_path):
    with pytest.raises(InputError, match="calibration file .*missing.json does not exist"):
        Calibration.load(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        Calibration.load(broken)
