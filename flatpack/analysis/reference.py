"""Single-process training of the original model: what a pipelined run must equal.

The same optimizer spec and loss on the same global batches, the loss a mean over the
global batch, optionally cut into the pipeline's micro-batches (gradient accumulation).
``flatpack run``/``demo`` (``job.py``) and the equivalence tests compare a run's final
parameters with these. :func:`train_async_single_process` simulates the asynchronous
schedules (weight stashing: 1F1B and 1F1B-RR, 2BW) in one process, what a ``1f1b-async`` or
``2bw`` run must equal.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn

from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec, loss_value
from flatpack.runtime.precision import SCALED, LossScaling, autocast
from flatpack.runtime.spec import (check_precision, micro_batch_size,
                                   split_value)
from flatpack.runtime import clipping
from flatpack.runtime.training import micro_batch_seed
from flatpack.schedules import Layout, Schedule, Setup
from flatpack.schedules import get as schedule_named
from flatpack.stage.artifact import stage_manifest


def first_output(output: Any) -> torch.Tensor:
    """The model's first tensor output (a tensor, the first of a tuple, or a ModelOutput's first field)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return first_output(next(iter(output.values())))
    if isinstance(output, (tuple, list)):
        return first_output(output[0])
    raise TypeError(f"cannot find a tensor in the model's output of type {type(output).__name__}")


def call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    if isinstance(inputs, dict):
        return model(**inputs)
    return model(*inputs)


def optimizer_tensors(opt: torch.optim.Optimizer,
                      named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Each trainable parameter's optimizer tensors (Adam's moments, SGD's momentum) by name."""
    return {name: {key: value for key, value in opt.state.get(param, {}).items()
                   if isinstance(value, torch.Tensor) and value.dim()} for name, param in named}


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` inside the block (None: left as they are),
    restored after it."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _training_copy(model: nn.Module, micro_batches: int, optimizer: Any, precision: str,
                   copy_model: bool) -> tuple[nn.Module, OptimizerSpec, list[tuple[str, nn.Parameter]]]:
    """What both references train: the checked options, the model (a copy unless
    ``copy_model`` is False) in train mode, its optimizer spec and trainable parameters."""
    check_precision(precision)
    if micro_batches < 1:
        raise InputError(f"micro_batches must be at least 1, got {micro_batches}")
    trained = copy.deepcopy(model) if copy_model else model
    trained.train()
    named = [(name, p) for name, p in trained.named_parameters() if p.requires_grad]
    return trained, OptimizerSpec.of(optimizer), named


def through_stages(trained: nn.Module, pipeline: Any, precision: str) -> tuple[nn.Module, dict[str, list[str]]]:
    """What the reference calls for its forward, and each of ``trained``'s tensors' names in it.

    ``pipeline`` None: ``trained`` itself. A compiled model: its stages chained in this
    process (``Compiled.as_module``) computing on ``trained``'s own parameters and buffers
    (the optimizer and the checks keep the original names), with every tensor one stage
    hands another rounded to ``precision``'s wire dtype forward and backward
    (``precision.crossed``): what the stages of a pipelined run compute, boundary rounding
    included, in one process. A tensor of ``trained`` that no stage holds raises."""
    if pipeline is None:
        return trained, {name: [name] for name, _ in trained.named_parameters()}
    staged = pipeline.as_module()
    staged.wire_precision = precision
    tensors = {**dict(trained.named_parameters(remove_duplicate=False)),
               **dict(trained.named_buffers(remove_duplicate=False))}
    paths: dict[str, list[str]] = {}
    for index, stage in enumerate(staged.stages):
        for entry in stage_manifest(stage).parameters:
            names = [name for name in (entry.name, *entry.aliases) if name in tensors]
            if not names:
                continue      # a constant the trace made; the stage keeps its own
            tensor, attr = tensors[names[0]], entry.attr
            if attr in stage._parameters:
                stage.register_parameter(attr, tensor)
            else:
                stage.register_buffer(attr, tensor)
            for name in names:
                paths.setdefault(name, []).append(f"stages.{index}.{attr}")
    missing = [name for name, _ in trained.named_parameters() if name not in paths]
    if missing:
        raise InputError(f"the compiled stages hold no parameter {missing[:5]} of the model; pass the model the "
                         "pipeline was compiled from")
    return staged.train(), paths


class StageSeeds:
    """Seeds each stage's forward as a pipelined run's workers seed it: torch's generator set
    to ``training.micro_batch_seed(iteration, stage, micro_batch)`` right before the stage
    runs, so that the reference draws the run's dropout masks (and any other random numbers
    a stage draws) and a run with dropout on is compared exactly
    (``tests/integration/test_dropout_verdict.py``). It hooks the stages chained in this
    process (``through_stages``), a module only the reference uses; run each micro-batch's
    forward inside :meth:`at`."""

    def __init__(self, staged: nn.Module) -> None:
        self.iteration = 0
        self.micro_batch = 0
        stages = staged.stages
        assert isinstance(stages, nn.ModuleList)    # Compiled.as_module's chain (through_stages)
        for index, stage in enumerate(stages):
            stage.register_forward_pre_hook(self._seeder(index))

    def _seeder(self, index: int) -> Callable[..., None]:
        def seed(module: nn.Module, args: Any) -> None:
            torch.manual_seed(micro_batch_seed(self.iteration, index, self.micro_batch))
        return seed

    @contextlib.contextmanager
    def at(self, iteration: int, micro_batch: int) -> Iterator[None]:
        """The forwards inside draw as micro-batch ``micro_batch`` of ``iteration`` does in
        the run; the caller's generator state is left as it was."""
        self.iteration, self.micro_batch = iteration, micro_batch
        with torch.random.fork_rng(devices=[]):
            yield


def stage_seeds(forward: nn.Module, pipeline: Any, seeded: bool) -> StageSeeds | None:
    """The workers' seeds on the chained stages ``forward`` (``seeded``), else None."""
    if not seeded:
        return None
    if pipeline is None:
        raise InputError("seeded=True seeds the compiled stages as the workers do: pass the compiled model as "
                         "pipeline")
    return StageSeeds(forward)


def _drawing(seeds: StageSeeds | None, iteration: int, micro_batch: int) -> contextlib.AbstractContextManager:
    """What a micro-batch's forward runs inside: its seeds, or nothing when unseeded."""
    return contextlib.nullcontext() if seeds is None else seeds.at(iteration, micro_batch)


def _batch_rows(inputs: Any) -> int | None:
    """The rows of a batch: the first dimension of its first tensor that has one (None: it
    has none, and the pipeline does not cut it)."""
    return next((int(leaf.shape[0]) for leaf in pytree.tree_leaves(inputs)
                 if isinstance(leaf, torch.Tensor) and leaf.dim()), None)


def _backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    """Back-propagates ``loss``, scaled first under fp16's loss scaler."""
    (loss if scaler is None else scaler.scale(loss)).backward()


@dataclass(frozen=True, eq=False)
class _Accumulation:
    """One global batch's forward and backward in :func:`train_single_process`: the gradients
    accumulate into the parameters', and :meth:`batch` returns the batch's mean loss."""

    forward: nn.Module        # the model, or its stages chained (``through_stages``)
    loss: str
    precision: str
    micro_batches: int
    weight: float             # 1/K under ``accumulate`` K: this iteration's share of the step
    scaler: torch.amp.GradScaler | None
    buffers: dict[str, torch.Tensor]
    fixed_buffers: Callable[[int], Collection[str]] | None
    seeds: StageSeeds | None = None     # the stages seeded as the workers seed them

    def batch(self, inputs: Any, target: Any, iteration: int) -> float:
        """The batch whole (M = 1, or nothing to cut), else its micro-batches in order."""
        rows = _batch_rows(inputs)
        if self.micro_batches == 1 or rows is None:
            return self._whole(inputs, target, iteration)
        total = 0.0
        for m in range(self.micro_batches):
            total += self._micro_batch(inputs, target, rows, iteration, m)
        return total

    def _whole(self, inputs: Any, target: Any, iteration: int) -> float:
        with _drawing(self.seeds, iteration, 0), autocast(self.precision):
            value = loss_value(self.loss, first_output(call(self.forward, inputs)), target)
        _backward(value * self.weight, self.scaler)
        return float(value.detach())

    def _micro_batch(self, inputs: Any, target: Any, rows: int, iteration: int, m: int) -> float:
        """Micro-batch m as the pipeline cuts it, its loss scaled by its share b/B of the rows."""
        piece = pytree.tree_map(lambda leaf: split_value(leaf, rows, self.micro_batches)[m], inputs)
        piece_target = split_value(target, rows, self.micro_batches)[m] if target is not None else None
        # the buffers the run's reported replica never saw micro-batch m update (``fixed_buffers``),
        # copied before the forward updates them (BatchNorm's running statistics) and put back after
        kept = {name: self.buffers[name].detach().clone()
                for name in (self.fixed_buffers(m) if self.fixed_buffers else ()) if name in self.buffers}
        with _drawing(self.seeds, iteration, m), autocast(self.precision):
            output = first_output(call(self.forward, piece))
            share = micro_batch_size(rows, self.micro_batches, m) / rows
            value = loss_value(self.loss, output, piece_target) * share
        _backward(value * self.weight, self.scaler)
        loss = float(value.detach())
        with torch.no_grad():
            for name, saved in kept.items():
                self.buffers[name].copy_(saved)
        return loss


def _optimizer_step(opt: torch.optim.Optimizer, scheduler: Any, scaler: torch.amp.GradScaler | None,
                    clip_grad_norm: float | None, parameters: list[nn.Parameter]) -> None:
    """The step that ends an accumulation, in torch's order: fp16's gradients unscaled (so the
    clipping sees the true norm), clipped, the step (GradScaler's: skipped after an overflow)
    and the scale updated, then the schedule."""
    if scaler is not None:
        scaler.unscale_(opt)
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(parameters, clip_grad_norm)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    if scheduler is not None:
        scheduler.step()
    opt.zero_grad(set_to_none=True)


def _scaler_state(scaler: torch.amp.GradScaler) -> dict[str, float]:
    """What ``scaler_state`` reports: the final loss scale and growth tracker."""
    return {"scale": float(scaler.get_scale()), "growth_tracker": int(scaler.state_dict()["_growth_tracker"])}


def train_single_process(model: nn.Module, batches: Sequence[Any] | Callable[[int], Any], iterations: int, *,
                         optimizer: OptimizerSpec | str | dict = "sgd", loss: str = "cross_entropy",
                         copy_model: bool = True, micro_batches: int = 1,
                         fixed_buffers: Callable[[int], Collection[str]] | None = None,
                         optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None,
                         precision: str = "fp32", pipeline: Any = None, loss_scaling: Any = None,
                         scaler_state: dict[str, float] | None = None,
                         threads: int | None = None, seeded: bool = False) -> tuple[nn.Module, list[float]]:
    """Trains (a copy of) ``model`` for ``iterations`` global batches; returns it and the losses.

    ``micro_batches`` = M: each global batch is cut as the pipeline cuts it
    (:func:`flatpack.runtime.spec.split_value`, the first B mod M micro-batches one sample
    larger), each micro-batch's loss is scaled by b/B (``training.scaled_loss``) and
    back-propagated, the gradients accumulate in micro-batch order and the optimizer steps
    once per iteration: gradient accumulation, what a pipeline computes. BatchNorm then sees
    each micro-batch's own statistics, and its running statistics update once per
    micro-batch in micro-batch order. M = 1 is plain full-batch training.

    The optimizer spec's knobs apply as torch applies them in one process: its parameter
    groups, ``torch.nn.utils.clip_grad_norm_`` before each step, the schedule stepped after
    each step, and under ``accumulate`` K one step every K iterations on the gradients of
    all K, each iteration's loss weighted 1/K (``losses`` stay each batch's mean).

    ``fixed_buffers(m)``: names of buffers micro-batch m must leave as they were; a stage
    with d replicas reports replica 0's buffers, which only its micro-batches (m mod d = 0)
    update. ``optimizer_state``: filled with each trainable parameter's final optimizer
    tensors (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``) by name.

    ``precision``: the forward under its autocast (``precision.autocast``). ``pipeline``: a
    compiled model of ``model``; the forward then runs through its stages with the tensors
    between them rounded as a pipelined run sends them (:func:`through_stages`); what a
    bf16 run is compared with (``verdict``).

    ``precision`` "fp16" trains as torch's recipe with ``torch.amp.GradScaler`` (settings:
    ``loss_scaling``, a ``precision.LossScaling`` or its dict; None: GradScaler's defaults):
    each micro-batch's loss scaled before its backward, and at each step ``unscale_``, the
    clipping, ``scaler.step`` (skipped after an overflow), ``scaler.update``, then the
    schedule. ``scaler_state``: filled with the final ``scale`` and ``growth_tracker``.

    ``threads``: torch's intra-op threads while it trains (None: the process's), restored
    after. Give the run's per-worker count (``flatpack run``'s functions use one) wherever a
    result is compared under bf16/fp16: a 16-bit GEMM rounds its float32 sums to 16 bits,
    and how a CPU kernel splits a sum across threads moves some of them across a rounding
    boundary (one thread against two: 5.6e-3 of the update apart after one step, 5 % after
    eight, on the transformer of tests/integration/test_precision_knobs.py).

    ``seeded``: each stage's forward draws its random numbers from the seed a pipelined run's
    worker gives it (:class:`StageSeeds`; needs ``pipeline``): dropout's masks are then the
    run's, and a run with dropout on is compared exactly.
    """
    with torch_threads(threads):
        trained, spec, named = _training_copy(model, micro_batches, optimizer, precision, copy_model)
        forward, _ = through_stages(trained, pipeline, precision)
        scaler = LossScaling.of(loss_scaling).grad_scaler() if precision in SCALED else None
        opt = spec.build(p for _, p in named)
        scheduler = spec.build_schedule(opt)
        accumulation = _Accumulation(forward, loss, precision, micro_batches, weight=1 / spec.accumulate,
                                     scaler=scaler, buffers=dict(trained.named_buffers(remove_duplicate=False)),
                                     fixed_buffers=fixed_buffers, seeds=stage_seeds(forward, pipeline, seeded))
        batch_for = batches if callable(batches) else batches.__getitem__
        losses = []
        for iteration in range(iterations):
            inputs, target = batch_for(iteration)
            losses.append(accumulation.batch(inputs, target, iteration))
            if (iteration + 1) % spec.accumulate == 0:
                _optimizer_step(opt, scheduler, scaler, spec.clip_grad_norm, [p for _, p in named])
        if optimizer_state is not None:
            optimizer_state.update(optimizer_tensors(opt, named))
        if scaler_state is not None and scaler is not None:
            scaler_state.update(_scaler_state(scaler))
        return trained, losses


@dataclass(eq=False)
class _StageSteps:
    """One stage's side of :func:`train_async_single_process`: its optimizer (and schedule),
    the weights after each of its steps, and the gradients of its current round, by replica."""

    names: list[str]
    opt: torch.optim.Optimizer
    scheduler: Any
    history: dict[int, dict[str, torch.Tensor]]
    replicas: int
    round_grads: dict[int, dict[str, torch.Tensor]]
    steps: int = 0

    def add(self, replica: int, grads: Mapping[str, torch.Tensor | None]) -> None:
        """One micro-batch's gradients into its replica's sum of the round (in sequence order)."""
        held = self.round_grads.setdefault(replica, {})
        for name in self.names:
            grad = grads.get(name)
            if grad is not None:
                held[name] = grad.detach().clone() if name not in held else held[name] + grad
        self.round_grads[replica] = held

    def reduced(self, mean: bool) -> dict[str, torch.Tensor]:
        """The round's gradient: the replicas' sums added in replica order (as
        ``collectives.scatter_reduce`` adds them), over the replicas if ``mean``."""
        total: dict[str, torch.Tensor] = {}
        for replica in sorted(self.round_grads):
            for name, grad in self.round_grads[replica].items():
                total[name] = grad.clone() if name not in total else total[name] + grad
        self.round_grads = {}
        if mean and self.replicas > 1:
            total = {name: grad / self.replicas for name, grad in total.items()}
        return total


def _step_stages(steppers: Sequence[_StageSteps], due: Sequence[int], params: Mapping[str, nn.Parameter],
                 clip_grad_norm: float | None, mean: bool) -> None:
    """Steps the stages ``due`` (their rounds complete), all together: the global norm (if
    clipped) is over theirs (a tied weight is one parameter here, counted once)."""
    grads = {index: steppers[index].reduced(mean) for index in due}
    if clip_grad_norm is not None:
        counted = [grad for index in due for grad in grads[index].values()]
        coefficient = clipping.clip_coefficient(math.sqrt(clipping.squared_norm(counted)), clip_grad_norm)
        if coefficient < 1.0:
            grads = {index: {name: grad * torch.tensor(coefficient, dtype=torch.float32).to(grad.dtype)
                             for name, grad in found.items()} for index, found in grads.items()}
    for index in due:
        stepper = steppers[index]
        for name in stepper.names:
            params[name].grad = grads[index].get(name)
        stepper.opt.step()
        if stepper.scheduler is not None:
            stepper.scheduler.step()
        stepper.opt.zero_grad(set_to_none=True)
        stepper.steps += 1
        stepper.history[stepper.steps] = {name: params[name].detach().clone() for name in stepper.names}


def train_async_single_process(model: nn.Module, batches: Sequence[Any] | Callable[[int], Any], iterations: int, *,
                               schedule: Schedule | str, stage_of: Mapping[str, int], stages: int, micro_batches: int,
                               optimizer: OptimizerSpec | str | dict = "sgd", loss: str = "cross_entropy",
                               vertical_sync: bool = False, call_iterations: int | None = None,
                               optimizer_state: dict[str, dict[str, torch.Tensor]] | None = None,
                               copy_model: bool = True, precision: str = "fp32",
                               pipeline: Any = None, threads: int | None = None,
                               seeded: bool = False, replicas: Sequence[int] | None = None,
                               fixed_buffers: Callable[[int], Collection[str]] | None = None,
                               ) -> tuple[nn.Module, list[float]]:
    """Single-process simulation of an asynchronous ``schedule`` with weight stashing
    (``runtime.stashing``: PipeDream's 1F1B without a flush, ``1f1b-async``, with replicated
    stages 1F1B-RR; PipeDream-2BW, ``2bw``): what such a pipelined run must equal.

    The call's micro-batches g = 0, 1, ... (each global batch cut as the pipeline cuts it)
    run in order; micro-batch g computes its forward and backward with, for each parameter,
    the version its stage (``stage_of[name]`` of ``stages``, with ``replicas[s]`` replicas,
    one each if None) steps to by then by the schedule's rule (``Schedule.weight_version``,
    the one place it is computed), its loss its own mean (``1f1b-async``) or scaled by its
    share of the batch (``2bw``). Its gradient joins its stage's round (``round_size``
    micro-batches), summed per replica (micro-batch m runs on replica m mod d) and then over
    the replicas in replica order, as the run reduces them on the store; a complete round
    steps the stage (its mean over the replicas under ``1f1b-async``), clipped to the global
    norm over the stages stepping together (``2bw``; ``optimizer``'s ``clip_grad_norm``).
    g counts from the start of a ``train()`` call, where the pipeline starts empty and at whose
    end every due round steps: ``call_iterations`` N simulates calls of N iterations each
    (None: one call). Every version is kept here; a stage keeps only those its in-flight
    micro-batches hold. The losses are each global batch's mean; ``fixed_buffers``,
    ``optimizer_state``, ``precision``, ``pipeline``, ``threads`` and ``seeded`` as
    :func:`train_single_process` takes them."""
    with torch_threads(threads):
        trained, spec, named = _training_copy(model, micro_batches, optimizer, precision, copy_model)
        schedule = schedule_named(schedule)
        if schedule.flush:
            raise InputError(f"the {schedule.name} schedule flushes every iteration; train_single_process is its "
                             "reference, not this simulation of an asynchronous one")
        layout = Layout(tuple(replicas) if replicas is not None else (1,) * stages, micro_batches,
                        accumulate=spec.accumulate, vertical_sync=vertical_sync)
        schedule.check(Setup(replicas=layout.replicas, vertical_sync=vertical_sync, clip_grad_norm=spec.clip_grad_norm,
                             accumulate=spec.accumulate, precision=precision, micro_batches=micro_batches))
        if call_iterations is not None and call_iterations < 1:
            raise InputError(f"call_iterations must be at least 1 (iterations per train() call), got {call_iterations}")
        forward, paths = through_stages(trained, pipeline, precision)
        missing = [name for name, _ in named if name not in stage_of]
        if missing:
            raise InputError(f"stage_of names no stage for parameters {missing}; give every trainable parameter's "
                             "stage")
        simulation = _AsyncSimulation(schedule, layout, dict(named), stage_of, paths, forward, loss, precision,
                                      spec, stage_seeds(forward, pipeline, seeded), fixed_buffers,
                                      dict(trained.named_buffers(remove_duplicate=False)))
        batch_for = batches if callable(batches) else batches.__getitem__
        losses = []
        per_call = call_iterations or iterations
        for first in range(0, iterations, per_call):
            calls = range(first, min(first + per_call, iterations))
            losses += simulation.call([(iteration, *batch_for(iteration)) for iteration in calls])
        if optimizer_state is not None:
            for stepper in simulation.steppers:
                named_here = [(name, simulation.params[name]) for name in stepper.names]
                optimizer_state.update(optimizer_tensors(stepper.opt, named_here))
        return trained, losses


@dataclass(eq=False)
class _AsyncSimulation:
    """:func:`train_async_single_process`'s state across calls: each stage's steps."""

    schedule: Schedule
    layout: Layout
    params: dict[str, nn.Parameter]
    stage_of: Mapping[str, int]
    paths: dict[str, list[str]]
    forward: nn.Module
    loss: str
    precision: str
    spec: OptimizerSpec
    seeds: StageSeeds | None
    fixed_buffers: Callable[[int], Collection[str]] | None
    buffers: dict[str, torch.Tensor]

    def __post_init__(self) -> None:
        self.steppers: list[_StageSteps] = []
        for index in range(self.layout.stages):
            names = [name for name in self.params if self.stage_of[name] == index]
            opt = self.spec.build(self.params[name] for name in names) if names else None
            self.steppers.append(_StageSteps(
                names, opt if opt is not None else torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0),
                self.spec.build_schedule(opt) if opt is not None else None,
                {0: {name: self.params[name].detach().clone() for name in names}}, self.layout.replicas[index], {}))

    def call(self, batches: list[tuple[int, Any, Any]]) -> list[float]:
        """One ``train()`` call over ``batches`` (iteration, inputs, target): an empty pipeline
        at its start, every due round stepped at its end."""
        schedule, layout = self.schedule, self.layout
        start_steps = [stepper.steps for stepper in self.steppers]
        total = len(batches) * layout.micro_batches
        losses = []
        for index, (iteration, inputs, target) in enumerate(batches):
            rows = _batch_rows(inputs) or 1
            mean = 0.0
            for m in range(layout.micro_batches):
                g = index * layout.micro_batches + m
                mean += self._micro_batch(iteration, m, g, inputs, target, rows, start_steps)
                due = [s for s in range(layout.stages)
                       if (g + 1) % schedule.round_size(s, layout) == 0 or g + 1 == total]
                if due:
                    _step_stages(self.steppers, due, self.params, self.spec.clip_grad_norm, schedule.own_minibatch)
            losses.append(mean)
        return losses

    def _micro_batch(self, iteration: int, m: int, g: int, inputs: Any, target: Any, rows: int,
                     start_steps: list[int]) -> float:
        """Micro-batch ``m`` of ``iteration``, the call's ``g``-th, on each stage's version;
        its gradients into each stage's round; its share of the batch's mean loss."""
        schedule, layout = self.schedule, self.layout
        piece = pytree.tree_map(lambda leaf: split_value(leaf, rows, layout.micro_batches)[m], inputs)
        piece_target = split_value(target, rows, layout.micro_batches)[m] if target is not None else None
        versions = [start_steps[s] + schedule.weight_version(g, s, layout) for s in range(layout.stages)]
        weights = {name: self.steppers[self.stage_of[name]].history[versions[self.stage_of[name]]][name]
                   .detach().requires_grad_() for name in self.params}
        args, kwargs = ((), piece) if isinstance(piece, dict) else ((piece,) if isinstance(piece, torch.Tensor)
                                                                     else tuple(piece), {})
        replaced = {path: weights[name] for name in self.params for path in self.paths[name]}
        kept = {name: self.buffers[name].detach().clone()
                for name in (self.fixed_buffers(m) if self.fixed_buffers else ()) if name in self.buffers}
        share = micro_batch_size(rows, layout.micro_batches, m) / rows
        with _drawing(self.seeds, iteration, m), autocast(self.precision):
            output = first_output(torch.func.functional_call(self.forward, replaced, args, kwargs))
            value = loss_value(self.loss, output, piece_target)
        (value if schedule.own_minibatch else value * (share / self.spec.accumulate)).backward()
        with torch.no_grad():
            for name, saved in kept.items():
                self.buffers[name].copy_(saved)
        for s, stepper in enumerate(self.steppers):
            stepper.add(layout.replica_of(s, g), {name: weights[name].grad for name in stepper.names})
        return float(value.detach()) * share
