"""The profiler function: measures every layer of a deployed chain inside one memory tier
(FuncPipe §3.1 step 3: the model profiler runs each layer on each memory tier in the cloud,
since a tier's CPU share, not its memory, sets how fast a layer runs there).

``flatpack.backends.profiling`` deploys the chain with one layer per stage artifact and
starts one function per tier with a role of kind ``"profile"`` whose ``stage`` field carries
the tier's memory size in MB (a backend sizes the function by it). The function reads
everything else from the store under the run's prefix (``RunKeys.profile``):

    <run>/profile/spec/m<MB>     the ProfileSpec (JSON)
    <run>/profile/inputs         the model's example inputs (wire format, no pickle)
    <run>/profile/result/m<MB>   what it writes: a TierResult (JSON)

It runs the chain layer by layer, each layer's artifact loaded alone and dropped after, on
the real example inputs (cut or repeated to each micro-batch size), so every layer sees the
values it sees in a run — token ids in range, masks, sizes that depend on the batch —
rather than values invented from the manifest's shapes. Each layer is timed by the host
profiler's own code (``measure.time_layer``), forward and backward, median of the
repeats, and fitted as ``a·micro_batch + b``.

Memory: before any measurement every layer's weights and gradients are checked against the
tier with the runtime's own size (the platform's ``base_memory_bytes``, FuncPipe's s0); a
tier that cannot hold some layer even without activations is reported as such and measures
nothing. Micro-batch sizes whose need (runtime + weights + the measured peak of forward plus
backward, extrapolated from the smaller sizes before running) passes the tier are left out
of the fit and noted, so a real function is not run out of memory.

CPU: on the local backend the tier's CPU share is emulated (``runtime.function.cpu_throttle``)
and its layers are timed by the tier's own clock, CPU seconds over its usable vCPUs
(``runtime.function.emulated_clock``), so the host's other load does not inflate them; on a
real platform the share is the platform's own, the spec says not to emulate, and layers are
timed by wall time.

Entry point: ``run_profile(store, role, raw_spec)``, from ``runtime.worker``'s dispatch of a
``"profile"`` role.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from flatpack.errors import first_line
from flatpack.linear import Linear
from flatpack.measure import forward_outputs, layer_peak_bytes, resize_inputs, time_layer
from flatpack.runtime.function import Role, cpu_throttle, emulated_clock, load_module, peak_rss_bytes
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store
from flatpack.stage.artifact import stage_manifest
from flatpack.stage.wire import unpack_values
from flatpack.units import MIB, mb

PROFILE_KIND = "profile"
SPEC_FORMAT = "flatpack-profile-spec"
RESULT_FORMAT = "flatpack-profile-result"

# Tier outcomes: every layer measured; some layer cannot fit the tier (nothing of the tier
# goes into the calibration); the function failed (see ``reason``).
OK = "ok"
DOES_NOT_FIT = "does-not-fit"
ERROR = "error"


def profile_role(keys: RunKeys, memory_mb: int, digest: str = "") -> Role:
    """The role of the function that profiles the ``memory_mb`` tier. ``stage`` carries the
    tier's memory size: a backend starts the function with that much memory, and the
    worker's status record for it lands under ``keys.status(memory_mb, 0, 0)``."""
    return Role(spec_key=keys.profile("spec", memory_mb), stage=memory_mb, replica=0, start_iteration=0,
                end_iteration=0, kind=PROFILE_KIND, digest=digest)


@dataclass(frozen=True)
class ProfileSpec:
    """What one profiler function measures. Stage ``i`` of the run's artifacts is layer ``i``
    of ``layers``; ``layer_inputs[i]`` names the values it reads, ``weight_bytes[i]`` and
    ``grad_bytes[i]`` are its parameters and buffers and its trainable parameters' bytes
    (from its manifest, so that the tier is checked before any artifact is loaded; the
    weights also count in every micro-batch size's need).
    ``grad_values``: boundary values that depend on a parameter (their gradient is
    computed, as a stage computes the gradient it sends back). ``emulate_cpu``: hold the
    computation to ``vcpus`` (local backend); off where the platform enforces its own
    share. ``bandwidth_probe_bytes``: when positive, also time a put and a get of that many
    bytes through the store (FuncPipe's W_j); 0 skips it."""

    run: str
    layers: tuple[str, ...]
    layer_inputs: tuple[tuple[str, ...], ...]
    weight_bytes: tuple[int, ...]
    grad_bytes: tuple[int, ...]
    input_names: tuple[str, ...]
    grad_values: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    example_batch: int
    memory_mb: int
    vcpus: float
    emulate_cpu: bool
    base_memory_bytes: int
    repeats: int = 3
    warmup: int = 1
    threads: int = 1
    bandwidth_probe_bytes: int = 0

    def dumps(self) -> bytes:
        return json.dumps({"format": SPEC_FORMAT, **asdict(self)}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> ProfileSpec:
        data = json.loads(raw)
        if data.pop("format", None) != SPEC_FORMAT:
            raise ValueError(f"not a profile spec (expected \"format\": \"{SPEC_FORMAT}\")")
        for name in ("layers", "weight_bytes", "grad_bytes", "input_names", "grad_values", "batch_sizes"):
            data[name] = tuple(data[name])
        data["layer_inputs"] = tuple(tuple(names) for names in data["layer_inputs"])
        return cls(**data)


@dataclass(frozen=True)
class LayerResult:
    """One layer on one tier: its lines (``None`` when no micro-batch size could be
    measured), the smallest micro-batch size that does not fit the tier (``None``: all
    fit), and notes on the sizes left out."""

    name: str
    forward_s: Linear | None = None
    backward_s: Linear | None = None
    over_tier_at: int | None = None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name,
                "forward_s": self.forward_s.to_json() if self.forward_s else None,
                "backward_s": self.backward_s.to_json() if self.backward_s else None,
                "over_tier_at": self.over_tier_at, "notes": list(self.notes)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerResult:
        return cls(name=data["name"],
                   forward_s=Linear.from_json(data["forward_s"]) if data.get("forward_s") else None,
                   backward_s=Linear.from_json(data["backward_s"]) if data.get("backward_s") else None,
                   over_tier_at=data.get("over_tier_at"), notes=tuple(data.get("notes", ())))


@dataclass(frozen=True)
class TierResult:
    """What one profiler function reports: ``status`` (``ok``, ``does-not-fit``, ``error``),
    why when not ok, every layer measured so far, when probed its bandwidth to the store,
    and notes on the tier as a whole."""

    memory_mb: int
    status: str
    layers: tuple[LayerResult, ...] = ()
    reason: str = ""
    bandwidth_bytes_s: float | None = None
    notes: tuple[str, ...] = ()

    def dumps(self) -> bytes:
        data = asdict(self)
        data["layers"] = [layer.to_json() for layer in self.layers]
        return json.dumps({"format": RESULT_FORMAT, **data}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> TierResult:
        data = json.loads(raw)
        if data.pop("format", None) != RESULT_FORMAT:
            raise ValueError(f"not a profile result (expected \"format\": \"{RESULT_FORMAT}\")")
        data["layers"] = tuple(LayerResult.from_json(layer) for layer in data["layers"])
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)


# --- the function ---------------------------------------------------------------------------


def run_profile(store: Store, role: Role, raw_spec: bytes) -> int:
    """Profiles every layer on this function's tier and writes a :class:`TierResult` to the
    store; returns the exit code, 0 once a result is written, whatever it says (a layer
    that does not fit, or refuses every micro-batch size, is a result). A failure outside
    the measurement (the store, an artifact) raises, for the worker to record in its status.
    Of ``role`` only the artifact digest is read (each layer's stage is verified against it);
    the spec says all else the function needs (the tier is ``spec.memory_mb``, as ``role.stage`` is)."""
    spec = ProfileSpec.loads(raw_spec)
    keys = RunKeys(spec.run)
    torch.set_num_threads(spec.threads)

    def finish(status: str, layers: list[LayerResult], reason: str = "", bandwidth: float | None = None) -> int:
        notes: list[str] = []
        peak = peak_rss_bytes()
        if spec.emulate_cpu and peak > spec.memory_mb * MIB:
            # a local process is not a function's runtime (this host's interpreter, torch build
            # and allocator), so fits are judged with the platform's runtime size instead
            notes.append(f"this local process peaked at {mb(peak)} resident, over the tier; fits were judged with "
                         f"the platform's runtime size ({mb(spec.base_memory_bytes)}) instead")
        result = TierResult(spec.memory_mb, status, tuple(layers), reason, bandwidth, tuple(notes))
        store.put(keys.profile("result", spec.memory_mb), result.dumps())
        return 0

    too_big = [_static_misfit(spec, index) for index in range(len(spec.layers))]
    if any(too_big):
        reasons = [reason for reason in too_big if reason]
        return finish(DOES_NOT_FIT, [LayerResult(name, over_tier_at=min(spec.batch_sizes) if reason else None,
                                                 notes=(reason,) if reason else ())
                                     for name, reason in zip(spec.layers, too_big)],
                      f"the {spec.memory_mb} MB tier cannot hold " + "; ".join(reasons))


    given = unpack_values(store.get(keys.profile("inputs")))
    leaves = [given[name] for name in spec.input_names]
    envs = {batch: dict(zip(spec.input_names, resize_inputs(leaves, batch, spec.example_batch)))
            for batch in sorted(set(spec.batch_sizes))}
    last_reader = {name: index for index, names in enumerate(spec.layer_inputs) for name in names}
    throttle = cpu_throttle(spec.vcpus if spec.emulate_cpu else None, spec.threads)
    # an emulated tier is timed by its own clock, so the host's other load does not bend its lines
    clock = (emulated_clock(spec.vcpus, spec.threads) if spec.emulate_cpu and spec.vcpus is not None
             else time.perf_counter)
    measured: list[LayerResult] = []
    for index, name in enumerate(spec.layers):
        module = load_module(store, keys, index, role.digest)
        layer_names = list(stage_manifest(module).layer_names)
        if layer_names != [name]:
            raise ValueError(f"stage {index} of the run holds layers {layer_names}, not "
                             f"the one layer {name!r}: the profiler needs the chain compiled one layer per stage")
        layer = _profile_layer(module, index, envs, spec, throttle, clock)
        measured.append(layer)
        if layer.forward_s is None:
            status = DOES_NOT_FIT if layer.over_tier_at is not None else ERROR
            return finish(status, measured, f"layer {index} ({name}) could not be measured on the {spec.memory_mb} "
                                            f"MB tier: {'; '.join(layer.notes)}")
        for batch in list(envs):
            try:
                forward_outputs(module, envs[batch])
            except Exception as err:  # noqa: BLE001 - later layers are measured at the other sizes
                del envs[batch]
                measured[-1] = _with_note(measured[-1], f"micro-batch {batch} dropped for the later layers: "
                                                        f"{first_line(err)}")
        del module
        for values in envs.values():   # free what no later layer reads
            for value_name in [key for key in values if last_reader.get(key, -1) <= index]:
                del values[value_name]
    bandwidth = (_probe_bandwidth(store, keys.profile("probe", spec.memory_mb), spec.bandwidth_probe_bytes)
                 if spec.bandwidth_probe_bytes > 0 else None)
    return finish(OK, measured, bandwidth=bandwidth)


def _profile_layer(module: torch.nn.Module, index: int, envs: dict[int, dict[str, Any]], spec: ProfileSpec,
                   throttle: Any, clock: Callable[[], float] = time.perf_counter) -> LayerResult:
    """Layer ``index`` at each micro-batch size, smallest first: predicted need
    (extrapolated from the sizes already measured) and measured need against the tier, then
    the timing. A size over the tier, and every larger one, is left out of the fit and noted."""
    limit = spec.memory_mb * MIB
    weights = spec.weight_bytes[index]
    sizes: list[int] = []
    peaks: list[int] = []
    forward: list[float] = []
    backward: list[float] = []
    notes: list[str] = []
    over_tier_at = None
    for batch in sorted(envs):
        if peaks:
            predicted = spec.base_memory_bytes + weights + int(Linear.fit(sizes, peaks).at(batch))
            if predicted > limit:
                notes.append(f"micro-batch {batch} and larger not run: predicted need {mb(predicted)} does not fit "
                             f"the {spec.memory_mb} MB tier")
                over_tier_at = batch
                break
        values = envs[batch]
        try:
            peak = layer_peak_bytes(module, values, spec.grad_values)
        except Exception as err:  # noqa: BLE001 - a size the layer refuses: fit over the others, as the host does
            notes.append(f"micro-batch {batch} refused: {first_line(err)}")
            continue
        need = spec.base_memory_bytes + weights + peak
        if need > limit:
            notes.append(f"micro-batch {batch} and larger not timed: needs {mb(need)} (runtime "
                         f"{mb(spec.base_memory_bytes)}, weights {mb(weights)}, forward+backward peak {mb(peak)}), "
                         f"which does not fit the {spec.memory_mb} MB tier")
            over_tier_at = batch
            break
        fwd, bwd = time_layer(module, values, spec.grad_values, repeats=spec.repeats, warmup=spec.warmup,
                              execute=throttle, clock=clock)
        sizes.append(batch)
        peaks.append(peak)
        forward.append(fwd)
        backward.append(bwd)
    name = spec.layers[index]
    if not sizes:
        return LayerResult(name, over_tier_at=over_tier_at, notes=tuple(notes))
    return LayerResult(name, Linear.fit(sizes, forward), Linear.fit(sizes, backward), over_tier_at, tuple(notes))


def _static_misfit(spec: ProfileSpec, index: int) -> str:
    """Why layer ``index`` cannot fit the tier even before any activation (runtime +
    weights + gradients), or "" when it may fit."""
    weights, gradients = spec.weight_bytes[index], spec.grad_bytes[index]
    need = spec.base_memory_bytes + weights + gradients
    if need <= spec.memory_mb * MIB:
        return ""
    return (f"layer {index} ({spec.layers[index]}), which needs at least {mb(need)} (runtime "
            f"{mb(spec.base_memory_bytes)}, weights {mb(weights)}, gradients {mb(gradients)}) before any activation")


def _probe_bandwidth(store: Store, key: str, nbytes: int) -> float:
    """Bytes per second of one put and one get of ``nbytes`` at ``key`` (the mean of the
    two ways); the object is deleted after."""
    payload = os.urandom(nbytes)
    began = time.perf_counter()
    store.put(key, payload)
    store.get(key)
    seconds = time.perf_counter() - began
    store.delete(key)
    return 2 * nbytes / max(seconds, 1e-9)


def _with_note(layer: LayerResult, note: str) -> LayerResult:
    return replace(layer, notes=(*layer.notes, note))
