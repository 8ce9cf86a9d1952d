"""What the cost-model solvers share: the goal they solve for, the choice among weighted
optimum, SLO and recommendation, fronts over FuncPipe's weight pairs, and the errors for
problems with no answer.

A cost-model solver implements ``solve(problem, goal) -> Plan | None`` (None: no plan meets
the goal's SLO; raising PlanError when no plan fits memory at all). :class:`CostSolver`
turns that into the ``Problem -> Plan`` protocol:

* ``workload.slo_s`` set: the cheapest plan whose time meets the SLO (Gillis §IV-C);
* ``options.weights = (α₁, α₂)``: the plan minimizing α₁·cost + α₂·time (FuncPipe eq. 3a);
* otherwise FuncPipe's recommendation (§5.1) among the optima of the four default weight
  pairs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights
from flatpack.partitioner.pareto import Front
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

TIME_ONLY = Weights(0.0, 1.0)


@dataclass(frozen=True)
class Goal:
    """Minimize ``weights`` (α₁·cost + α₂·time), or, with ``slo_s``, cost subject to
    time ≤ ``slo_s`` (ties broken by time)."""

    weights: Weights = Weights()
    slo_s: float | None = None

    def score(self, time_s: float, cost_units: float, dollars: float) -> tuple[float, float] | None:
        """(primary, tie-break), lower is better; None when the SLO is missed."""
        if self.slo_s is not None:
            return None if time_s > self.slo_s else (dollars, time_s)
        return self.weights.cost * cost_units + self.weights.time * time_s, time_s

    def describe(self) -> str:
        if self.slo_s is not None:
            return f"the cheapest plan within {self.slo_s:g} s"
        return f"weights {self.weights.label()}"


class CostSolver:
    """Mixin: ``__call__`` and ``front`` from a ``solve(problem, goal)`` method."""

    name: str
    # False for the sampling solvers (rl, bayes): their "no plan" means none was seen
    exact: ClassVar[bool] = True

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:  # pragma: no cover - protocol
        raise NotImplementedError

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        """``solve`` for each goal; a solver that can share work between goals overrides it."""
        return [self.solve(problem, goal) for goal in goals]

    def __call__(self, problem: Problem) -> Plan:
        if problem.workload.slo_s is not None:
            return self.within_slo(problem, problem.workload.slo_s)
        if problem.options.weights is not None:
            return self._solved(problem, Goal(Weights.of(problem.options.weights)))
        front = self.front(problem)
        return front.recommendation.with_predictions(recommended=True)

    def _solved(self, problem: Problem, goal: Goal) -> Plan:
        started = time.perf_counter()
        plan = self.solve(problem, goal)
        return self._found(plan, goal, time.perf_counter() - started)

    def _found(self, plan: Plan | None, goal: Goal, seconds: float) -> Plan:
        """``plan`` tagged with its goal and solve seconds (the solver's own figure when it
        reports one); no plan for a weighted goal is an error."""
        if plan is None:
            raise PlanError(f"solver {self.name!r} found no plan for {goal.describe()}")
        return _tagged(plan, goal, solve_s=plan.predictions.get("solve_s", seconds))

    def within_slo(self, problem: Problem, slo_s: float) -> Plan:
        """The cheapest plan meeting ``slo_s``; when none does, the error names the fastest
        plan and its time."""
        plan = self.solve(problem, Goal(slo_s=slo_s))
        if plan is not None:
            return _tagged(plan, Goal(slo_s=slo_s))
        fastest = self._solved(problem, Goal(TIME_ONLY))
        if not self.exact:
            raise PlanError(
                f"solver {self.name!r} saw no plan within the SLO of {slo_s:g} s in its budget; the fastest plan it "
                f"found takes {fastest.predictions['time_s']:.4g} s — {describe_plan(fastest)}. Raise its budget "
                "(episodes, evaluations, time_limit_s) or use solver='dp', which is exact and says whether any plan "
                "meets the SLO")
        raise PlanError(
            f"no plan meets the SLO of {slo_s:g} s: the fastest plan takes {fastest.predictions['time_s']:.4g} s "
            f"(${fastest.predictions['dollars']:.4g}) — {describe_plan(fastest)}. Relax the SLO to at least "
            f"{fastest.predictions['time_s']:.4g} s, allow more replicas or larger tiers, or use a smaller batch")

    def front(self, problem: Problem, weights: Sequence[tuple[float, float] | Weights] = FUNCPIPE_WEIGHTS) -> Front:
        """The optima at each weight pair (FuncPipe §3.4.1: each pair gives a Pareto-optimal
        plan), reduced to the non-dominated ones, with FuncPipe's recommendation."""
        started = time.perf_counter()
        goals = [Goal(Weights.of(pair)) for pair in weights]
        plans = self.solve_all(problem, goals)
        share = (time.perf_counter() - started) / len(goals)
        return Front.of([self._found(plan, goal, share) for goal, plan in zip(goals, plans)])


def _tagged(plan: Plan, goal: Goal, **facts: object) -> Plan:
    """``plan`` with its goal and the goal's objective (from the cost model's predictions,
    where the solver did not report it) in ``predictions``."""
    predictions = plan.predictions
    if "objective" not in predictions and {"time_s", "cost_mb_s", "dollars"} <= predictions.keys():
        score = goal.score(predictions["time_s"], predictions["cost_mb_s"], predictions["dollars"])
        if score is not None:
            facts["objective"] = score[0]
    return plan.with_predictions(goal=goal.describe(), **facts)


def describe_plan(plan: Plan) -> str:
    """One line: stages as layer ranges with tier and replicas."""
    stages = ", ".join(f"{stage.start}-{stage.end}@{stage.memory_mb}MBx{stage.replicas}" for stage in plan.stages)
    micro = f", M={plan.micro_batches}" if plan.micro_batches is not None else ""
    return f"{len(plan.stages)} stage(s) [{stages}]{micro}"


def better(candidate: tuple[float, float], incumbent: tuple[float, float] | None) -> bool:
    """Lexicographic comparison of (primary, tie-break) scores with a relative tolerance on
    the primary, so that the same optimum reached by different float sums is one optimum."""
    if incumbent is None:
        return True
    primary, tie = candidate
    best_primary, best_tie = incumbent
    scale = max(abs(primary), abs(best_primary), 1e-300)
    if primary < best_primary - 1e-12 * scale:
        return True
    return abs(primary - best_primary) <= 1e-12 * scale and tie < best_tie
