"""Re-planning a run between epochs and switching it onto the new plan (``train(replan=...)``,
``flatpack run --replan``; issue 19, item 3).

At every epoch boundary (``epoch_iterations``) the invoker hands this module the timeline
the current plan measured. :class:`ReplanPolicy` decides: by default it re-fits the cost
model to that timeline and solves again (``analysis.refit.replan``, what ``flatpack plan
--from-run`` does after a run) and switches when the new plan is predicted at least
``threshold`` faster. A switch (:func:`switch_plan`) happens after every function of the
epoch ended, its last iteration checkpointed by every stage:

1. the stages are emitted for the new cuts (``compiler.with_plan``) and uploaded under a new
   run prefix of the same store;
2. the stage checkpoints are read into one training state by parameter name and written as
   the new stages' checkpoints of the same iteration (``analysis.restage``), where the new
   functions' first invocation loads them, and the run's call records are copied there;
3. ``on_switch`` (``flatpack run``: the run directory now names the new prefix and plan),
   then the deployment runs the new plan and the old prefix is deleted.

Until step 3 the old prefix is whole and the run's record names it; from step 3 on the new
one is whole: a crash at any point resumes from one plan's consistent checkpoint, never a
mix (``tests/integration/test_replan.py``). Every step is exact: the new plan continues with
the weights, optimizer state, schedule position, accumulated gradients and loss scale the
old one left, so the run ends where a run on one plan ends.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from flatpack import logs
from flatpack.analysis.refit import Replan, replan
from flatpack.analysis.restage import gather, stage_checkpoint
from flatpack.backends.store_files import package
from flatpack.compiler import Compiled, with_plan
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan
from flatpack.runtime import timeline
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.spec import RunSpec
from flatpack.runtime.store import Store
from flatpack.stage.manifest import Manifest
from flatpack.table import plural

LOG = logs.get("replan")

# A switch stops every function, moves the checkpoints and cold-starts the new ones (seconds
# on the local backend), and the re-fitted model's own error is a few percent of an iteration
# (the predicted-vs-measured table of ``flatpack run``): a smaller predicted saving is within
# that error and would not pay for the switch
DEFAULT_THRESHOLD = 0.05
# the iterations of an epoch the re-fit leaves out: the first pays the cold starts, the second
# still warms up (``flatpack run`` compares predicted with measured the same way)
SKIP_FIRST = 2

Chooser = Callable[[Compiled, list[timeline.Event]], Replan]


class _CallRecord(Protocol):
    """A training call's record in the store (``functions.CallRecord``), as a switch copies it."""

    @property
    def first_iteration(self) -> int: ...

    def dumps(self) -> bytes: ...


class SwitchableDeployment(Protocol):
    """What a plan switch uses of a deployment (``functions.FunctionDeployment`` has it all):
    named here, not imported, since functions imports this module."""

    @property
    def platform(self) -> str: ...

    @property
    def compiled(self) -> Compiled: ...

    @property
    def keys(self) -> RunKeys: ...

    @property
    def store(self) -> Store: ...

    @property
    def manifests(self) -> Sequence[Manifest]: ...

    def calls(self) -> Sequence[_CallRecord]: ...

    def adopt(self, compiled: Compiled, keys: RunKeys) -> None: ...

    def respecified(self, spec: RunSpec) -> RunSpec: ...


@dataclass
class PlanSwitch:
    """One switch of a run: after ``iteration`` from ``old`` to ``new`` (run prefix ``run``),
    the iteration times the re-fitted model predicted for each, and the measured iteration
    before (the epoch the re-fit read) and after (the epochs the new plan ran)."""

    iteration: int
    old: Plan
    new: Plan
    old_predicted_s: float
    new_predicted_s: float
    measured_before_s: float | None
    run: str
    measured_after_s: float | None = None
    at: float = field(default_factory=time.time)   # when the run decided it (the timeline marks it)

    @property
    def saving(self) -> float:
        """The predicted saving as a share of the old plan's predicted iteration."""
        return (self.old_predicted_s - self.new_predicted_s) / self.old_predicted_s if self.old_predicted_s else 0.0

    def describe(self) -> str:
        def shape(plan: Plan) -> str:
            return " | ".join(f"layers {s.start}-{s.end} × {s.replicas}" for s in plan.stages)

        def ms(seconds: float | None) -> str:
            return f"{seconds * 1000:.1f} ms" if seconds is not None else "not measured"

        return (f"after iteration {self.iteration}: switched from [{shape(self.old)}] to [{shape(self.new)}], "
                f"predicted {self.old_predicted_s * 1000:.1f} -> {self.new_predicted_s * 1000:.1f} ms per iteration "
                f"({self.saving * 100:.1f}% saving); measured {ms(self.measured_before_s)} before, "
                f"{ms(self.measured_after_s)} after")

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "old_plan": self.old.to_json(), "new_plan": self.new.to_json(),
                "old_predicted_s": self.old_predicted_s, "new_predicted_s": self.new_predicted_s,
                "saving": self.saving, "measured_before_s": self.measured_before_s,
                "measured_after_s": self.measured_after_s, "run": self.run, "at": self.at}

    def mark(self) -> timeline.Mark:
        """The switch on the run's timeline."""
        return timeline.Mark(self.at, f"re-planned after {self.iteration}: "
                                      f"{' | '.join(f'×{s.replicas}' for s in self.new.stages)}")


@dataclass(frozen=True)
class ReplanPolicy:
    """How a run re-plans at its epoch boundaries. ``threshold``: the least predicted saving
    (a share of the old plan's iteration) that switches. ``solver``: what solves the re-fitted
    problem. ``choose(compiled, events) -> Replan``: decides instead of the re-fit (tests force
    a switch with it). ``on_switch(switch, compiled)``: called once the new plan's prefix is
    whole, before the run moves onto it (``flatpack run`` records it in the run directory)."""

    threshold: float = DEFAULT_THRESHOLD
    solver: str = "dp"
    choose: Chooser | None = None
    on_switch: Callable[[PlanSwitch, Compiled], None] | None = None

    @classmethod
    def of(cls, value: bool | ReplanPolicy) -> ReplanPolicy:
        return value if isinstance(value, ReplanPolicy) else cls()

    def proposal(self, compiled: Compiled, events: list[timeline.Event]) -> Replan:
        if self.choose is not None:
            return self.choose(compiled, events)
        assert compiled.problem is not None   # checked before launch (Replanner.for_call)
        return replan(compiled.problem, compiled.plan, events, solver=self.solver, skip_first=SKIP_FIRST,
                      source="the run's last epoch")


def check_replan(deployment: SwitchableDeployment, policy: ReplanPolicy, *, elastic: bool,
                 epoch_iterations: int | None, iterations: int) -> None:
    """Refuses, before any function starts, a run that cannot re-plan, naming the cause and the fix."""
    if elastic:
        raise InputError("elastic re-scales the plan's replica degrees at epoch boundaries and replan replaces the "
                         "plan there (degrees included); give one of them (an ElasticPolicy, --elastic auto, "
                         "re-plans the cuts as well)")
    if not 0 <= policy.threshold < 1:
        raise InputError(f"the replan threshold is a share of the iteration time in [0, 1), got {policy.threshold}; "
                         f"use e.g. {DEFAULT_THRESHOLD}")
    check_switchable(deployment, "replan", epoch_iterations=epoch_iterations, iterations=iterations,
                     refits=policy.choose is None)


def check_switchable(deployment: SwitchableDeployment, what: str, *, epoch_iterations: int | None, iterations: int,
                     refits: bool) -> None:
    """Refuses, before any function starts, a run that cannot switch plans at its epoch
    boundaries (``what``: the option asking for it), or with ``refits``, cannot re-fit the
    cost model to an epoch; each refusal names the cause and the fix."""
    if deployment.platform != "local":
        raise InputError(f"{what} switches plans on the local backend, whose invoker uploads each plan's stages to "
                         f"the store; a {deployment.platform} function runs the stage code of the image it was "
                         "deployed with. Re-plan after the run (flatpack plan --from-run RUN_DIR) and deploy the "
                         "new plan")
    if epoch_iterations is None or epoch_iterations >= iterations:
        raise InputError(f"{what} acts at epoch boundaries, and this call's {plural(iterations, 'iteration')} "
                         f"{'has' if iterations == 1 else 'have'} none: give "
                         f"epoch_iterations (--epoch-iterations) shorter than the run, e.g. {max(iterations // 2, 1)}")
    if refits and epoch_iterations <= SKIP_FIRST:
        raise InputError(f"{what} re-fits the cost model to each epoch's iterations after its first {SKIP_FIRST} "
                         f"(cold starts, warm-up), so an epoch needs at least {SKIP_FIRST + 1}; got "
                         f"--epoch-iterations {epoch_iterations}")
    compiled = deployment.compiled
    if compiled.graph is None or compiled.problem is None:
        raise InputError(f"{what} emits the stages of each new plan from the layer chain flatpack.compile made in "
                         f"this process; this deployment's artifact was read back with flatpack.load. Compile the "
                         f"model in this process to train it with {what}")
    if refits and (compiled.profile is None or any(stage.memory_mb is None for stage in compiled.plan.stages)):
        raise InputError(f"{what} re-fits the cost model, which prices a plan from its per-layer profile and each "
                         "stage's memory tier; compile with profile=True and a plan whose every stage has a "
                         "memory_mb (a cost-model solver such as dp chooses them)")


class Replanner:
    """One ``train()`` call's re-planning: asked at each epoch boundary, it keeps the switches."""

    def __init__(self, policy: ReplanPolicy) -> None:
        self.policy = policy
        self.switches: list[PlanSwitch] = []

    def after_epoch(self, deployment: SwitchableDeployment, spec: RunSpec, events: list[timeline.Event],
                    last: int) -> RunSpec | None:
        """At the boundary after iteration ``last`` (every stage checkpointed it): the spec of
        the new plan the run switched to, or None to keep the current one. ``events``: the
        timeline of the current plan so far."""
        self._measured_after(events)
        proposal = self.policy.proposal(deployment.compiled, events)
        if proposal.new == proposal.old:
            LOG.info(f"after iteration {last}: the re-fitted model keeps the plan")
            return None
        switch = PlanSwitch(last, proposal.old, proposal.new, proposal.old_predicted_s, proposal.new_predicted_s,
                            proposal.measured_s, next_run(deployment.keys.run))
        if switch.saving < self.policy.threshold:
            LOG.info(f"after iteration {last}: a new plan is predicted {switch.saving * 100:.1f}% faster, below the "
                     f"{self.policy.threshold * 100:.0f}% threshold; keeping the plan")
            return None
        too_wide = [stage.replicas for stage in proposal.new.stages if stage.replicas > spec.micro_batches]
        if too_wide:
            LOG.info(f"after iteration {last}: the new plan has {max(too_wide)} replicas of a stage, more than the "
                     f"run's {plural(spec.micro_batches, 'micro-batch', 'micro-batches')}; keeping the plan")
            return None
        new_spec = switch_plan(deployment, with_plan(deployment.compiled, proposal.new), spec, switch,
                               self.policy.on_switch)
        self.switches.append(switch)
        LOG.info(switch.describe())
        return new_spec

    def finish(self, events: list[timeline.Event]) -> None:
        """The end of the call: ``events`` (the last plan's timeline) measure the last switch."""
        self._measured_after(events)

    def _measured_after(self, events: list[timeline.Event]) -> None:
        if self.switches and self.switches[-1].measured_after_s is None:
            self.switches[-1].measured_after_s = timeline.summarize(events, skip_first=SKIP_FIRST).iteration_s


def next_run(run: str) -> str:
    """The run prefix of the next plan of ``run``: ``<run>-plan<n>``, counting on."""
    found = re.fullmatch(r"(.*)-plan(\d+)", run)
    return f"{found.group(1)}-plan{int(found.group(2)) + 1}" if found else f"{run}-plan1"


def switch_plan(deployment: SwitchableDeployment, compiled: Compiled, spec: RunSpec, switch: PlanSwitch,
                on_switch: Callable[[PlanSwitch, Compiled], None] | None = None) -> RunSpec:
    """Moves the run from the deployment's plan onto ``compiled`` after ``switch.iteration``
    (see the module's steps) and returns the run's spec for the new plan."""
    old_keys, new_keys = deployment.keys, RunKeys(switch.run)
    store = deployment.store
    store.delete_prefix(new_keys.prefix)     # what a switch that crashed half-way left there
    for key, data in package(compiled).items():
        store.put(f"{new_keys.prefix}{key}", data)
    checkpoints = [store.get(old_keys.checkpoint(stage, switch.iteration))
                   for stage in range(len(deployment.compiled.plan.stages))]
    state = gather(checkpoints, deployment.manifests, spec.optimizer)
    for artifact in compiled.artifacts:
        store.put(new_keys.checkpoint(artifact.manifest.stage, switch.iteration),
                  stage_checkpoint(state, artifact.manifest, spec.optimizer))
    for call in deployment.calls():
        store.put(new_keys.call(call.first_iteration), call.dumps())
    if on_switch is not None:
        on_switch(switch, compiled)
    deployment.adopt(compiled, new_keys)
    store.delete_prefix(old_keys.prefix)
    return dataclasses.replace(deployment.respecified(spec), run=new_keys.run)
