"""What a gpu-container training call costs on this machine with its ranks forked from the
deployment's fork server (``flatpack.runtime.forked``, the ``rank`` program) against fresh
interpreters (``FLATPACK_FORK_SERVER=0``), in one run.

The plan is the integration tests' 5-rank one (3 stages × (2, 1, 2) replicas over gloo, the
first two stages sharing a weight); each call trains 2 iterations of 12 samples, so a call is
almost all start-up: each fresh rank imports torch and the packaged flatpack, and pays
``torch._dynamo``'s import at its first optimizer step. ``--calls`` calls of each kind,
alternated (fresh, forked, fresh, ...) so that both see the same load. Each kind has its own
deployment; the forked one's first call also starts its fork server, and is reported apart.
Prints per kind the median, min and max wall seconds of a call, the host's load, and the
ratio of the medians.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/rank_start.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flatpack.backends import gpu_container
from flatpack.runtime import forked
from tests.integration.test_gpu_container import batches, compiled_with

OPTIMIZER = {"name": "adam", "lr": 0.01}


def timed_call(deployment: gpu_container.GpuContainerDeployment, fork_server: str) -> float:
    """Seconds of one ``train`` call of 2 iterations with ``FLATPACK_FORK_SERVER`` set to
    ``fork_server`` (read when each rank starts)."""
    os.environ[forked.FORK_SERVER_ENV] = fork_server
    began = time.perf_counter()
    deployment.train(batches(2), iterations=2, optimizer=OPTIMIZER)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description="gpu-container train() with forked against fresh ranks")
    parser.add_argument("--calls", type=int, default=5, help="calls of each kind (default 5)")
    args = parser.parse_args()
    if forked.unavailable_reason() is not None:
        raise SystemExit(f"no fork server here: {forked.unavailable_reason()}")
    compiled = compiled_with((2, 1, 2), micro_batches=4)
    seconds: dict[str, list[float]] = {"fresh": [], "forked": []}
    with gpu_container.deploy(compiled, backend="gloo") as fresh, \
            gpu_container.deploy(compiled, backend="gloo") as forking:
        first_forked = timed_call(forking, "1")     # starts the deployment's fork server
        for _ in range(args.calls):
            seconds["fresh"].append(timed_call(fresh, "0"))
            seconds["forked"].append(timed_call(forking, "1"))
    load = os.getloadavg()[0]
    print(f"gpu-container train(): 5 gloo ranks, 2 iterations, {args.calls} calls of each kind, alternated; "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    for kind, values in seconds.items():
        print(f"  {kind:<6}  median {statistics.median(values):6.2f} s  min {min(values):6.2f}  "
              f"max {max(values):6.2f}")
    print(f"  the forked deployment's first call, its fork server's start included: {first_forked:.2f} s")
    ratio = statistics.median(seconds["fresh"]) / statistics.median(seconds["forked"])
    print(f"  fresh / forked (medians): {ratio:.1f}x")


if __name__ == "__main__":
    main()
