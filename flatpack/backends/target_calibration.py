"""``flatpack calibrate --target T``: measure the target itself, for every model, and write
the calibration file (:mod:`flatpack.platform.calibration`, schema 2) that ``compile``,
``plan`` and ``run`` take with ``--calibration``.

How: a one-layer probe model is compiled for the target and deployed with the target's
backend, as in-target profiling deploys (``profiling._default_deploy``: the local backend
for ``local`` and emulated tiers, else one function per memory tier); one calibration
function per tier (:mod:`flatpack.runtime.calibrate_function`, role kind ``"calibrate"``)
runs twice: cold, measuring everything, then warm, saying only when it was ready. The
invoker times the same compute probes on this host, at the same thread count, and
divides: the tier's compute speed relative to the profiling host, per op class. The store
requests' seconds of all tiers are fitted with ``scipy.stats.exponnorm`` (Gillis §IV-B's
delay model; its mean is FuncPipe's t_lat). The deployment is torn down afterwards, on
success or failure.

Nothing here is a model: every figure in the file is a measurement, and the provenance
says where it was taken (emulated tiers on this machine, or the platform's own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flatpack.backends import profiling, task_overheads
from flatpack.backends.collective_calibration import collective_summary
from flatpack.backends.functions import FunctionDeployment, Invocation, read_status
from flatpack.backends.request_cpu import measure_request_cpu
from flatpack.backends.profiling import _status_detail
from flatpack.compiler import compile as compile_model
from flatpack.errors import InputError, RunFailure, StoreKeyError
from flatpack.platform.calibration import (SCHEMA_VERSION, TASK_KINDS, Calibration, StoreLatency, TargetInfo,
                                           TierCalibration)
from flatpack.platform.catalog import Platform, RequestCpu, get_platform, host_cores
from flatpack.profiler import default_cache_dir, host_clock, host_info
from flatpack.runtime.calibrate_function import (IDLE_S, SMALL_PROBE_PARTS, CalibrateResult, CalibrateSpec,
                                                 calibrate_role, time_op_classes)
from flatpack.runtime.function import Role, cpu_share
from flatpack.runtime.s3server import LocalS3Server
from flatpack.version import __version__

DEFAULT_TIMEOUT_S = 300.0
COLD, WARM = 0, 1
# warm invocations after the cold one, each a further reading of the tier's compute and
# optimizer speed: the tier's figure is the median of the cold and these readings. One
# reading in five or so lands on a slow moment of one side of the ratio (five calibrations
# on one host read the 512 MB tier's conv ratio at 3.45, 3.23; 3.54, 3.46; 3.03, 4.80; 3.56,
# 3.06; 3.67, 3.82), and the mean of two carried it whole into every prediction
WARM_READINGS = 2
HOST_REPEATS = 15
# The revision of how calibrate measures, in the demo's cache key: a file measured by an
# earlier method is measured again, though its schema still loads. 2: the compute and
# optimizer probes run first in a settled allocator, the host's probes before and after the
# functions, and the probe pipeline with 1 worker too (its download term from its prefetches,
# its iteration gap counted from the prefetched input's arrival when that is later). 3: the
# probe pipelines run with the invoker's cheaper deletions (one list per kind of key, at most
# once a second), which leave the store and the host less loaded: the task terms measured
# before are larger than what a run now pays. 4: the warm invocation times the compute and
# optimizer probes too, each invocation beside the host's passes just before and after it, the
# two readings averaged; every probe is timed on each of up to 2 CPUs in turn (flatpack.cpus). 5: a probe
# task's term counts from when it could start, its hand-off included (task_overheads._ready_times).
# 6: two warm invocations, the tier's compute ratios and optimizer speed the median of three
# readings (WARM_READINGS). 7: a second, small transfer probe after the link idled; the
# bandwidth is the slope between the two sizes and the link's burst its intercept (link_fit).
# 8: the store requests' host CPU (request_cpu_s, backends.request_cpu), which the host bound
# counts by (analysis.host_load): a cached calibration without it bounds nothing. 9: the host's
# cores a run's processes get (RequestCpu.cores_obtained), reported beside the figures. 10: one S3
# server for the whole calibration, and emulated tiers of one CPU share take their cold start and
# task terms from the smallest of them (alike_tiers). 11: the first stage's forward counts from its
# prefetched input's arrival (task_overheads._ready_times), as a later stage's from its download.
# 12: a store request's host CPU is the mean of six rounds, not the median of three (request_cpu:
# the median snapped to the fast or the slow speed of a VM whose interpreter slows in bursts).
METHOD_REVISION = 12


def _probe_model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """What is deployed: the smallest model a backend accepts (the function measures the
    target, not a model)."""
    return nn.Sequential(nn.Linear(8, 8)), (torch.zeros(2, 8),)


def calibrate_target(target: str, *, tiers: Sequence[int] | None = None, out: str | os.PathLike | None = None,
                     emulate: bool = False, region: str | None = None, threads: int = 1, round_trips: int = 60,
                     probe_bytes: int = 4 << 20, timeout_s: float = DEFAULT_TIMEOUT_S,
                     deploy: Callable[[Any], FunctionDeployment] | None = None,
                     launch: Callable[[Role], Invocation] | None = None,
                     report: Callable[[str], None] | None = None,
                     task_iterations: int = task_overheads.PROBE_ITERATIONS) -> Calibration:
    """Measures ``target``'s memory ``tiers`` (default: its default tiers) with one
    calibration function per tier and returns the :class:`Calibration` (also written
    atomically to ``out``). ``emulate``: run the target's tiers as local processes held to
    their CPU share and link (always so for ``local``). ``threads``: torch threads, as the
    stages and the host profile run. ``round_trips``: small store requests each way per
    tier (the latency fit needs at least 8). ``probe_bytes``: each bandwidth probe.
    ``deploy`` / ``launch``: override the backend's (tests; a caller's own deployment).
    ``task_iterations``: then run the probe pipelines on each tier, this many iterations
    each, and record the task terms they measure (:mod:`flatpack.backends.task_overheads`;
    0: not measured)."""
    platform = get_platform(target)
    _check_request(target, platform, emulate=emulate, region=region, task_iterations=task_iterations,
                   threads=threads, round_trips=round_trips, probe_bytes=probe_bytes, timeout_s=timeout_s)
    memory_sizes = profiling._tier_sizes(platform, tiers)
    say = report or (lambda line: None)
    failed: list[int] = []
    with contextlib.ExitStack() as cleanup:
        server_pid = None
        if deploy is None:
            deploy, scratch, server_pid = _shared_store_deploy(target, emulate, memory_sizes, region, cleanup)
            if scratch is not None:
                cleanup.callback(profiling._remove_logs_unless_failed, scratch, failed)
        calibration, alike = _calibrate_functions(target, platform, memory_sizes, deploy, launch, server_pid, failed,
                                                  say, threads=threads, region=region, round_trips=round_trips,
                                                  probe_bytes=probe_bytes, timeout_s=timeout_s)
        if task_iterations:
            try:
                calibration = _with_task_overheads(calibration, target, alike, deploy, task_iterations, timeout_s,
                                                   say)
            except Exception:
                failed.extend(memory_sizes)    # the functions' logs are the one full account of why
                raise
    if out is not None:
        calibration.save(out)
        say(f"wrote {out}")
    return calibration


def _shared_store_deploy(target: str, emulate: bool, memory_sizes: Sequence[int], region: str | None,
                         cleanup: contextlib.ExitStack
                         ) -> tuple[Callable[[Any], FunctionDeployment], Path | None, int | None]:
    """The deploy function every step of the calibration uses, the scratch folder of its
    functions' logs (None: the backend keeps them), and the pid of the S3 server its
    deployments share (None: the target's own store). Emulated tiers (and ``local``) share
    one server, started here for the whole calibration and stopped by ``cleanup``: the probe
    pipelines and serving probes deploy 6 times a tier, and a server of their own each took
    1-1.5 s to start, a third of the calibration of ``local``'s 8 tiers (issue 42)."""
    if not (emulate or target == "local"):
        deploy, scratch = profiling._default_deploy(target, emulate, tuple(memory_sizes), region)
        return deploy, scratch, None
    server = LocalS3Server().start()
    cleanup.callback(server.stop)
    deploy, scratch = profiling._default_deploy(target, emulate, tuple(memory_sizes), region, server=server)
    return deploy, scratch, server.pid


def _calibrate_functions(target: str, platform: Platform, memory_sizes: Sequence[int],
                         deploy: Callable[[Any], FunctionDeployment], launch: Callable[[Role], Invocation] | None,
                         server_pid: int | None, failed: list[int], say: Callable[[str], None], *, threads: int,
                         region: str | None, round_trips: int, probe_bytes: int, timeout_s: float
                         ) -> tuple[Calibration, dict[int, int]]:
    """The calibration functions' part of the file: each tier's function cold, then warm
    (:func:`_invoke_tiers`), and the store requests' host CPU; their deployment is torn down
    on success or failure, leaving nothing in the store. With it, each tier's
    representative (:func:`alike_tiers`)."""
    with contextlib.ExitStack() as cleanup:
        model, example = _probe_model()
        compiled = compile_model(model, example, target=target, stages=1)
        say(f"deploying the calibration function to {target} ({', '.join(f'{mb} MB' for mb in memory_sizes)})")
        deployment = deploy(compiled)
        cleanup.callback(deployment.teardown)
        emulated = bool(getattr(deployment, "emulate_tiers", False))
        alike = alike_tiers(platform, memory_sizes, threads, emulated)
        for memory_mb in memory_sizes:
            tier = platform.tier(memory_mb)
            spec = CalibrateSpec(run=deployment.keys.run, memory_mb=memory_mb, vcpus=tier.vcpus, emulate_cpu=emulated,
                                 bandwidth_bytes_s=tier.bandwidth_bytes_s if emulated else None, threads=threads,
                                 round_trips=round_trips, probe_bytes=probe_bytes,
                                 link_only=alike[memory_mb] != memory_mb)
            deployment.store.put(deployment.keys.calibrate("spec", memory_mb), spec.dumps())
        # the cold invocation starts as a platform's cold start does (a fresh interpreter that
        # imports torch), never from the local fork server, whose start is a warm container's
        # (docs/local-functions.md); a caller's own launch starts both
        launch_cold = launch or getattr(deployment, "launch_cold", deployment.launch)
        readings = _invoke_tiers(deployment, compiled.digest, alike, launch or deployment.launch, launch_cold,
                                 threads, timeout_s, say, failed)
        if failed:
            reasons = "; ".join(f"{mb} MB: {_why(deployment, calibrate_role(deployment.keys, mb, COLD))}"
                                for mb in sorted(set(failed)))
            raise RunFailure(f"the calibration function failed on {reasons}. "
                             + profiling._next_step(deployment, emulated))
        request_cpu = _request_cpu(deployment, emulated, server_pid, say)
    calibration = _calibration(target, alike, readings, emulated=emulated, region=region, threads=threads,
                               round_trips=round_trips, probe_bytes=probe_bytes, request_cpu=request_cpu)
    return calibration, alike


def alike_tiers(platform: Platform, memory_sizes: Sequence[int], threads: int, emulated: bool) -> dict[int, int]:
    """Each of ``memory_sizes`` mapped to the tier whose cold start and task terms stand for
    it: on emulated tiers, the smallest tier held to the same CPU share at ``threads``
    threads (``runtime.function.cpu_share``: at one thread every tier of 1 vCPU or more runs
    its compute unthrottled, so ``local``'s six tiers from 2048 MB on differ only in their
    link, which the model carries, and their memory limit); on a platform, itself. The
    calibration measures those figures once per representative: each cold start (a fresh
    interpreter importing torch, 4-8 s) and each tier's probe pipelines (10-20 s) had made
    ``flatpack calibrate --target local`` take 150-230 s (issue 42). So are the compute and
    optimizer probes and the warm starts: the five tiers from 3072 MB on had spent about 11 s
    reading what 2048 MB's function reads, and calibrating the 8 tiers took 60.2 s against
    52.7 s with their functions timing their links alone (back to back, BENCHMARKS.md). Every
    tier still gets a function of its own that times its link (its bandwidth and burst)."""
    if not emulated:
        return {memory_mb: memory_mb for memory_mb in memory_sizes}
    first: dict[float, int] = {}
    return {memory_mb: first.setdefault(cpu_share(platform.tier(memory_mb).vcpus, threads), memory_mb)
            for memory_mb in sorted(memory_sizes)}


def _check_request(target: str, platform: Platform, *, emulate: bool, region: str | None, task_iterations: int,
                   threads: int, round_trips: int, probe_bytes: int, timeout_s: float) -> None:
    """Refuses, before anything is deployed, a calibration that cannot run as asked."""
    if platform.kind == "container":
        raise InputError(f"{target}'s ranks talk to each other directly, not through a store: measure their link "
                         "and all-reduce with backends.collective_calibration.calibrate_collective (the CLI's "
                         f"`flatpack calibrate --target {target}` does)")
    if region is not None and (emulate or target == "local"):
        raise InputError(f"--region places calibration functions in a cloud region; "
                         f"{'emulated tiers' if emulate else 'the local target'} run on this machine. Leave --region "
                         "out")
    if task_iterations and task_iterations <= task_overheads.SKIP:
        raise InputError(f"--probe-iterations {task_iterations}: the probe pipelines' first {task_overheads.SKIP} "
                         f"iterations are not measured; give at least {task_overheads.SKIP + 1}, or 0 to skip them")
    if threads < 1 or round_trips < 4 or probe_bytes < 1 or timeout_s <= 0:
        raise InputError(f"calibrate needs threads >= 1, round_trips >= 4 (8 requests or more for the latency fit), "
                         f"probe_bytes >= 1 and a positive timeout; got threads={threads}, round_trips={round_trips}, "
                         f"probe_bytes={probe_bytes}, timeout_s={timeout_s}")


@dataclass
class _Readings:
    """What the calibration functions measured, by (memory MB, invocation): each one's result,
    when it was launched (wall clock), and the host's probe seconds around it."""

    results: dict[tuple[int, int], CalibrateResult] = field(default_factory=dict)
    launched: dict[tuple[int, int], float] = field(default_factory=dict)
    host_passes: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)


def _invoke_tiers(deployment: FunctionDeployment, digest: str, alike: dict[int, int],
                  launch: Callable[[Role], Invocation], launch_cold: Callable[[Role], Invocation], threads: int,
                  timeout_s: float, say: Callable[[str], None], failed: list[int]) -> _Readings:
    """Invokes each tier's calibration function once first (by ``launch_cold`` on a tier
    that stands for others or itself, ``alike``; by ``launch`` on the others, which time their
    link alone: their cold start, compute and optimizer are their representative's) and a
    representative ``WARM_READINGS`` times warm, one at a time, with the host's probes around
    each reading of the compute probes; a tier whose function failed goes to ``failed``."""
    readings = _Readings()

    def timed(role: Role) -> Invocation:
        readings.launched[(role.stage, role.start_iteration)] = time.time()
        cold = role.start_iteration == COLD and alike[role.stage] == role.stage
        return (launch_cold if cold else launch)(role)

    # the host's probes just before and just after each function: the host's speed moves
    # by up to 45 % for seconds to minutes (BENCHMARKS.md, issue 19's sixth pass), so a
    # function's reading is set beside the host's nearest in time, not the run's first
    before = _on_host(threads)
    for invocation in range(COLD, WARM + WARM_READINGS):
        for memory_mb in alike:
            represented = alike[memory_mb] != memory_mb
            if represented and invocation != COLD:
                continue
            if invocation != COLD:
                verb = f"starting again (warm, {invocation} of {WARM_READINGS})"
            elif represented:
                verb = f"calibrating its link (its cold start and compute the {alike[memory_mb]} MB tier's)"
            else:
                verb = "calibrating (cold start)"
            role = calibrate_role(deployment.keys, memory_mb, invocation, digest)
            profiling._run_functions([role], timed, 1, timeout_s, say, verb=verb)
            if not represented:
                after = _on_host(threads)
                readings.host_passes[(memory_mb, invocation)] = {name: (seconds + after[name]) / 2
                                                                 for name, seconds in before.items()}
                before = after
            result = _collect(deployment, role)
            if result is None:
                failed.append(role.stage)
            else:
                readings.results[(role.stage, invocation)] = result
    return readings


def _request_cpu(deployment: FunctionDeployment, emulated: bool, server_pid: int | None,
                 say: Callable[[str], None]) -> RequestCpu | None:
    """The host CPU a store request costs (client and server), where the store's server runs
    on this host beside emulated tiers (the calibration's shared server, ``server_pid``, or
    one the deployment started); None elsewhere."""
    server = getattr(deployment, "server", None)
    if server_pid is None and server is not None:
        server_pid = server.pid
    if not emulated or server_pid is None:
        return None
    # the host's cores are shared: what a request costs them bounds a run (analysis.host_load)
    say("timing the host CPU of the store's requests (client and server)")
    return measure_request_cpu(deployment.store, server_pid, f"{deployment.keys.run}/calibrate/request-cpu")


def _calibration(target: str, alike: dict[int, int], readings: _Readings, *, emulated: bool,
                 region: str | None, threads: int, round_trips: int, probe_bytes: int,
                 request_cpu: RequestCpu | None) -> Calibration:
    """The calibration the readings make: per tier, the store's latency and poll overhead from
    the cold invocations, the host's probe seconds averaged over every pass."""
    results, host_passes = readings.results, readings.host_passes
    measured = _tiers(alike, results, readings.launched, host_passes)
    host_seconds = {name: statistics.mean(passes[name] for passes in host_passes.values())
                    for name in next(iter(host_passes.values()))}
    requests = [seconds for (_, invocation), result in results.items() if invocation == COLD
                for seconds in result.request_s]
    polls = [seconds for (_, invocation), result in results.items() if invocation == COLD
             for seconds in result.poll_overhead_s]
    first = results[(next(iter(alike)), COLD)]
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return Calibration(
        platform=target, layer_names=(), tiers=measured,
        target=TargetInfo(target, now, host_info().cpu, __version__, region, threads),
        store_latency=StoreLatency.fit(requests), poll_overhead_s=statistics.mean(polls),
        host_cores=host_cores() if emulated else None, collective=first.collective, request_cpu=request_cpu,
        provenance=_provenance(target, emulated, round_trips, probe_bytes, host_seconds, alike))


def local_calibration_path(tiers: Sequence[int]) -> Path:
    """Where the calibration of the local target's ``tiers`` on this host, with this flatpack
    and torch, is cached (next to the profile cache: ``$FLATPACK_CACHE_DIR`` or the user's
    cache directory). The name changes with the host, its cores, torch, flatpack, the tiers
    and calibrate's method (``METHOD_REVISION``), so that a file measured otherwise is not read."""
    identity = {"host": host_info().cpu, "cores": host_cores(), "torch": torch.__version__, "flatpack": __version__,
                "tiers": sorted(tiers), "schema": SCHEMA_VERSION, "method": METHOD_REVISION}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return default_cache_dir() / f"calibration-local-{key}.json"


def find_local_calibration(tiers: Sequence[int], report: Callable[[str], None] | None = None) -> Path | None:
    """The cached calibration of the local target's ``tiers`` on this host
    (:func:`local_calibration_path`), or None when none was measured (or it no longer loads).
    ``flatpack demo`` predicts with it when there is one, and otherwise calibrates in the
    run (docs/training.md, "The first demo")."""
    path = local_calibration_path(tiers)
    if not path.is_file():
        return None
    try:
        found = Calibration.load(path)
    except InputError:
        return None
    if report is not None:
        report(f"predicting with the local calibration measured {found.target.date if found.target else ''} "
               f"({path}; `flatpack demo --calibration measure` measures it again)")
    return path


def measure_local_calibration(tiers: Sequence[int], report: Callable[[str], None] | None = None) -> Path:
    """Measures the local target's ``tiers`` now (:func:`calibrate_target`, about 2 minutes on
    a quiet 2-core host) into the cache :func:`find_local_calibration` reads, replacing an
    earlier file; returns its path."""
    say = report or (lambda line: None)
    path = local_calibration_path(tiers)
    say(f"calibrating the local target for this host ({', '.join(map(str, tiers))} MB tiers; about 2 minutes on a "
        f"quiet machine): later demos predict with what it measures; cached at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    calibrate_target("local", tiers=tiers, out=path, report=say)
    return path


def _with_task_overheads(calibration: Calibration, target: str, alike: dict[int, int],
                         deploy: Callable[[Any], FunctionDeployment], iterations: int, timeout_s: float,
                         say: Callable[[str], None]) -> Calibration:
    """``calibration`` with each tier's task terms, measured by the probe pipeline on the tier
    with the figures measured so far (``task_overheads.measure_tier``), deployed by ``deploy``:
    once per representative tier (``alike``), the others taking their representative's."""
    tiers = dict(calibration.tiers)
    for memory_mb in dict.fromkeys(alike.values()):
        say(f"running the probe pipeline (1 stage, then 2; "
            f"{', '.join(map(str, task_overheads.probe_workers()))} workers, {iterations} iterations "
            f"each) on the {memory_mb} MB tier: each task's seconds beyond the model")
        measured = task_overheads.measure_tier(target, memory_mb, calibration, deploy, iterations=iterations,
                                               timeout_s=timeout_s)
        say(f"serving the probe model on the {memory_mb} MB tier (the master alone, then split over "
            f"{' and '.join(map(str, task_overheads.SERVING_PARTITIONS))} workers): each request's seconds "
            "beyond Gillis's model")
        # as many timed requests as the pipeline's iterations, and one (a median of an odd count)
        for functions, terms in task_overheads.measure_serving(target, memory_mb, calibration, deploy,
                                                                requests=iterations + 1,
                                                                timeout_s=timeout_s).items():
            measured.setdefault(functions, {}).update(terms)
        for same in (tier for tier, stands in alike.items() if stands == memory_mb):
            tiers[same] = dataclasses.replace(tiers[same], task_overhead_s=measured)
    provenance = {**calibration.provenance, "tasks": (
        f"task terms: a probe pipeline of linear layers per tier, in 1 stage then 2, with "
        f"{', '.join(map(str, task_overheads.probe_workers()))} workers, {iterations} iterations of "
        f"{task_overheads.PROBE_MICRO_BATCHES} micro-batches each, Adam; each task's mean measured - modelled "
        f"seconds after the first {task_overheads.SKIP} iterations; serving: the probe model at batch 1 with the "
        f"master alone, then its middle layer split by channel over "
        f"{' and '.join(map(str, task_overheads.SERVING_PARTITIONS))} workers, the median of "
        f"{iterations + 1} requests less gillis.latency")}
    return dataclasses.replace(calibration, tiers=tiers, provenance=provenance)


def _on_host(threads: int) -> dict[str, float]:
    """The compute probes on this (the profiling) host, unthrottled, at ``threads``, by the
    clock the host profile times layers by (``profiler.host_clock``: at one thread, this
    thread's CPU seconds), so that a ratio maps profiled seconds to the tier's."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return time_op_classes(HOST_REPEATS, host_clock(torch.device("cpu")))
    finally:
        torch.set_num_threads(previous)


def _collect(deployment: FunctionDeployment, role: Role) -> CalibrateResult | None:
    """The function's result; None when it wrote none (its status record says why)."""
    with contextlib.suppress(StoreKeyError):
        return CalibrateResult.loads(deployment.store.get(
            deployment.keys.calibrate("result", role.stage, role.start_iteration)))
    return None


def _why(deployment: FunctionDeployment, role: Role) -> str:
    return _status_detail(read_status(deployment.store, deployment.keys, role)) or "it wrote no result"


def link_fit(probe_bytes: int, seconds: Sequence[float], small_bytes: int, small_seconds: Sequence[float],
             request_s: float) -> tuple[float, float]:
    """A link's (bytes/s, burst seconds) from transfers of two sizes: each transfer takes
    t_lat + n/W − b, where b is what an idle link sends beyond its rate (a token bucket's
    burst: the local backend's is 10 ms of its rate; 0 where none shows). W is the slope
    between the two sizes' medians, so neither t_lat nor b biases it; b is the large probe's
    time short of t_lat + n/W, at least 0. Without the small probe (an earlier flatpack's
    function), when its median is not below the large one's, or when the burst fitted would
    cover the small probe itself (then its time is t_lat alone, off the line, and the fit
    says nothing): W = n/(t − t_lat), b = 0."""
    large = statistics.median(seconds)
    if small_seconds and 0 < small_bytes < probe_bytes:
        small = statistics.median(small_seconds)
        if large > small:
            rate = (probe_bytes - small_bytes) / (large - small)
            burst = max(0.0, request_s + probe_bytes / rate - large)
            # on the line the small probe's time beyond t_lat is n/W − b; all burst, it is 0
            # and the fit puts b at n/W: keep a fifth of n/W as the margin between the two
            if burst < 0.8 * small_bytes / rate:
                return rate, burst
    return probe_bytes / max(large - request_s, 1e-9), 0.0


def _tiers(alike: dict[int, int], results: dict[tuple[int, int], CalibrateResult],
           launched: dict[tuple[int, int], float],
           host_passes: dict[tuple[int, int], dict[str, float]]) -> dict[int, TierCalibration]:
    """Per tier: compute ratios against the host, each direction's bandwidth and the link's
    burst (:func:`link_fit`, from the two transfer probes and one request's median), and the
    invoke latency: launch to ready, as the invoker's and the function's clocks say (on a
    cloud target the two clocks differ by their skew, milliseconds under NTP).

    The cold and each warm invocation time the compute and optimizer probes; each reading is
    set beside the host's passes just before and after that invocation, and the tier's
    figure is the readings' median (with two, their mean). ``invoke_warm_s``: the first warm
    start's; ``invoke_cold_s``: the cold start. A tier another stands for (``alike``) takes
    its representative's compute, optimizer and starts, and fits its own link with the
    representative's request time."""
    tiers = {}
    for memory_mb, stands in alike.items():
        # this tier's own cold invocation timed its link; its representative's, everything else
        cold, representative, warm = results[(memory_mb, COLD)], results[(stands, COLD)], results[(stands, WARM)]
        request = statistics.median(representative.request_s)
        upload = link_fit(cold.probe_bytes, cold.upload_s, cold.small_probe_bytes, cold.small_upload_s, request)
        download = link_fit(cold.probe_bytes, cold.download_s, cold.small_probe_bytes, cold.small_download_s, request)

        readings = [(result, host_passes[(mb, invocation)]) for (mb, invocation), result in sorted(results.items())
                    if mb == stands and result.compute_s]
        compute_ratio = {name: statistics.median(result.compute_s[name] / host[name] for result, host in readings)
                         for name in readings[0][1]}
        optimizer_s_per_byte = {name: statistics.median(result.optimizer_s_per_byte[name] for result, _ in readings)
                                for name in representative.optimizer_s_per_byte}
        tiers[memory_mb] = TierCalibration(
            compute_ratio=compute_ratio,
            upload_bytes_s=upload[0], download_bytes_s=download[0], burst_s=(upload[1] + download[1]) / 2,
            invoke_cold_s=max(0.0, representative.ready_at - launched[(stands, COLD)]),
            invoke_warm_s=max(0.0, warm.ready_at - launched[(stands, WARM)]),
            optimizer_s_per_byte=optimizer_s_per_byte)
    return tiers


def _provenance(target: str, emulated: bool, round_trips: int, probe_bytes: int,
                host_seconds: dict[str, float], alike: dict[int, int]) -> dict[str, str]:
    where = (f"local processes on {host_info().cpu}, each held to the {target} tier's CPU share and link by the local "
             "backend: emulated, not measured on the platform" if emulated
             else f"one calibration function per memory tier on {target}, at the platform's own CPU share and link")
    host = ", ".join(f"{name} {seconds * 1000:.3f} ms" for name, seconds in host_seconds.items())
    shared = {memory_mb: stands for memory_mb, stands in alike.items() if stands != memory_mb}
    provenance = {}
    if shared:
        standing = ", ".join(f"{mb} MB" for mb in sorted(set(shared.values())))
        provenance["alike"] = (f"the cold and warm starts, compute ratios, optimizer step and task terms of "
                               f"{', '.join(f'{mb} MB' for mb in shared)} are those of the tier of their CPU share, "
                               f"{standing}; their link is measured on its own (emulated tiers of one share differ "
                               "only in their link and memory limit)")
    return {**provenance, "where": where, "cpu_share": "emulated" if emulated else "platform",
            "method": (f"per tier: compute probes (conv, matmul, elementwise) timed by the tier's clock (emulated: CPU "
                       f"seconds over its usable vCPUs; a platform: wall time), over the same probes' CPU seconds on "
                       f"this host before and after the functions ran, averaged ({host}); {round_trips} small puts "
                       f"and gets fitted with scipy.stats.exponnorm; a {probe_bytes}-byte put and get through the "
                       f"tier's link, 3 times, and a {probe_bytes // SMALL_PROBE_PARTS}-byte one after "
                       f"{IDLE_S * 1000:.0f} ms idle, 3 times (their slope the bandwidth, their intercept the link's "
                       "burst); 12 waits for a key written during the wait; optimizer steps on 1M "
                       "float32 parameters; invoke latency from launch to the function being ready, cold then "
                       f"warm; the compute probes and the optimizer step read in the cold and {WARM_READINGS} warm "
                       "invocations, their median"),
            "torch": torch.__version__}


def calibration_summary(calibration: Calibration) -> str:
    """The file's figures as a short table (``flatpack calibrate`` prints it)."""
    fit = calibration.collective_fit
    if fit is not None:    # a container platform's: the ranks' link and all-reduce, no functions
        return "\n".join([f"{calibration.platform} measured {calibration.target.date if calibration.target else ''} "
                          f"({calibration.provenance.get('where', '')})", collective_summary(fit),
                          f"tiers {', '.join(map(str, calibration.tiers_mb))} MB take bandwidth D = "
                          f"{fit.bandwidth_bytes_s / 1e6:.1f} MB/s"])
    lines = [f"{calibration.platform} measured {calibration.target.date if calibration.target else ''} "
             f"({calibration.provenance.get('cpu_share', '')} CPU share)"]
    if calibration.store_latency is not None:
        latency = calibration.store_latency
        lines.append(f"store request: EMG K={latency.k:.3g} loc={latency.loc * 1000:.3f} ms "
                     f"scale={latency.scale * 1000:.3f} ms, mean {latency.mean_s * 1000:.3f} ms "
                     f"({latency.samples} requests)")
    if calibration.poll_overhead_s is not None:
        lines.append(f"a wait sees a written key after {calibration.poll_overhead_s * 1000:.3f} ms on average")
    if calibration.host_cores is not None:
        lines.append(f"host cores shared by every worker and the store: {calibration.host_cores}")
    if calibration.request_cpu is not None:
        cpu = calibration.request_cpu
        lines.append(f"host CPU of a store request (client + server): put {cpu.put_s * 1000:.2f} ms "
                     f"+ {cpu.put_s_per_byte * 1e9:.2f} ns/B, get {cpu.get_s * 1000:.2f} ms "
                     f"+ {cpu.get_s_per_byte * 1e9:.2f} ns/B, a poll's miss {cpu.miss_s * 1000:.2f} ms")
        if cpu.cores_obtained:
            lines.append("host cores a run's busy processes got: " + ", ".join(
                f"{cores:.2f} of {calibration.host_cores} for {processes}" for processes, cores in cpu.cores_obtained))
            if calibration.host_cores and min(cores for _, cores in cpu.cores_obtained) < 0.8 * min(
                    calibration.host_cores, cpu.cores_obtained[0][0]):
                lines.append("  other work shares this host: the predictions assume its cores are the run's, and its "
                             "figures drift with that work; measure on a quiet host")
    lines.append(f"{'tier MB':>8}  {'compute x host (conv/matmul/elementwise)':>42}  {'up MB/s':>8}  {'down MB/s':>9}  "
                 f"{'cold s':>7}  {'warm s':>7}  {'adam ns/B':>9}")
    for memory_mb in calibration.tiers_mb:
        tier = calibration.tiers[memory_mb]
        ratios = "/".join(f"{tier.compute_ratio.get(name, float('nan')):.2f}"
                          for name in ("conv", "matmul", "elementwise"))
        lines.append(f"{memory_mb:>8}  {ratios:>42}  {(tier.upload_bytes_s or 0) / 1e6:>8.1f}  "
                     f"{(tier.download_bytes_s or 0) / 1e6:>9.1f}  {tier.invoke_cold_s or 0:>7.2f}  "
                     f"{tier.invoke_warm_s or 0:>7.2f}  {tier.optimizer_s_per_byte.get('adam', 0) * 1e9:>9.3f}")
    measured_tasks = [mb for mb in calibration.tiers_mb if calibration.tiers[mb].task_overhead_s]
    if measured_tasks:
        lines.append(f"{'tier MB':>8}  {'functions':>9}  task ms beyond the model: "
                     + "  ".join(f"{kind:>9}" for kind in TASK_KINDS))
        for memory_mb in measured_tasks:
            for workers, overheads in sorted(calibration.tiers[memory_mb].task_overhead_s.items()):
                lines.append(f"{memory_mb:>8}  {workers:>9}  {'':>25}" + "  ".join(
                    f"{overheads[kind] * 1000:>9.2f}" if kind in overheads else f"{'-':>9}" for kind in TASK_KINDS))
    skipped = calibration.collective.get("skipped")
    if skipped:
        lines.append(f"collective alpha, beta: not measured ({skipped})")
    return "\n".join(lines)
