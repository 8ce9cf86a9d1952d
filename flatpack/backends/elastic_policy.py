"""Elasticity as a policy (Hydrozoa §3.5, dynamic worker scaling; issue 43, item 4):
``flatpack run --elastic auto`` and ``train(elastic=ElasticPolicy(...), epoch_iterations=N)``.

At every epoch boundary the invoker hands :class:`ElasticScaler` the timeline of the epoch
that just ended. It re-fits the cost model to that epoch (``analysis.refit.refit``, as
``--replan`` does), prices under the re-fit the plan that ran, the same cuts at every other
replica degree the policy allows and, with ``cuts``, the solver's front on the re-fitted
problem, and asks :meth:`ElasticPolicy.decide`: the cheapest plan by the policy's objective
(seconds or dollars per iteration) is adopted when its predicted saving exceeds the model's
own error on this run (:func:`run_error`), never a fixed constant. A change moves the run
exactly as a re-plan does (``replan.switch_plan``: every stage's checkpoint gathered by
parameter name and written as the new stages' checkpoints under a new run prefix).

Every decision, kept or changed, is an :class:`ElasticDecision`: its reason, the predicted
iteration (seconds and dollars) of the old and the chosen plan, the iteration measured in the
epoch before it and, once the next epoch ran, after it. ``flatpack run`` logs each, lists them
in its report and ``--json``, writes them to ``events.json`` (``decisions``) and marks them on
the timeline. ``tests/integration/test_elastic_policy.py`` checks that a run that changes
replicas this way ends with the weights of a run that follows the same plans fixed in advance.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from flatpack import logs
from flatpack.analysis.refit import fitted_problem, prediction_error, refit
from flatpack.backends.replan import SKIP_FIRST, PlanSwitch, SwitchableDeployment, next_run, switch_plan
from flatpack.compiler import Compiled, with_plan
from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import get_solver
from flatpack.runtime import timeline
from flatpack.runtime.elastic import OBJECTIVES
from flatpack.runtime.spec import RunSpec

LOG = logs.get("elastic")


def with_degree(plan: Plan, degree: int) -> Plan:
    """``plan``'s cuts and tiers with every stage at ``degree`` replicas."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(stage, replicas=degree)
                                                  for stage in plan.stages))


def shape(plan: Plan) -> str:
    """A plan in a log line: each stage's layers and replicas."""
    return " | ".join(f"layers {stage.start}-{stage.end} × {stage.replicas}" for stage in plan.stages)


@dataclass(frozen=True)
class Priced:
    """A plan under the re-fitted model: its predicted iteration in seconds and in dollars."""

    plan: Plan
    seconds: float
    dollars: float

    def cost(self, objective: str) -> float:
        return self.seconds if objective == "time" else self.dollars


@dataclass(frozen=True)
class Choice:
    """What :meth:`ElasticPolicy.decide` chose: ``chosen`` (``current`` when kept), the
    cheapest other plan it weighed (None: none was allowed), that plan's predicted saving
    (a share of the current plan's objective), the error it was weighed against, and why."""

    current: Priced
    chosen: Priced
    best_other: Priced | None
    saving: float
    error: float
    reason: str

    @property
    def changed(self) -> bool:
        return self.chosen.plan != self.current.plan


@dataclass(frozen=True)
class EpochMeasure:
    """One epoch of the run: the iteration the model predicted for the plan it ran and the
    iteration it measured (the median after its first ``SKIP_FIRST``). ``refitted``: the
    prediction came from a re-fit to an earlier epoch of this run (else the compile-time model)."""

    predicted_s: float
    measured_s: float
    refitted: bool

    @property
    def error(self) -> float:
        return prediction_error(self.predicted_s, self.measured_s)


def run_error(epochs: Sequence[EpochMeasure]) -> float:
    """The model's own error on this run: the mean |predicted − measured| / measured over the
    epochs whose plan a re-fit predicted (the model that decides is the re-fitted one). Until a
    re-fitted prediction has been measured (the first boundary) it is the compile-time model's
    error on the epochs so far, which is what the first decision has to go on."""
    if not epochs:
        raise ValueError("the model's error needs at least one measured epoch")
    refitted = [epoch.error for epoch in epochs if epoch.refitted]
    return statistics.fmean(refitted or [epoch.error for epoch in epochs])


@dataclass(frozen=True)
class ElasticPolicy:
    """How a run re-scales at its epoch boundaries (``train(elastic=ElasticPolicy(...))``).

    ``objective``: "time" (seconds per iteration) or "dollars" (per iteration, at the
    platform's prices) is what a change must save. ``min_replicas``/``max_replicas``: the
    floor and ceiling of every stage's degree (None: the run's micro-batches; a degree never
    exceeds them). ``cuts``: also weigh the solver's front on the re-fitted problem, so the
    cuts and tiers may change with the degrees (the re-plan of ``--replan``); False keeps the
    cuts and changes degrees only. ``solver``: what solves the re-fitted problem.
    ``on_switch(switch, compiled)``: called once a new plan's prefix is whole, before the run
    moves onto it (``flatpack run`` records it in the run directory). ``on_decision(decision)``:
    called after every decision, kept or changed."""

    objective: str = "time"
    min_replicas: int = 1
    max_replicas: int | None = None
    cuts: bool = True
    solver: str = "dp"
    on_switch: Callable[[PlanSwitch, Compiled], None] | None = None
    on_decision: Callable[[ElasticDecision], None] | None = None

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise InputError(f"the elastic objective is one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not isinstance(self.min_replicas, int) or self.min_replicas < 1:
            raise InputError(f"min_replicas is the least degree of a stage, at least 1, got {self.min_replicas}")
        if self.max_replicas is not None and (not isinstance(self.max_replicas, int)
                                              or self.max_replicas < self.min_replicas):
            raise InputError(f"max_replicas ({self.max_replicas}) is the most replicas of a stage, at least "
                             f"min_replicas ({self.min_replicas})")

    def ceiling(self, micro_batches: int) -> int:
        """The most replicas a stage may have: the policy's ceiling, at most the micro-batches."""
        return min(self.max_replicas or micro_batches, micro_batches)

    def allows(self, plan: Plan, micro_batches: int) -> bool:
        return all(self.min_replicas <= stage.replicas <= self.ceiling(micro_batches) for stage in plan.stages)

    def degrees(self, micro_batches: int) -> range:
        """The degrees a stage may be given."""
        return range(self.min_replicas, self.ceiling(micro_batches) + 1)

    def decide(self, current: Priced, candidates: Iterable[Priced], *, error: float, micro_batches: int) -> Choice:
        """The plan to run next: the cheapest allowed candidate by the objective (fewer
        workers on a tie) when its predicted saving over ``current`` exceeds ``error``, the
        model's own error on this run; else ``current``."""
        others = [c for c in candidates if c.plan != current.plan and self.allows(c.plan, micro_batches)]
        better = "faster" if self.objective == "time" else "cheaper"
        if not others:
            return Choice(current, current, None, 0.0, error,
                          f"no other plan has degrees within {self.min_replicas}..{self.ceiling(micro_batches)} "
                          f"and the {micro_batches} micro-batches")
        best = min(others, key=lambda c: (c.cost(self.objective), c.plan.workers))
        now = current.cost(self.objective)
        saving = (now - best.cost(self.objective)) / now if now > 0 else 0.0
        weighed = (f"the best other plan [{shape(best.plan)}] is predicted {abs(saving) * 100:.1f}% "
                   f"{better if saving > 0 else 'worse'}")
        if saving <= 0:
            return Choice(current, current, best, saving, error,
                          f"the plan that ran is still the {'fastest' if self.objective == 'time' else 'cheapest'} "
                          f"the re-fitted model finds ({weighed})")
        if saving <= error:
            return Choice(current, current, best, saving, error,
                          f"{weighed}, within the model's own error on this run ({error * 100:.1f}%)")
        return Choice(current, best, best, saving, error,
                      f"{weighed}, more than the model's own error on this run ({error * 100:.1f}%)")


@dataclass
class ElasticDecision:
    """One epoch boundary of an elastic run: after ``iteration``, ``old`` kept or replaced by
    ``new``, why, the predicted iteration (seconds, dollars) of each under the re-fit, the
    model error it was weighed against, and the iteration measured before (the epoch the re-fit
    read) and after (the next epoch, once it ran). ``run``: the run prefix after it."""

    iteration: int
    objective: str
    old: Plan
    new: Plan
    old_predicted_s: float
    new_predicted_s: float
    old_predicted_dollars: float
    new_predicted_dollars: float
    saving: float              # the predicted saving of the best other plan weighed (kept or not)
    model_error: float
    reason: str
    measured_before_s: float
    run: str
    measured_after_s: float | None = None
    at: float = field(default_factory=time.time)

    @property
    def changed(self) -> bool:
        return self.new != self.old

    @property
    def degrees(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The stages' replica degrees before and after."""
        return tuple(s.replicas for s in self.old.stages), tuple(s.replicas for s in self.new.stages)

    @property
    def measured_after_dollars(self) -> float | None:
        """The measured iteration at the new plan's price per second (the model's own rate)."""
        if self.measured_after_s is None or not self.new_predicted_s:
            return None
        return self.measured_after_s * self.new_predicted_dollars / self.new_predicted_s

    def describe(self) -> str:
        def ms(seconds: float | None) -> str:
            return f"{seconds * 1000:.1f} ms" if seconds is not None else "not measured yet"

        verdict = (f"changed [{shape(self.old)}] to [{shape(self.new)}]" if self.changed
                   else f"kept [{shape(self.old)}]")
        return (f"after iteration {self.iteration}: {verdict}: {self.reason}; predicted "
                f"{self.old_predicted_s * 1000:.1f} -> {self.new_predicted_s * 1000:.1f} ms "
                f"(${self.old_predicted_dollars:.3g} -> ${self.new_predicted_dollars:.3g}) per iteration; measured "
                f"{ms(self.measured_before_s)} before, {ms(self.measured_after_s)} after")

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "changed": self.changed, "objective": self.objective,
                "old_plan": self.old.to_json(), "new_plan": self.new.to_json(),
                "degrees_before": list(self.degrees[0]), "degrees_after": list(self.degrees[1]),
                "reason": self.reason, "old_predicted_s": self.old_predicted_s,
                "new_predicted_s": self.new_predicted_s, "old_predicted_dollars": self.old_predicted_dollars,
                "new_predicted_dollars": self.new_predicted_dollars, "saving": self.saving,
                "model_error": self.model_error, "measured_before_s": self.measured_before_s,
                "measured_after_s": self.measured_after_s, "measured_after_dollars": self.measured_after_dollars,
                "run": self.run, "at": self.at}

    def mark(self) -> timeline.Mark:
        """The decision on the run's timeline."""
        before, after = self.degrees
        what = f"×{before} -> ×{after}" if self.changed else f"kept ×{before}"
        weighed = ">" if self.changed else "≤"
        return timeline.Mark(self.at, f"elastic after {self.iteration}: {what}, {self.saving * 100:.0f}% {weighed} "
                                      f"{self.model_error * 100:.0f}% error")


def price(problem: Problem, plan: Plan, anchor: float = 1.0) -> Priced | None:
    """``plan`` under ``problem``'s model, its iteration (and so its dollars) times ``anchor``
    (None: the model cannot run or price it)."""
    try:
        cost = funcpipe.predicted(problem, plan)
    except PlanError:
        return None    # e.g. more replicas than micro-batches
    return Priced(plan, cost.iteration_s * anchor, cost.dollars_per_iteration * anchor) if cost.fits else None


def candidates(fitted: Problem, plan: Plan, policy: ElasticPolicy, micro_batches: int,
               anchor: float = 1.0) -> list[Priced]:
    """What the policy weighs against ``plan``: its cuts at every allowed degree and, with
    ``policy.cuts``, the solver's front on the re-fitted problem; each priced by ``fitted``
    times ``anchor``."""
    plans = [with_degree(plan, degree) for degree in policy.degrees(micro_batches)]
    if policy.cuts:
        solving = get_solver(policy.solver)
        front = getattr(solving, "front", None)   # duck-typed: a cost-model solver's front, else its one plan
        plans += list(front(fitted).plans) if front is not None else [solving(fitted)]
    priced = (price(fitted, candidate, anchor) for candidate in plans)
    return [found for found in priced if found is not None]


def check_elastic(deployment: SwitchableDeployment, policy: ElasticPolicy, micro_batches: int) -> None:
    """Refuses, before any function starts, a first plan the policy cannot weigh."""
    plan = deployment.compiled.plan
    if not policy.allows(plan, micro_batches):
        raise InputError(f"the plan's replicas {[s.replicas for s in plan.stages]} are outside the elastic policy's "
                         f"{policy.min_replicas}..{policy.ceiling(micro_batches)} (and the {micro_batches} "
                         "micro-batches); widen --replicas (min_replicas/max_replicas) or start from a plan within it")
    problem = deployment.compiled.problem
    assert problem is not None   # replan.check_switchable refused a read-back artifact
    if price(problem, plan) is None:
        raise InputError("the elastic policy prices plans with the FuncPipe model, which cannot price this first "
                         f"plan ([{shape(plan)}]: a stage does not fit its tier, or a degree exceeds the "
                         f"{micro_batches} micro-batches); start from a plan that fits, e.g. larger --memory tiers")


class ElasticScaler:
    """One ``train()`` call's elastic policy: asked at each epoch boundary, it keeps the
    decisions and the plan switches (the same interface as ``replan.Replanner``)."""

    def __init__(self, policy: ElasticPolicy, epoch_iterations: int) -> None:
        self.policy = policy
        self.epoch_iterations = epoch_iterations
        self.decisions: list[ElasticDecision] = []
        self.switches: list[PlanSwitch] = []
        self.epochs: list[EpochMeasure] = []
        self.predicted_s: float | None = None   # the re-fit's prediction of the epoch now running
        self.boundary = -1                      # the last iteration before the latest boundary

    def after_epoch(self, deployment: SwitchableDeployment, spec: RunSpec, events: list[timeline.Event],
                    last: int) -> RunSpec | None:
        """At the boundary after iteration ``last``: the spec of the plan the run moved to, or
        None to keep it. ``events``: the current plan's timeline so far."""
        compiled = deployment.compiled
        assert compiled.problem is not None   # check_switchable refused a read-back artifact
        epoch = [event for event in events if last - self.epoch_iterations < event.iteration <= last]
        measured_s = self._measure(compiled.problem, compiled.plan, epoch)
        fitted = fitted_problem(compiled.problem, refit(compiled.problem, compiled.plan, epoch,
                                                        skip_first=SKIP_FIRST, source="the run's last epoch"))
        # the re-fit alone does not reproduce the epoch it was fitted to (a 2 × 2 epoch measured
        # at 630 ms was re-fitted to 886 ms: its sync follows the upload latency, not the sync
        # measured), so every plan's price is anchored there: the re-fit's ratios between plans,
        # times the measured over the re-fitted iteration of the plan that ran
        cost = funcpipe.predicted(fitted, compiled.plan)    # check_elastic and candidates priced it before
        anchor = measured_s / cost.iteration_s
        current = Priced(compiled.plan, measured_s, cost.dollars_per_iteration * anchor)
        weighed = candidates(fitted, compiled.plan, self.policy, spec.micro_batches, anchor)
        choice = self.policy.decide(current, weighed, error=run_error(self.epochs), micro_batches=spec.micro_batches)
        self.predicted_s, self.boundary = choice.chosen.seconds, last
        run = next_run(deployment.keys.run) if choice.changed else deployment.keys.run
        decision = ElasticDecision(last, self.policy.objective, current.plan, choice.chosen.plan, current.seconds,
                                   choice.chosen.seconds, current.dollars, choice.chosen.dollars, choice.saving,
                                   choice.error, choice.reason, measured_s, run)
        self.decisions.append(decision)
        LOG.info(decision.describe())
        if self.policy.on_decision is not None:
            self.policy.on_decision(decision)
        if not choice.changed:
            return None
        switch = PlanSwitch(last, current.plan, choice.chosen.plan, current.seconds, choice.chosen.seconds,
                            measured_s, run, at=decision.at)
        new_spec = switch_plan(deployment, with_plan(compiled, choice.chosen.plan), spec, switch,
                               self.policy.on_switch)
        self.switches.append(switch)
        return new_spec

    def finish(self, events: list[timeline.Event]) -> None:
        """The end of the call: ``events`` (the last plan's timeline) measure the last decision."""
        last_epoch = [event for event in events if event.iteration > self.boundary]
        if self.decisions and last_epoch:
            self._measured_after(timeline.summarize(last_epoch, skip_first=SKIP_FIRST).iteration_s)

    def _measure(self, problem: Problem, plan: Plan, epoch: list[timeline.Event]) -> float:
        """The epoch's measured iteration, recorded with what was predicted for it, and set as
        the previous decision's measured effect."""
        measured_s = timeline.summarize(epoch, skip_first=SKIP_FIRST).iteration_s
        if measured_s is None:
            raise InputError(f"the epoch before iteration {self.boundary + self.epoch_iterations + 1} recorded no "
                             "iteration to measure; give --epoch-iterations of at least "
                             f"{SKIP_FIRST + 1}")
        predicted_s = self.predicted_s
        if predicted_s is None:
            predicted_s = funcpipe.predicted(problem, plan).iteration_s   # the compile-time model's
        self.epochs.append(EpochMeasure(predicted_s, measured_s, refitted=self.predicted_s is not None))
        self._measured_after(measured_s)
        return measured_s

    def _measured_after(self, measured_s: float | None) -> None:
        if not self.decisions or self.decisions[-1].measured_after_s is not None:
            return
        decision = self.decisions[-1]
        decision.measured_after_s = measured_s
        if measured_s is not None:
            LOG.info(f"the decision after iteration {decision.iteration} ({'changed' if decision.changed else 'kept'}) "
                     f"predicted {decision.new_predicted_s * 1000:.1f} ms per iteration and measured "
                     f"{measured_s * 1000:.1f} ms "
                     f"({prediction_error(decision.new_predicted_s, measured_s) * 100:.1f}% off)")
        if self.switches and self.switches[-1].iteration == self.decisions[-1].iteration:
            self.switches[-1].measured_after_s = measured_s
