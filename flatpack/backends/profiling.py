"""In-target profiling (FuncPipe §3.1 step 3): measure every layer on every memory tier
inside the target and write the calibration file (:mod:`flatpack.platform.calibration`)
that makes plans for that target use measured rather than scaled compute times.

How: the model is compiled with the same passes a plan is made with, but one layer per
stage, so every stage artifact is one layer of the very chain the calibration names. The
artifacts are deployed with the target's backend, the example inputs and one profile spec
per tier go to the store under the run's prefix, and one profiler function per tier
(:mod:`flatpack.runtime.profile_function`, role kind ``"profile"``) measures every layer's
forward and backward at several micro-batch sizes and writes its lines back. The
deployment is torn down afterwards, on success or failure, leaving nothing in the store.

On the local backend (``deployment.emulate_tiers``) each function holds itself to the tier's
CPU share from the *target's* catalog, so ``target="aws-lambda", emulate=True`` emulates
Lambda's tiers on this machine; the calibration's provenance says the share was emulated. A
real platform's functions run at their own share; its backend must be able to start a
function of each tier's memory holding every layer (see ``_default_deploy``).

Every layer is timed alone, in a loop of its own, so its weights stay warm in the caches
between repeats, where the host profiler times the whole chain in turn as a stage runs it;
the provenance's ``"method"`` says so.

A tier on which some layer cannot run (its weights and gradients, with the runtime, pass
the tier; or every micro-batch size does) is left out of the calibration, since the file
holds one measured line per layer per tier and a stand-in would look measured; plans then
use the catalog's model for that tier, whose memory check keeps such a layer off it. Why
each tier was left out is in the provenance (``"tier <MB> MB"``) and logged.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flatpack.backends import get_backend
from flatpack.backends.functions import FunctionDeployment, Invocation, read_status
from flatpack.compiler import Compiled
from flatpack.compiler import compile as compile_model
from flatpack.errors import InputError, RunFailure, StoreKeyError
from flatpack.ir.passes import resolve
from flatpack.ir.profile import Linear
from flatpack.partitioner.plan import Plan
from flatpack.platform.calibration import Calibration, TierCalibration
from flatpack.platform.catalog import Platform, get_platform
from flatpack.measure import example_batch_size
from flatpack.profiler import DEFAULT_BATCH_SIZES, ProfileOptions, graph_hash, host_info
from flatpack.runtime.profile_function import DOES_NOT_FIT, ERROR, OK, ProfileSpec, TierResult, profile_role
from flatpack.runtime.function import Role
from flatpack.stage.manifest import Manifest
from flatpack.stage.wire import pack_values
from flatpack.table import format_table, plural
from flatpack.version import __version__

log = logging.getLogger("flatpack.profiling")

DEFAULT_TIMEOUT_S = 900.0          # per function: Lambda's own limit
BANDWIDTH_PROBE_BYTES = 16 << 20   # on a real platform; an emulated tier's store is this machine's, unthrottled
POLL_S = 0.05
TRACEBACK_LINES = 20               # of a failed function's traceback, in the tier's reason


@dataclass(frozen=True)
class _Ended:
    """How a profiler function ended: its exit code (None: stopped at the timeout) and,
    for a failed invocation, the platform's own reason (``ThreadInvocation.failure``, such
    as Lambda's Runtime.OutOfMemory; "" where the handle has none)."""

    code: int | None
    failure: str = ""


def profile_in_target(model: nn.Module, example_inputs: Any = (), *, target: str,
                      tiers: Sequence[int] | None = None, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                      repeats: int = 3, warmup: int = 1, threads: int = 1,
                      passes: str | Sequence[Any] | None = None, profile: bool | ProfileOptions = False,
                      example_kwargs: dict | None = None, emulate: bool = False,
                      deploy: Callable[[Any], FunctionDeployment] | None = None,
                      launch: Callable[[Role], Invocation] | None = None, parallel: int = 1,
                      timeout_s: float = DEFAULT_TIMEOUT_S, bandwidth_probe_bytes: int | None = None,
                      out: str | os.PathLike | None = None,
                      report: Callable[[str], None] | None = None, region: str | None = None) -> Calibration:
    """Measures every layer of ``model``'s chain on each memory tier of ``target`` inside
    the target and returns the :class:`Calibration` (also written atomically to ``out``).

    ``tiers``: memory sizes in MB (default: the target's default tiers). ``batch_sizes``,
    ``repeats``, ``warmup``: the micro-batch sizes the lines are fitted over and the timed
    runs per size (median). ``threads``: torch threads in each function, as the stages run
    (``train(threads=...)``). ``passes`` and ``profile``: as given to ``compile`` for the
    plans this calibration is for (``profile`` matters only when a pass reads profiles,
    such as ``coarsen{by=time}``: the chain must come out the same). ``emulate``: run the
    functions on the local backend, each held to the target's tier's CPU share, instead of
    deploying to the target (always so for ``local``). ``deploy``: a function
    ``Compiled -> deployment`` overriding both (default: the local backend when emulating,
    else the target's backend's ``deploy``). ``launch``: how to start a function (default
    ``deployment.launch``). ``parallel``: functions at a time (1 by default: emulated
    tiers on one machine would slow each other). ``timeout_s``: per function.
    ``bandwidth_probe_bytes``: also time moving this many bytes through the store per tier
    (default: 16 MiB on a real platform; none when tiers are emulated, where asking for a
    probe is an error: an emulated function reaches this machine's store unthrottled, so the
    figure would be localhost's, not the tier's). ``report``: called with a line per step
    (the CLI prints them). ``region``: the cloud region the profiler functions go to
    (default: the backend's own resolution, e.g. ``AWS_REGION``).

    A function that fails leaves its tier out, with the platform's reason and the end of
    its traceback in the provenance; when emulating, the scratch folder of the functions'
    logs is then kept, and named. When no tier could be calibrated, :class:`RunFailure`
    says where the logs are.
    """
    platform = get_platform(target)
    memory_sizes = _tier_sizes(platform, tiers)
    # ProfileOptions checks the sizes (each a positive int), repeats and warmup as the host profiler does
    options = ProfileOptions(batch_sizes=tuple(batch_sizes), repeats=repeats, warmup=warmup)
    sizes = tuple(sorted(set(options.batch_sizes)))
    if threads < 1 or parallel < 1 or timeout_s <= 0:
        raise InputError(f"profiling needs threads >= 1, parallel >= 1 and a positive timeout; got {threads}, "
                         f"{parallel}, {timeout_s}")
    say = report or (lambda line: None)
    failed_tiers: list[int] = []   # filled once the functions ended; a failure keeps the scratch logs
    with contextlib.ExitStack() as cleanup:
        if deploy is None:   # before compiling: a target that cannot profile, or a probe that
            # would time localhost, is refused at once
            _probe_size(emulate or target == "local", bandwidth_probe_bytes)
            deploy, scratch = _default_deploy(target, emulate, memory_sizes, region)
            if scratch is not None:
                cleanup.callback(_remove_logs_unless_failed, scratch, failed_tiers)
        compiled = _compile_one_layer_per_stage(model, example_inputs, target, passes, profile, example_kwargs)
        graph = compiled.graph
        layer_names = tuple(layer.name for layer in graph.layers)
        leaves = [leaf.detach() if hasattr(leaf, "detach") else leaf
                  for leaf in compiled.input_leaves(example_inputs, example_kwargs)]
        say(f"compiled {plural(len(layer_names), 'layer')}, one per stage; deploying")
        deployment = deploy(compiled)
        cleanup.callback(deployment.teardown)   # also on failure: nothing is left in the store
        # a deployment from a caller's ``deploy`` need not say; one that does not, does not emulate
        emulated = bool(getattr(deployment, "emulate_tiers", False))
        probe = _probe_size(emulated, bandwidth_probe_bytes)
        roles = _put_specs(compiled, deployment, leaves, platform, memory_sizes, layer_names, batch_sizes=sizes,
                           emulated=emulated, probe=probe, repeats=repeats, warmup=warmup, threads=threads)
        ended = _run_functions(roles, launch or deployment.launch, parallel, timeout_s, say)
        results = {role.stage: _collect(deployment, role, ended[role.stage]) for role in roles}
        failed_tiers.extend(memory_mb for memory_mb, result in results.items() if result.status == ERROR)
        next_step = _report_failures(deployment, emulated, failed_tiers, say)
    calibration = _calibration(target, layer_names, graph_hash(graph), results, emulated, sizes, repeats, threads,
                               next_step)
    if out is not None:
        calibration.save(out)
        say(f"wrote {out}")
    return calibration


def _put_specs(compiled: Compiled, deployment: FunctionDeployment, leaves: list[Any], platform: Platform,
               memory_sizes: Sequence[int], layer_names: tuple[str, ...], *, batch_sizes: tuple[int, ...],
               emulated: bool, probe: int, repeats: int, warmup: int, threads: int) -> list[Role]:
    """Puts the model's example inputs and one :class:`ProfileSpec` per memory tier into the
    deployment's store (the chain compiled one layer per stage) and returns the roles that
    read them."""
    keys = deployment.keys
    deployment.store.put(keys.profile("inputs"), pack_values(dict(zip(compiled.info.input_names, leaves))))
    weights, gradients = zip(*(_weight_and_grad_bytes(artifact.manifest) for artifact in compiled.artifacts))
    roles = []
    for memory_mb in memory_sizes:
        spec = ProfileSpec(run=keys.run, layers=layer_names,
                           layer_inputs=tuple(artifact.manifest.input_names for artifact in compiled.artifacts),
                           weight_bytes=weights, grad_bytes=gradients, input_names=compiled.info.input_names,
                           grad_values=_grad_values(compiled), batch_sizes=batch_sizes,
                           example_batch=example_batch_size(leaves), memory_mb=memory_mb,
                           vcpus=platform.tier(memory_mb).vcpus, emulate_cpu=emulated,
                           base_memory_bytes=int(platform.base_memory_bytes), repeats=repeats, warmup=warmup,
                           threads=threads, bandwidth_probe_bytes=probe)
        role = profile_role(keys, memory_mb, compiled.digest)
        deployment.store.put(role.spec_key, spec.dumps())
        roles.append(role)
    return roles


def _report_failures(deployment: FunctionDeployment, emulated: bool, failed_tiers: Sequence[int],
                     say: Callable[[str], None]) -> str:
    """Warns of the tiers whose profiler function failed and returns what to do next (where
    the logs are); "" when none failed."""
    if not failed_tiers:
        return ""
    next_step = _next_step(deployment, emulated)
    failed = f"the profiler function failed on: {', '.join(f'{mb} MB' for mb in failed_tiers)}. {next_step}"
    log.warning("%s", failed)
    say(failed)
    return next_step


def profile_command(model: nn.Module, example_inputs: Any, *, target: str, tiers: Sequence[int] | None = None,
                    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, repeats: int = 3,
                    passes: str | None = None, out: str | os.PathLike | None = None, parallel: int = 1,
                    timeout_s: float = DEFAULT_TIMEOUT_S, emulate: bool = False, region: str | None = None,
                    show: Callable[[str, dict[str, Any]], None] | None = None) -> int:
    """``flatpack profile MODEL --target T``: profiles inside ``target``, prints a table of
    the measured seconds and writes the calibration file (default
    ``calibration-<target>.json``). ``emulate``: run the target's tiers as local processes
    (the local backend) instead of deploying to the target; always so for ``local``.
    ``region``: the cloud region the profiler functions are deployed in (default: the
    backend's, from the environment or the SDK's profile). ``show(text, document)`` prints the
    report (the table, and the calibration as JSON for ``--json``); default: the text on stdout.
    Progress goes to the ``flatpack.profiling`` logger."""
    if region is not None and (emulate or target == "local"):
        raise InputError("--region places profiler functions in a cloud region; "
                         f"{'emulated tiers' if emulate else 'the local target'} run on this machine. Leave --region "
                         "out")
    out = Path(out) if out is not None else Path(f"calibration-{target}.json")
    calibration = profile_in_target(model, example_inputs, target=target, tiers=tiers, batch_sizes=batch_sizes,
                                    repeats=repeats, passes=passes, emulate=emulate, parallel=parallel,
                                    timeout_s=timeout_s, out=out, report=log.info, region=region)
    table = calibration_table(calibration, max(batch_sizes))
    if show is None:
        print(table)
    else:
        show(table, calibration.to_json())
    return 0


def calibration_table(calibration: Calibration, micro_batch: int) -> str:
    """Forward + backward milliseconds of one micro-batch, per layer (rows) and tier
    (columns), then what the provenance says of single tiers: why one was left out, notes
    on one calibrated."""
    tiers = calibration.tiers_mb
    where = (f"{calibration.platform}'s tiers emulated on this machine"
             if calibration.provenance.get("cpu_share") == "emulated" else f"measured in {calibration.platform}")
    rows = [[name, *(_fwd_bwd_ms(calibration.seconds(index, mb, micro_batch)) for mb in tiers)]
            for index, name in enumerate(calibration.layer_names)]
    lines = [f"fwd+bwd ms at micro-batch {micro_batch}, {where}",
             format_table(["layer", *(f"{mb} MB" for mb in tiers)], rows, numeric=range(1, len(tiers) + 1))]
    lines.extend(f"{key}: {value}" for key, value in calibration.provenance.items() if key.startswith("tier "))
    return "\n".join(lines)


def _fwd_bwd_ms(seconds: tuple[float, float] | None) -> str:
    """Forward + backward milliseconds; "-" for a tier without per-layer lines."""
    return "-" if seconds is None else f"{sum(seconds) * 1000:.3f}"


# --- steps ------------------------------------------------------------------------------------


def _tier_sizes(platform: Any, tiers: Sequence[int] | None) -> tuple[int, ...]:
    sizes = tuple(platform.memory_choices) if tiers is None else tuple(tiers)
    if not sizes:
        raise InputError(f"no tiers to profile on {platform.name}; pass memory sizes in MB, such as 512,1024,2048")
    if len(set(sizes)) != len(sizes):
        raise InputError(f"tiers {list(sizes)} name a memory size twice; give each once")
    for memory_mb in sizes:
        platform.tier(memory_mb)   # refuses a size the platform does not offer, saying which it does
    return sizes


def _probe_size(emulated: bool, requested: int | None) -> int:
    """Bytes each function moves through the store to time its bandwidth: as asked, else
    ``BANDWIDTH_PROBE_BYTES`` on a real platform and none when the tiers are emulated."""
    if requested is not None and requested < 0:
        raise InputError(f"bandwidth_probe_bytes must be 0 (no probe) or more, got {requested}")
    if not emulated:
        return BANDWIDTH_PROBE_BYTES if requested is None else requested
    if requested:
        raise InputError(f"bandwidth_probe_bytes={requested} asks emulated tiers to time the store, but their "
                         "functions reach this machine's store at local speed, not held to the tier's bandwidth, so "
                         "the calibration would record localhost's bandwidth as the tier's. Leave it unset (or 0) "
                         "when emulating, and plans use the catalog's bandwidth; to measure it, profile on the target "
                         "itself (emulate=False)")
    return 0


@dataclass
class _OneLayerPerStage:
    """A solver: every layer its own stage, so every artifact is one layer."""

    name: str = "one-layer-per-stage"

    def __call__(self, problem: Any) -> Plan:
        count = len(problem.chain)
        return Plan.from_ranges([(index, index) for index in range(count)], count, solver=self.name)


def _compile_one_layer_per_stage(model: nn.Module, example_inputs: Any, target: str, passes: Any,
                                 profile: bool | ProfileOptions, example_kwargs: dict | None) -> Any:
    """The chain a plan for ``target`` is made on (same passes; a host profile only when a
    pass reads one), emitted one layer per stage."""
    reads_profile = any(getattr(graph_pass, "reads_profile", False) for graph_pass in resolve(passes))
    return compile_model(model, example_inputs, target=target, passes=passes, example_kwargs=example_kwargs,
                         solver=_OneLayerPerStage(), profile=(profile or True) if reads_profile else False)


def _grad_values(compiled: Any) -> tuple[str, ...]:
    """Values entering a layer whose gradient a stage computes: those that depend on a
    parameter (the host profiler's rule, ``graph.analysis.param_dependent``)."""
    entering = {name for artifact in compiled.artifacts for name in artifact.manifest.input_names}
    return tuple(sorted(entering & compiled.graph.analysis.param_dependent))


def _weight_and_grad_bytes(manifest: Manifest) -> tuple[int, int]:
    """A stage's parameter and buffer bytes, and its trainable parameters' (their gradients),
    from its manifest."""
    weights = gradients = 0
    for entry in manifest.parameters:
        nbytes = math.prod(entry.shape) * getattr(torch, entry.dtype).itemsize
        weights += nbytes
        if entry.trainable:
            gradients += nbytes
    return weights, gradients


def _default_deploy(target: str, emulate: bool, memory_sizes: tuple[int, ...], region: str | None = None,
                    server: Any = None) -> tuple[Callable[[Any], FunctionDeployment], Path | None]:
    """The deploy function, and the scratch folder it keeps its functions' logs in (None:
    the backend keeps them where it keeps its deployment record). Emulating (and for
    ``local``): the local backend's deploy, into a new scratch folder. Otherwise the
    target's backend's, which must say it can start profiler functions: a function of each
    tier's memory with every layer's artifact (``PROFILE_FUNCTIONS = True``;
    ``deploy(compiled, profile_tiers=...)``, and ``launch`` sizing a ``"profile"`` role by
    ``role.stage`` MB). ``server``: a running ``LocalS3Server`` the local deployments share
    (each starts its own without one)."""
    if emulate or target == "local":
        scratch = Path(tempfile.mkdtemp(prefix="flatpack-profile-"))
        store = {} if server is None else {"store_url": server.url(""), "env": server.env()}
        return partial(get_backend("local").deploy, workdir=scratch, **store), scratch
    backend = get_backend(target)
    if not getattr(backend, "PROFILE_FUNCTIONS", False):
        raise InputError(f"the {target} backend cannot start profiler functions yet (one function per memory tier); "
                         f"emulate its tiers on this machine instead: emulate=True (flatpack profile --emulate)")
    options = {} if region is None else {"region": region}
    return partial(backend.deploy, profile_tiers=memory_sizes, **options), None


def _remove_logs_unless_failed(scratch: Path, failed_tiers: list[int]) -> None:
    """Removes the scratch folder of the functions' logs, unless a function failed: its log
    is then the one full account of why."""
    if not failed_tiers:
        shutil.rmtree(scratch, ignore_errors=True)


def _next_step(deployment: FunctionDeployment, emulated: bool) -> str:
    """Where a failed profiler function's log is, and how to look closer."""
    # a deployment from a caller's ``deploy`` may keep no logs
    workdir = getattr(deployment, "workdir", None)
    logs = (f"The profiler functions' logs are in {workdir}" if workdir is not None
            else "This deployment keeps no logs of its functions")
    if emulated:
        return f"{logs}: each function's output, its traceback included."
    return (f"{logs}. To debug a failure on this machine, re-run with --emulate (emulate=True): the same "
            "profiler functions then run as local processes, their full output kept.")


def _run_functions(roles: list[Role], launch: Callable[[Role], Invocation], parallel: int, timeout_s: float,
                   say: Callable[[str], None], verb: str = "profiling") -> dict[int, _Ended]:
    """Starts the functions, ``parallel`` at a time, and waits for each up to ``timeout_s``;
    memory size -> how it ended. Every function still running when this returns or raises
    is killed. ``verb`` says what the functions do (``flatpack calibrate`` runs them too)."""
    pending = list(roles)
    running: dict[int, tuple[Invocation, float]] = {}
    ended: dict[int, _Ended] = {}
    try:
        while pending or running:
            while pending and len(running) < parallel:
                role = pending.pop(0)
                say(f"{verb} the {role.stage} MB tier")
                running[role.stage] = (launch(role), time.monotonic())
            for memory_mb, (handle, started) in list(running.items()):
                code = handle.poll()
                if code is None and time.monotonic() - started <= timeout_s:
                    continue
                if code is None:
                    _stop(handle)
                    log.warning("the function %s the %d MB tier ran past %g s and was stopped",
                                verb, memory_mb, timeout_s)
                ended[memory_mb] = _Ended(code, getattr(handle, "failure", ""))
                del running[memory_mb]
                ending = {0: "done", None: "stopped at the timeout"}.get(code, f"ended with exit code {code}")
                say(f"  {memory_mb} MB tier: {ending} after {time.monotonic() - started:.1f} s")
            time.sleep(POLL_S)
    finally:
        for handle, _ in running.values():
            _stop(handle)
    return ended


def _stop(handle: Invocation) -> None:
    """Kills a function and waits briefly, so no zombie is left."""
    handle.kill()
    with contextlib.suppress(Exception):  # a function that will not end is the platform's to reap
        handle.wait(timeout=5)


def _collect(deployment: FunctionDeployment, role: Role, ended: _Ended) -> TierResult:
    """The function's result; or, when it wrote none, an error result saying why: how it
    ended, the platform's reason, and the end of its status record's traceback."""
    with contextlib.suppress(StoreKeyError):
        return TierResult.loads(deployment.store.get(deployment.keys.profile("result", role.stage)))
    if ended.code is None:
        reason = "the profiler function did not finish within the timeout"
    else:
        reason = f"the profiler function ended with exit code {ended.code} and wrote no result"
    if ended.failure:
        reason += f"; the platform reported {ended.failure}"
    detail = _status_detail(read_status(deployment.store, deployment.keys, role))
    return TierResult(role.stage, ERROR, reason=f"{reason}:\n{detail}" if detail else reason)


def _status_detail(status: dict) -> str:
    """The last ``TRACEBACK_LINES`` lines of a status record's traceback (the frames nearest
    the failure and the exception), else its status; "" when the function left none."""
    lines = [line for line in str(status.get("traceback", "")).rstrip().splitlines() if line.strip()]
    if lines:
        return "\n".join(lines[-TRACEBACK_LINES:])
    return str(status.get("status", ""))


def _measured_lines(result: TierResult) -> tuple[tuple[Linear, ...], tuple[Linear, ...]]:
    """The forward and backward lines of a tier measured in full (an ``ok`` result has both
    for every layer: the profiler function stops at the first layer it cannot measure)."""
    forward: list[Linear] = []
    backward: list[Linear] = []
    for layer in result.layers:
        if layer.forward_s is None or layer.backward_s is None:
            raise RunFailure(f"the profiler function of the {result.memory_mb} MB tier reported {result.status!r} "
                             f"without lines for layer {layer.name}; profile the tier again")
        forward.append(layer.forward_s)
        backward.append(layer.backward_s)
    return tuple(forward), tuple(backward)


def _calibration(target: str, layer_names: tuple[str, ...], digest: str, results: dict[int, TierResult],
                 emulated: bool, batch_sizes: tuple[int, ...], repeats: int, threads: int,
                 next_step: str) -> Calibration:
    """The calibration of the tiers measured in full; the provenance says why any other
    tier was left out, and notes on the calibrated ones. ``next_step``: what to do about a
    failed function, said when no tier could be calibrated."""
    tiers: dict[int, TierCalibration] = {}
    provenance = _provenance(target, emulated, batch_sizes, repeats, threads)
    for memory_mb, result in sorted(results.items()):
        if result.status != OK:
            provenance[f"tier {memory_mb} MB"] = f"not calibrated ({result.status}): {result.reason}"
            log.warning("tier %d MB not calibrated: %s", memory_mb, result.reason)
            continue
        forward_s, backward_s = _measured_lines(result)
        tiers[memory_mb] = TierCalibration(forward_s, backward_s, result.bandwidth_bytes_s)
        remarks = _calibrated_tier_remarks(result)
        if remarks:
            provenance[f"tier {memory_mb} MB"] = remarks
    if not tiers:
        reasons = "; ".join(f"{mb} MB: {result.reason}" for mb, result in sorted(results.items()))
        if all(result.status == DOES_NOT_FIT for result in results.values()):
            raise InputError(f"no tier of {target} could be calibrated: {reasons}. Profile larger tiers, or cut "
                             "the model into smaller layers (passes)")
        raise RunFailure(f"no tier of {target} could be calibrated: {reasons}\n{next_step}")
    return Calibration(platform=target, layer_names=layer_names, tiers=tiers, graph_hash=digest,
                       provenance=provenance)


def _calibrated_tier_remarks(result: TierResult) -> str:
    """What the provenance says of a calibrated tier ("" for nothing): the layers whose
    lines are fitted over the smaller micro-batch sizes only, then every note of the tier
    and its layers (a size refused, a size dropped for the later layers)."""
    partial_fits = [f"{layer.name} from micro-batch {layer.over_tier_at}" for layer in result.layers
                    if layer.over_tier_at is not None]
    notes = [*result.notes, *(f"{layer.name}: {note}" for layer in result.layers for note in layer.notes)]
    if not partial_fits and not notes:
        return ""
    remarks = "calibrated"
    if partial_fits:
        remarks += (", but these layers do not fit the tier from the micro-batch size given, so their lines are "
                    "fitted over the smaller sizes only: " + ", ".join(partial_fits))
    if notes:
        remarks += ". Notes: " + "; ".join(notes)
    return remarks


def _provenance(target: str, emulated: bool, batch_sizes: tuple[int, ...], repeats: int,
                threads: int) -> dict[str, str]:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    if emulated:
        where = (f"local processes on {host_info().cpu}, each held to the {target} tier's CPU share by "
                 "runtime.function.cpu_throttle: the tier CPU share was emulated on the local backend, not measured "
                 f"on {target}")
    else:
        where = f"one profiler function per memory tier on {target}, at the platform's own CPU share"
    return {"measured": now, "where": where, "cpu_share": "emulated" if emulated else "platform",
            "method": (f"every layer in one profiler function per memory tier, one layer at a time: forward and "
                       f"backward timed at micro-batch sizes {', '.join(map(str, batch_sizes))} (median of "
                       f"{repeats}, {threads} torch thread{'s' if threads != 1 else ''}), fitted as "
                       "a*micro_batch + b. Each layer is timed alone, in a loop of its own, so its weights stay "
                       "warm in the CPU caches between repeats, unlike the host profiler, which times the whole "
                       "chain in turn as a stage runs it: these times may be lower than a stage of many layers "
                       "sees"),
            "flatpack": __version__, "torch": torch.__version__}
