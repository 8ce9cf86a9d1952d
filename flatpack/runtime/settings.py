"""The settings of one training call, from the command line to the worker: what the pipeline
computes (:class:`TrainSettings`, recorded with the call so that ``resume`` repeats it) and
how the call is driven (:class:`RunControls`: limits, faults, progress, elastic scaling).

Both are parsed once at the edge (``flatpack run``'s options, or a Python caller) and passed
whole: ``Deployment.train(batches, settings, controls)``. A Python caller may instead name
the fields as keywords (``deployment.train(batches, iterations=3, micro_batches=4)``): they
are typed by :class:`TrainOptions` and parsed once by :func:`resolve_options`, which refuses
an unknown name. A worker reads the settings through the ``RunSpec`` built from them
(``RunSpec.of``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TypedDict

from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec, check_loss
from flatpack.runtime.precision import LossScaling
from flatpack.schedules import DEFAULT_SCHEDULE


@dataclass(frozen=True)
class TrainSettings:
    """What a training call computes. Every field is recorded with the call (the store's
    call record) and read back by ``resume``, so a resumed call computes what the first did
    (tests/unit/test_train_settings.py, tests/integration/test_resume.py).

    ``micro_batches``: None takes the plan's, else the workload's (``Plan.micro_batches_for``).
    ``sync``: None takes the plan's workload's. ``threads``: intra-op threads per worker, None
    the backend's default. ``optimizer``: a name, a dict or an :class:`OptimizerSpec`;
    ``loss_scaling``: a dict or a :class:`LossScaling` (fp16 only)."""

    optimizer: OptimizerSpec = field(default_factory=lambda: OptimizerSpec(name="sgd"))
    loss: str = "cross_entropy"
    micro_batches: int | None = None
    schedule: str = DEFAULT_SCHEDULE     # a registered schedule's name (flatpack.schedules)
    sync: str | None = None
    threads: int | None = None
    checkpoint_every: int = 1
    precision: str = "fp32"
    vertical_sync: bool = False
    loss_scaling: LossScaling = field(default_factory=LossScaling)

    def __post_init__(self) -> None:
        # a Python caller may name the optimizer or give the loss scaler's settings as a dict
        object.__setattr__(self, "optimizer", OptimizerSpec.of(self.optimizer))
        object.__setattr__(self, "loss_scaling", LossScaling.of(self.loss_scaling))
        check_loss(self.loss)
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 1:
            raise InputError(f"checkpoint_every must be at least 1 (a checkpoint every that many iterations), got "
                             f"{self.checkpoint_every!r}")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise InputError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InputError(f"threads must be a positive integer (intra-op threads per worker), got {self.threads!r}")

    def replace(self, **changes: Any) -> TrainSettings:
        return dataclasses.replace(self, **changes)

    @property
    def micro_batch_count(self) -> int:
        """M of settings resolved for a plan (``backends.functions.resolve_settings``)."""
        if self.micro_batches is None:
            raise ValueError("these settings are not resolved for a plan (micro_batches is None); resolve them with "
                             "backends.functions.resolve_settings first")
        return self.micro_batches

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["optimizer"] = self.optimizer.to_json()
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrainSettings:
        """The settings :meth:`to_json` wrote; an unknown field is refused, naming the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"training settings have unknown fields {unknown}; known: {sorted(known)}")
        values = dict(data)
        if "optimizer" in values:
            values["optimizer"] = OptimizerSpec.from_json(values["optimizer"])
        return cls(**values)


@dataclass(frozen=True)
class RunControls:
    """How a training call is driven: none of it changes what the pipeline computes.

    ``iterations``: None trains every batch given. ``time_limit_s``: a function re-invokes
    itself before this (None: the platform's). ``elastic(epoch, degrees) -> degrees | None``
    is asked every ``epoch_iterations``, or ``elastic`` is a
    ``backends.elastic_policy.ElasticPolicy`` that decides from what each epoch measured.
    ``faults`` and ``store_faults`` are injected failures
    (tests, chaos runs). ``non_finite``: "warn", "error" or "ignore". ``replan``: True or a
    ``backends.replan.ReplanPolicy``. ``wait_timeout_s``: None takes the backend's default."""

    iterations: int | None = None
    time_limit_s: float | None = None
    # a callback, or a backends.elastic_policy.ElasticPolicy (runtime names no backend type)
    elastic: Callable[[int, tuple[int, ...]], Sequence[int] | None] | Any = None
    epoch_iterations: int | None = None
    straggler_ratio: float | None = None
    faults: tuple[dict, ...] = ()
    progress: Any = False
    timeout_s: float = 600.0
    wait_timeout_s: float | None = None
    batch_offset: int = 0
    store_faults: dict | None = None
    non_finite: str = "warn"
    replan: Any = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "faults", tuple(self.faults))

    def replace(self, **changes: Any) -> RunControls:
        return dataclasses.replace(self, **changes)


class TrainOptions(TypedDict, total=False):
    """The fields of :class:`TrainSettings` and :class:`RunControls` as keywords, for a Python
    caller's ``deployment.train(batches, iterations=3, micro_batches=4)`` (a test keeps the
    two lists equal)."""

    optimizer: OptimizerSpec | str | dict
    loss: str
    micro_batches: int | None
    schedule: str
    sync: str | None
    threads: int | None
    checkpoint_every: int
    precision: str
    vertical_sync: bool
    loss_scaling: LossScaling | dict | None
    iterations: int | None
    time_limit_s: float | None
    elastic: Callable[[int, tuple[int, ...]], Sequence[int] | None] | Any
    epoch_iterations: int | None
    straggler_ratio: float | None
    faults: Iterable[dict]
    progress: Any
    timeout_s: float
    wait_timeout_s: float | None
    batch_offset: int
    store_faults: dict | None
    non_finite: str
    replan: Any


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def fields_of(cls: type, options: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that name a field of the dataclass ``cls``."""
    names = set(_names(cls))
    return {name: value for name, value in options.items() if name in names}


def resolve_options(settings: TrainSettings | None, controls: RunControls | None, options: Mapping[str, Any], *,
                    what: str = "train()") -> tuple[TrainSettings, RunControls]:
    """``settings`` and ``controls`` (None: the defaults) with the keyword ``options`` a Python
    caller wrote on top (``micro_batches=4, timeout_s=60``); an unknown name is refused,
    naming the known ones."""
    known = _names(TrainSettings) + _names(RunControls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"{what} got unknown options {unknown}; it takes {sorted(known)}")
    settings = (settings or TrainSettings()).replace(**fields_of(TrainSettings, options))
    controls = (controls or RunControls()).replace(**fields_of(RunControls, options))
    return settings, controls


def split_options(options: Mapping[str, Any], *, what: str = "train()") -> tuple[TrainSettings, RunControls]:
    """Keyword options into the two typed halves (the defaults for what is not named)."""
    return resolve_options(None, None, options, what=what)


def refuse_unhonoured(settings: TrainSettings, controls: RunControls, honoured: Iterable[str], *, what: str,
                      why: str) -> None:
    """Refuses a setting or control ``what`` does not act on (one that differs from its
    default and is not in ``honoured``), so that it is not silently ignored."""
    honoured = set(honoured)
    ignored = sorted(name for half, default in ((settings, TrainSettings()), (controls, RunControls()))
                     for name in _names(type(half))
                     if name not in honoured and getattr(half, name) != getattr(default, name))
    if ignored:
        raise InputError(f"{what} does not take {', '.join(ignored)} ({why}); it takes {', '.join(sorted(honoured))}")
