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
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.objective import cost_model_for
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

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        return self._algorithm(problem).solve(problem, goal, SearchSpace.of(problem), **self._options(problem))

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        algorithm = self._algorithm(problem)
        if hasattr(algorithm, "solve_all"):  # shares its tables between the goals of a front
            return algorithm.solve_all(problem, goals, SearchSpace.of(problem), **self._options(problem))
        return super().solve_all(problem, goals)

    def _options(self, problem: Problem) -> dict:
        """The options the problem's algorithm takes; ``dominance`` is FuncPipe's alone."""
        if cost_model_for(problem) == "funcpipe":
            return {"dominance": self.dominance}
        if self.dominance != "completion":
            raise PlanError(f"dp's option dominance={self.dominance!r} applies to FuncPipe's training model only; "
                            f"this problem is solved under {cost_model_for(problem)!r}: drop the option")
        return {}

    @staticmethod
    def _algorithm(problem: Problem):
        return importlib.import_module(ALGORITHMS[cost_model_for(problem)])
