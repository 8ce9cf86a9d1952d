"""Pipeline schedules as registered, typed objects: the order in which a stage replica runs
its forwards and backwards, whether the pipeline drains (flushes) every iteration, how many
optimizer steps an iteration takes, what the schedule combines with, and how its iteration
time is predicted.

Modelled on torch.distributed.pipelining: one class per schedule, each emitting typed
actions (:class:`Action`: stage, computation, micro-batch), and a name -> class map
(:data:`SCHEDULE_REGISTRY`, a :class:`flatpack.registry.Registry` like the passes', solvers' and
cost models'). A run names its schedule as a string (``RunSpec.schedule``, the call record,
``flatpack run --schedule``): that is the wire format; :func:`get` turns it into the object
once, and everything else asks the object.

* ``sync``: FuncPipe's synchronous schedule (§3.2): the forwards of every owned micro-batch,
  then their backwards in reverse order, then the gradient synchronization and one optimizer
  step.
* ``1f1b``: PipeDream's one-forward-one-backward with a flush per iteration: stage s of S
  runs ``S - s - 1`` forwards before its first backward, then alternates.
* ``1f1b-async``: PipeDream's 1F1B without a flush (thesis Ch. 5): every micro-batch is a
  minibatch of its own, each stage steps after every backward on the weight version its
  forward used (weight stashing, ``runtime.stashing``), and a call's iterations are slices of
  one 1F1B sequence over the call.

A new flush-type schedule is one class with :meth:`Schedule.actions` and
:meth:`Schedule.iteration_s`, registered under its name; one defined outside flatpack reaches
the workers, which are processes of their own, through the deployment's environment
(:data:`PLUGINS_ENV`, :func:`register_plugins`). ``tests/unit/test_schedules.py`` adds one
(``tests/unit/gpipe_schedule.py``) and trains with it on the local backend. Torch-free: the
command line imports it for its choices.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping, Sequence

from flatpack.errors import InputError
from flatpack.registry import Registry
from flatpack.stage.settings import SCALED_PRECISIONS


class Computation(enum.Enum):
    """What an action computes on its stage."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One compute task of a stage replica: ``kind`` of ``micro_batch`` of the iteration
    ``iteration`` iterations after the first of the span the actions cover (always 0 in one
    iteration's actions; an asynchronous schedule's slice of a call holds earlier
    iterations' backwards)."""

    stage: int
    kind: Computation
    micro_batch: int
    iteration: int = 0

    @property
    def is_forward(self) -> bool:
        return self.kind is Computation.FORWARD

    def __str__(self) -> str:   # torch.distributed.pipelining's notation: "2F0" is stage 2's forward of 0
        return f"{self.stage}{self.kind.value}{self.micro_batch}" + (f"@{self.iteration}" if self.iteration else "")


@dataclass(frozen=True)
class Setup:
    """What a run combines its schedule with, for :meth:`Schedule.check`: the settings some
    schedule cannot run with. ``replan``, ``elastic``: the run switches plans or replica
    degrees between epochs; ``ranks``: it runs as GPU-container ranks (``runtime.distributed``)."""

    replicas: tuple[int, ...] = ()
    vertical_sync: bool = False
    clip_grad_norm: float | None = None
    accumulate: int = 1
    precision: str = "fp32"
    shared: tuple[str, ...] = ()           # tied parameters held by several stages
    time_limit_s: float | None = None
    replan: bool = False
    elastic: bool = False
    ranks: bool = False


@dataclass(frozen=True)
class Schedule(ABC):
    """One pipeline schedule. Subclasses set ``name`` and ``description`` and implement
    :meth:`actions` and :meth:`iteration_s`; an asynchronous one (``flush = False``) also
    :meth:`call_actions` and :meth:`weight_version`."""

    name: ClassVar[str]
    description: ClassVar[str]       # one line for the command line's help
    # True: the pipeline drains every iteration, whose gradients are synchronized among a
    # stage's replicas before one optimizer step. False (asynchronous): each micro-batch is a
    # minibatch of its own, stepped after its backward on the weights its forward used
    flush: ClassVar[bool] = True

    @abstractmethod
    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        """The compute actions of one iteration of a replica of ``stage`` (of ``stages``)
        over the micro-batches it ``owned``, in the order it runs them: each micro-batch
        forwarded once and backwarded once, after its forward."""

    @abstractmethod
    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        """The predicted seconds of one iteration, from FuncPipe's t_iter (eq. 7, which lets
        no backward start before the whole pipeline's forward has drained) and the span of
        this schedule's actions simulated with the model's durations (``simulated_s()``,
        ``analysis.report``, computed only if asked for)."""

    def call_actions(self, stage: int, stages: int, owned: Sequence[int], iterations: int) -> list[list[Action]]:
        """The actions of a call of ``iterations`` iterations, one list per iteration: what
        each iteration runs. A flush schedule's are each iteration's own :meth:`actions`."""
        if not self.flush:
            raise NotImplementedError(f"the asynchronous schedule {self.name!r} must say how a call's iterations "
                                      "cut its actions (call_actions)")
        one = self.actions(stage, stages, owned)
        return [[dataclasses.replace(action, iteration=index) for action in one] for index in range(iterations)]

    def optimizer_steps(self, micro_batches: int) -> int:
        """Optimizer steps per iteration (before gradient accumulation): one after a flush,
        one per micro-batch otherwise (PipeDream's minibatch)."""
        return 1 if self.flush else micro_batches

    def weight_version(self, sequence: int, stage: int, stages: int, vertical_sync: bool) -> int:
        """An asynchronous schedule's weight version for the forward (and backward) of the
        call's ``sequence``-th micro-batch on ``stage``: the optimizer steps taken since the
        call began, or under ``vertical_sync`` those of the first stage."""
        raise NotImplementedError(f"the {self.name!r} schedule flushes every iteration and keeps one weight version")

    def check(self, setup: Setup) -> None:
        """Refuses what this schedule does not run with, before any function starts, naming
        the cause and the fix. A flush schedule runs with everything but vertical sync."""
        if setup.vertical_sync:
            stashing = [name for name in names() if not get(name).flush] or ["asynchronous"]
            raise InputError(f"vertical sync applies to the {' or '.join(stashing)} schedule, not {self.name!r}; use "
                             f"--schedule {stashing[0]} --vertical-sync, or leave --vertical-sync out")


def one_forward_one_backward(owned: Sequence[int], warmup: int) -> list[tuple[Computation, int]]:
    """PipeDream's 1F1B over ``owned`` (in order): ``warmup`` forwards, then one forward and
    the oldest pending backward in turn, then the remaining backwards."""
    warmup = min(warmup, len(owned))
    order = [(Computation.FORWARD, m) for m in owned[:warmup]]
    for index, m in enumerate(owned[warmup:]):
        order += [(Computation.FORWARD, m), (Computation.BACKWARD, owned[index])]
    order += [(Computation.BACKWARD, m) for m in owned[len(owned) - warmup:]]
    return order


def warmup_forwards(stage: int, stages: int) -> int:
    """Forwards stage ``stage`` of ``stages`` runs before its first backward under 1F1B:
    PipeDream's NOAM - 1 for one replica per stage, S - s - 1 (the last stage alternates
    from the start)."""
    return stages - stage - 1


@dataclass(frozen=True)
class Synchronous(Schedule):
    name: ClassVar[str] = "sync"
    description: ClassVar[str] = "FuncPipe's synchronous schedule: all forwards, then all backwards, then one step"

    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        return ([Action(stage, Computation.FORWARD, m) for m in owned]
                + [Action(stage, Computation.BACKWARD, m) for m in reversed(owned)])

    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        # FuncPipe's model is this schedule's: with one micro-batch per replica its t_iter is
        # the simulated span exactly, with more an upper bound (analysis.report)
        return pipeline_bound_s


@dataclass(frozen=True)
class OneForwardOneBackward(Schedule):
    name: ClassVar[str] = "1f1b"
    description: ClassVar[str] = "PipeDream's 1F1B with a flush per iteration"

    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        return [Action(stage, kind, m) for kind, m in one_forward_one_backward(owned, warmup_forwards(stage, stages))]

    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        # each backward waits for the round trip through the stages above, and the forwards
        # after it wait for it: with transfers as long as the compute the span exceeds
        # FuncPipe's t_iter, so the simulated span is the prediction
        return simulated_s()


@dataclass(frozen=True)
class AsynchronousOneForwardOneBackward(Schedule):
    """PipeDream's 1F1B without a flush: a call's micro-batches, numbered g = 0, 1, ...
    across its iterations, run as one 1F1B sequence; stage s steps after each backward, so
    before the forward of g it has taken ``g - (S - s - 1)`` steps, the version the forward
    (and, stashed, the backward) uses."""

    name: ClassVar[str] = "1f1b-async"
    description: ClassVar[str] = ("PipeDream's 1F1B without a flush: a step per micro-batch, weight stashing, "
                                  "one replica per stage")
    flush: ClassVar[bool] = False

    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        return [action for chunk in self.call_actions(stage, stages, owned, 1) for action in chunk]

    def call_actions(self, stage: int, stages: int, owned: Sequence[int], iterations: int) -> list[list[Action]]:
        """One 1F1B sequence over the call, cut into one list per iteration: iteration i's
        runs from the forward of its first micro-batch to the task before the next
        iteration's first forward, and the last also drains the pipeline's backwards."""
        per = len(owned)
        sequence = list(range(iterations * per))
        chunks: list[list[Action]] = [[] for _ in range(iterations)]
        current = 0
        for kind, g in one_forward_one_backward(sequence, warmup_forwards(stage, stages)):
            if kind is Computation.FORWARD:
                current = g // per
            chunks[current].append(Action(stage, kind, owned[g % per], g // per))
        return chunks

    def weight_version(self, sequence: int, stage: int, stages: int, vertical_sync: bool) -> int:
        lag = warmup_forwards(0 if vertical_sync else stage, stages)
        return max(0, sequence - lag)

    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        # without a flush no stage waits for the pipeline to drain: FuncPipe's t_iter bounds it
        return pipeline_bound_s

    def check(self, setup: Setup) -> None:
        """Refuses what stepping each stage after every micro-batch on its own gradient does
        not combine with: anything that needs every stage (or every replica) at one step,
        and anything that stops between iterations, where micro-batches are in flight."""
        fix = f"use --schedule 1f1b (flushed) for it, or run {self.name} without it"
        refusals = [
            (any(degree > 1 for degree in setup.replicas),
             f"{self.name} runs one replica per stage (PipeDream's 1F1B-RR is not built), but the replica degrees are "
             f"{list(setup.replicas)}; use --replicas 1, or {fix}"),
            (setup.clip_grad_norm is not None,
             f"--clip-grad-norm {setup.clip_grad_norm} needs every stage's gradient of one step, but {self.name} "
             f"steps each stage on its own micro-batch; {fix}"),
            (setup.precision in SCALED_PRECISIONS,
             f"--precision {setup.precision} skips a step wherever any stage's gradient overflowed, which needs every "
             f"stage's gradient of one step, but {self.name} steps each stage on its own micro-batch; use "
             f"--precision bf16 (no loss scaler), or {fix}"),
            (setup.accumulate != 1,
             f"--accumulate {setup.accumulate}: {self.name} steps after every micro-batch (PipeDream's minibatch), so "
             f"there is nothing to accumulate; use larger micro-batches, or {fix}"),
            (bool(setup.shared),
             f"tied weights {list(setup.shared)} are held by several stages, which must step together, but "
             f"{self.name} steps each stage alone; untie them, or {fix}"),
            (setup.time_limit_s is not None,
             f"a function time limit ({setup.time_limit_s} s) re-invokes a function between iterations, where "
             f"{self.name} has micro-batches in flight; train in calls short enough for the platform's limit (the "
             f"pipeline drains at the end of each call) with time_limit_s=None, or {fix}"),
            (setup.replan,
             f"replan switches plans between epochs, and {self.name} has micro-batches in flight across iterations "
             "with stashed weights that no checkpoint holds; use --schedule sync or 1f1b, or leave --replan out"),
            (setup.elastic,
             f"elastic re-scaling changes replica degrees between epochs, and {self.name} runs one replica per stage; "
             "use --schedule 1f1b for an elastic run, or leave elastic out"),
            (setup.ranks,
             f"the {self.name} schedule runs on functions (the local, Lambda and Alibaba FC backends); GPU-container "
             f"ranks run {' or '.join(name for name in names() if get(name).flush)}: use --schedule 1f1b for this "
             "target"),
        ]
        for refused, message in refusals:
            if refused:
                raise InputError(message)


SCHEDULE_REGISTRY: Registry[Schedule] = Registry("schedule", InputError, {})
for _entry in (Synchronous, OneForwardOneBackward, AsynchronousOneForwardOneBackward):
    SCHEDULE_REGISTRY.register(_entry.name, _entry)
# the built-in names in the order the command line's help lists them
SCHEDULES: tuple[str, ...] = tuple(SCHEDULE_REGISTRY.factories)
DEFAULT_SCHEDULE = Synchronous.name


def get(schedule: str | Schedule) -> Schedule:
    """The schedule a name names (an :class:`InputError` listing the known ones otherwise);
    a schedule object is returned as it is."""
    if isinstance(schedule, Schedule):
        return schedule
    found = SCHEDULE_REGISTRY.make(schedule)
    if not isinstance(found, Schedule):
        raise InputError(f"schedule {schedule!r} is registered as {found!r}, not a Schedule; register the class")
    return found


def names() -> list[str]:
    """Every registered schedule's name, the built-ins first in their order."""
    return [*SCHEDULES, *(name for name in SCHEDULE_REGISTRY.names() if name not in SCHEDULES)]


# a schedule defined outside flatpack, named in the deployment's environment as
# "module:Class" (comma-separated, as the registry names its built-ins): every worker, a
# process of its own, imports and registers it before it reads its run. The environment is
# the deployer's, as trusted as PYTHONPATH; a run's data (the spec in the store) only names
# a registered schedule, never code
PLUGINS_ENV = "FLATPACK_SCHEDULES"


def register_plugins(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Registers the schedule classes ``environ[PLUGINS_ENV]`` names (one registered already,
    the same class, is left as it is); returns their names."""
    registered = []
    for entry in (part.strip() for part in environ.get(PLUGINS_ENV, "").split(",")):
        if not entry:
            continue
        module_name, colon, attribute = entry.partition(":")
        if not colon:
            raise InputError(f"{PLUGINS_ENV} names {entry!r}; name each schedule class as module:Class, e.g. "
                             "my_schedules:Interleaved")
        found = getattr(importlib.import_module(module_name), attribute, None)
        if not (isinstance(found, type) and issubclass(found, Schedule)):
            raise InputError(f"{PLUGINS_ENV} names {entry!r}, which is {found!r}, not a Schedule subclass")
        if SCHEDULE_REGISTRY.factories.get(found.name) is not found:
            SCHEDULE_REGISTRY.register(found.name, found)
        registered.append(found.name)
    return registered
