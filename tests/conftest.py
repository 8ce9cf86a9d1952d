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

from hypothesis import HealthCheck, settings

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

