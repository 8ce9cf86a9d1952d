"""How long a local function takes to start: forked by the fork server
(``flatpack.runtime.forked``) beside a fresh ``python -m flatpack.runtime.worker``, in one run.

One local deployment (its own S3 server on 127.0.0.1), and ``--count`` functions of each
kind, alternated (fresh, forked, fresh, ...) so that both see the same load on the host. Each
function is a real worker on its real path: it verifies nothing and trains nothing, but it
starts, makes its store client, reads its role's spec from the store (a spec that does not
parse, placed there by this script), writes its status record and exits. A function's start
is the time from the invoker's launch call to its exit being seen (polled every millisecond):
an upper bound of the start, which includes one GET and one PUT to the store.

The fork server's own start (its imports, once per invoker process) is timed apart and is not
in any function's figure; a fresh interpreter pays its imports in each. Prints per kind the
median, the 10th and 90th percentiles, the min and max of the wall seconds and of the
function's CPU seconds (user + system, which a loaded host does not stretch as it does the
wall time), the host's load, and the ratio of the wall medians.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/function_start.py``.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):   # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.runtime import forked
from flatpack.backends.functions import Invocation
from flatpack.runtime.function import Role

POLL_S = 0.001


def start_seconds(launch: Callable[[Role], Invocation], role: Role) -> tuple[float, float]:
    """Seconds from ``launch(role)`` to the function's exit, and the CPU seconds the function
    used (user + system: what the host's load does not stretch); the function must fail as
    expected (exit code 1: its spec does not parse)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    process = launch(role)
    while (code := process.poll()) is None:
        time.sleep(POLL_S)
    seconds = time.perf_counter() - began
    if code != 1:
        raise SystemExit(f"a function ended with code {code}, not 1 (its spec should not parse); see its log")
    if isinstance(process, forked.ForkedProcess):   # the fork server's child: the server measured it
        return seconds, process.cpu_seconds or 0.0
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)   # this process's child, reaped by poll()
    return seconds, (reaped.ru_utime + reaped.ru_stime) - (children.ru_utime + children.ru_stime)


def summary(name: str, seconds: list[float]) -> str:
    ordered = sorted(seconds)
    tenth, ninetieth = (statistics.quantiles(ordered, n=10)[index] for index in (0, 8))
    return (f"{name:<32} median {statistics.median(ordered):7.3f} s   p10 {tenth:7.3f}   p90 {ninetieth:7.3f}   "
            f"min {ordered[0]:7.3f}   max {ordered[-1]:7.3f}   (n={len(ordered)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--count", type=int, default=20, help="functions of each kind (default 20)")
    args = parser.parse_args()
    if forked.unavailable_reason() is not None:
        raise SystemExit(f"no fork server here: {forked.unavailable_reason()}")
    compiled = flatpack.compile(nn.Sequential(nn.Linear(8, 8)), (torch.zeros(2, 8),), stages=1)
    began = time.perf_counter()
    deployment = local.deploy(compiled)
    with deployment:
        spec_key = f"{deployment.keys.run}/bench/spec"
        deployment.store.put(spec_key, b"not a run spec")
        # the first forked function waits for the server's imports: timed apart
        first, _ = start_seconds(deployment.launch, Role(spec_key, 0, 0, 0, 1, attempt=0, digest=deployment.digest))
        print(f"fork server started and its first function ran in {first:.2f} s "
              f"({time.perf_counter() - began:.2f} s from deploy)")
        fresh, forked_starts = [], []
        for index in range(1, args.count + 1):
            fresh.append(start_seconds(deployment.launch_cold,
                                       Role(spec_key, 1, index, 0, 1, attempt=index, digest=deployment.digest)))
            forked_starts.append(start_seconds(deployment.launch,
                                               Role(spec_key, 2, index, 0, 1, attempt=index, digest=deployment.digest)))
    print(f"host: {os.cpu_count()} CPUs, load average {' '.join(f'{load:.1f}' for load in os.getloadavg())}")
    for name, runs in (("fresh interpreter", fresh), ("forked (fork server)", forked_starts)):
        print(summary(f"{name}, wall", [wall for wall, _ in runs]))
        print(summary(f"{name}, CPU", [cpu for _, cpu in runs]))
    ratio = statistics.median(wall for wall, _ in fresh) / statistics.median(wall for wall, _ in forked_starts)
    print(f"ratio of the wall medians: {ratio:.1f}x")


if __name__ == "__main__":
    main()
