"""Hypothesis profiles for the whole test suite.

``ci`` (loaded when the ``CI`` environment variable is set, as CI sets it): derandomized,
so every run tests the same examples; 200 examples per test unless a test asks for fewer;
no deadline (the first compile of a session warms torch up). ``dev`` (otherwise): 30
random examples. ``soak`` (``benchmarks/property_trials.py`` selects it): 1,000 random
examples per test, so the properties that ask for ``strategies.scaled(N)`` run 5 N; the
long trials live there, not in the suite. ``HYPOTHESIS_PROFILE=<name>`` picks a profile
explicitly.

On a failure Hypothesis prints the failing spec and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# each xdist worker starts its own SeaweedFS and moto servers and imports torch (~1 GB with
# them); past 4 the integration tests' own processes already fill the cores
MAX_XDIST_WORKERS = 4

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    database=None,
)
settings.register_profile(
    "dev",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "soak",
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    database=None,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): one worker per core, at most MAX_XDIST_WORKERS."""
    # start-up time: the catalog is read only when xdist asks (it imports no torch)
    from flatpack.platform.catalog import host_cores

    return min(MAX_XDIST_WORKERS, host_cores())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests on the shared Ray cluster (``ray_cluster``, a session fixture: three raylets,
    ~20 s to start) run first. xdist's worksteal hands each worker a contiguous half of the
    collection and steals from the tail of a queue, so tests at the head stay on one worker
    and one cluster serves them all; where they sat mid-collection, both workers started a
    cluster of their own in some runs (issue 42)."""
    items.sort(key=lambda item: "ray_cluster" not in getattr(item, "fixturenames", ()))
