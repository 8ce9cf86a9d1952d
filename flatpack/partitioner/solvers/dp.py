"""dp: the exact dynamic-programming solver, one algorithm per cost model.

* FuncPipe's serverless training pipeline (``funcpipe_dp``): labels with dominance and
  bounds over cuts × tiers, for every (M, d) of the space.
* Gillis's fork-join inference (``gillis_dp``).
* PipeDream's per-stage replication on GPU containers (``pipedream_dp``).
* Hydrozoa's A×B hybrid on GPU containers (``hydrozoa_planner.solve``).

Which one runs is :func:`objective.cost_model_for`: the model the plan is judged by.

``dp{dominance=componentwise}`` runs FuncPipe's labels with the reference filter (every label
number compared on its own) instead of the default completion-aware one; both are exact, the
reference is there to compare plans and label counts against (``benchmarks/solvers.py``).
``dp{time-limit-s=N}`` (FuncPipe's model) makes the search anytime: past N seconds it returns
its best plan with status "feasible", a proven ``lower_bound`` and the ``gap`` to it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.objective import cost_model_for
from flatpack.partitioner.pareto import Front
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import CostSolver, Goal
from flatpack.partitioner.space import SearchSpace

ALGORITHMS = {
    "funcpipe": "flatpack.partitioner.solvers.funcpipe_dp",
    "gillis": "flatpack.partitioner.solvers.gillis_dp",
    "pipedream": "flatpack.partitioner.solvers.pipedream_dp",
    "hydrozoa": "flatpack.partitioner.solvers.hydrozoa_planner",
}


@dataclass(frozen=True)
class Dp(CostSolver):
    """Exact optimum of the problem's cost model over the search space (``space.py``)."""

    name: ClassVar[str] = "dp"
    dominance: str = "completion"   # FuncPipe's label filter: "completion" or "componentwise"
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        from flatpack.partitioner.solvers.funcpipe_dp import DOMINANCE

        if self.dominance not in DOMINANCE:
            raise PlanError(f"dp's dominance {self.dominance!r} is not one of {', '.join(DOMINANCE)}; use "
                            "'completion' (the default) or 'componentwise' (the slower reference filter)")
        limit = self.time_limit_s
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise PlanError(f"dp's time_limit_s must be a positive number of seconds, got {limit!r}; "
                            "leave it out to run dp to its proof")

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        return self._algorithm(problem).solve(problem, goal, SearchSpace.of(problem), **self._options(problem))

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        algorithm = self._algorithm(problem)
        if hasattr(algorithm, "solve_all"):  # shares its tables between the goals of a front
            return algorithm.solve_all(problem, goals, SearchSpace.of(problem), **self._options(problem))
        return super().solve_all(problem, goals)

    def exact_front(self, problem: Problem) -> Front:
        """Every non-dominated (time, dollars) plan (FuncPipe's model), FuncPipe's four
        weight pairs' optima tagged among them and its recommendation marked."""
        if cost_model_for(problem) != "funcpipe":
            raise PlanError(f"the exact front is solved for FuncPipe's training model only; this problem is solved "
                            f"under {cost_model_for(problem)!r}: use the weight pairs' front (--front weights)")
        from flatpack.partitioner.solvers import funcpipe_dp

        return Front.of(funcpipe_dp.exact_front(problem, SearchSpace.of(problem), self.dominance))

    def _options(self, problem: Problem) -> dict:
        """The options the problem's algorithm takes; ``dominance`` is FuncPipe's alone."""
        if cost_model_for(problem) == "funcpipe":
            return {"dominance": self.dominance, "time_limit_s": self.time_limit_s}
        for option, value, default in (("dominance", self.dominance, "completion"),
                                       ("time_limit_s", self.time_limit_s, None)):
            if value != default:
                raise PlanError(f"dp's option {option}={value!r} applies to FuncPipe's training model only; this "
                                f"problem is solved under {cost_model_for(problem)!r}: drop the option")
        return {}

    @staticmethod
    def _algorithm(problem: Problem):
        return importlib.import_module(ALGORITHMS[cost_model_for(problem)])
