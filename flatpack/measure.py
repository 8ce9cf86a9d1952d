"""Measuring stage modules: the forward and backward seconds of a chain of one-layer stages,
run as a stage runs them, and what one layer holds in memory. The one implementation of
both, used by the host profiler (``flatpack.profiler``, which builds the stages from a
LayerGraph and fits the results into a profile) and by the profile role of a function
(``runtime.profile_function``, which has only the deployed one-layer stages and the values
that reach them).

It sits below ir, the planner and the runtime (``.importlinter``): it knows stage modules
(``stage.artifact``) and torch, nothing of graphs, plans or platforms, so a function's
profile role loads it without the compiler.

How it times, and why this way rather than an fx ``Interpreter`` or module hooks: the layers
run in chain order, forward then backward in reverse, each layer's inputs detached so that
its backward is its own. That isolates each layer's backward exactly (hooks on a whole model
cannot split backward time between layers that interleave, and an Interpreter times node by
node with Python overhead the worker does not have) while the caches see what a stage sees.
Memory is measured on each layer alone: what autograd keeps for backward is read from
``saved_tensors_hooks``, not guessed from shapes, and the peak from a dispatch-mode tracker
of live storages.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping, Protocol, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flatpack.batching import batch_rows, has_batch_dimension
from flatpack.cpus import pinned, runs_per_cpu
from flatpack.errors import InputError
from flatpack.stage.artifact import stage_manifest

Execute = Callable[[Callable[[], Any]], Any]
Clock = Callable[[], float]


class Steps(Protocol):
    """A progress display the timing advances (``profiler._Progress``): one step per run
    through the chain, the runs a spent budget leaves out skipped."""

    def step(self, what: str) -> None: ...

    def skip(self, steps: int) -> None: ...


def direct(compute: Callable[[], Any]) -> Any:
    """Runs a timed computation as it is (no CPU throttle)."""
    return compute()


# --- timing a chain ------------------------------------------------------------------------------


def run_schedule(cpus: Sequence[int | None], warmup: int, repeats: int) -> list[tuple[int | None, bool]]:
    """(cpu, timed) per run through the chain: ``warmup`` untimed runs on the first CPU, then
    its share of the ``repeats`` timed ones; on each further CPU one untimed run (the move
    leaves its caches cold; none when ``warmup`` is 0), then its share."""
    schedule: list[tuple[int | None, bool]] = []
    for index, (cpu, share) in enumerate(zip(cpus, runs_per_cpu(repeats, len(cpus)))):
        schedule += [(cpu, False)] * (warmup if index == 0 else min(warmup, 1)) + [(cpu, True)] * share
    return schedule


@dataclass(frozen=True)
class _Timer:
    """How one computation is run and timed: ``execute`` runs it (directly, or through a
    tier's CPU throttle), ``clock`` times it, ``synchronize`` waits for a GPU's kernels on
    either side."""

    synchronize: Callable[[], None]
    execute: Execute
    clock: Clock

    def __call__(self, compute: Callable[[], Any]) -> tuple[Any, float]:
        self.synchronize()
        begin = self.clock()
        result = self.execute(compute)
        self.synchronize()
        return result, self.clock() - begin


@dataclass
class _ChainTimes:
    """The timed runs' seconds: per CPU, per layer, one entry per timed run (the no-grad
    forward's too)."""

    forward: dict[int | None, list[list[float]]]
    backward: dict[int | None, list[list[float]]]
    inference: dict[int | None, list[list[float]]]

    @classmethod
    def empty(cls, cpus: Sequence[int | None], layers: int) -> _ChainTimes:
        def table() -> dict[int | None, list[list[float]]]:
            return {cpu: [[] for _ in range(layers)] for cpu in cpus}

        return cls(table(), table(), table())

    def add(self, cpu: int | None, forward: list[float], backward: list[float], served: list[list[float]]) -> None:
        for index in range(len(forward)):
            self.forward[cpu][index].append(forward[index])
            self.backward[cpu][index].append(backward[index])
            self.inference[cpu][index] += served[index]

    def figures(self, layers: int, inference: bool) -> tuple[list[tuple[float, float]], list[float]]:
        """A layer's figure is its per-CPU medians' mean, over the CPUs that ran a timed run."""
        measured = [cpu for cpu, times in self.forward.items() if times[0]] if layers else []

        def figure(times: dict[int | None, list[list[float]]], index: int) -> float:
            return statistics.mean(statistics.median(times[cpu][index]) for cpu in measured)

        training = [(figure(self.forward, index), figure(self.backward, index)) for index in range(layers)]
        served = [figure(self.inference, index) for index in range(layers)] if inference else []
        return training, served


def time_chain(modules: list[nn.Module], env: dict[str, Any], grad_values: Collection[str], *, repeats: int,
               warmup: int, budget_s: float | None = None, progress: Steps | None = None, batch: int = 0,
               execute: Execute = direct, inference: bool = True, clock: Clock = time.perf_counter,
               cpus: Sequence[int | None] = (None,)) -> tuple[list[tuple[float, float]], list[float]]:
    """Median forward and backward seconds of every layer, and with ``inference`` its no-grad
    forward's, over ``repeats`` timed runs after ``warmup`` untimed ones, timed the way a
    stage runs them: forward through all layers in order (each on its predecessors' fresh
    outputs, detached at the layer's inputs so its backward is its own), then backward layer
    by layer in reverse, then (``inference``) a forward under ``no_grad``. Timing each layer
    in a tight loop of its own instead would keep its weights and activations in the CPU
    caches, which a stage running many layers in turn does not.
    ``grad_values``: the value names whose gradient a stage computes (see :func:`layer_inputs`).
    ``budget_s``: once spent, no further run starts (one timed run always happens).
    ``progress`` (with ``batch`` for its messages): a display to advance, if any. ``execute``
    runs each timed computation: directly, or through a tier's CPU throttle
    (``runtime.function.cpu_throttle``) when profiling inside an emulated tier, and ``clock``
    times it: wall time, or an emulated tier's own clock (``runtime.function.emulated_clock``:
    CPU seconds over the tier's share, which the host's other load does not inflate).
    ``cpus``: the timed runs are shared among these CPUs, the calling thread pinned to each
    in turn (``flatpack.cpus``; ``None``: where it runs), each CPU's first run after the move
    untimed, and a layer's figure is its per-CPU medians' mean. Returns
    (forward, backward) per layer, and the no-grad forward per layer (empty when not
    ``inference``)."""
    schedule = run_schedule(cpus, warmup, repeats)
    times = _ChainTimes.empty(cpus, len(modules))
    timer = _Timer(synchronizer(list(env.values())), execute, clock)
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
            forward_run, backward_run = _train_run(modules, env, grad_values, timer)
            served_run: list[list[float]] = [[] for _ in modules]
            if inference:
                serve_chain(modules, dict(env), served_run, timer)
            if timed:
                timed_runs += 1
                times.add(cpu, forward_run, backward_run, served_run)
            if timed_runs >= 1 and budget_s is not None and time.perf_counter() - started > budget_s:
                if progress is not None:
                    progress.skip(len(schedule) - run - 1)
                break
    return times.figures(len(modules), inference)


def _train_run(modules: list[nn.Module], env: dict[str, Any], grad_values: Collection[str],
               timer: _Timer) -> tuple[list[float], list[float]]:
    """One training run through the chain, as a stage runs it: every layer's forward in
    order, then every backward in reverse; the seconds of each, per layer."""
    forward_run, backward_run = [0.0] * len(modules), [0.0] * len(modules)
    values = dict(env)
    outputs: list[Any] = []
    for index, module in enumerate(modules):
        args = layer_inputs(module, values, grad_values)
        result, forward_run[index] = timer(lambda: module(*args))
        outputs.append(result)
        names = stage_manifest(module).output_names
        values.update(zip(names, (value.detach() if isinstance(value, torch.Tensor) else value
                                  for value in result)))
    for index in reversed(range(len(modules))):
        _, backward_run[index] = timer(lambda: backward(outputs[index]))
        outputs[index] = None  # frees the layer's saved tensors, as a stage's backward does
    for module in modules:
        module.zero_grad(set_to_none=True)
    return forward_run, backward_run


def serve_chain(modules: list[nn.Module], values: dict[str, Any], seconds: list[list[float]] | None = None,
                timer: _Timer | None = None) -> None:
    """One forward through the layers under ``no_grad``, as served: each layer reads its
    inputs from ``values`` and adds its outputs there; ``seconds[i]`` gets layer i's time
    by ``timer`` (default: run directly, by wall time)."""
    timer = timer or _Timer(lambda: None, direct, time.perf_counter)
    with torch.no_grad():
        for index, module in enumerate(modules):
            manifest = stage_manifest(module)
            args = [values[name] for name in manifest.input_names]
            outputs, elapsed = timer(lambda: module(*args))
            if seconds is not None:
                seconds[index].append(elapsed)
            values.update(zip(manifest.output_names, outputs))


def layer_inputs(module: nn.Module, env: Mapping[str, Any], grad_values: Collection[str]) -> list[Any]:
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


def backward(outputs: Any) -> None:
    """Backward from every output that requires grad, with a gradient of ones."""
    tensors = [value for value in pytree.tree_leaves(outputs)
               if isinstance(value, torch.Tensor) and value.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(tensor) for tensor in tensors])


def synchronizer(args: list[Any]) -> Callable[[], None]:
    """Waits for the GPU's kernels where any of ``args`` is on one; nothing on the CPU."""
    on_cuda = any(isinstance(value, torch.Tensor) and value.is_cuda for value in args)
    return torch.cuda.synchronize if on_cuda else (lambda: None)


# --- memory of one layer ------------------------------------------------------------------------


@dataclass
class Memory:
    """What one forward plus backward of a layer held: ``saved`` (storage pointer -> bytes, of
    what autograd saved), its outputs, the ``peak`` bytes allocated at once and the bytes of
    the gradients its parameters received."""

    saved: dict[int, int]
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


def memory_of(module: nn.Module, args: list[Any]) -> Memory:
    """What autograd saved (parameters excluded: they are not activations), the peak bytes
    allocated during forward+backward, and the gradient bytes the parameters receive."""
    with _LiveBytes() as live:
        with saved_tensors(exclude=[*module.parameters(), *module.buffers()]) as saved:
            outputs = module(*args)
        memory = Memory(saved, list(outputs), 0, 0)
        backward(outputs)
    memory.peak = live.peak
    memory.grad_bytes = unique_bytes(param.grad for param in module.parameters() if param.grad is not None)
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


def nbytes(value: Any) -> int:
    """A tensor's bytes (its elements, not its storage); 0 for any other value."""
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def unique_bytes(tensors: Any) -> int:
    """The bytes of the storages under ``tensors``, each storage once."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# --- inputs at other batch sizes ----------------------------------------------------------------


def example_batch(tensors: Sequence[torch.Tensor]) -> int:
    """The batch size of the example tensors (their first dimension's rows)."""
    rows = batch_rows(tensors)
    if rows is None:
        raise InputError("profiling needs at least one tensor input with a batch dimension (dim 0)")
    return rows


def resize(inputs: list[Any], batch: int, example_batch: int, device: torch.device) -> list[Any]:
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


# --- one layer at a time, from its inputs (in-target profiling) --------------------------------
# ``runtime.profile_function`` measures a deployed chain inside a function of each memory tier,
# where there is no LayerGraph: only one-layer stage modules and the values that reach them.


def example_batch_size(inputs: Sequence[Any]) -> int:
    """The batch size of the model's flat inputs: the first dimension of the first tensor
    that has one."""
    return example_batch([value for value in inputs if isinstance(value, torch.Tensor)])


def resize_inputs(inputs: Sequence[Any], batch: int, example_batch: int) -> list[Any]:
    """The model's flat inputs at ``batch`` samples (rows cycle; other values pass)."""
    return resize(list(inputs), batch, example_batch, torch.device("cpu"))


def layer_peak_bytes(module: nn.Module, values: Mapping[str, Any], grad_values: Collection[str]) -> int:
    """The most bytes one forward plus backward of the stage ``module`` held at once beyond
    its weights (saved activations, transients, outputs, gradients), on its inputs read by
    name from ``values``; ``grad_values`` as in :func:`time_layer`. Untimed."""
    return memory_of(module, layer_inputs(module, values, grad_values)).peak


def time_layer(module: nn.Module, values: Mapping[str, Any], grad_values: Collection[str], *, repeats: int,
               warmup: int = 1, execute: Execute = direct, clock: Clock = time.perf_counter) -> tuple[float, float]:
    """Median forward and backward seconds of the stage ``module`` on its inputs read by
    name from ``values``, timed as the host profiler times a chain, as a chain of one (so,
    unlike a whole chain, the layer's weights stay in the caches between repeats). The
    inputs named in ``grad_values`` (values that depend on a parameter) require grad, so
    backward computes the gradient a stage sends back. ``execute`` wraps each timed
    computation (``runtime.function.cpu_throttle`` emulates a tier's CPU share) and
    ``clock`` times it (see :func:`time_chain`). The no-grad forward is not timed: a
    calibration holds training lines only."""
    training, _ = time_chain([module], dict(values), grad_values, repeats=repeats, warmup=warmup, execute=execute,
                             inference=False, clock=clock)
    return training[0]


def forward_outputs(module: nn.Module, values: dict[str, Any]) -> None:
    """Runs the stage ``module`` once under ``no_grad`` on its inputs from ``values`` and adds
    its outputs there by name, as the next layer will read them."""
    serve_chain([module], values)
