"""What a training function runs: one stage replica of the pipeline, iteration by iteration.

The order of a replica's forwards and backwards is its schedule's (``flatpack.schedules``:
``RunSpec.schedule`` names it, ``Schedule.call_actions`` gives each iteration's actions),
and one loop runs every schedule (:meth:`StageTrainer.run_iteration`). A flush schedule ends
each iteration with the gradient synchronization among the stage's replicas
(``collectives.scatter_reduce``) and one optimizer step: FuncPipe's synchronous schedule
(§3.2: the forwards of every micro-batch the replica owns, then their backwards in reverse
order), or PipeDream's 1F1B with a flush. Under an asynchronous schedule (``1f1b-async``,
PipeDream's 1F1B without a flush, 1F1B-RR with replicated stages; ``2bw``) each backward
computes on the weights its forward used (weight stashing: ``stashing``), its gradient joins
its round's, a complete round is reduced over the stage's replicas on the store on lanes of
its own, and the step is applied when a forward first asks for its version
(``Schedule.weight_version``); its iterations are slices of one sequence over the call.
Within an iteration the work is a task DAG over three lanes (``lanes``): downloads of inputs
and gradients, computation, and uploads run at the same time.

Micro-batch m of an iteration runs on replica m mod d of each stage. The loss of a
micro-batch of b samples is scaled by b/B, so the gradients summed over micro-batches and
replicas are those of the mean loss over the global batch, and the parameters after N
iterations equal single-process training on the same batches.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from torch import nn

from flatpack.runtime import clipping
from flatpack.runtime.collectives import scatter_reduce
from flatpack.runtime.keys import Round, RunKeys
from flatpack.runtime.lanes import Lanes
from flatpack.runtime.optim import loss_value, packed_positions
from flatpack.runtime.precision import LossScaler, autocast, for_wire, loss_scaler
from flatpack.runtime.spec import DATA_SOURCE, RunSpec, StageSpec, micro_batch_size, received_specs
from flatpack.runtime.stashing import RoundGradients, WeightStash
from flatpack.runtime.store import Store
from flatpack.runtime.timeline import Event, Recorder
from flatpack.schedules import Action, Layout
from flatpack.stage import wire
from flatpack.stage.artifact import install_weights, stage_manifest, stage_tensors
from flatpack.stage.tensor_check import check_stage_inputs, stage_input_specs
from flatpack.stage.wire import pack_values, unpack_values

if TYPE_CHECKING:   # the gpu-container ranks run the micro-batch compute without a function's role
    from flatpack.runtime.function import Role

TARGET = "__target__"     # the data blob's entry holding a micro-batch's targets


# -- the micro-batch compute, shared with the gpu-container ranks (runtime.distributed) -------
# Both runtimes must compute exactly this, so that both equal single-process training.

def scaled_loss(spec: RunSpec, micro_batch: int, output: Any, target: Any) -> torch.Tensor:
    """Micro-batch ``micro_batch``'s loss scaled by b/B, so that the micro-batch losses add
    up to the mean over the global batch, and by 1/K under gradient accumulation over K
    iterations (``OptimizerSpec.accumulate``), so that the K batches' gradients add up to
    those of their mean. b comes from the split, not the output: a model that returns its
    own (scalar) loss has no rows."""
    samples = micro_batch_size(spec.batch, spec.micro_batches, micro_batch)
    return loss_value(spec.loss, output, target) * (samples / spec.batch / spec.optimizer.accumulate)


def backward_outputs(outputs: dict[str, Any], grads: dict[str, torch.Tensor]) -> None:
    """Back-propagates the consumers' gradients ``grads`` through the stage's ``outputs``
    (those that take a gradient) in one autograd call."""
    # a bf16 run's gradients arrive in the wire dtype; autograd wants each in its output's
    pairs = [(outputs[name], grad.to(outputs[name].dtype)) for name, grad in grads.items()
             if isinstance(outputs.get(name), torch.Tensor) and outputs[name].requires_grad]
    if pairs:
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])


def input_gradients(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The gradients a backward left on the stage's inputs, by input name."""
    return {name: value.grad for name, value in inputs.items()
            if isinstance(value, torch.Tensor) and value.requires_grad and value.grad is not None}


def flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients (zeros where there is none) as one float32 vector."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])


def assign_flat_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Sets each parameter's gradient from its slice of ``flat`` (the inverse of :func:`flat_grads`)."""
    offset = 0
    for param in params:
        count = param.numel()
        param.grad = flat[offset:offset + count].view_as(param).to(param.dtype).clone()
        offset += count


def micro_batch_seed(iteration: int, stage: int, micro_batch: int) -> int:
    """The seed of a stage's random draws (dropout) for one micro-batch of one iteration,
    ``iteration`` counted in the run's data (``RunSpec.data_iteration``). A replayed forward
    (a restarted function, a relaunched straggler, a resumed run) so draws the same masks
    and produces the same activations its consumers may already have read."""
    return (iteration * 1_000_003 + stage * 10_007 + micro_batch) % (1 << 63)


@dataclass
class MicroBatchState:
    """One micro-batch between its forward and its backward: what autograd needs."""

    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    target: Any = None      # the last stage's targets, for a recomputed forward's loss
    # an asynchronous schedule: the stashed weight version the forward used, as the leaf tensors autograd
    # saved (by original name), so that the backward computes the gradient on them
    version: int | None = None
    weights: dict[str, torch.Tensor] | None = None


def stage_forward(module: nn.Module, spec: RunSpec, stage: StageSpec, iteration: int, micro_batch: int,
                  state: MicroBatchState, *, attrs: dict[str, str] | None = None, device_type: str = "cpu") -> None:
    """The stage's forward of one micro-batch into ``state`` (its outputs, and on the last
    stage its loss), under the precision's autocast and with the micro-batch's dropout seed
    (:func:`micro_batch_seed`), so that a recomputed forward draws the same masks. With
    ``state.weights`` (an asynchronous schedule) the forward computes on that stashed version, mapped to
    the module's attributes by ``attrs``. Autograd records it or not as the caller's grad
    mode says: a recomputing stage's first forward runs without."""
    args = [state.inputs[name] for name in stage.inputs]
    with torch.random.fork_rng(devices=[]), autocast(spec.precision, device_type):
        torch.manual_seed(micro_batch_seed(spec.data_iteration(iteration), stage.index, micro_batch))
        if state.weights is None:
            outputs = module(*args)
        else:
            if attrs is None:
                raise ValueError(f"stage {stage.index}: a forward on stashed weights needs attrs, the module "
                                 "attribute of each weight")
            # the stashed version in place of the live parameters (which later steps change)
            outputs = torch.func.functional_call(
                module, {attrs[name]: tensor for name, tensor in state.weights.items()}, tuple(args))
        state.outputs = dict(zip(stage.outputs, outputs))
        if stage.index == len(spec.stages) - 1 and spec.schedule_object.own_minibatch:
            # each micro-batch is a step of its own (PipeDream's minibatch): its mean loss
            state.loss = loss_value(spec.loss, state.outputs[spec.loss_output], state.target)
        elif stage.index == len(spec.stages) - 1:
            state.loss = scaled_loss(spec, micro_batch, state.outputs[spec.loss_output], state.target)


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Puts ``module``'s buffers back as they were once the block (a recomputed forward and
    its backward) is done: the first forward already moved BatchNorm's running statistics
    for this micro-batch, and moving them twice would differ from training that keeps its
    activations. Not before the backward: autograd saved those tensors and checks that
    nothing changed them."""
    saved = [buffer.clone() for buffer in module.buffers()]
    yield
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), saved):
            buffer.copy_(value)


def stage_backward(module: nn.Module, spec: RunSpec, stage: StageSpec, iteration: int, micro_batch: int,
                   state: MicroBatchState, grads: dict[str, torch.Tensor], *, attrs: dict[str, str] | None = None,
                   device_type: str = "cpu", scaler: LossScaler | None = None) -> None:
    """The backward of one micro-batch: from the loss on the last stage (times fp16's loss
    scale: ``scaler``), else from the consumers' ``grads`` through the outputs. A stage that
    recomputes (``StageSpec.recompute``) kept only the inputs, so it first runs
    :func:`stage_forward` again, with autograd."""
    def backpropagate() -> None:
        if stage.index == len(spec.stages) - 1:
            loss = state.loss
            if loss is None:
                raise RuntimeError(f"stage {stage.index}: micro-batch {micro_batch}'s backward before its forward "
                                   "computed the loss")
            (loss if scaler is None else scaler.scaled(loss)).backward()
        else:
            backward_outputs(state.outputs, grads)

    if not stage.recompute:
        backpropagate()
        return
    with buffers_kept(module):
        with torch.enable_grad():
            stage_forward(module, spec, stage, iteration, micro_batch, state, attrs=attrs, device_type=device_type)
        backpropagate()


def checkpoint_bytes(iteration: int, state_tensors: dict[str, torch.Tensor], trainable: dict[str, nn.Parameter],
                     optimizer: torch.optim.Optimizer, accumulated: dict[str, torch.Tensor], steps: int,
                     accumulated_count: int, loss_scale: dict[str, Any] | None) -> bytes:
    """A stage checkpoint after ``iteration``: its weights and buffers (``w/<name>``), its
    optimizer state by the parameter's position in ``trainable`` (``o/<position>/<key>``,
    non-tensor entries in the ``scalars`` metadata), its accumulated gradients (``a/<name>``),
    the optimizer's parameter groups, the steps taken (the schedule's position), the
    accumulation count and the loss scaler's state. What :meth:`StageTrainer.load_state`
    installs; ``StageTrainer.state_bytes`` and a plan switch (``analysis.restage``) write it."""
    tensors = {f"w/{name}": tensor.detach() for name, tensor in state_tensors.items()}
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    # optimizer state is keyed by the parameter's position in the stage (manifest order),
    # whatever order the optimizer's parameter groups put it in
    packed = packed_positions(optimizer, list(trainable.values()))
    for position, index in enumerate(packed):
        for key, value in state["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"o/{position}/{key}"] = value
            else:
                scalars.setdefault(str(position), {})[key] = value
    tensors.update({f"a/{name}": grad for name, grad in accumulated.items()})
    return wire.dumps(tensors, {"iteration": iteration, "param_groups": state["param_groups"],
                                "scalars": scalars, "steps": steps, "accumulated": accumulated_count,
                                "optimizer_class": type(optimizer).__name__, "loss_scale": loss_scale})


# (kind "F" | "B", iteration, micro-batch, weight version, the weights the task computes with)
WeightObserver = Callable[[str, int, int, int, dict[str, torch.Tensor]], None]


def run_layout(spec: RunSpec) -> Layout:
    """What the schedule's version rule reads about the run (``schedules.Layout``)."""
    return Layout(tuple(stage.replicas for stage in spec.stages), spec.micro_batches,
                  accumulate=spec.optimizer.accumulate, vertical_sync=spec.vertical_sync)


class StageTrainer:
    """One replica of one stage. ``hooks`` lets the worker process wrap tasks (memory
    guard, CPU throttle, injected faults) without this class knowing about processes."""

    def __init__(self, spec: RunSpec, role: Role, store: Store, module: nn.Module, recorder: Recorder,
                 *, after_task: Callable[[str, int, int | None], None] | None = None,
                 throttle_compute: Callable[[Callable[[], Any]], Any] | None = None,
                 observe_weights: WeightObserver | None = None) -> None:
        self.spec = spec
        self.role = role
        self.stage = spec.stages[role.stage]
        self.store = store
        self.keys = RunKeys(spec.run)
        self.module = module.train()
        self.recorder = recorder
        self.after_task = after_task or (lambda kind, iteration, micro_batch: None)
        self.throttle_compute = throttle_compute or (lambda fn: fn())
        self.state_tensors, self.trainable = stage_tensors(module)
        self.optimizer = spec.optimizer.build(self.trainable.values())
        self.scheduler = spec.optimizer.build_schedule(self.optimizer)
        self.scaler = loss_scaler(spec.precision, spec.loss_scaling)    # fp16 only
        self.steps = 0     # optimizer steps taken (or skipped for an overflow): the schedule's position
        # gradient accumulation: the reduced gradients of the iterations since the last step,
        # and how many iterations they hold (kept in checkpoints, not derived from iteration
        # numbers, which a resumed call does not continue)
        self.accumulated: dict[str, torch.Tensor] = {}
        self.accumulated_count = 0
        self.is_last = role.stage == len(spec.stages) - 1
        self.losses: dict[int, float] = {}
        self._prefetched: dict[tuple[int, int], Future] = {}   # (iteration, micro-batch) -> its inputs
        # the call's actions by iteration (``Schedule.call_actions``) and the micro-batches in
        # flight, by iteration; an asynchronous schedule's (``stashing``) cross iterations, with
        # the weight versions they hold, the steps taken since the call began and the
        # forwards run (the version a vertical-sync forward asks for)
        self.schedule = spec.schedule_object
        self.observe_weights = observe_weights
        self.attrs = stage_manifest(module).attributes()
        self.stash = None if self.schedule.flush else WeightStash(self.trainable)
        self.layout = run_layout(spec)
        self._actions: list[list[Action]] | None = None
        self._in_flight: dict[int, dict[int, MicroBatchState]] = {}
        self.call_steps = 0       # rounds applied since the call began: the live weights' version
        # an asynchronous schedule's rounds: the replica's gradients of each, and each one's
        # reduction over the replicas (and the stages' global knobs) on lanes of their own, so
        # that waiting for the other replicas never holds up this one's compute or transfers
        self.rounds = RoundGradients()
        self._reduced: dict[int, Future] = {}
        self._round_lanes: Lanes | None = None
        # what each tensor input must be (the manifest's example shape, dtype and free
        # dimensions): a wrong value is refused naming it, not failed on inside generated code
        self.input_specs = received_specs(stage_input_specs(stage_manifest(module)),
                                          self.stage, spec.precision)

    # state ----------------------------------------------------------------------------------
    def state_bytes(self, iteration: int) -> bytes:
        return checkpoint_bytes(iteration, self.state_tensors, self.trainable, self.optimizer, self.accumulated,
                                self.steps, self.accumulated_count,
                                self.scaler.state() if self.scaler is not None else None)

    def load_state(self, data: bytes) -> int:
        """Installs a checkpoint; returns the iteration it was taken after. The optimizer
        state (moments, momentum) carries over when the checkpoint's optimizer is this one's
        kind with as many parameter groups, and the hyperparameters are always this call's
        spec's (a later ``train()`` call may change the learning rate); a checkpoint of
        another optimizer gives only its weights, the state starting afresh."""
        tensors, meta = wire.loads(data)
        install_weights(self.state_tensors, tensors)
        self.steps = int(meta.get("steps", 0))
        self.accumulated = {key[2:]: value for key, value in tensors.items() if key.startswith("a/")}
        self.accumulated_count = int(meta.get("accumulated", 0))
        if self.scaler is not None and meta.get("loss_scale"):
            self.scaler.load(meta["loss_scale"])
        if (meta.get("optimizer_class", type(self.optimizer).__name__) != type(self.optimizer).__name__
                or len(meta["param_groups"]) != len(self.optimizer.param_groups)):
            self.scheduler = self.spec.optimizer.restore_schedule(self.optimizer, self.steps)
            return int(meta["iteration"])
        settings = [{key: value for key, value in group.items() if key != "params"}
                    for group in self.optimizer.param_groups]
        packed = packed_positions(self.optimizer, list(self.trainable.values()))
        state: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("o/"):
                _, position, entry = key.split("/", 2)
                state.setdefault(packed[int(position)], {})[entry] = value
        for position, entries in meta["scalars"].items():
            state.setdefault(packed[int(position)], {}).update(entries)
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        for group, setting in zip(self.optimizer.param_groups, settings):
            group.pop("initial_lr", None)
            group.update(setting)
        self.scheduler = self.spec.optimizer.restore_schedule(self.optimizer, self.steps)
        return int(meta["iteration"])

    # transfers ------------------------------------------------------------------------------
    def _fetch_inputs(self, iteration: int, micro_batch: int, kind: str = "download") -> dict[str, Any]:
        values: dict[str, Any] = {}
        keys = [self.keys.data(iteration, micro_batch) if producer == DATA_SOURCE
                else self.keys.activation(iteration, producer, micro_batch)
                for producer in sorted(set(self.stage.sources.values()))]
        if self.is_last and self.spec.loss != "output":
            keys.append(self.keys.target(iteration, micro_batch))
        nbytes = 0
        start = time.time()
        for key in keys:
            data = self.store.wait(key, self.spec.wait_timeout_s)
            nbytes += len(data)
            values.update(unpack_values(data))
        self._record(kind, iteration, micro_batch, start, nbytes, "download")
        return values

    def _put(self, key: str, data: bytes, iteration: int, micro_batch: int | None) -> None:
        start = time.time()
        self.store.put(key, data)
        self._record("upload", iteration, micro_batch, start, len(data), "upload")

    def _fetch_gradients(self, iteration: int, micro_batch: int) -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        start = time.time()
        nbytes = 0
        for consumer in self.stage.consumers:
            data = self.store.wait(self.keys.gradient(iteration, consumer, micro_batch), self.spec.wait_timeout_s)
            nbytes += len(data)
            mine = {name for name, source in self.spec.stages[consumer].sources.items() if source == self.role.stage}
            for name, grad in wire.loads(data)[0].items():
                if name in mine:
                    grads[name] = grads[name] + grad if name in grads else grad
        self._record("download", iteration, micro_batch, start, nbytes, "download")
        return grads

    def _record(self, kind: str, iteration: int, micro_batch: int | None, start: float, nbytes: int, lane: str) -> None:
        self.recorder.add(Event(stage=self.role.stage, replica=self.role.replica, iteration=iteration, kind=kind,
                                start=start, end=time.time(), micro_batch=micro_batch, nbytes=nbytes, lane=lane,
                                attempt=self.role.attempt))

    # compute --------------------------------------------------------------------------------
    def _forward(self, iteration: int, micro_batch: int, fetched: Future, states: dict[int, MicroBatchState]) -> None:
        values = fetched.result()
        state = MicroBatchState(target=values.get(TARGET))
        check_stage_inputs(self.input_specs, ((name, values[name]) for name in self.stage.inputs),
                           where=f"stage {self.role.stage}, iteration {iteration}, micro-batch {micro_batch}: ")
        for name in self.stage.inputs:
            value = values[name]
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and self.stage.sources[name] != DATA_SOURCE):
                value = value.detach().requires_grad_(True)
            state.inputs[name] = value
        if self.stash is not None:
            self._stashed_weights("F", iteration, micro_batch, state)
        start = time.time()
        # a recomputing stage keeps only its inputs: the forward builds no autograd graph and
        # the backward runs it again (``stage_backward``)
        with torch.set_grad_enabled(not self.stage.recompute):
            self.throttle_compute(lambda: stage_forward(self.module, self.spec, self.stage, iteration, micro_batch,
                                                        state, attrs=self.attrs))
        states[micro_batch] = state
        self._record("forward", iteration, micro_batch, start, 0, "compute")
        self.after_task("forward", iteration, micro_batch)

    def _backward(self, iteration: int, micro_batch: int, fetched: Future | None,
                  states: dict[int, MicroBatchState]) -> bytes | None:
        state = states[micro_batch]
        grads = fetched.result() if fetched is not None else {}
        start = time.time()
        self.throttle_compute(lambda: stage_backward(self.module, self.spec, self.stage, iteration, micro_batch, state,
                                                     grads, attrs=self.attrs, scaler=self.scaler))
        input_grads = input_gradients(state.inputs)
        if self.is_last and state.loss is not None:
            # the report's loss is the batch's mean, whatever the accumulation's 1/K weight
            # (asynchronous: each micro-batch's mean, weighted by its share of the batch)
            weight = (self.spec.optimizer.accumulate if not self.schedule.own_minibatch
                      else micro_batch_size(self.spec.batch, self.spec.micro_batches, micro_batch) / self.spec.batch)
            self._loss_total += float(state.loss.detach()) * weight
        if self.stash is not None:
            self._stashed_weights("B", iteration, micro_batch, state)
            self._add_to_round(iteration, micro_batch, state)
        states.pop(micro_batch)
        self._record("backward", iteration, micro_batch, start, 0, "compute")
        self.after_task("backward", iteration, micro_batch)
        return wire.dumps(for_wire(input_grads, self.spec.precision)) if self._sends_gradients else None

    @property
    def _sends_gradients(self) -> bool:
        return any(source != DATA_SOURCE for source in self.stage.sources.values())

    # one iteration ----------------------------------------------------------------------------
    def run_iteration(self, iteration: int, lanes: Lanes) -> None:
        """Iteration ``iteration``'s actions (``Schedule.call_actions``): a flush schedule's
        forwards and backwards of the iteration, then the synchronization and the step; an
        asynchronous one's slice of the call's sequence, whose forwards may be backwarded in
        a later slice and whose backwards may be an earlier iteration's (each steps on its
        own). A slice waits only for its own tasks."""
        self._loss_total = 0.0
        actions = self._iteration_actions(iteration)
        prefetched, self._prefetched = self._prefetched, {}
        forwards: dict[tuple[int, int], Future] = {}
        uploads: dict[tuple[int, int], Future] = {}
        pending: list[Future] = []
        for action in actions:
            number, m = self.role.start_iteration + action.iteration, action.micro_batch
            key, states = (number, m), self._in_flight.setdefault(number, {})
            if action.is_forward:
                fetched = prefetched.pop(key, None) or lanes.submit("download", self._fetch_inputs, number, m)
                forwards[key] = lanes.submit("compute", self._forward, number, m, fetched, states, after=[fetched])
                pending.append(forwards[key])
                if not self.is_last:
                    uploads[key] = lanes.submit("upload", self._upload_outputs, number, m, states,
                                                after=[forwards[key]])
                    pending.append(uploads[key])
                continue
            fetched = None if self.is_last else lanes.submit("download", self._fetch_gradients, number, m)
            # the backward releases the micro-batch's state, so it waits for every lane that
            # reads it: its forward and the upload of its outputs (a micro-batch forwarded in an
            # earlier slice: that slice waited for both). In a first run the gradients cannot
            # arrive before that upload, but in a replayed iteration they are already in the
            # store (at-least-once execution: any task may run twice)
            done = lanes.submit("compute", self._backward, number, m, fetched, states,
                                after=[forwards.get(key), uploads.get(key), fetched])
            pending.append(lanes.submit("upload", self._upload_gradients, number, m, done, after=[done])
                           if self._sends_gradients else done)
        # markers for the invoker's straggler watch go out on the upload lane, off the critical path
        lanes.submit("upload", self._mark, iteration, "forwarded", after=list(forwards.values()))
        self._prefetch(iteration + 1, lanes)
        for future in pending:
            future.result()
        self._in_flight = {number: states for number, states in self._in_flight.items() if states}
        lanes.submit("upload", self._mark, iteration, "computed")
        if not self.schedule.flush:     # the rounds step as the version rule asks for them
            if iteration == self.role.end_iteration - 1:
                lanes.submit("compute", self._finish_call).result()
            if self.is_last:
                self.losses[iteration] = self._loss_total
            return
        lanes.submit("compute", self._synchronize, iteration, lanes).result()
        lanes.submit("compute", self._update, iteration).result()

    def _iteration_actions(self, iteration: int) -> list[Action]:
        """This replica's actions of ``iteration``, from the schedule's actions of the call."""
        if self._actions is None:
            owned = self.stage.owned(self.spec.micro_batches, self.role.replica)
            self._actions = self.schedule.call_actions(self.role.stage, self.layout, owned,
                                                       self.role.end_iteration - self.role.start_iteration)
        return self._actions[iteration - self.role.start_iteration]

    def _prefetch(self, iteration: int, lanes: Lanes) -> None:
        """The first stage's inputs are the data, already in the store: the forwards of
        ``iteration`` download theirs while the current one computes."""
        if not self._reads_only_data or iteration >= self.role.end_iteration:
            return
        for action in self._iteration_actions(iteration):
            number = self.role.start_iteration + action.iteration
            if action.is_forward:
                self._prefetched[(number, action.micro_batch)] = lanes.submit(
                    "prefetch", self._fetch_inputs, number, action.micro_batch, "prefetch")

    def _sequence(self, iteration: int, micro_batch: int) -> int:
        """A micro-batch's number g in the call's sequence (the version rule's argument)."""
        return (iteration - self.role.start_iteration) * self.spec.micro_batches + micro_batch

    def _stashed_weights(self, kind: str, iteration: int, micro_batch: int, state: MicroBatchState) -> None:
        """A forward takes the weight version the schedule's rule names
        (``Schedule.weight_version``), first applying the rounds due before it; its backward
        hands the same leaves to the observer, if any."""
        stash = self._weight_stash()
        if kind == "F":
            state.version = self.schedule.weight_version(self._sequence(iteration, micro_batch), self.role.stage,
                                                         self.layout)
            self._apply_rounds(state.version)
            stash.snapshot(state.version)
            state.weights = stash.acquire(state.version)
        if self.observe_weights is not None:
            version, weights = self._held_version(state)
            self.observe_weights(kind, iteration, micro_batch, version, weights)

    def _add_to_round(self, iteration: int, micro_batch: int, state: MicroBatchState) -> None:
        """After a micro-batch's backward: its gradient (on its version's leaves) joins its
        round's, the stash lets go of the versions nothing needs any more, and a round whose
        micro-batches on this replica are all in goes to the reduction."""
        stash = self._weight_stash()
        version, weights = self._held_version(state)
        stash.release(version)
        stash.prune(self.call_steps)
        state.weights = None
        size = self.schedule.round_size(self.role.stage, self.layout)
        round_index = self._sequence(iteration, micro_batch) // size
        held = self.rounds.add(round_index, {name: weights[name].grad for name in self.trainable})
        if held == self._round_share(round_index):
            self._submit_reduction(round_index)

    def _call_length(self) -> int:
        return (self.role.end_iteration - self.role.start_iteration) * self.spec.micro_batches

    def _round_share(self, round_index: int) -> int:
        """The micro-batches of round ``round_index`` this replica runs (the call's last round
        may be cut short by the call's end)."""
        size = self.schedule.round_size(self.role.stage, self.layout)
        return sum(1 for g in range(round_index * size, min((round_index + 1) * size, self._call_length()))
                   if self.layout.replica_of(self.role.stage, g) == self.role.replica)

    def _submit_reduction(self, round_index: int) -> None:
        if self._round_lanes is None:
            self._round_lanes = Lanes(("reduce", "upload", "download"))
        local = self.rounds.pop(round_index)
        self._reduced[round_index] = self._round_lanes.submit("reduce", self._reduce_round, round_index, local)

    def _reduce_round(self, round_index: int, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A round's gradient: this replica's summed over the stage's replicas on the store
        (``collectives.scatter_reduce``, added in replica order, so every replica gets the
        same), its mean under PipeDream's 1F1B (each micro-batch a minibatch of its own),
        then tied weights' summed over their holders and the global norm clipped, as a
        flushed step does. Keyed by the round's first micro-batch in the run's sequence."""
        start = time.time()
        key = self.role.start_iteration * self.spec.micro_batches + round_index * self.schedule.round_size(
            self.role.stage, self.layout)
        # the round's store keys name the iteration of its first micro-batch: the invoker frees them with it
        slot = Round.of(key, self.spec.micro_batches)
        params = list(self.trainable.values())
        grads = dict(local)
        if self.stage.replicas > 1 and params:
            def record(lane: str, kind: str, nbytes: int):
                return self.recorder.task(kind, key, nbytes=nbytes, lane=lane)

            flat = torch.cat([(grads[name] if grads.get(name) is not None else torch.zeros_like(param))
                              .reshape(-1).float() for name, param in self.trainable.items()])
            total = scatter_reduce(flat, store=self.store, keys=self.keys, iteration=slot, stage=self.role.stage,
                                   replica=self.role.replica, replicas=self.stage.replicas, method=self.spec.sync,
                                   lanes=self._round_lanes, timeout_s=self.spec.wait_timeout_s, record=record)
            offset = 0
            for name, param in self.trainable.items():
                grads[name] = total[offset:offset + param.numel()].view_as(param).to(param.dtype)
                offset += param.numel()
        if self.schedule.own_minibatch and self.stage.replicas > 1:
            grads = {name: grad / self.stage.replicas for name, grad in grads.items() if grad is not None}
        self._sum_shared(slot, grads)
        clip = self.spec.optimizer.clip_grad_norm
        if clip is not None:
            counted = [grad for name, grad in grads.items()
                       if min(self.spec.shared.get(name, (self.role.stage,))) == self.role.stage]
            squared = clipping.global_sums(self.store, self.keys, slot, self.role.stage, len(self.spec.stages),
                                           self.role.replica, [clipping.squared_norm(counted)],
                                           self.spec.wait_timeout_s)[0]
            coefficient = clipping.clip_coefficient(math.sqrt(squared), clip)
            if coefficient < 1.0:
                grads = {name: grad * torch.tensor(coefficient, dtype=torch.float32).to(grad.dtype)
                         for name, grad in grads.items()}
        self._record("sync", slot.iteration, None, start, 0, "compute")
        return grads

    def _apply_rounds(self, version: int) -> None:
        """Steps the live weights up to ``version``: each round due, once its reduction is in,
        in round order (a replica never waits here for a round whose backwards come after
        this task in the stage's 1F1B order: the version rule's lag sees to it)."""
        stash = self._weight_stash()
        while self.call_steps < version:
            if self.call_steps not in self._reduced:
                if self._round_share(self.call_steps):
                    raise RuntimeError(f"stage {self.role.stage}: round {self.call_steps} is due before this replica "
                                       "ran its backwards; this is a bug in the asynchronous schedule")
                self._submit_reduction(self.call_steps)
            grads = self._reduced.pop(self.call_steps).result()
            # a version nobody holds any more is not copied for the step
            stash.prune(self.call_steps + 1)
            stash.before_step(self.call_steps)
            for name, param in self.trainable.items():
                param.grad = grads.get(name)
            self.throttle_compute(self.optimizer.step)
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
            self.call_steps += 1

    def _finish_call(self) -> None:
        """The call's end: the pipeline has drained, so every round's update is applied (the
        final weights hold every micro-batch's gradient) and the round lanes close."""
        size = self.schedule.round_size(self.role.stage, self.layout)
        self._apply_rounds(-(-self._call_length() // size))
        if self._round_lanes is not None:
            self._round_lanes.close()
            self._round_lanes = None

    def _weight_stash(self) -> WeightStash:
        """The stash of weight versions, which only a stage under an asynchronous schedule keeps."""
        if self.stash is None:
            raise RuntimeError(f"stage {self.role.stage} keeps no weight versions: the {self.schedule.name} schedule "
                               "flushes every iteration, and only an asynchronous schedule stashes them")
        return self.stash

    def _held_version(self, state: MicroBatchState) -> tuple[int, dict[str, torch.Tensor]]:
        """The weight version a micro-batch's forward took from the stash, and its leaves."""
        if state.version is None or state.weights is None:
            raise RuntimeError(f"stage {self.role.stage}: a micro-batch holds no stashed weight version (its "
                               "forward did not run on this stage under an asynchronous schedule)")
        return state.version, state.weights

    @property
    def _reads_only_data(self) -> bool:
        """The first stage: its inputs are the data, already in the store, so the next
        iteration's can be downloaded while this one computes."""
        return all(source == DATA_SOURCE for source in self.stage.sources.values())

    def _mark(self, iteration: int, phase: str) -> None:
        # the straggler watch reads markers only where a stage has replicas to compare; with one
        # replica everywhere they are 2 requests per worker and iteration that nobody reads
        if all(stage.replicas == 1 for stage in self.spec.stages):
            return
        self.store.put(self.keys.marker(iteration, self.role.stage, self.role.replica, phase), b"1")

    def _upload_outputs(self, iteration: int, micro_batch: int, states: dict[int, MicroBatchState]) -> None:
        outputs = states[micro_batch].outputs
        self._put(self.keys.activation(iteration, self.role.stage, micro_batch),
                  pack_values(for_wire(outputs, self.spec.precision)),
                  iteration, micro_batch)

    def _upload_gradients(self, iteration: int, micro_batch: int, done: Future) -> None:
        self._put(self.keys.gradient(iteration, self.role.stage, micro_batch), done.result(), iteration, micro_batch)

    def _synchronize(self, iteration: int, lanes: Lanes) -> None:
        start = time.time()
        params = list(self.trainable.values())
        if self.stage.replicas > 1 and params:
            flat = flat_grads(params)

            def record(lane: str, kind: str, nbytes: int):
                return self.recorder.task(kind, iteration, nbytes=nbytes, lane=lane)

            total = scatter_reduce(flat, store=self.store, keys=self.keys, iteration=iteration,
                                   stage=self.role.stage, replica=self.role.replica, replicas=self.stage.replicas,
                                   method=self.spec.sync, lanes=lanes, timeout_s=self.spec.wait_timeout_s,
                                   record=record)
            assign_flat_grads(params, total)
        self._exchange_shared(iteration)
        self._record("sync", iteration, None, start, 0, "compute")
        self.after_task("sync", iteration, None)

    def _exchange_shared(self, iteration: int) -> None:
        """Tied weights held by several stages: every holder adds the others' gradients, so
        all copies take the same step (README, "Tied weights")."""
        grads = {name: param.grad for name, param in self.trainable.items()}
        self._sum_shared(iteration, grads)
        for name in self.spec.shared:
            if name in self.trainable and name in grads:
                self.trainable[name].grad = grads[name]

    def _sum_shared(self, iteration: int | Round, grads: dict[str, torch.Tensor | None]) -> None:
        """Adds the other holders' gradients of each tied weight into ``grads`` (replica 0 of
        each holder publishes its own under ``iteration``)."""
        mine = {name: holders for name, holders in self.spec.shared.items()
                if self.role.stage in holders and name in self.trainable}
        if not mine:
            return
        if self.role.replica == 0:
            for name in mine:
                grad = grads.get(name)
                self.store.put(self.keys.shared_gradient(iteration, self.role.stage, name),
                               wire.dumps({"grad": grad if grad is not None
                                           else torch.zeros_like(self.trainable[name])}))
        for name, holders in mine.items():
            own = grads.get(name)
            total = own if own is not None else torch.zeros_like(self.trainable[name])
            for holder in holders:
                if holder == self.role.stage:
                    continue
                data = self.store.wait(self.keys.shared_gradient(iteration, holder, name), self.spec.wait_timeout_s)
                total = total + wire.loads(data)[0]["grad"]
            grads[name] = total

    def _update(self, iteration: int) -> None:
        start = time.time()
        if self._accumulates():
            self._apply_step(iteration)
        self.optimizer.zero_grad(set_to_none=True)
        self._record("update", iteration, None, start, 0, "compute")
        self.after_task("update", iteration, None)
        if self.is_last:
            self.losses[iteration] = self._loss_total

    def _accumulates(self) -> bool:
        """Folds the iteration's reduced gradients into the accumulation; whether the
        optimizer steps after this iteration (the K-th since the last step, across calls:
        the count is in the checkpoints). Accumulating the already reduced gradients (not
        each replica's own) keeps every replica's accumulation equal to replica 0's, which is
        what its checkpoint holds, so a restarted replica resumes it exactly."""
        every = self.spec.optimizer.accumulate
        if every == 1:
            return True
        for name, param in self.trainable.items():
            if param.grad is None:
                continue
            held = self.accumulated.get(name)
            self.accumulated[name] = param.grad.detach().clone() if held is None else held + param.grad
        self.accumulated_count += 1
        if self.accumulated_count < every:
            return False
        for name, param in self.trainable.items():
            param.grad = self.accumulated.get(name)
        self.accumulated, self.accumulated_count = {}, 0
        return True

    def _apply_step(self, iteration: int) -> None:
        """Unscales (fp16) and clips the gradients to the global norm (``clipping.checked_step``),
        steps the optimizer unless a stage overflowed, updates the loss scale and steps the
        schedule (as torch's recipe does, skipped step or not)."""
        counted = [param.grad for name, param in self.trainable.items()
                   if min(self.spec.shared.get(name, (self.role.stage,))) == self.role.stage]

        def reduce(own: list[float]) -> list[float]:
            return clipping.global_sums(self.store, self.keys, iteration, self.role.stage, len(self.spec.stages),
                                        self.role.replica, own, self.spec.wait_timeout_s)

        steps = clipping.checked_step(list(self.trainable.values()), counted, self.spec.optimizer.clip_grad_norm,
                                      self.scaler, reduce)
        if steps:
            self.throttle_compute(self.optimizer.step)
        if self.scaler is not None:
            self.scaler.update(not steps)
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1

    def progress(self, iteration: int) -> dict[str, Any]:
        return {"loss": self.losses.get(iteration) if self.is_last else None,
                "end": time.time()}
