"""Random small solver problems: chains of a few profiled layers, platforms with a few tiers
that differ in speed, bandwidth and price, and workloads — small enough for brute force."""

from __future__ import annotations

from hypothesis import strategies as st

from flatpack.ir.profile import HostInfo, LayerProfile, Linear
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.problem import ChainLayer, Problem
from flatpack.partitioner.workload import Workload
from flatpack.units import MIB
from flatpack.platform.catalog import Platform, Tier

HOST = HostInfo(device="cpu", threads=2, cpu="test", torch_version="test")
BASE = 64 * MIB


def make_layer(name: str, forward: float, backward: float, params_mib: float, saved_mib: float,
               output_mib: float, fixed_s: float = 0.0) -> LayerProfile:
    """Times and activations grow with the micro-batch (seconds and MiB per sample)."""
    params = int(params_mib * MIB)
    return LayerProfile(
        name=name, forward_s=Linear(forward, fixed_s), backward_s=Linear(backward, fixed_s),
        param_bytes=params, grad_bytes=params, buffer_bytes=0, saved_bytes=Linear(saved_mib * MIB),
        output_bytes=Linear(output_mib * MIB), peak_bytes=Linear(saved_mib * MIB),
        optimizer_state_bytes={"sgd": 0, "sgd-momentum": params, "adam": 2 * params},
        inference_s=Linear(forward * 0.8, fixed_s),
    )


def make_platform(tiers, kind: str = "serverless", cap_mib_s: float | None = None, latency: float = 0.01,
                  granularity: float = 0.001) -> Platform:
    """``tiers``: (memory MiB, vCPUs, bandwidth MiB/s, dollars per second)."""
    return Platform(
        name=f"synthetic-{kind}", kind=kind,
        tiers=tuple(Tier(memory, vcpus, bandwidth * MIB, price) for memory, vcpus, bandwidth, price in tiers),
        min_memory_mb=min(t[0] for t in tiers), max_memory_mb=max(t[0] for t in tiers),
        storage_latency_s=latency, price_per_request=2e-7, billing_granularity_s=granularity, timeout_s=None,
        base_memory_bytes=BASE, overlap_slowdown=1.5,
        aggregate_bandwidth_bytes_s=None if cap_mib_s is None else cap_mib_s * MIB,
    )


def make_problem(layers, platform: Platform, workload: Workload, **options) -> Problem:
    profiles = [make_layer(f"l{index}", *spec) for index, spec in enumerate(layers)]
    chain = tuple(ChainLayer(p.name, p.param_bytes, 0, 0, p) for p in profiles)
    return Problem(chain, platform, workload, host=HOST, options=ProblemOptions.of(options),
                   input_bytes=Linear(1.0 * MIB))


@st.composite
def tiers(draw, count_range=(1, 3)):
    """Increasing memory; vCPUs 1 or 2 (the host profiled with 2 threads, so 1 vCPU is half
    speed); bandwidth and price drawn independently so that no tier need dominate another."""
    count = draw(st.integers(*count_range))
    sizes = sorted(draw(st.sets(st.sampled_from([128, 256, 512, 1024, 2048]), min_size=count, max_size=count)))
    return [(size, draw(st.sampled_from([1, 2])), draw(st.sampled_from([20.0, 50.0, 100.0])),
             size / 1024 * draw(st.sampled_from([1e-5, 1.5e-5, 2e-5]))) for size in sizes]


@st.composite
def layer_specs(draw, min_layers: int = 1, max_layers: int = 4):
    count = draw(st.integers(min_layers, max_layers))
    return [(draw(st.floats(0.001, 0.2)), draw(st.floats(0.001, 0.4)), draw(st.floats(0.0, 60.0)),
             draw(st.floats(0.0, 8.0)), draw(st.floats(0.0, 8.0)), draw(st.sampled_from([0.0, 0.01])))
            for _ in range(count)]


@st.composite
def training_problems(draw, kind: str = "serverless", max_layers: int = 4, cap: bool | None = None):
    """FuncPipe-style training on a small serverless (or container) platform."""
    layers = draw(layer_specs(max_layers=max_layers))
    use_cap = draw(st.booleans()) if cap is None else cap
    platform = make_platform(draw(tiers()), kind=kind, cap_mib_s=draw(st.sampled_from([60.0, 150.0])) if use_cap
                             else None)
    batch = draw(st.sampled_from([4, 8, 16]))
    micro = draw(st.sampled_from([m for m in (1, 2, 4) if m <= batch]))
    workload = Workload("train", batch=batch, micro_batches=micro,
                        optimizer=draw(st.sampled_from(["sgd", "sgd-momentum", "adam"])),
                        sync=draw(st.sampled_from(["pipelined", "lambdaml"])))
    space_kwargs = {"replicas": draw(st.sampled_from([(1,), (1, 2), (1, 2, 4)]))}
    if draw(st.booleans()):
        space_kwargs["micro_batches"] = tuple(m for m in (1, 2, 4) if m <= batch)
    return make_problem(layers, platform, workload, **space_kwargs)


@st.composite
def inference_problems(draw, max_layers: int = 4):
    """Gillis-style fork-join serving of one request."""
    layers = draw(layer_specs(max_layers=max_layers))
    platform = make_platform(draw(tiers()))
    workload = Workload("infer", batch=draw(st.sampled_from([1, 4])))
    return make_problem(layers, platform, workload, max_workers=draw(st.sampled_from([0, 2, 3])))
