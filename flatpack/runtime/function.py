"""What holds a function process to its tier and gives it its stage: the environment a function
reads (its :class:`Role`, the store, baked artifacts), its peak memory, its CPU share and
emulated clock, its bandwidth to the store, and its verified stage module.

Shared by the roles a function runs (``runtime.worker``: train and infer; ``forkjoin``,
``profile_function``, ``calibrate_function``), which is why it is not part of ``worker``:
they would import each other.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from flatpack.errors import ArtifactError
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store
from flatpack.stage.artifact import MANIFEST_FILE, SOURCE_FILE, WEIGHTS_FILE, build_module, parse_stage, stage_dirname
from flatpack.stage.integrity import INDEX_FILE, Index, check_digest, verify_files

ARTIFACTS_ENV = "FLATPACK_ARTIFACTS"   # a directory of stage_XXX artifacts baked into the function's image


@dataclass(frozen=True)
class Role:
    """One function invocation: which stage replica, from which iteration to which (end
    exclusive), and which attempt (a restart or a self re-invocation counts up)."""

    spec_key: str
    stage: int
    replica: int
    start_iteration: int
    end_iteration: int
    attempt: int = 0
    kind: str = "train"      # "train" | "infer-master" | "infer-worker"
    # the sha256 of the artifact's index (Compiled.digest): the worker checks what it loads
    # against it. It travels in the invocation, never through the store, so that whoever can
    # write the store cannot also vouch for what they wrote.
    digest: str = ""

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, raw: str) -> Role:
        return cls(**json.loads(raw))

    @property
    def worker(self) -> str:
        return f"s{self.stage}r{self.replica}"


class OutOfMemory(Exception):
    def __init__(self, peak_bytes: int, limit_bytes: int, task: str) -> None:
        super().__init__(f"peak {peak_bytes} bytes over the {limit_bytes}-byte tier during {task}")
        self.peak_bytes, self.limit_bytes, self.task = peak_bytes, limit_bytes, task

def peak_rss_bytes() -> int:
    """The process's peak resident set since it started (Linux VmHWM; elsewhere ru_maxrss)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024

def cpu_share(vcpus: float | None, threads: int) -> float:
    """The share of a core each of ``threads`` compute threads gets on a tier of ``vcpus``
    (the catalog's compute model: speed ∝ min(v, threads)/threads); 1 unthrottled (None)."""
    return 1.0 if vcpus is None else min(vcpus, threads) / threads


def cpu_throttle(vcpus: float | None, threads: int) -> Callable[[Callable[[], Any]], Any]:
    """Runs a computation and stretches it to CPU time / share when the tier has less than
    one vCPU per thread (:func:`cpu_share`)."""
    share = cpu_share(vcpus, threads)

    def run(fn: Callable[[], Any]) -> Any:
        if share >= 1.0:
            return fn()
        wall, cpu = time.perf_counter(), time.thread_time()
        result = fn()
        stretched = (time.thread_time() - cpu) / share
        remaining = stretched - (time.perf_counter() - wall)
        if remaining > 0:
            time.sleep(remaining)
        return result

    return run

def emulated_clock(vcpus: float, threads: int) -> Callable[[], float]:
    """A clock of a tier with ``vcpus`` running ``threads`` compute threads: CPU seconds over
    the CPUs it may use, min(vcpus, threads) (the catalog's compute model). An emulated tier
    times by it, not by wall time: the host's other processes (2 shared cores) stretch wall
    time, but not the CPU time a computation needs, so a tier with a whole vCPU is not
    measured slower than it is while the machine is busy. At one thread the CPU seconds are
    the calling thread's (``time.thread_time``), what :func:`cpu_throttle` stretches a
    stage's compute by and what the host profile is timed by (``profiler.host_clock``): the
    process's CPU time would also count its other threads, e.g. torch's intra-op pool
    spinning after earlier parallel work, and read a computation as slower than it is."""
    usable = min(vcpus, threads)
    cpu_seconds = time.thread_time if threads == 1 else time.process_time
    return lambda: cpu_seconds() / usable

def artifact_index(store: Store, keys: RunKeys, digest: str, baked: str | None) -> Index:
    """The artifact's index, checked against ``digest`` (from the invocation) before it is
    parsed: from the image when one is baked there, else from the store."""
    if not digest:
        raise ArtifactError("this invocation carries no artifact digest (Role.digest), so the stage cannot be "
                            "verified and will not be loaded; deploy with this flatpack version, which puts "
                            "Compiled.digest in every invocation")
    baked_index = os.path.join(baked, INDEX_FILE) if baked else None
    if baked_index and os.path.isfile(baked_index):
        with open(baked_index, "rb") as file:
            raw, where = file.read(), baked_index
    else:
        raw, where = store.get(keys.artifact_index()), f"store:{keys.artifact_index()}"
    check_digest(raw, digest, where)
    return Index.parse(raw, where)

def load_module(store: Store, keys: RunKeys, stage: int, digest: str) -> torch.nn.Module:
    """The stage's module, from the artifacts baked into the function's image
    (``FLATPACK_ARTIFACTS``, the cloud backends) or else from the store (the local backend).

    Verified before its source runs: the index against ``digest`` (the invocation's, never
    the store's), then the stage's files against the index (``tests/security/test_worker.py``).
    """
    baked = os.environ.get(ARTIFACTS_ENV)
    prefix = stage_dirname(stage)
    names = (MANIFEST_FILE, SOURCE_FILE, WEIGHTS_FILE)
    index = artifact_index(store, keys, digest, baked)
    if baked and os.path.isdir(os.path.join(baked, prefix)):
        where = baked
        contents = {}
        for name in names:
            with open(os.path.join(baked, prefix, name), "rb") as file:
                contents[name] = file.read()
    else:
        where = f"store:{keys.run}/artifacts"
        contents = {name: store.get(keys.artifact(stage, name)) for name in names}
    verify_files(index, {f"{prefix}/{name}": data for name, data in contents.items()}, where)
    artifact = parse_stage(contents, f"{where}/{prefix}")
    return build_module(artifact, f"<flatpack stage {stage}>")

def tier_link(base: Store, bandwidth_bytes_s: float | None) -> Store:
    """The function's view of the store: its tier's bandwidth each way (full duplex)."""
    if bandwidth_bytes_s is None:
        return base
    # start-up time: only a tier with a bandwidth limit needs the token buckets
    from flatpack.runtime.throttle import Throttled

    return Throttled(base, bandwidth_bytes_s, bandwidth_bytes_s)
