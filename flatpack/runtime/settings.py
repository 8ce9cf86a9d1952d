"""The settings of one training call, from the command line to the worker: what the pipeline
computes (:class:`TrainSettings`, recorded with the call so that ``resume`` repeats it) and
how the call is driven (:class:`RunControls`: limits, faults, progress, elastic scaling).

Both are parsed once at the edge (``flatpack run``'s options, or a Python caller) and passed
whole: ``Deployment.train(batches, settings, controls)``. A worker reads the settings through
the ``RunSpec`` built from them (``runtime.spec``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable

from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec, check_loss
from flatpack.runtime.precision import LossScaling
from flatpack.schedules import DEFAULT_SCHEDULE


@dataclass(frozen=True)
class TrainSettings:
    """What a training call computes. Every field is recorded with the call (the store's
    call record) and read back by ``resume``, so a resumed call computes what the first did.

    ``micro_batches``: None takes the plan's (``resolve_micro_batches``). ``sync``: None takes
    the plan's workload's. ``optimizer``: a name, a dict or an :class:`OptimizerSpec`;
    ``loss_scaling``: a dict or a :class:`LossScaling` (fp16 only)."""

    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec(name="sgd"))
    loss: str = "cross_entropy"
    micro_batches: int | None = None
    schedule: str = DEFAULT_SCHEDULE     # a registered schedule's name (flatpack.schedules)
    sync: str | None = None
    threads: int = 1
    checkpoint_every: int = 1
    precision: str = "fp32"
    vertical_sync: bool = False
    loss_scaling: LossScaling = field(default_factory=LossScaling)

    def __post_init__(self) -> None:
        # a Python caller may name the optimizer or give the loss scaler's settings as a dict
        object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))
        object.__setattr__(self, "loss_scaling", LossScaling.of(self.loss_scaling))
        check_loss(self.loss)
        if self.checkpoint_every < 1:
            raise InputError(f"checkpoint_every must be at least 1 (a checkpoint every that many iterations), got "
                             f"{self.checkpoint_every}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise InputError(f"micro_batches must be at least 1, got {self.micro_batches}")

    def replace(self, **changes: Any) -> TrainSettings:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["optimizer"] = self.optimizer.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"training settings have unknown fields {unknown}; known: {sorted(known)}")
        return cls(**{**data, "optimizer": OptimizerSpec.from_json(data["optimizer"])} if "optimizer" in data
                   else data)


@dataclass(frozen=True)
class RunControls:
    """How a training call is driven: none of it changes what the pipeline computes.

    ``iterations``: None trains every batch given. ``time_limit_s``: a function re-invokes
    itself before this (None: the platform's). ``elastic(epoch, degrees) -> degrees | None``
    is asked every ``epoch_iterations``. ``faults`` and ``store_faults`` are injected failures
    (tests, chaos runs). ``non_finite``: "warn", "error" or "ignore". ``replan``: True or a
    ``backends.replan.ReplanPolicy``."""

    iterations: int | None = None
    time_limit_s: float | None = None
    elastic: Any = None
    epoch_iterations: int | None = None
    straggler_ratio: float | None = None
    faults: tuple[dict, ...] = ()
    progress: Any = False
    timeout_s: float = 600.0
    wait_timeout_s: float = 120.0
    batch_offset: int = 0
    store_faults: dict | None = None
    non_finite: str = "warn"
    replan: Any = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))

    def replace(self, **changes: Any) -> RunControls:
        return dataclasses.replace(self, **changes)


def fields_of(cls: type, options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that name a field of the dataclass ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {name: value for name, value in options.items() if name in names}


def split_options(options: dict[str, Any], *, what: str = "train()") -> tuple[TrainSettings, RunControls]:
    """Keyword options as a Python caller writes them (``micro_batches=4, timeout_s=60``)
    into the two typed halves; an unknown name is refused, naming the known ones."""
    known: Iterable[str] = [f.name for f in dataclasses.fields(TrainSettings)] + \
        [f.name for f in dataclasses.fields(RunControls)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"{what} got unknown options {unknown}; it takes {sorted(known)}")
    return TrainSettings(**fields_of(TrainSettings, options)), RunControls(**fields_of(RunControls, options))
