"""The ray target's platform and capacity checks, from a cluster description (no Ray needed:
``ray.nodes()``'s records are plain dicts); the cluster itself is tested in
tests/integration/test_ray_backend.py."""

from __future__ import annotations

from typing import Iterator

import pytest

from flatpack.backends import ray as ray_backend
from flatpack.errors import InputError
from flatpack.platform.catalog import (RAY_PRICE_PER_GB_S, RAY_PRICE_PER_VCPU_S, RayCluster, RayNode, get_platform,
                                       use_ray_cluster)
from flatpack.units import GIB

NODES = [{"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 1.0, "memory": 2.0 * GIB}},
         {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0, "memory": 6.0 * GIB}}]


@pytest.fixture
def cluster(monkeypatch) -> Iterator[RayCluster]:
    for name in ray_backend.PRICE_ENV.values():
        monkeypatch.delenv(name, raising=False)
    described = ray_backend.read_cluster(NODES, address="test")
    use_ray_cluster(described)
    try:
        yield described
    finally:
        use_ray_cluster(None)


def test_the_largest_node_bounds_a_tier_and_prices_default_to_fargates(cluster):
    platform = get_platform("ray")
    assert platform.max_memory_mb == 6144
    assert platform.tier(6144).vcpus == pytest.approx(6144 / 1769)
    assert max(tier.memory_mb for tier in platform.tiers) == 6144
    tier = platform.tier(1769)
    assert tier.vcpus == 1.0
    assert tier.price_per_s == pytest.approx(RAY_PRICE_PER_VCPU_S + 1769 / 1024 * RAY_PRICE_PER_GB_S)
    assert platform.missing_sources() == []
    assert "Fargate" in platform.sources["scaling.price_per_vcpu_s"]
    with pytest.raises(InputError, match="allows 128-6144 MB"):
        platform.tier(8192)


def test_prices_come_from_the_arguments_then_the_environment(monkeypatch):
    monkeypatch.setenv("FLATPACK_RAY_PRICE_PER_VCPU_S", "0.001")
    monkeypatch.delenv("FLATPACK_RAY_PRICE_PER_GB_S", raising=False)
    described = ray_backend.read_cluster(NODES, price_per_gb_s=0.0)
    assert (described.price_per_vcpu_s, described.price_per_gb_s) == (0.001, 0.0)
    assert "FLATPACK_RAY_PRICE_PER_VCPU_S" in described.price_source
    monkeypatch.setenv("FLATPACK_RAY_PRICE_PER_VCPU_S", "cheap")
    with pytest.raises(InputError, match="FLATPACK_RAY_PRICE_PER_VCPU_S must be dollars per second"):
        ray_backend.read_cluster(NODES)
    with pytest.raises(InputError, match="price_per_gb_s must be a non-negative"):
        RayCluster((RayNode(1.0, GIB),), price_per_gb_s=-1.0)


def test_a_cluster_without_nodes_is_refused():
    with pytest.raises(InputError, match="no alive node with CPUs"):
        ray_backend.read_cluster([], address="ray://head:10001")


def test_without_a_cluster_the_platform_is_this_host_and_says_so():
    use_ray_cluster(None)
    platform = get_platform("ray")
    assert "no Ray cluster was read" in platform.sources["max_memory_mb"]


def test_capacity_shortfalls_are_named(cluster):
    one_vcpu = ray_backend.demand_of(1769)
    assert one_vcpu == ray_backend.Demand(1.0, 1769 << 20)
    ray_backend.check_capacity([("stage 0", 2, one_vcpu), ("stage 1", 2, one_vcpu)], cluster)
    with pytest.raises(InputError, match=r"needs 6 vCPU at once \(stage 0: 3 x 1, stage 1: 3 x 1\) and the Ray "
                                         r"cluster has 5: 1 vCPU short"):
        ray_backend.check_capacity([("stage 0", 3, one_vcpu), ("stage 1", 3, one_vcpu)], cluster)
    with pytest.raises(InputError, match="stage 1 of the plan asks for 5 vCPU"):
        ray_backend.check_capacity([("stage 0", 1, one_vcpu), ("stage 1", 1, ray_backend.Demand(5.0, 0))], cluster)
    with pytest.raises(InputError, match=r"9.00 GiB of memory at once .* 8.00 GiB: 1.00 GiB short"):
        ray_backend.check_capacity([("stage 0", 3, ray_backend.Demand(0.5, 3 * GIB))], cluster)
    assert ray_backend.demand_of(None) == ray_backend.Demand(1.0, 0)
