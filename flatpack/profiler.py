"""The profiler: per layer of the chain, forward and backward seconds on this host and the
bytes a stage worker holds (parameters, gradients, saved activations, boundary, peak,
optimizer state).

How it measures: every layer is emitted as a one-layer stage by ``codegen`` — the very code a
stage worker runs — and timed and sized by ``flatpack.measure`` (which says why it times a
chain that way rather than with an fx ``Interpreter`` or module hooks), the same code a
function's profile role runs (``runtime.profile_function``).

Times and sizes are fitted as ``a·batch + b`` over several micro-batch sizes (FuncPipe §4);
profiles are cached on disk, keyed by the graph's hash, the input shapes and dtypes, the
torch version and the measurement settings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from flatpack import measure
from flatpack.atomic import write_atomic
from flatpack.codegen.emit import emit_stages
from flatpack.cpus import measured_cpus
from flatpack.errors import InputError, first_line
from flatpack.ir import meta
from flatpack.ir.graph import LayerGraph
from flatpack.ir.profile import CACHE_ENV, ChainProfile, HostInfo, LayerProfile, Linear, ProfileWarning
from flatpack.ir.trace import EXPORT
from flatpack.partitioner.plan import Plan
from flatpack.stage.artifact import build_module, stage_manifest

log = logging.getLogger("flatpack.profiler")

PROFILE_SCHEMA_VERSION = 4     # 4: a CPU profile at one thread is timed by the thread's CPU seconds
DEFAULT_BATCH_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class ProfileOptions:
    """``batch_sizes``: the micro-batch sizes measured (the line is fitted through them).
    ``repeats``: timed runs through the chain per size after ``warmup`` untimed ones; each
    layer keeps its median. ``max_seconds``: a wall-time budget for the timing, spread over
    the sizes — once a size's share is spent no further runs start (one timed run always
    happens).
    ``cache_dir``: where profiles are kept (default ``$FLATPACK_CACHE_DIR`` or the user's
    cache directory); ``use_cache=False`` measures afresh. ``progress``: a progress bar on
    stderr (default: when stderr is a terminal)."""

    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    repeats: int = 5
    warmup: int = 1
    max_seconds: float | None = None
    cache_dir: str | None = None
    use_cache: bool = True
    progress: bool | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0
                                       for b in self.batch_sizes):
            raise InputError(f"profile batch sizes must be positive integers, got {self.batch_sizes!r}")
        if self.repeats < 1 or self.warmup < 0:
            raise InputError(f"profiling needs repeats >= 1 and warmup >= 0, got {self.repeats} and {self.warmup}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise InputError(f"max_seconds must be positive, got {self.max_seconds!r}")

    def key_fields(self) -> dict[str, Any]:
        """The settings that change what is measured (the time budget does not)."""
        return {"batch_sizes": sorted(set(self.batch_sizes)), "repeats": self.repeats, "warmup": self.warmup,
                "device": self.device}


# --- public entry points ------------------------------------------------------------------------


def profile_graph(graph: LayerGraph, inputs: Sequence[Any], options: ProfileOptions | None = None) -> ChainProfile:
    """Profiles every layer of ``graph`` with the model's flat ``inputs`` (one per graph
    placeholder, in order, as ``flatten_inputs`` gives them), or loads the cached profile."""
    options = options or ProfileOptions()
    if options.device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"profiling on {options.device!r} was asked for but torch sees no CUDA device here; "
                         "profile on device='cpu', or run on the GPU host")
    if not (options.device == "cpu" or options.device.startswith("cuda")):
        raise InputError(f"the profiler runs on 'cpu' or 'cuda[:N]', not {options.device!r}")
    tensors = [value for value in inputs if isinstance(value, torch.Tensor)]
    example_batch = measure.example_batch(tensors)
    _refuse_static_batch(graph, options)
    graph_digest = graph_hash(graph)
    key = cache_key(graph_digest, tensors, options)
    path = cache_path(key, options.cache_dir)
    if options.use_cache:
        cached = _read_cache(path)
        if cached is not None:
            log.debug("profile of %d layers loaded from cache (%s)", len(cached.layers), path)
            _warn_flat_slopes(cached)
            return cached
    started = time.perf_counter()
    measured, sizes, notes = _measure(graph, list(inputs), example_batch, options)
    input_bytes = Linear.fit(sizes, [sum(measure.nbytes(value) for value in measure.resize_inputs(inputs, size,
                                                                                                  example_batch))
                                     for size in sizes])
    flat = flat_slopes(measured, sizes)
    profile = ChainProfile(tuple(measured), host_info(options.device), tuple(sizes), graph_digest,
                           _dominant_dtype(graph), options.repeats, input_bytes, tuple(notes),
                           wall_s=time.perf_counter() - started, flat_slopes=flat)
    _warn_flat_slopes(profile)
    if options.use_cache:
        _write_cache(path, profile)
    return profile


def _refuse_static_batch(graph: LayerGraph, options: ProfileOptions) -> None:
    """A graph whose batch dimension torch.export fixed runs at one batch size only: a line
    fitted over several sizes would be made of refusals and one point, so say why instead."""
    traced = graph.traced
    if traced.frontend != EXPORT or traced.dynamic_batch or len(set(options.batch_sizes)) < 2:
        return
    shapes = ", ".join(str(tuple(leaf.shape)) for leaf in traced.example_leaves[:4])
    why = "; ".join(traced.notes) or "export specialized the batch dimension"
    raise InputError(
        f"cannot profile over batch sizes {sorted(set(options.batch_sizes))}: the traced graph fixes the batch "
        f"dimension of its inputs ({shapes}; {why}), so every other batch size would be refused and the "
        "fitted time per sample would be meaningless. Pass example inputs with a batch of 2 or more that the "
        "model accepts at other batch sizes, or profile the one batch size it runs at "
        f"(ProfileOptions(batch_sizes=({traced.example_leaves[0].shape[0] if traced.example_leaves else 1},)))."
    )


def flat_slopes(layers: Sequence[LayerProfile], sizes: Sequence[int]) -> tuple[str, ...]:
    """The time lines (forward, backward) whose fitted per-sample slope is zero: measured
    over two or more batch sizes, they did not grow with the batch (or fell, and were
    clamped). One size cannot show a slope, so nothing is reported then."""
    if len(set(sizes)) < 2:
        return ()
    flat = []
    for index, layer in enumerate(layers):
        for what, line in (("forward", layer.forward_s), ("backward", layer.backward_s)):
            if line.per_sample <= 0.0 and line.fixed > 0.0:
                flat.append(f"layer {index} ({layer.name}): {what}")
    return tuple(flat)


def _warn_flat_slopes(profile: ChainProfile) -> None:
    if profile.slopes_trusted:
        return
    total = sum(layer.forward_s.per_sample for layer in profile.layers)
    shown = "; ".join(profile.flat_slopes[:5]) + ("; …" if len(profile.flat_slopes) > 5 else "")
    whole = (" The whole chain's forward time does not grow with the batch: the profile cannot tell micro-batch "
             "sizes apart." if total <= 0.0 else "")
    warnings.warn(
        f"{len(profile.flat_slopes)} layer time(s) did not grow over batch sizes {list(profile.batch_sizes)}; "
        f"their fitted time per sample is 0 and the micro-batch does not change their prediction: {shown}.{whole} "
        "Profile larger batch sizes (ProfileOptions(batch_sizes=...)) or more repeats; "
        "profile.flat_slopes lists them.", ProfileWarning, stacklevel=3)


def attach(graph: LayerGraph, profile: ChainProfile) -> None:
    """Stores each layer's profile in ``layer.meta["profile"]`` (``meta.PROFILE``)."""
    if len(profile.layers) != len(graph.layers):
        raise InputError(f"the profile has {len(profile.layers)} layers, the graph {len(graph.layers)}; "
                         "profile the graph after the passes")
    for layer, layer_profile in zip(graph.layers, profile.layers):
        layer.meta[meta.PROFILE] = layer_profile


def graph_hash(graph: LayerGraph) -> str:
    """Identifies the computation and its cut into layers: the graph's generated code, the
    shape and dtype of every parameter and buffer (the code alone does not change when a
    model is made wider), and the node names of every layer. Equal models traced the same
    way hash equal, whatever their weights' values."""
    digest = hashlib.sha256(graph.gm.code.encode())
    for name, tensor in sorted([*graph.gm.named_parameters(), *graph.gm.named_buffers()]):
        digest.update(f"\x00{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    for layer in graph.layers:
        digest.update(b"\x00" + "\x01".join(layer.nodes).encode())
    return digest.hexdigest()[:32]


def host_info(device: str = "cpu") -> HostInfo:
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return HostInfo(device="cuda" if gpu else "cpu", threads=torch.get_num_threads(), cpu=_cpu_name(),
                    torch_version=torch.__version__, gpu=gpu)


def cache_key(graph_digest: str, tensors: Sequence[torch.Tensor], options: ProfileOptions) -> str:
    key = {"schema": PROFILE_SCHEMA_VERSION, "graph": graph_digest, "torch": torch.__version__,
           "threads": torch.get_num_threads(),
           "inputs": [[list(tensor.shape), str(tensor.dtype)] for tensor in tensors], **options.key_fields()}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return default_cache_dir(cache_dir) / f"{key}.json"


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "flatpack" / "profiles"


# --- measurement --------------------------------------------------------------------------------


def _measure(graph: LayerGraph, inputs: list[Any], example_batch: int,
             options: ProfileOptions) -> tuple[list[LayerProfile], list[int], list[str]]:
    """The layers' profiles, the batch sizes they were fitted over, and notes on the sizes
    the model refused (training-mode BatchNorm cannot normalize one value per channel, so
    batch 1 fails where the spatial size has shrunk to 1×1)."""
    count = len(graph.layers)
    plan = Plan.from_ranges([(index, index) for index in range(count)], count, solver="profiler")
    device = torch.device(options.device)
    artifacts = emit_stages(graph, plan)
    modules = []
    while artifacts:  # each artifact's weight snapshot is dropped once its module holds a copy
        artifact = artifacts.pop(0)
        modules.append(build_module(artifact, f"<flatpack profile layer {artifact.index}>").to(device))
    sizes = sorted(set(options.batch_sizes))
    per_size = options.max_seconds / len(sizes) if options.max_seconds else None
    cpus = measurement_cpus(device)
    runs = len(measure.run_schedule(cpus, options.warmup, options.repeats))
    progress = _Progress((runs + count) * len(sizes), _progress_enabled(options))
    samples: list[dict[int, _Sample]] = [{} for _ in range(count)]
    input_names = [node.name for node in graph.gm.graph.nodes if node.op == "placeholder"]
    refused: dict[int, str] = {}
    grad_values = graph.analysis.param_dependent
    try:
        for batch in sizes:
            try:
                env = _reference_values(modules, input_names, measure.resize(inputs, batch, example_batch, device))
            except Exception as err:  # noqa: BLE001 - any refusal means: fit over the other sizes
                refused[batch] = first_line(err)
                progress.skip(runs + count)
                continue
            training, inference = measure.time_chain(modules, env, grad_values, repeats=options.repeats,
                                                     warmup=options.warmup, budget_s=per_size, progress=progress,
                                                     batch=batch, clock=host_clock(device), cpus=cpus)
            for index, module in enumerate(modules):
                progress.step(f"memory of layer {index} ({graph.layers[index].name}) at batch {batch}")
                samples[index][batch] = _layer_sample(module, measure.layer_inputs(module, env, grad_values),
                                                      (*training[index], inference[index]), graph.crossing(index),
                                                      env)
    finally:
        progress.close()
    measured = [batch for batch in sizes if batch not in refused]
    if not measured:
        details = "; ".join(f"batch {batch}: {reason}" for batch, reason in refused.items())
        raise InputError(f"the model fails at every profiling batch size ({details}); pass sizes it accepts, "
                         "e.g. ProfileOptions(batch_sizes=(2, 4, 8))")
    notes = [f"batch {batch} skipped, the model refused it: {reason}" for batch, reason in refused.items()]
    for note in notes:
        log.warning("profiling: %s", note)
    layers = [_fit_layer(graph.layers[index].name, module, samples[index]) for index, module in enumerate(modules)]
    return layers, measured, notes


@dataclass
class _Sample:
    forward_s: float
    backward_s: float
    inference_s: float
    saved_bytes: int
    saved_boundary_bytes: dict[str, int]
    output_bytes: int
    peak_bytes: int
    grad_bytes: int


def host_clock(device: torch.device) -> Callable[[], float]:
    """How the host profile times a layer: on the CPU at one thread, by the profiling
    thread's CPU seconds (``time.thread_time``), which other processes on a busy host do not
    stretch, and which is what a function worker's CPU throttle stretches by its tier's share
    (``runtime.worker.cpu_throttle`` times the compute by ``thread_time`` too); with more
    threads (the other threads' CPU would be missed) and on a GPU (kernels run beside the
    thread), by wall time."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def measurement_cpus(device: torch.device) -> tuple[int | None, ...]:
    """The CPUs a host profile shares its timed runs among: on the CPU, those
    ``flatpack.cpus.measured_cpus`` gives at torch's thread count (up to two at one thread,
    where ``host_clock`` times by the profiling thread's CPU seconds; none pinned with more);
    on a GPU, ``(None,)``."""
    return measured_cpus(torch.get_num_threads()) if device.type == "cpu" else (None,)


def _layer_sample(module: nn.Module, args: list[Any], times: tuple[float, float, float], crossing: list[str],
                  env: dict[str, Any]) -> _Sample:
    """The layer's timing plus what it holds in memory, measured on the layer alone."""
    memory = measure.memory_of(module, args)
    manifest = stage_manifest(module)
    named = {**dict(zip(manifest.input_names, args)), **dict(zip(manifest.output_names, memory.outputs))}
    output_bytes = sum(measure.nbytes(env[name]) for name in crossing)
    return _Sample(times[0], times[1], times[2], memory.saved_bytes, memory.saved_boundary_bytes(named),
                   output_bytes, memory.peak, memory.grad_bytes)


def _fit_layer(name: str, module: nn.Module, samples: dict[int, _Sample]) -> LayerProfile:
    sizes = sorted(samples)

    def line(attribute: str) -> Linear:
        return Linear.fit(sizes, [getattr(samples[size], attribute) for size in sizes])

    trainable = [param for param in module.parameters() if param.requires_grad]
    return LayerProfile(
        name=name, forward_s=line("forward_s"), backward_s=line("backward_s"),
        param_bytes=measure.unique_bytes(trainable), grad_bytes=max(samples[size].grad_bytes for size in sizes),
        buffer_bytes=measure.unique_bytes(module.buffers()), saved_bytes=line("saved_bytes"),
        output_bytes=line("output_bytes"), peak_bytes=line("peak_bytes"),
        optimizer_state_bytes=optimizer_state_bytes(trainable), saved_boundary_bytes=_boundary_lines(samples),
        inference_s=line("inference_s"),
    )


def _boundary_lines(samples: dict[int, _Sample]) -> dict[str, Linear]:
    sizes = sorted(samples)
    names = {name for size in sizes for name in samples[size].saved_boundary_bytes}
    return {name: Linear.fit(sizes, [samples[size].saved_boundary_bytes.get(name, 0) for size in sizes])
            for name in sorted(names)}


def optimizer_state_bytes(params: Sequence[nn.Parameter]) -> dict[str, int]:
    """Bytes of state one step of each optimizer creates, read from the optimizer itself
    (on copies, so the layer's parameters are untouched)."""
    copies = [nn.Parameter(param.detach().clone()) for param in params]
    if not copies:
        return {"sgd": 0, "sgd-momentum": 0, "adam": 0}
    optimizers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "sgd": lambda: torch.optim.SGD(copies, lr=0.1),
        "sgd-momentum": lambda: torch.optim.SGD(copies, lr=0.1, momentum=0.9),
        "adam": lambda: torch.optim.Adam(copies, lr=0.1),
    }
    result = {}
    for name, make in optimizers.items():
        for copy in copies:
            copy.grad = torch.zeros_like(copy)
        optimizer = make()
        optimizer.step()
        result[name] = measure.unique_bytes(value for state in optimizer.state.values()
                                            for value in state.values() if isinstance(value, torch.Tensor))
    return result


def _reference_values(modules: list[nn.Module], input_names: list[str], inputs: list[Any]) -> dict[str, Any]:
    """Every boundary value at this batch size, from one forward through the layers."""
    env = dict(zip(input_names, inputs))
    measure.serve_chain(modules, env)
    return env


# --- small helpers -----------------------------------------------------------------------------


def _dominant_dtype(graph: LayerGraph) -> str:
    sizes: dict[str, int] = {}
    for tensor in [*graph.gm.parameters(), *graph.gm.buffers()]:
        sizes[str(tensor.dtype)] = sizes.get(str(tensor.dtype), 0) + tensor.numel()
    return max(sizes, key=lambda dtype: sizes[dtype]) if sizes else "torch.float32"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _progress_enabled(options: ProfileOptions) -> bool:
    return options.progress if options.progress is not None else sys.stderr.isatty()


def _read_cache(path: Path) -> ChainProfile | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("schema") != PROFILE_SCHEMA_VERSION:
        return None
    try:
        return ChainProfile.from_json(data["profile"], cache_hit=True)
    except (KeyError, TypeError, ValueError):
        log.warning("ignoring unreadable profile cache entry %s", path)
        return None


def _write_cache(path: Path, profile: ChainProfile) -> None:
    """Writes atomically, so a reader never sees half a profile; a read-only cache
    directory costs the cache, not the profile."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"schema": PROFILE_SCHEMA_VERSION, "profile": profile.to_json()}))
    except OSError as err:
        log.warning("could not write the profile cache %s: %s", path, err)


class _Progress:
    """The profiler's steps as a progress display on stderr (flatpack.progress: a bar
    on a terminal, periodic plain lines elsewhere): steps done, elapsed time, what runs now."""

    def __init__(self, total: int, enabled: bool) -> None:
        # optional dependency: tqdm is not in a function image, where the profile role times layers
        # without a display
        from flatpack.progress import Progress

        self.total, self.done = total, 0
        self.started = time.perf_counter()
        self.display = Progress(total, "profiling ", sys.stderr) if enabled else None

    def step(self, what: str) -> None:
        if self.display is not None:
            elapsed = time.perf_counter() - self.started
            self.display.update(self.done, f"{self.done}/{self.total} {elapsed:.1f} s  {what[:48]}")
        self.done += 1

    def skip(self, steps: int) -> None:
        self.done += steps

    def close(self) -> None:
        if self.display is not None:
            elapsed = time.perf_counter() - self.started
            self.display.update(self.done, f"{self.done}/{self.total} {elapsed:.1f} s  done")
            self.display.close()
