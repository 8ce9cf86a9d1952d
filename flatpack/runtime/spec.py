"""What a training run tells its workers: the stages and their routing, the schedule, the
optimizer and loss. Plain JSON in the store (``RunKeys.spec``), so a worker needs nothing but
the store's address and its role (``runtime.function.Role``) to start."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from flatpack.batching import has_batch_dimension
from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec, check_loss
from flatpack.runtime.precision import WIRE_DTYPES, LossScaling
from flatpack.runtime.settings import RunControls, TrainSettings
from flatpack.schedules import DEFAULT_SCHEDULE, Schedule, Setup
from flatpack.schedules import get as schedule_named
from flatpack.stage.manifest import Manifest
from flatpack.stage.settings import PRECISIONS, SYNC_METHODS
from flatpack.stage.tensor_check import TensorSpec, dtype_name

DATA_SOURCE = -1   # an input that comes from the data, not from an earlier stage
WAIT_TIMEOUT_S = 300.0   # a worker's wait on a peer's tensor, when the call names none


@dataclass(frozen=True)
class StageSpec:
    index: int
    replicas: int
    memory_mb: int | None
    vcpus: float | None            # the tier's CPU share; compute is throttled below one thread per vCPU
    bandwidth_bytes_s: float | None  # token-bucket rate of each direction of the function's link
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    sources: dict[str, int]        # input name -> producing stage, or DATA_SOURCE
    consumers: tuple[int, ...]     # later stages that read any of this stage's outputs
    # keep no activations between a micro-batch's forward and its backward: the backward
    # re-runs the forward from the saved inputs (the plan's StagePlan.recompute)
    recompute: bool = False

    def owned(self, micro_batches: int, replica: int) -> list[int]:
        """Micro-batch m runs on replica m mod d of every stage (FuncPipe: µ = M/d each)."""
        return [m for m in range(micro_batches) if m % self.replicas == replica]


@dataclass(frozen=True)
class RunSpec:
    run: str
    stages: tuple[StageSpec, ...]
    micro_batches: int
    batch: int
    optimizer: OptimizerSpec
    loss: str
    loss_output: str                   # the model output the loss reads
    schedule: str = DEFAULT_SCHEDULE   # a registered schedule's name (flatpack.schedules): the wire format
    sync: str = "pipelined"
    threads: int = 1
    wait_timeout_s: float = WAIT_TIMEOUT_S
    checkpoint_every: int = 1
    time_limit_s: float | None = None  # a function re-invokes itself before this (Lambda: 900 s)
    # the call's first iteration and the checkpoint (an iteration number) its first iteration
    # starts from; None: the artifacts' weights (keys.py: numbers are never reused in a run)
    first_iteration: int = 0
    initial_checkpoint: int | None = None
    # the call's first iteration's place in the run's data: a resumed call trains batches from
    # the one it had not trained, under new iteration numbers (``data_iteration``)
    batch_offset: int = 0
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tied parameter -> holder stages
    faults: tuple[dict, ...] = ()      # injected failures (tests, chaos runs): see worker.apply_fault
    # transient store errors and stalls injected into every worker's store (chaos runs, the
    # fault benchmark), e.g. {"error_rate": 0.1, "stall_rate": 0.05, "stall_s": 2.0, "seed": 7}:
    # see runtime.chaos; None: none
    store_faults: dict | None = None
    precision: str = "fp32"            # one of PRECISIONS
    # asynchronous schedules only: every stage uses the weight version the first stage used for a
    # micro-batch (PipeDream's vertical sync), not its own latest
    vertical_sync: bool = False
    # fp16 only: torch.amp.GradScaler's settings for every stage's loss scaler
    loss_scaling: LossScaling = field(default_factory=LossScaling)

    def __post_init__(self) -> None:
        self.check_schedule()
        check_precision(self.precision)
        if self.sync not in SYNC_METHODS:
            raise InputError(f"sync {self.sync!r} is not one of {', '.join(SYNC_METHODS)}")
        check_loss(self.loss)
        for stage in self.stages:
            if stage.replicas > self.micro_batches:
                raise InputError(f"stage {stage.index} has {stage.replicas} replicas but an iteration has only "
                                 f"{self.micro_batches} micro-batches; some replicas would idle. Use at most "
                                 f"{self.micro_batches} replicas or more micro-batches")

    @functools.cached_property
    def schedule_object(self) -> Schedule:
        """The registered schedule ``schedule`` names (an InputError listing them otherwise)."""
        return schedule_named(self.schedule)

    def check_schedule(self, *, replan: bool = False, elastic: bool = False, ranks: bool = False) -> None:
        """Refuses, before any worker starts, what the schedule does not run with
        (``Schedule.check``); ``replan``, ``elastic``, ``ranks``: as ``schedules.Setup`` says."""
        self.schedule_object.check(Setup(
            replicas=tuple(stage.replicas for stage in self.stages), vertical_sync=self.vertical_sync,
            clip_grad_norm=self.optimizer.clip_grad_norm, accumulate=self.optimizer.accumulate,
            precision=self.precision, shared=tuple(sorted(self.shared)), time_limit_s=self.time_limit_s,
            replan=replan, elastic=elastic, ranks=ranks, micro_batches=self.micro_batches))

    @classmethod
    def of(cls, settings: TrainSettings, controls: RunControls, *, run: str, stages: tuple[StageSpec, ...],
           shared: dict[str, tuple[int, ...]], batch: int, loss_output: str, first_iteration: int = 0,
           initial_checkpoint: int | None = None) -> RunSpec:
        """What the workers of one call run: the call's ``settings`` (resolved for the plan: its
        micro-batches known), the driving ``controls`` the workers act on (time limit, waits,
        injected faults), the plan's ``stages`` and the ``batch`` measured from the data."""
        return cls(run=run, stages=stages, micro_batches=settings.micro_batch_count, batch=batch,
                   optimizer=settings.optimizer, loss=settings.loss, loss_output=loss_output,
                   schedule=settings.schedule, sync=settings.sync or "pipelined", threads=settings.threads or 1,
                   wait_timeout_s=controls.wait_timeout_s if controls.wait_timeout_s is not None else WAIT_TIMEOUT_S,
                   checkpoint_every=settings.checkpoint_every, time_limit_s=controls.time_limit_s,
                   first_iteration=first_iteration, initial_checkpoint=initial_checkpoint,
                   batch_offset=controls.batch_offset, shared=shared,
                   faults=controls.faults, store_faults=controls.store_faults, precision=settings.precision,
                   vertical_sync=settings.vertical_sync, loss_scaling=settings.loss_scaling)

    def data_iteration(self, iteration: int) -> int:
        """Iteration ``iteration``'s place in the run's data: the global batch it trains. Its
        iteration number is the store's (never reused: a resumed call numbers on from the
        last call); this is the same however the run was interrupted, so what is drawn per
        batch (dropout's seed, ``training.micro_batch_seed``) is too."""
        return self.batch_offset + iteration - self.first_iteration

    def checkpoints_after(self, iteration: int, segment_end: int) -> bool:
        """Whether replica 0 of every stage checkpoints after ``iteration``: every
        ``checkpoint_every``-th iteration of the call and the last of each segment. The
        invoker keeps an iteration's tensors until the next such checkpoint, so a lost
        stage replays from its last checkpoint with its neighbours' tensors still there.
        Under an asynchronous schedule only the last of each segment: between iterations
        micro-batches are in flight with stashed weights that a checkpoint of the weights
        would not hold, so a lost stage replays the segment from its start (every step is
        deterministic)."""
        if not self.schedule_object.flush:
            return iteration == segment_end - 1
        return (iteration + 1 - self.first_iteration) % self.checkpoint_every == 0 or iteration == segment_end - 1

    def checkpoint_before(self, start_iteration: int) -> int | None:
        """The checkpoint a worker starting at ``start_iteration`` loads: the one after the
        previous iteration, or at the call's first iteration the call's initial one."""
        return self.initial_checkpoint if start_iteration == self.first_iteration else start_iteration - 1

    def with_replicas(self, degrees: list[int]) -> RunSpec:
        stages = tuple(replace(stage, replicas=degree) for stage, degree in zip(self.stages, degrees))
        return replace(self, stages=stages)

    def dumps(self) -> bytes:
        data = asdict(self)
        data["optimizer"] = self.optimizer.to_json()
        return json.dumps(data).encode()

    @classmethod
    def loads(cls, raw: bytes) -> RunSpec:
        data = json.loads(raw)
        stages = tuple(StageSpec(**{**entry, "inputs": tuple(entry["inputs"]), "outputs": tuple(entry["outputs"]),
                                    "sources": {k: int(v) for k, v in entry["sources"].items()},
                                    "consumers": tuple(entry["consumers"])})
                       for entry in data.pop("stages"))
        return cls(stages=stages, optimizer=OptimizerSpec.from_json(data.pop("optimizer")),
                   shared={k: tuple(v) for k, v in data.pop("shared").items()},
                   faults=tuple(data.pop("faults")), loss_scaling=LossScaling.of(data.pop("loss_scaling", None)),
                   **data)


def routing(manifests: Sequence[Manifest],
            input_names: Sequence[str]) -> tuple[list[dict[str, int]], list[tuple[int, ...]]]:
    """For each stage, where each input comes from (the nearest earlier stage that outputs
    it, else the data) and which later stages read its outputs."""
    known_inputs = set(input_names)
    sources: list[dict[str, int]] = []
    consumers: list[set[int]] = [set() for _ in manifests]
    for index, manifest in enumerate(manifests):
        stage_sources = {}
        for name in manifest.input_names:
            producer = next((earlier for earlier in range(index - 1, -1, -1)
                             if name in manifests[earlier].output_names), DATA_SOURCE)
            if producer == DATA_SOURCE and name not in known_inputs:
                raise InputError(f"stage {index} reads {name!r}, which no earlier stage outputs and the model does "
                                 "not take as input; recompile the model")
            stage_sources[name] = producer
            if producer != DATA_SOURCE:
                consumers[producer].add(index)
        sources.append(stage_sources)
    return sources, [tuple(sorted(c)) for c in consumers]


def check_precision(precision: Any) -> None:
    """Refuses a precision the runtime does not train in, naming the ones it does."""
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}; use fp32 (the default), "
                         "bf16 (autocast, float32 master weights, bfloat16 tensors between stages) or fp16 (the "
                         "same in float16, with a loss scaler)")


def stage_specs(manifests: Sequence[Manifest], input_names: Sequence[str], degrees: Sequence[int],
                memory_mb: Sequence[int | None], tier_of: Callable[[int], Any] | None = None,
                recompute: Sequence[bool] | None = None) -> tuple[StageSpec, ...]:
    """The runtime's view of a plan's stages: routing, degrees, and each stage's tier as the
    functions emulate it (``tier_of(memory_mb)`` giving ``vcpus`` and ``bandwidth_bytes_s``;
    None where the platform enforces its tiers itself); ``recompute``: the plan's per-stage
    choice (None: no stage recomputes)."""
    sources, consumers = routing(manifests, input_names)
    recompute = recompute or [False] * len(manifests)
    specs = []
    for index, manifest in enumerate(manifests):
        memory = memory_mb[index]
        tier = tier_of(memory) if tier_of is not None and memory else None
        specs.append(StageSpec(
            index=index, replicas=degrees[index], memory_mb=memory_mb[index],
            vcpus=tier.vcpus if tier else None, bandwidth_bytes_s=tier.bandwidth_bytes_s if tier else None,
            inputs=manifest.input_names, outputs=manifest.output_names,
            sources=sources[index], consumers=consumers[index], recompute=bool(recompute[index])))
    return tuple(specs)


def shared_holders(manifests: Sequence[Manifest]) -> dict[str, tuple[int, ...]]:
    """Tied parameter name -> the stages holding a copy (from the manifests' ``shared_with``)."""
    shared: dict[str, set[int]] = {}
    for index, manifest in enumerate(manifests):
        for entry in manifest.parameters:
            if entry.shared_with:
                shared.setdefault(entry.name, set()).update([index, *entry.shared_with])
    return {name: tuple(sorted(holders)) for name, holders in shared.items()}


def micro_batch_size(batch: int, micro_batches: int, index: int) -> int:
    """Samples in micro-batch ``index``, as ``torch.tensor_split`` cuts: the first B mod M get one more."""
    base, extra = divmod(batch, micro_batches)
    return base + (1 if index < extra else 0)


def split_value(value: Any, batch: int, micro_batches: int) -> list[Any]:
    """``value`` of a global batch of ``batch`` samples, cut into its micro-batches as
    :func:`micro_batch_size` counts: a tensor whose first dimension is the batch is cut with
    ``tensor_split``; anything else (a mask without a batch dimension, a size) is the same
    for every micro-batch."""
    if has_batch_dimension(value, batch):
        return [piece.contiguous() for piece in torch.tensor_split(value, micro_batches)]
    return [value] * micro_batches


def received_specs(specs: Mapping[str, TensorSpec], stage: StageSpec, precision: str) -> dict[str, TensorSpec]:
    """What a stage's worker checks its inputs against: the manifest's specs, with the float32
    inputs another stage sends in the precision's wire dtype, since ``precision.for_wire`` cast them
    on the way (the model's own inputs, ``DATA_SOURCE``, arrive as the data has them)."""
    dtype = WIRE_DTYPES[precision]
    if dtype is None:
        return dict(specs)
    received = {name for name in stage.inputs if stage.sources[name] != DATA_SOURCE}
    return {name: replace(spec, dtype=dtype_name(dtype))
            if name in received and spec.dtype == dtype_name(torch.float32) else spec
            for name, spec in specs.items()}
