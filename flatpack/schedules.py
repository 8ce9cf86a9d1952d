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
  one 1F1B sequence over the call. With replicated stages it is PipeDream's 1F1B-RR: a stage
  of d replicas gives the call's micro-batches to them round-robin and steps once per round
  of d, on their gradients reduced on the store.
* ``2bw``: PipeDream-2BW (ICML 2021, §3): two weight versions, one step per iteration on
  gradients computed on the previous version, as one 1F1B sequence over the call.

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
    micro_batches: int = 0                 # M of an iteration (0: not known yet, the solver picks it)


@dataclass(frozen=True)
class Layout:
    """What an asynchronous schedule's version rule reads about a run: each stage's replica
    degree, the micro-batches M of an iteration, the accumulation K and vertical sync. The
    rule (:meth:`Schedule.weight_version`) is a pure function of a micro-batch's number in
    the call, its stage and this."""

    replicas: tuple[int, ...]
    micro_batches: int
    accumulate: int = 1
    vertical_sync: bool = False

    @classmethod
    def single(cls, stages: int, micro_batches: int, vertical_sync: bool = False) -> Layout:
        """One replica per stage."""
        return cls((1,) * stages, micro_batches, vertical_sync=vertical_sync)

    @property
    def stages(self) -> int:
        return len(self.replicas)

    def replica_of(self, stage: int, sequence: int) -> int:
        """The replica of ``stage`` that runs the call's ``sequence``-th micro-batch: micro-batch
        m of an iteration runs on replica m mod d (``StageSpec.owned``), round-robin over the
        call's sequence when d divides M (which 1F1B-RR requires)."""
        return (sequence % self.micro_batches) % self.replicas[stage]


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
    # whether --vertical-sync applies: every stage computes a micro-batch on the first stage's version
    vertical_sync: ClassVar[bool] = False
    # True: each micro-batch is a minibatch of its own, its loss its own mean (PipeDream's
    # 1F1B); False: its loss is scaled by its share b/B of the batch (and 1/K), so that the
    # gradients of an iteration's micro-batches sum to the batch mean's
    own_minibatch: ClassVar[bool] = False

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

    def call_actions(self, stage: int, layout: Layout, owned: Sequence[int], iterations: int) -> list[list[Action]]:
        """The actions of a call of ``iterations`` iterations, one list per iteration: what
        each iteration runs on the replica of ``stage`` that owns the micro-batches ``owned``
        of each iteration. A flush schedule's are each iteration's own :meth:`actions`."""
        if not self.flush:
            raise NotImplementedError(f"the asynchronous schedule {self.name!r} must say how a call's iterations "
                                      "cut its actions (call_actions)")
        one = self.actions(stage, layout.stages, owned)
        return [[dataclasses.replace(action, iteration=index) for action in one] for index in range(iterations)]

    def optimizer_steps(self, micro_batches: int, replicas: int = 1) -> int:
        """Optimizer steps per iteration (before gradient accumulation) of a stage of
        ``replicas`` replicas: one after a flush; an asynchronous schedule's one per round
        (:meth:`round_size`)."""
        if self.flush:
            return 1
        return max(1, micro_batches // self.round_size(0, Layout((replicas,), micro_batches)))

    def weight_versions(self, in_flight: int) -> int:
        """Copies of its weights a stage keeps with ``in_flight`` micro-batches in flight on
        it (what the ``pipedream`` cost model prices, ``cost.pipedream.iteration``): one for a
        flush schedule, whose every micro-batch of an iteration computes on the same weights."""
        return 1

    # -- the version rule of an asynchronous schedule: the one place it is computed -------------
    def round_size(self, stage: int, layout: Layout) -> int:
        """Micro-batches of the call's sequence whose gradients one optimizer step of
        ``stage`` applies (a round: numbered k = g // round_size)."""
        raise NotImplementedError(f"the {self.name!r} schedule flushes every iteration and steps once per iteration")

    def version_lag(self, stage: int, layout: Layout) -> int:
        """How many micro-batches of the call's sequence after a round's last one a forward
        of ``stage`` first computes on that round's step."""
        raise NotImplementedError(f"the {self.name!r} schedule flushes every iteration and keeps one weight version")

    def warmup(self, stage: int, layout: Layout) -> int:
        """Forwards of the call's sequence ``stage`` runs before its first backward (over all
        its replicas together: a replica runs its own micro-batches of that one order)."""
        return warmup_forwards(stage, layout.stages)

    def weight_version(self, sequence: int, stage: int, layout: Layout) -> int:
        """An asynchronous schedule's weight version for the forward (and backward) of the
        call's ``sequence``-th micro-batch on ``stage``: the optimizer steps the stage has
        taken since the call began, ``max(0, floor((g - lag) / R))`` with R the
        :meth:`round_size` and lag the :meth:`version_lag`. Every replica of the stage steps
        once per round on the round's reduced gradient, so all hold the same versions."""
        return max(0, (sequence - self.version_lag(stage, layout)) // self.round_size(stage, layout))

    def check(self, setup: Setup) -> None:
        """Refuses what this schedule does not run with, before any function starts, naming
        the cause and the fix. A flush schedule runs with everything but vertical sync."""
        if setup.vertical_sync:
            stashing = [name for name in names() if get(name).vertical_sync] or ["asynchronous"]
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


def projected_call(stage: int, layout: Layout, owned: Sequence[int], iterations: int,
                   warmup: int) -> list[list[Action]]:
    """One 1F1B sequence over the call's micro-batches g = 0, 1, ... (``warmup`` forwards
    deep), as the stage would run it alone, restricted to the replica that owns ``owned`` of
    each iteration (round-robin: ``Layout.replica_of``), and cut into one list per
    iteration: iteration i's runs from the replica's first forward of i to the task before
    its next iteration's first forward, and the last also drains the backwards. Every
    replica's order is so a subsequence of one order of the stage, which keeps the replicas
    of a stage, and the stages, free of a wait cycle (docs/training.md)."""
    per = layout.micro_batches
    mine = set(owned)
    chunks: list[list[Action]] = [[] for _ in range(iterations)]
    current = 0
    for kind, g in one_forward_one_backward(list(range(iterations * per)), warmup):
        if g % per not in mine:
            continue
        if kind is Computation.FORWARD:
            current = g // per
        chunks[current].append(Action(stage, kind, g % per, g // per))
    return chunks


@dataclass(frozen=True)
class AsynchronousSchedule(Schedule, ABC):
    """What PipeDream's schedules without a flush share: a call's micro-batches, numbered
    g = 0, 1, ... across its iterations, run as one 1F1B sequence of the stage
    (:func:`projected_call`), and each stage steps once per round of its own
    (:meth:`Schedule.round_size` micro-batches) on the round's gradient, summed over the
    stage's replicas on the store. A forward computes on the version the rule
    (:meth:`Schedule.weight_version`) names, stashed until its backward."""

    flush: ClassVar[bool] = False
    own_minibatch: ClassVar[bool] = True

    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        layout = Layout.single(stages, max(owned, default=0) + 1)
        return [action for chunk in self.call_actions(stage, layout, owned, 1) for action in chunk]

    def call_actions(self, stage: int, layout: Layout, owned: Sequence[int], iterations: int) -> list[list[Action]]:
        return projected_call(stage, layout, owned, iterations, self.warmup(stage, layout))

    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        # without a flush no stage waits for the pipeline to drain: FuncPipe's t_iter bounds it
        return pipeline_bound_s

    def _refusals(self, setup: Setup, fix: str) -> list[tuple[bool, str]]:
        """What no schedule without a flush runs with: anything that stops between
        iterations, where micro-batches are in flight with stashed weights."""
        return [
            (setup.time_limit_s is not None,
             f"a function time limit ({setup.time_limit_s} s) re-invokes a function between iterations, where "
             f"{self.name} has micro-batches in flight; train in calls short enough for the platform's limit (the "
             f"pipeline drains at the end of each call) with time_limit_s=None, or {fix}"),
            (setup.replan,
             f"replan switches plans between epochs, and {self.name} has micro-batches in flight across iterations "
             "with stashed weights that no checkpoint holds; use --schedule sync or 1f1b, or leave --replan out"),
            (setup.elastic,
             f"elastic re-scaling changes replica degrees between epochs, and {self.name} has micro-batches in flight "
             "with stashed weights across them; use --schedule 1f1b for an elastic run, or leave elastic out"),
            (setup.ranks,
             f"the {self.name} schedule runs on functions (the local, Lambda and Alibaba FC backends); GPU-container "
             f"ranks run {' or '.join(name for name in names() if get(name).flush)}: use --schedule 1f1b for this "
             "target"),
        ]

    @staticmethod
    def _refuse(refusals: list[tuple[bool, str]]) -> None:
        for refused, message in refusals:
            if refused:
                raise InputError(message)


@dataclass(frozen=True)
class AsynchronousOneForwardOneBackward(AsynchronousSchedule):
    """PipeDream's 1F1B without a flush (SOSP'19 §3; the thesis, Ch. 5), with replicated
    stages as 1F1B-RR: a call's micro-batches g = 0, 1, ... run as one 1F1B sequence of each
    stage, stage s (of S, with d_s replicas) giving g to replica g mod d_s (round-robin;
    d_s must divide M). Every micro-batch is a minibatch of its own (its loss its own mean).

    The version rule: stage s steps once per round of d_s consecutive micro-batches (one on
    each replica), on the mean of the round's d_s gradients, reduced on the store so every
    replica applies the same update and the replicas stay identical (d_s = 1: a step per
    micro-batch). The forward of g (and, stashed, its backward) computes on the rounds the
    stage has completed before that forward in its 1F1B order, whose warm-up is W_s = S - s - 1
    forwards: ``v_s(g) = max(0, floor((g - W_s) / d_s))``; under vertical sync (one replica
    per stage) every stage takes the first stage's, ``max(0, g - W_0)``."""

    name: ClassVar[str] = "1f1b-async"
    vertical_sync: ClassVar[bool] = True
    description: ClassVar[str] = ("PipeDream's 1F1B without a flush: a step per micro-batch (per round of d on a "
                                  "stage of d replicas: 1F1B-RR), weight stashing")

    def round_size(self, stage: int, layout: Layout) -> int:
        return layout.replicas[stage]

    def version_lag(self, stage: int, layout: Layout) -> int:
        return self.warmup(0 if layout.vertical_sync else stage, layout)

    def weight_versions(self, in_flight: int) -> int:
        return in_flight       # weight stashing: a version per micro-batch in flight (S - s on stage s)

    def check(self, setup: Setup) -> None:
        """Refuses what stepping each stage on its own rounds does not combine with:
        anything that needs every stage at one step (docs/training.md, "Asynchronous
        schedules and the step's global knobs", says why none can be exact without
        serialising the pipeline; ``2bw`` steps every stage together and runs them), and
        anything that stops between iterations, where micro-batches are in flight."""
        fix = f"use --schedule 2bw or 1f1b (flushed) for it, or run {self.name} without it"
        # the global knobs need every stage's gradient of micro-batch g before any stage steps
        # on it: under vertical sync no stage's forward wants that step before the first
        # stage's backward of g has run, otherwise the last stage's next forward would wait for
        # it, which waits for that forward (docs/training.md)
        vertical = "use --vertical-sync (every stage then steps on g only after the first stage's backward of g), or"
        degrees = list(setup.replicas)
        uneven = [d for d in degrees if setup.micro_batches and setup.micro_batches % d]
        self._refuse([
            (bool(uneven),
             f"1F1B-RR gives micro-batch g of the call to replica g mod d of a stage and steps it once per round of "
             f"d micro-batches, but the replica degrees {degrees} do not all divide the {setup.micro_batches} "
             f"micro-batches of an iteration; use --micro-batches a multiple of {max(uneven or [1])}, or other "
             "degrees"),
            (setup.vertical_sync and any(d > 1 for d in degrees),
             f"vertical sync makes every stage compute on the first stage's version, counted in micro-batches, but "
             f"stages of replica degrees {degrees} step once per round of d; use --stage-replicas 1 for every "
             "stage, or leave --vertical-sync out"),
            (setup.clip_grad_norm is not None and not setup.vertical_sync,
             f"--clip-grad-norm {setup.clip_grad_norm} needs every stage's gradient of one step, but {self.name} "
             f"steps the later stages on a micro-batch before the first stage's backward of it has run; {vertical} "
             f"{fix}"),
            (setup.precision in SCALED_PRECISIONS,
             f"--precision {setup.precision} skips a step wherever any stage's gradient overflowed, which needs every "
             f"stage's gradient of one step, but {self.name} steps each stage on its own micro-batch; use "
             f"--precision bf16 (no loss scaler), or use --schedule 1f1b for it"),
            (setup.accumulate != 1,
             f"--accumulate {setup.accumulate}: {self.name} steps after every micro-batch (PipeDream's minibatch), so "
             f"there is nothing to accumulate; use larger micro-batches, or {fix}"),
            (bool(setup.shared) and not setup.vertical_sync,
             f"tied weights {list(setup.shared)} are held by several stages, which must step together on one "
             f"version, but {self.name} steps each stage on its own versions; {vertical} untie them, or {fix}"),
            *self._refusals(setup, fix),
        ])


@dataclass(frozen=True)
class DoubleBufferedWeights(AsynchronousSchedule):
    """PipeDream-2BW (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
    ICML 2021, §3): W(t+1) = W(t) - ν·∇f(W(t-1)). Every stage keeps two weight versions; the
    gradients of an iteration's M micro-batches (of K iterations under ``--accumulate K``)
    accumulate, each micro-batch's loss scaled by its share of the batch as under a flush,
    are summed over the stage's replicas on the store, and step every stage once. The
    forwards and backwards of iteration t compute on W(t-1), the version before the latest
    update: ``v(g) = max(0, floor(g / R) - 1)`` with R = M·K, the same on every stage, so a
    micro-batch sees one model across the stages (what vertical sync buys 1F1B).

    It runs as one 1F1B sequence over the call, like ``1f1b-async``, not flushed: that is
    what the second version is for. Iteration t + 1's first forward needs only the update of
    iteration t - 1, whose last backward is R - W_s micro-batches behind it in the stage's
    1F1B order (warm-up W_s = min(S - s - 1, R)), so no stage waits for the pipeline to
    drain; flushed, the stale version would cost the staleness and buy nothing. The call's
    end drains the pipeline and applies the updates still due, so a call's final weights
    hold every iteration's gradient (the paper's last W(t+1) too). Because every stage steps
    at the same round, the global knobs of a step work: the global gradient norm
    (``--clip-grad-norm``), ``--accumulate`` and tied weights are reduced across stages on the
    store as a flushed step reduces them."""

    name: ClassVar[str] = "2bw"
    description: ClassVar[str] = ("PipeDream-2BW: two weight versions, one step per iteration on the previous "
                                  "version's gradients, no flush")
    own_minibatch: ClassVar[bool] = False

    def round_size(self, stage: int, layout: Layout) -> int:
        return layout.micro_batches * layout.accumulate

    def version_lag(self, stage: int, layout: Layout) -> int:
        return self.round_size(stage, layout)

    def warmup(self, stage: int, layout: Layout) -> int:
        # deeper than a round, a forward would wait for an update whose backwards come after it
        return min(warmup_forwards(stage, layout.stages), self.round_size(stage, layout))

    def weight_versions(self, in_flight: int) -> int:
        return min(2, in_flight)    # the version the in-flight micro-batches compute on and the one being updated

    def check(self, setup: Setup) -> None:
        """Refuses what 2BW is not built for here: fp16's skipped steps, vertical sync (its
        versions are one model across the stages already), and anything that stops between
        iterations, where micro-batches are in flight."""
        fix = f"use --schedule 1f1b (flushed) for it, or run {self.name} without it"
        self._refuse([
            (setup.vertical_sync,
             f"vertical sync makes every stage compute a micro-batch on one version; {self.name}'s version is the "
             "iteration's on every stage already: leave --vertical-sync out"),
            (setup.precision in SCALED_PRECISIONS,
             f"--precision {setup.precision}'s loss scaler is not built into {self.name}'s deferred steps; use "
             f"--precision bf16 (no loss scaler), or {fix}"),
            *self._refusals(setup, fix),
        ])


SCHEDULE_REGISTRY: Registry[Schedule] = Registry("schedule", InputError, {})
for _entry in (Synchronous, OneForwardOneBackward, AsynchronousOneForwardOneBackward, DoubleBufferedWeights):
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
