"""The cost models by name, each an entry that knows what it prices and how to price a plan.

An entry is a small frozen dataclass (:class:`CostModel`): its ``name``, the workload kinds
(``"train"``, ``"infer"``), platform kinds and pipeline schedules it prices, the shape of the
plans it prices (a tier per stage or one for all; a replica degree per stage or one for all),
its own options as typed fields (Hydrozoa's α and β, Gillis's measured delay), and
:meth:`CostModel.price`, the one entry point that times and prices a plan. :data:`COST_MODEL_REGISTRY`
holds them (one :class:`flatpack.registry.Registry`, as for passes, solvers, platforms,
backends and models), and :func:`cost_model_for` is the one place that picks the model a
problem's plans are judged by, so that the objective, the solvers, the reports and the command
line ask once and then use the entry instead of comparing names.

The options stay on :class:`~flatpack.partitioner.options.ProblemOptions` (``Problem.options``,
``flatpack.compile(options=...)`` and the command line set them there, saved plans record them
there); :meth:`CostModel.of_options` is the one place each model's typed options are built from
them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from flatpack.errors import InputError
from flatpack.partitioner.cost import funcpipe, gillis, hydrozoa, pipedream
from flatpack.partitioner.cost.collectives import AllReduceTerms
from flatpack.partitioner.cost.gillis import CommDelay
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.registry import Registry
from flatpack.schedules import Schedule

# typing.Self is 3.11+; the package supports 3.10 (pyproject requires-python)
ModelT = TypeVar("ModelT", bound="CostModel")

# the model a problem is judged by when ``options.cost_model`` does not choose one, by
# (workload kind, platform kind): FuncPipe's for training where workers share only storage,
# Hydrozoa's for training on GPU containers, Gillis's for inference anywhere
DEFAULT_MODELS: dict[tuple[str, str], str] = {
    ("train", "serverless"): funcpipe.MODEL,
    ("train", "local"): funcpipe.MODEL,
    ("train", "container"): hydrozoa.MODEL,
    ("infer", "serverless"): gillis.MODEL,
    ("infer", "local"): gillis.MODEL,
    ("infer", "container"): gillis.MODEL,
}
# ``options.cost_model`` chooses among training models; an inference request is priced by
# Gillis's fork-join model whatever it says
CHOOSABLE_MODES = ("train",)


@dataclass(frozen=True)
class Priced:
    """What one cost model says of one plan: seconds per training iteration or inference
    request, dollars for the same, whether every worker fits its memory, and the model's own
    breakdown (``PipelineCost``, ``ForkJoinCost``, ``HybridCost``, ``PipeDreamCost``)."""

    time_s: float
    dollars: float
    fits: bool
    detail: Any


@dataclass(frozen=True)
class CostModel(ABC):
    """One cost model: what it prices (class attributes) and its options (fields)."""

    name: ClassVar[str]
    label: ClassVar[str]                      # how reports name it ("FuncPipe")
    modes: ClassVar[tuple[str, ...]]          # workload kinds it prices
    platform_kinds: ClassVar[tuple[str, ...]]
    # whether it prices asynchronous schedules (no flush, ``flatpack.schedules``) beside the
    # ones that flush every iteration: see :meth:`predicts`
    asynchronous: ClassVar[bool]
    tier_per_stage: ClassVar[bool]            # False: one memory tier for every function
    degree_per_stage: ClassVar[bool]          # False: one replica degree for the whole pipeline

    @classmethod
    def of_options(cls: type[ModelT], options: ProblemOptions) -> ModelT:
        """This model with its options read from the problem's (none by default)."""
        return cls()

    @classmethod
    def prices(cls, mode: str, platform_kind: str) -> bool:
        """Whether this model describes ``mode`` workloads on ``platform_kind`` platforms."""
        return mode in cls.modes and platform_kind in cls.platform_kinds

    @classmethod
    def predicts(cls, schedule: Schedule) -> bool:
        """Whether this model prices a training iteration under ``schedule``: every model
        prices a flush schedule's (its cuts run with any order of actions), only some an
        asynchronous one's."""
        return schedule.flush or cls.asynchronous

    @abstractmethod
    def price(self, problem: Problem, plan: Plan) -> Priced:
        """Time, dollars and fit of ``plan`` (whose micro-batch count the problem carries)."""


@dataclass(frozen=True)
class FuncPipeModel(CostModel):
    """FuncPipe's storage-based training pipeline (``cost/funcpipe.py``)."""

    name: ClassVar[str] = funcpipe.MODEL
    label: ClassVar[str] = "FuncPipe"
    modes: ClassVar[tuple[str, ...]] = ("train",)
    platform_kinds: ClassVar[tuple[str, ...]] = ("serverless", "local", "container")
    # FuncPipe's t_iter bounds a pipeline that never drains (``Schedule.iteration_s``)
    asynchronous: ClassVar[bool] = True
    tier_per_stage: ClassVar[bool] = True
    degree_per_stage: ClassVar[bool] = False

    def price(self, problem: Problem, plan: Plan) -> Priced:
        cost = funcpipe.iteration(problem, plan)
        return Priced(cost.iteration_s, cost.dollars_per_iteration, cost.fits, cost)


@dataclass(frozen=True)
class GillisModel(CostModel):
    """Gillis's fork-join inference (``cost/gillis.py``); ``comm_delay`` is the measured
    master↔worker delay (None: the one ``flatpack calibrate`` fitted, else the platform's
    storage latency)."""

    name: ClassVar[str] = gillis.MODEL
    label: ClassVar[str] = "Gillis"
    modes: ClassVar[tuple[str, ...]] = ("infer",)
    platform_kinds: ClassVar[tuple[str, ...]] = ("serverless", "local", "container")
    asynchronous: ClassVar[bool] = False    # it prices inference (fork-join), no training schedule
    tier_per_stage: ClassVar[bool] = False
    degree_per_stage: ClassVar[bool] = True

    comm_delay: CommDelay | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "comm_delay", gillis.measured_delay(self.comm_delay))

    @classmethod
    def of_options(cls, options: ProblemOptions) -> GillisModel:
        return cls(comm_delay=options.comm_delay)

    def price(self, problem: Problem, plan: Plan) -> Priced:
        cost = gillis.latency(problem, plan, self.comm_delay)
        return Priced(cost.latency_s, cost.dollars_per_request, cost.fits, cost)


@dataclass(frozen=True)
class HydrozoaModel(CostModel):
    """Hydrozoa's A×B hybrid on GPU containers (``cost/hydrozoa.py``); ``alpha`` and
    ``beta`` are its all-reduce overheads per byte and per round (§3.4); None: the ones
    ``flatpack calibrate --target gpu-container`` fitted, else 0 (``hydrozoa.sync_overheads``)."""

    name: ClassVar[str] = hydrozoa.MODEL
    label: ClassVar[str] = "Hydrozoa"
    modes: ClassVar[tuple[str, ...]] = ("train",)
    platform_kinds: ClassVar[tuple[str, ...]] = ("container",)
    asynchronous: ClassVar[bool] = False    # GPU-container ranks run only flush schedules
    tier_per_stage: ClassVar[bool] = True
    degree_per_stage: ClassVar[bool] = False

    alpha: float | None = None
    beta: float | None = None

    @classmethod
    def of_options(cls, options: ProblemOptions) -> HydrozoaModel:
        return cls(alpha=None if options.hydrozoa_alpha is None else float(options.hydrozoa_alpha),
                   beta=None if options.hydrozoa_beta is None else float(options.hydrozoa_beta))

    def sync_terms(self, problem: Problem) -> AllReduceTerms:
        """What this model prices an all-reduce by on ``problem`` (``hydrozoa.sync_overheads``)."""
        return hydrozoa.sync_overheads(problem, self.alpha, self.beta)

    def price(self, problem: Problem, plan: Plan) -> Priced:
        cost = hydrozoa.iteration(problem, plan, self.sync_terms(problem))
        return Priced(cost.iteration_s, cost.dollars_per_iteration, cost.fits, cost)


@dataclass(frozen=True)
class PipeDreamModel(CostModel):
    """PipeDream's slowest-stage model with per-stage replicas on GPU containers
    (``cost/pipedream.py``)."""

    name: ClassVar[str] = pipedream.MODEL
    label: ClassVar[str] = "PipeDream"
    modes: ClassVar[tuple[str, ...]] = ("train",)
    platform_kinds: ClassVar[tuple[str, ...]] = ("container",)
    asynchronous: ClassVar[bool] = False    # GPU-container ranks run only flush schedules
    tier_per_stage: ClassVar[bool] = True
    degree_per_stage: ClassVar[bool] = True

    def price(self, problem: Problem, plan: Plan) -> Priced:
        cost = pipedream.iteration(problem, plan)
        return Priced(cost.iteration_s, cost.dollars_per_iteration, cost.fits, cost)


COST_MODEL_REGISTRY: Registry[CostModel] = Registry("cost model", InputError, {})
for _entry in (FuncPipeModel, HydrozoaModel, PipeDreamModel, GillisModel):
    COST_MODEL_REGISTRY.register(_entry.name, _entry)
# the built-in names in the order reports and JSON list them
COST_MODELS: tuple[str, ...] = tuple(COST_MODEL_REGISTRY.factories)


def entry(name: str) -> type[CostModel]:
    """The registered cost model ``name`` (InputError listing the known names otherwise)."""
    factory = COST_MODEL_REGISTRY.factory(name)
    if not (isinstance(factory, type) and issubclass(factory, CostModel)):
        raise InputError(f"cost model {name!r} is registered as {factory!r}, not a CostModel subclass; register "
                         "the class itself")
    return factory


def label_of(name: str) -> str:
    """How reports name the cost model ``name`` ("FuncPipe"); an unknown name as it is."""
    return entry(name).label if name in COST_MODEL_REGISTRY.names() else name


def models_pricing(mode: str, platform_kind: str) -> list[str]:
    """Names of the registered models that price ``mode`` workloads on ``platform_kind``, in
    registration order."""
    return [name for name in COST_MODEL_REGISTRY.factories if entry(name).prices(mode, platform_kind)]


def cost_model_for(problem: Problem) -> CostModel:
    """The cost model a problem's plans are judged by, with its options: the default for the
    problem's workload kind and platform kind (:data:`DEFAULT_MODELS`); for training,
    ``options.cost_model`` overrides it with another model that prices the platform
    (``"hydrozoa"``, ``"pipedream"`` or ``"funcpipe"`` on GPU containers)."""
    mode, kind = problem.workload.mode, problem.platform.kind
    chosen = problem.options.cost_model if mode in CHOOSABLE_MODES else None
    if chosen is None:
        return _predicting(entry(DEFAULT_MODELS[(mode, kind)]), problem).of_options(problem.options)
    if chosen in models_pricing(mode, kind):
        return _predicting(entry(chosen), problem).of_options(problem.options)
    if kind == "container":
        raise InputError(f"cost_model {chosen!r} cannot price GPU-container training; use hydrozoa or pipedream")
    raise InputError(f"cost_model {chosen!r} cannot price training on {problem.platform.name}: workers there "
                     "share only storage, which FuncPipe's model describes; leave cost_model out")


def _predicting(model: type[CostModel], problem: Problem) -> type[CostModel]:
    """``model``, unless the problem trains with a schedule it does not predict: that is
    refused, naming the models that do."""
    schedule = problem.workload.schedule_object
    if problem.workload.mode != "train" or model.predicts(schedule):
        return model
    able = [name for name in models_pricing("train", problem.platform.kind) if entry(name).predicts(schedule)]
    fix = (f"choose --cost-model {' or '.join(able)}, or " if able else "") + "train with a schedule that flushes"
    raise InputError(f"the {model.label} cost model ({model.name}) prices only schedules that flush every iteration, "
                     f"not the asynchronous {schedule.name}; {fix} (--schedule)")
