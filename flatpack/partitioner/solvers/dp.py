"""dp: the exact dynamic-programming solver, one algorithm per cost model.

* FuncPipe's serverless training pipeline (``funcpipe_dp``): labels with dominance and
  bounds over cuts × tiers, for every (M, d) of the space.
* Gillis's fork-join inference (``gillis_dp``).
* PipeDream's per-stage replication on GPU containers (``pipedream_dp``).
* Hydrozoa's A×B hybrid on GPU containers (``hydrozoa_planner.solve``).

Which one runs is the entry :func:`cost.registry.cost_model_for` returns: the model the plan
is judged by (``ALGORITHMS`` maps its name to its algorithm).

``dp{reference=true}`` runs FuncPipe's dp as it stood before issue 20 (every label number
compared on its own, a looser bound); both are exact, the reference is there to compare
plans and label counts against (``benchmarks/solvers.py``, the property tests).
``dp{time-limit-s=N}`` (FuncPipe's model) makes the search anytime: past N seconds it returns
its best plan with status "feasible", a proven ``lower_bound`` and the ``gap`` to it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.cost.registry import CostModel, FuncPipeModel, cost_model_for
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
    reference: bool = False          # FuncPipe's dp as before issue 20, for comparison
    time_limit_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reference, bool):
            raise PlanError(f"dp's reference must be true or false, got {self.reference!r}; reference=true runs "
                            "the slower pre-issue-20 algorithm for comparison")
        limit = self.time_limit_s
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0):
            raise PlanError(f"dp's time_limit_s must be a positive number of seconds, got {limit!r}; "
                            "leave it out to run dp to its proof")

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        model = cost_model_for(problem)
        return self._algorithm(model).solve(problem, goal, SearchSpace.of(problem), **self._options(model))

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        model = cost_model_for(problem)
        algorithm = self._algorithm(model)
        if hasattr(algorithm, "solve_all"):  # shares its tables between the goals of a front
            return algorithm.solve_all(problem, goals, SearchSpace.of(problem), **self._options(model))
        return super().solve_all(problem, goals)

    def exact_front(self, problem: Problem) -> Front:
        """Every non-dominated (time, dollars) plan (FuncPipe's model), FuncPipe's four
        weight pairs' optima tagged among them and its recommendation marked."""
        model = cost_model_for(problem)
        if not isinstance(model, FuncPipeModel):
            raise PlanError(f"the exact front is solved for FuncPipe's training model only; this problem is solved "
                            f"under {model.name!r}: use the weight pairs' front (--front weights)")
        return Front.of(self._algorithm(model).exact_front(problem, SearchSpace.of(problem), self.reference))

    def _options(self, model: CostModel) -> dict:
        """The options ``model``'s algorithm takes; ``reference`` and ``time_limit_s`` are
        FuncPipe's alone."""
        if isinstance(model, FuncPipeModel):
            return {"reference": self.reference, "time_limit_s": self.time_limit_s}
        for option, value, default in (("reference", self.reference, False),
                                       ("time_limit_s", self.time_limit_s, None)):
            if value != default:
                raise PlanError(f"dp's option {option}={value!r} applies to FuncPipe's training model only; this "
                                f"problem is solved under {model.name!r}: drop the option")
        return {}

    @staticmethod
    def _algorithm(model: CostModel):
        if model.name not in ALGORITHMS:
            raise PlanError(f"solver 'dp' has no algorithm for the cost model {model.name!r}; it solves "
                            f"{', '.join(ALGORITHMS)}: add its algorithm to dp.ALGORITHMS, or use solver='brute'")
        return importlib.import_module(ALGORITHMS[model.name])
