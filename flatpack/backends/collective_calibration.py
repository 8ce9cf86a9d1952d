"""``flatpack calibrate --target gpu-container``: what the containers' ranks pay to move bytes.

A GPU-container plan's time depends on two transfers the catalog can only assume (1 Gbit/s,
1 ms; ``catalog.GPU_CONTAINER_SOURCES``): the activations a stage sends the next (Hydrozoa's
c_p = a/D) and the all-reduce of a stage's gradients among its replicas (Hydrozoa §3.4's
T^(D) = 2(A − 1)(|p|/(A·D) + α|p|/A + β), whose α and β the paper fits by regression on a
few runs). This module starts ``ranks`` ranks of :mod:`flatpack.runtime.collective_probe` on
this machine — the processes, backend and device that ``gpu_container.deploy`` runs a plan's
ranks with (gloo on the CPU, NCCL with one GPU per rank, or gloo ranks sharing the GPU) —
and fits the link's latency and bandwidth D and the all-reduce's α, β to what they measured
(``cost.collectives.fit_ring``). The calibration it writes sets every requested tier's D and
the platform's message latency, and Hydrozoa's model and planner price an all-reduce with the
fitted equation anchored to the measured all-reduces (``cost.collectives.measured_terms``).

What it does not measure here: a cluster's network between machines. For that, run the same
probe in the cluster — ``torchrun ... -m flatpack.runtime.collective_probe --out probe.json``;
the gpu-container image ships it (``gpu_container.RANK_ENTRIES``) — and turn rank 0's file into
a calibration with ``flatpack calibrate --target gpu-container --from-probe probe.json``
(:func:`calibration_from_probe`). Nor the GPU's compute speed (profile the model on the GPU).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from flatpack.backends import profiling
# how a rendezvous port is found and a rank's log is quoted
from flatpack.backends.gpu_container import _free_port as free_port, _tail
from flatpack.errors import InputError, PlanError, RunFailure
from flatpack.partitioner.cost.collectives import fit_ring
from flatpack.platform.calibration import Calibration, CollectiveFit, TargetInfo, TierCalibration
from flatpack.platform.catalog import get_platform
from flatpack.profiler import host_info
from flatpack.runtime.collective_probe import DEFAULT_REPEATS, DEFAULT_SIZES, RESULT_FORMAT
from flatpack.sources import ROOT
from flatpack.version import __version__

PROBE_MODULE = "flatpack.runtime.collective_probe"
# all-reduces among 2, 3 and 4 ranks: two counts or more tell the terms that grow with the
# ranks (the ring's) from those that do not (the copies), and plans replicate stages 2 to 4 ways
DEFAULT_RANKS = 4
LOG_TAIL_LINES = 20


def choose_transport(ranks: int, backend: str | None, device: str | None) -> tuple[str, str]:
    """(backend, device) of the probe ranks, checked before any process starts: as given,
    else NCCL when every rank can have its own GPU, gloo ranks sharing the GPU when there are
    fewer GPUs than ranks, gloo on the CPU without a GPU — what a plan's ranks would run with."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise InputError(f"--ranks {ranks!r}: an all-reduce and a message need two ranks or more")
    if backend not in (None, "gloo", "nccl"):
        raise InputError(f"--backend {backend!r} is not one of gloo, nccl")
    if device not in (None, "cpu", "cuda"):
        raise InputError(f"--device {device!r} is not one of cpu, cuda")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = backend or ("nccl" if gpus >= ranks and device != "cpu" else "gloo")
    device = device or ("cuda" if backend == "nccl" or gpus else "cpu")
    if device == "cuda" and not gpus:
        raise InputError(f"--device cuda needs a GPU, and torch {torch.__version__} sees none here; use --device cpu "
                         "(gloo)")
    if backend == "nccl" and device != "cuda":
        raise InputError("NCCL moves CUDA tensors only: use --device cuda with --backend nccl, or --backend gloo")
    if backend == "nccl" and gpus < ranks:
        raise InputError(f"NCCL needs one GPU per rank: {ranks} ranks, {gpus} GPU(s) here. Use --ranks {gpus} "
                         "or fewer, or --backend gloo (the ranks share the GPU)" if gpus >= 2 else
                         f"NCCL needs one GPU per rank: {ranks} ranks, {gpus} GPU(s) here. Use --backend gloo "
                         "(the ranks share the GPU)")
    return backend, device


def measure(*, ranks: int = DEFAULT_RANKS, backend: str | None = None, device: str | None = None,
            sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS, timeout_s: float = 300.0,
            threads: int = 1) -> dict[str, Any]:
    """Runs the probe's ``ranks`` ranks on 127.0.0.1 and returns rank 0's result (medians per size)."""
    backend, device = choose_transport(ranks, backend, device)
    if len(set(sizes)) < 2 or any(size < 4 for size in sizes):
        raise InputError(f"sizes {list(sizes)}: give at least two different message sizes of 4 bytes or more")
    sizes = sorted(set(sizes))   # the probe writes its medians in increasing size
    if repeats < 1 or timeout_s <= 0:
        raise InputError(f"repeats must be at least 1 and the timeout positive, got {repeats} and {timeout_s}")
    source_root = ROOT.parent
    with tempfile.TemporaryDirectory(prefix="flatpack-collective-") as scratch:
        directory = Path(scratch)
        out = directory / "probe.json"
        port = free_port()
        processes = {}
        for rank in range(ranks):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "PYTHONPATH": os.pathsep.join(filter(None, (str(source_root), os.environ.get("PYTHONPATH")))),
                   "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
            command = [sys.executable, "-m", PROBE_MODULE, "--backend", backend, "--device", device,
                       "--sizes", ",".join(map(str, sizes)), "--repeats", str(repeats), "--out", str(out)]
            with open(directory / f"rank_{rank}.log", "wb") as log:
                processes[rank] = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   stdin=subprocess.DEVNULL)
        _wait(processes, directory, timeout_s)
        result = json.loads(out.read_text())
    if result.get("format") != RESULT_FORMAT:
        raise RunFailure(f"the collective probe wrote no {RESULT_FORMAT} result")
    return result


def _wait(processes: dict[int, subprocess.Popen], directory: Path, timeout_s: float) -> None:
    """Waits for every rank; on the first failure or the deadline stops the others and
    raises with the failed rank's log tail."""
    def log(rank: int) -> str:
        return _tail(directory / f"rank_{rank}.log", LOG_TAIL_LINES)

    deadline = time.monotonic() + timeout_s
    try:
        while any(process.poll() is None for process in processes.values()):
            failed = [rank for rank, process in processes.items() if process.returncode not in (None, 0)]
            if failed:
                raise RunFailure(f"collective probe rank {failed[0]} failed:\n{log(failed[0])}")
            if time.monotonic() > deadline:
                raise RunFailure(f"the collective probe did not finish in {timeout_s:g} s (raise --timeout); rank 0's "
                                 f"log:\n{log(0)}")
            time.sleep(0.05)
        failed = [rank for rank, process in processes.items() if process.returncode != 0]
        if failed:
            raise RunFailure(f"collective probe rank {failed[0]} failed:\n{log(failed[0])}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def fitted(result: Mapping[str, Any], source: str = "the collective probe's result") -> CollectiveFit:
    """The probe's medians and the ring's terms fitted to them; a result that is not the
    probe's (a file edited, truncated or from another program) is refused naming ``source``."""
    if not isinstance(result, Mapping) or result.get("format") != RESULT_FORMAT:
        raise InputError(f"{source} is not a {RESULT_FORMAT} result (python -m {PROBE_MODULE} writes one)")
    try:
        sizes = [int(n) for n in result["sizes_bytes"]]
        all_reduce = {int(count): tuple(float(t) for t in seconds)
                      for count, seconds in result["all_reduce_s"].items()}
        point_to_point = tuple(float(t) for t in result["point_to_point_s"])
        ranks = int(result["ranks"])
        terms = fit_ring(sizes, point_to_point, all_reduce)
        fit = CollectiveFit(ranks=ranks, backend=str(result["backend"]), device=str(result["device"]),
                            device_name=str(result["device_name"]), sizes_bytes=tuple(sizes),
                            point_to_point_s=point_to_point, all_reduce_s=all_reduce, **terms)
        # the checks a calibration file's collective section gets where it is read
        return CollectiveFit.from_json(fit.to_json())
    except (KeyError, TypeError, ValueError, AttributeError, PlanError, InputError) as error:
        detail = f"lacks {error}" if isinstance(error, KeyError) else str(error)
        raise InputError(f"{source}: {detail}; measure again with python -m {PROBE_MODULE}") from error


def calibrate_collective(target: str = "gpu-container", *, tiers: Sequence[int] | None = None,
                         out: str | os.PathLike | None = None, ranks: int = DEFAULT_RANKS, backend: str | None = None,
                         device: str | None = None, sizes: Sequence[int] = DEFAULT_SIZES,
                         repeats: int = DEFAULT_REPEATS, timeout_s: float = 300.0,
                         report: Callable[[str], None] | None = None) -> Calibration:
    """Measures the collective of ``target`` (a container platform) on this machine and
    returns the :class:`Calibration` (also written atomically to ``out``): every tier of
    ``tiers`` (default the platform's) gets the measured bandwidth D, the platform the
    message latency, and ``collective`` the fit."""
    memory_sizes = _container_tiers(target, tiers)
    backend, device = choose_transport(ranks, backend, device)
    say = report or (lambda line: None)
    say(f"timing messages and all-reduces between {ranks} {backend} ranks on {device} "
        f"({len(sizes)} sizes, {repeats} rounds each)")
    result = measure(ranks=ranks, backend=backend, device=device, sizes=sizes, repeats=repeats, timeout_s=timeout_s)
    fit = fitted(result)
    where = (f"{ranks} {fit.backend} ranks on this machine (127.0.0.1, {fit.device_name}): the link and all-reduce of "
             "gpu-container runs here, not a cluster's network")
    return _write(_calibration(target, memory_sizes, fit, where, int(result.get("repeats", repeats))), out, say)


def calibration_from_probe(probe: str | os.PathLike, target: str = "gpu-container", *,
                           tiers: Sequence[int] | None = None, out: str | os.PathLike | None = None,
                           report: Callable[[str], None] | None = None) -> Calibration:
    """The calibration of what the probe measured elsewhere — in the cluster, started there
    with ``torchrun --nnodes N ... -m flatpack.runtime.collective_probe --out probe.json``
    (the gpu-container image ships it) — read from rank 0's ``probe``, fitted as
    :func:`calibrate_collective` fits what it measures here."""
    memory_sizes = _container_tiers(target, tiers)
    path = Path(probe)
    try:
        result = json.loads(path.read_text())
    except OSError as error:
        raise InputError(f"cannot read the probe's result {path}: {error.strerror or error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path} is not JSON ({error}): give the file rank 0 of the probe wrote") from error
    fit = fitted(result, str(path))
    where = (f"{fit.ranks} {fit.backend} ranks measured elsewhere ({fit.device_name}, torch "
             f"{result.get('torch', '?')}), read from {path.name}")
    return _write(_calibration(target, memory_sizes, fit, where, int(result.get("repeats", 0))), out,
                  report or (lambda line: None))


def _container_tiers(target: str, tiers: Sequence[int] | None) -> tuple[int, ...]:
    platform = get_platform(target)
    if platform.kind != "container":
        raise InputError(f"{target} is a {platform.kind} platform: its workers talk through the store, which "
                         "`flatpack calibrate` measures without --ranks, --backend, --device or --from-probe")
    return profiling._tier_sizes(platform, tiers)


def _calibration(target: str, memory_sizes: Sequence[int], fit: CollectiveFit, where: str,
                 repeats: int) -> Calibration:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return Calibration(
        platform=target, layer_names=(),
        tiers={memory_mb: TierCalibration(bandwidth_bytes_s=fit.bandwidth_bytes_s) for memory_mb in memory_sizes},
        target=TargetInfo(target, now, host_info().cpu, __version__, None, 1),
        storage_latency_s=fit.latency_s, collective=fit.to_json(),
        provenance={"where": where,
                    "method": (f"runtime.collective_probe: ping-pong messages (half the round trip) and all-reduces "
                               f"(the last rank to arrive, per round) at {len(fit.sizes_bytes)} sizes, median of "
                               f"{repeats} rounds; lines fitted on relative error (cost.collectives.fit_line), alpha "
                               "and beta from the ring all-reduce at the measured D (fit_ring); plans take the "
                               "measured all-reduces with the equation's shape beyond them (measured_terms)")})


def _write(calibration: Calibration, out: str | os.PathLike | None, say: Callable[[str], None]) -> Calibration:
    if out is not None:
        calibration.save(out)
        say(f"wrote {out}")
    return calibration


def collective_summary(fit: CollectiveFit) -> str:
    return (f"collective: {fit.ranks} {fit.backend} ranks on {fit.device_name}: message latency "
            f"{fit.latency_s * 1e3:.3f} ms, bandwidth {fit.bandwidth_bytes_s / 1e6:.1f} MB/s; all-reduce among "
            f"{', '.join(map(str, sorted(fit.all_reduce_s)))} ranks: alpha {fit.alpha_s_per_byte * 1e9:.3f} ns/byte, "
            f"beta {fit.beta_s * 1e3:.3f} ms/round, per call {fit.per_call_s * 1e3:.3f} ms, copies "
            f"{fit.copy_s_per_byte * 1e9:.3f} ns/byte (this equation is within {fit.ring_error:.0%} of every measured "
            "size and count; plans are priced with it anchored to the measurements, "
            "cost.collectives.measured_terms)")
