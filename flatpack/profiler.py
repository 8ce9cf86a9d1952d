"""The profiler: per layer of the chain, forward and backward seconds on this host and the
bytes a stage worker holds (parameters, gradients, saved activations, boundary, peak,
optimizer state).

How it measures, and why this way rather than an fx ``Interpreter`` or module hooks: every
layer is emitted as a one-layer stage by ``codegen`` — the very code a stage worker runs.
Timing runs them in chain order, forward then backward in reverse, each layer's inputs
detached so that its backward is its own: that isolates each layer's backward exactly
(hooks on a whole model cannot split backward time between layers that interleave, and an
Interpreter times node by node with Python overhead the worker does not have) while the
caches see what a stage sees. Memory is measured on each layer alone: what autograd keeps
for backward is read from ``saved_tensors_hooks``, not guessed from shapes, and the peak
from a dispatch-mode tracker of live storages.

Times and sizes are fitted as ``a·batch + b`` over several micro-batch sizes (FuncPipe §4);
profiles are cached on disk, keyed by the graph's hash, the input shapes and dtypes, the
torch version and the measurement settings.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flatpack.atomic import write_atomic
from flatpack.batching import batch_rows, has_batch_dimension
from flatpack.codegen.emit import emit_stages
from flatpack.cpus import measured_cpus, pinned, runs_per_cpu
from flatpack.errors import InputError
from flatpack.ir import meta
from flatpack.ir.graph import LayerGraph
from flatpack.ir.profile import CACHE_ENV, ChainProfile, HostInfo, LayerProfile, Linear, ProfileWarning
from flatpack.ir.trace import EXPORT, _first_line
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
    example_batch = _example_batch(tensors)
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
    input_bytes = Linear.fit(sizes, [sum(_nbytes(value) for value in _resize(list(inputs), size, example_batch,
                                                                           torch.device("cpu")))
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
    runs = len(_run_schedule(cpus, options.warmup, options.repeats))
    progress = _Progress((runs + count) * len(sizes), _progress_enabled(options))
    samples: list[dict[int, _Sample]] = [{} for _ in range(count)]
    input_names = [node.name for node in graph.gm.graph.nodes if node.op == "placeholder"]
    refused: dict[int, str] = {}
    grad_values = graph.analysis.param_dependent
    try:
        for batch in sizes:
            try:
                env = _reference_values(modules, input_names, _resize(inputs, batch, example_batch, device))
            except Exception as err:  # noqa: BLE001 - any refusal means: fit over the other sizes
                refused[batch] = _first_line(err)
                progress.skip(runs + count)
                continue
            training, inference = _time_chain(modules, env, grad_values, repeats=options.repeats,
                                              warmup=options.warmup, budget_s=per_size, progress=progress,
                                              batch=batch, clock=host_clock(device), cpus=cpus)
            for index, module in enumerate(modules):
                progress.step(f"memory of layer {index} ({graph.layers[index].name}) at batch {batch}")
                samples[index][batch] = _layer_sample(module, _layer_inputs(module, env, grad_values),
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


def _direct(compute: Callable[[], Any]) -> Any:
    return compute()


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


def _run_schedule(cpus: Sequence[int | None], warmup: int, repeats: int) -> list[tuple[int | None, bool]]:
    """(cpu, timed) per run through the chain: ``warmup`` untimed runs on the first CPU, then
    its share of the ``repeats`` timed ones; on each further CPU one untimed run (the move
    leaves its caches cold; none when ``warmup`` is 0), then its share."""
    schedule: list[tuple[int | None, bool]] = []
    for index, (cpu, share) in enumerate(zip(cpus, runs_per_cpu(repeats, len(cpus)))):
        schedule += [(cpu, False)] * (warmup if index == 0 else min(warmup, 1)) + [(cpu, True)] * share
    return schedule


def _time_chain(modules: list[nn.Module], env: dict[str, Any], grad_values: Collection[str], *, repeats: int,
                warmup: int, budget_s: float | None = None, progress: _Progress | None = None, batch: int = 0,
                execute: Callable[[Callable[[], Any]], Any] = _direct,
                inference: bool = True,
                clock: Callable[[], float] = time.perf_counter,
                cpus: Sequence[int | None] = (None,)) -> tuple[list[tuple[float, float]], list[float]]:
    """Median forward and backward seconds of every layer, and with ``inference`` its no-grad
    forward's, over ``repeats`` timed runs after ``warmup`` untimed ones, timed the way a
    stage runs them: forward through all layers in order (each on its predecessors' fresh
    outputs, detached at the layer's inputs so its backward is its own), then backward layer
    by layer in reverse, then (``inference``) a forward under ``no_grad``. Timing each layer
    in a tight loop of its own instead would keep its weights and activations in the CPU
    caches, which a stage running many layers in turn does not.
    ``grad_values``: the value names whose gradient a stage computes (see ``_layer_inputs``).
    ``budget_s``: once spent, no further run starts (one timed run always happens).
    ``progress`` (with ``batch`` for its messages): a bar to advance, if any. ``execute``
    runs each timed computation: directly, or through a tier's CPU throttle
    (``runtime.function.cpu_throttle``) when profiling inside an emulated tier, and ``clock``
    times it: wall time, or an emulated tier's own clock (``runtime.function.emulated_clock``:
    CPU seconds over the tier's share, which the host's other load does not inflate).
    ``cpus``: the timed runs are shared among these CPUs, the calling thread pinned to each
    in turn (``flatpack.cpus``; ``None``: where it runs), each CPU's first run after the move
    untimed, and a layer's figure is its per-CPU medians' mean. Returns
    (forward, backward) per layer, and the no-grad forward per layer (empty when not
    ``inference``)."""
    schedule = _run_schedule(cpus, warmup, repeats)
    forward_times: dict[int | None, list[list[float]]] = {cpu: [[] for _ in modules] for cpu in cpus}
    backward_times: dict[int | None, list[list[float]]] = {cpu: [[] for _ in modules] for cpu in cpus}
    inference_times: dict[int | None, list[list[float]]] = {cpu: [[] for _ in modules] for cpu in cpus}
    synchronize = _synchronizer(list(env.values()))
    started = time.perf_counter()
    timed_runs = 0
    # a CPU's pin is held over all its runs: given back between runs, the thread could move and
    # come back to cold caches before a timed run
    with contextlib.ExitStack() as pin:
        pinned_to: object = object()
        for run, (cpu, timed) in enumerate(schedule):
            if cpu != pinned_to:
                pin.close()
                pin.enter_context(pinned(cpu))
                pinned_to = cpu
            if progress is not None:
                progress.step(f"{'timed' if timed else 'warm-up'} run {run + 1} at batch {batch}")
            forward_run, backward_run = [0.0] * len(modules), [0.0] * len(modules)
            values = dict(env)
            outputs = []
            for index, module in enumerate(modules):
                args = _layer_inputs(module, values, grad_values)
                synchronize()
                begin = clock()
                result = execute(lambda: module(*args))
                synchronize()
                forward_run[index] = clock() - begin
                outputs.append(result)
                names = stage_manifest(module).output_names
                values.update(zip(names, (value.detach() if isinstance(value, torch.Tensor) else value
                                          for value in result)))
            for index in reversed(range(len(modules))):
                synchronize()
                begin = clock()
                execute(lambda: _backward(outputs[index]))
                synchronize()
                backward_run[index] = clock() - begin
                outputs[index] = None  # frees the layer's saved tensors, as a stage's backward does
            for module in modules:
                module.zero_grad(set_to_none=True)
            served_run: list[list[float]] = [[] for _ in modules]
            if inference:
                _serve_chain(modules, dict(env), served_run, synchronize, execute, clock)
            if timed:
                timed_runs += 1
                for index in range(len(modules)):
                    forward_times[cpu][index].append(forward_run[index])
                    backward_times[cpu][index].append(backward_run[index])
                    inference_times[cpu][index] += served_run[index]
            if timed_runs >= 1 and budget_s is not None and time.perf_counter() - started > budget_s:
                if progress is not None:
                    progress.skip(len(schedule) - run - 1)
                break
    measured = [cpu for cpu in cpus if forward_times[cpu][0]] if modules else []

    def figure(times: dict[int | None, list[list[float]]], index: int) -> float:
        return statistics.mean(statistics.median(times[cpu][index]) for cpu in measured)

    training = [(figure(forward_times, index), figure(backward_times, index)) for index in range(len(modules))]
    served = [figure(inference_times, index) for index in range(len(modules))] if inference else []
    return training, served


def _layer_sample(module: nn.Module, args: list[Any], times: tuple[float, float, float], crossing: list[str],
                  env: dict[str, Any]) -> _Sample:
    """The layer's timing plus what it holds in memory, measured on the layer alone."""
    memory = _memory(module, args)
    manifest = stage_manifest(module)
    named = {**dict(zip(manifest.input_names, args)), **dict(zip(manifest.output_names, memory.outputs))}
    output_bytes = sum(_nbytes(env[name]) for name in crossing)
    return _Sample(times[0], times[1], times[2], memory.saved_bytes, memory.saved_boundary_bytes(named),
                   output_bytes, memory.peak, memory.grad_bytes)


@dataclass
class _Memory:
    saved: dict[int, int]        # storage pointer -> bytes, of what autograd saved
    outputs: list[Any]
    peak: int
    grad_bytes: int

    @property
    def saved_bytes(self) -> int:
        return sum(self.saved.values())

    def saved_boundary_bytes(self, named: dict[str, Any]) -> dict[str, int]:
        """Of the layer's named inputs and outputs, the ones autograd saved, with their bytes."""
        return {name: self.saved[value.untyped_storage().data_ptr()] for name, value in named.items()
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.saved}


@contextlib.contextmanager
def saved_tensors(exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict[int, int]]:
    """While active, records what autograd saves for backward: storage pointer -> bytes,
    each storage once. Storages of ``exclude`` (pass the parameters and buffers: they are
    not activations) are left out. ``sum(saved.values())`` is the activation memory."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield saved


def _memory(module: nn.Module, args: list[Any]) -> _Memory:
    """What autograd saved (parameters excluded: they are not activations), the peak bytes
    allocated during forward+backward, and the gradient bytes the parameters receive."""
    with _LiveBytes() as live:
        with saved_tensors(exclude=[*module.parameters(), *module.buffers()]) as saved:
            outputs = module(*args)
        memory = _Memory(saved, list(outputs), 0, 0)
        _backward(outputs)
    memory.peak = live.peak
    memory.grad_bytes = _unique_bytes(param.grad for param in module.parameters() if param.grad is not None)
    module.zero_grad(set_to_none=True)
    return memory


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of storages created by ops while active and still alive; ``peak`` is
    the most held at once. Storages are counted from the op that creates them until they
    are freed (a finalizer on the storage object, which torch keeps one of per storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.tracked: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in pytree.tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._track(value.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key in self.tracked or nbytes == 0:
            return
        self.tracked.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self.tracked.discard(key)
        self.live -= nbytes


def _backward(outputs: Any) -> None:
    tensors = [value for value in pytree.tree_leaves(outputs)
               if isinstance(value, torch.Tensor) and value.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(tensor) for tensor in tensors])


def _fit_layer(name: str, module: nn.Module, samples: dict[int, _Sample]) -> LayerProfile:
    sizes = sorted(samples)

    def line(attribute: str) -> Linear:
        return Linear.fit(sizes, [getattr(samples[size], attribute) for size in sizes])

    trainable = [param for param in module.parameters() if param.requires_grad]
    return LayerProfile(
        name=name, forward_s=line("forward_s"), backward_s=line("backward_s"),
        param_bytes=_unique_bytes(trainable), grad_bytes=max(samples[size].grad_bytes for size in sizes),
        buffer_bytes=_unique_bytes(module.buffers()), saved_bytes=line("saved_bytes"),
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
        result[name] = _unique_bytes(value for state in optimizer.state.values() for value in state.values()
                                     if isinstance(value, torch.Tensor))
    return result


# --- inputs at other batch sizes ----------------------------------------------------------------


def _example_batch(tensors: Sequence[torch.Tensor]) -> int:
    rows = batch_rows(tensors)
    if rows is None:
        raise InputError("profiling needs at least one tensor input with a batch dimension (dim 0)")
    return rows


def _resize(inputs: list[Any], batch: int, example_batch: int, device: torch.device) -> list[Any]:
    """The inputs at ``batch`` samples: every tensor whose first dimension is the example
    batch is cut or repeated along it (rows cycle), other values pass unchanged."""
    rows = torch.arange(batch) % example_batch
    resized = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            if has_batch_dimension(value, example_batch):
                value = value.index_select(0, rows)
            value = value.to(device)
        resized.append(value)
    return resized


def _reference_values(modules: list[nn.Module], input_names: list[str], inputs: list[Any]) -> dict[str, Any]:
    """Every boundary value at this batch size, from one forward through the layers."""
    env = dict(zip(input_names, inputs))
    _serve_chain(modules, env)
    return env


def _serve_chain(modules: list[nn.Module], values: dict[str, Any], seconds: list[list[float]] | None = None,
                 synchronize: Callable[[], None] = lambda: None,
                 execute: Callable[[Callable[[], Any]], Any] = _direct,
                 clock: Callable[[], float] = time.perf_counter) -> None:
    """One forward through the layers under ``no_grad``, as served: each layer reads its
    inputs from ``values`` and adds its outputs there; ``seconds[i]`` gets layer i's time
    by ``clock``."""
    with torch.no_grad():
        for index, module in enumerate(modules):
            manifest = stage_manifest(module)
            args = [values[name] for name in manifest.input_names]
            synchronize()
            begin = clock()
            outputs = execute(lambda: module(*args))
            synchronize()
            if seconds is not None:
                seconds[index].append(clock() - begin)
            values.update(zip(manifest.output_names, outputs))


def _layer_inputs(module: nn.Module, env: Mapping[str, Any], grad_values: Collection[str]) -> list[Any]:
    """The layer's inputs, detached; the ones a stage receives gradients for (values that
    depend on a parameter, ``grad_values``: ``graph.analysis.param_dependent``) require grad,
    so backward computes the gradient it would send."""
    args = []
    for name in stage_manifest(module).input_names:
        value = env[name]
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if value.untyped_storage().nbytes() > value.numel() * value.element_size():
                # a view into a larger tensor (position ids sliced from a buffer of the layer
                # before): a stage receives it as a tensor of its own, and autograd's saved
                # bytes count whole storages, so give it one
                value = value.clone()
            if value.is_floating_point() and name in grad_values:
                value.requires_grad_(True)
        args.append(value)
    return args


# --- one layer at a time, from its inputs (in-target profiling) --------------------------------
# ``runtime.profile_function`` measures a deployed chain inside a function of each memory tier,
# where there is no LayerGraph: only one-layer stage modules and the values that reach them.
# These entry points give it the measuring code above, unchanged, one layer at a time.


def example_batch_size(inputs: Sequence[Any]) -> int:
    """The batch size of the model's flat inputs: the first dimension of the first tensor
    that has one."""
    return _example_batch([value for value in inputs if isinstance(value, torch.Tensor)])


def resize_inputs(inputs: Sequence[Any], batch: int, example_batch: int) -> list[Any]:
    """The model's flat inputs at ``batch`` samples (rows cycle; other values pass)."""
    return _resize(list(inputs), batch, example_batch, torch.device("cpu"))


def layer_peak_bytes(module: nn.Module, values: Mapping[str, Any], grad_values: Collection[str]) -> int:
    """The most bytes one forward plus backward of the stage ``module`` held at once beyond
    its weights (saved activations, transients, outputs, gradients), on its inputs read by
    name from ``values``; ``grad_values`` as in :func:`time_layer`. Untimed."""
    return _memory(module, _layer_inputs(module, values, grad_values)).peak


def time_layer(module: nn.Module, values: Mapping[str, Any], grad_values: Collection[str], *, repeats: int,
               warmup: int = 1, execute: Callable[[Callable[[], Any]], Any] = _direct,
               clock: Callable[[], float] = time.perf_counter) -> tuple[float, float]:
    """Median forward and backward seconds of the stage ``module`` on its inputs read by
    name from ``values``, timed by the host profiler's code as a chain of one (so, unlike a
    whole chain, the layer's weights stay in the caches between repeats). The inputs named
    in ``grad_values`` (values that depend on a parameter) require grad, so backward
    computes the gradient a stage sends back. ``execute`` wraps each timed computation
    (``runtime.function.cpu_throttle`` emulates a tier's CPU share) and ``clock`` times it
    (see :func:`_time_chain`). The no-grad forward is not timed: a calibration holds
    training lines only."""
    training, _ = _time_chain([module], dict(values), grad_values, repeats=repeats, warmup=warmup, execute=execute,
                              inference=False, clock=clock)
    return training[0]


def forward_outputs(module: nn.Module, values: dict[str, Any]) -> None:
    """Runs the stage ``module`` once under ``no_grad`` on its inputs from ``values`` and adds
    its outputs there by name, as the next layer will read them."""
    _serve_chain([module], values)


# --- small helpers -----------------------------------------------------------------------------


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _unique_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _synchronizer(args: list[Any]) -> Callable[[], None]:
    on_cuda = any(isinstance(value, torch.Tensor) and value.is_cuda for value in args)
    return torch.cuda.synchronize if on_cuda else (lambda: None)


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
