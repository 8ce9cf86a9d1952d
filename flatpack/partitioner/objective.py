"""What solvers minimize, computed one way for all of them.

:func:`evaluate` prices and times a plan with the cost model that fits the problem —
FuncPipe's for training on serverless (and local) targets, Hydrozoa's or PipeDream's for
training on GPU containers, Gillis's for inference, as :func:`cost_model_for` picks it from
the registry (``cost/registry.py``) — so that every solver, brute force included, is judged
by the same numbers.

:class:`Weights` is FuncPipe's weighted sum α₁·c_iter + α₂·t_iter
(FuncPipe eq. 3a). FuncPipe's default pairs (1, 0), (1, 2¹⁶), (1, 2¹⁹),
(1, 2²²) (§5.1) only make sense with c_iter in memory-seconds: its eq. 6,
c_iter = P·t_iter·c_mem, with c_mem in MB and the price P left out — in dollars a Lambda
iteration costs ~10⁻³ and time would take all the weight from the first non-zero α₂. So the
cost term here is the iteration's dollars over the platform's price of one MB-second
(:func:`dollars_per_mb_s`, the cheapest per MB among its tiers): exactly FuncPipe's MB·s on
Lambda, where price is proportional to memory, and a consistent unit elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flatpack.errors import InputError, PlanError
# re-exported: the solvers and the command line have always asked here
from flatpack.partitioner.cost.registry import COST_MODELS as COST_MODELS, cost_model_for as cost_model_for
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

if TYPE_CHECKING:
    from flatpack.platform.catalog import Platform

FUNCPIPE_WEIGHTS: tuple[tuple[float, float], ...] = ((1.0, 0.0), (1.0, 2.0 ** 16), (1.0, 2.0 ** 19), (1.0, 2.0 ** 22))


@dataclass(frozen=True)
class Weights:
    """α₁ on cost (MB-seconds, see the module docstring) and α₂ on time (seconds)."""

    cost: float = 1.0
    time: float = 0.0

    def __post_init__(self) -> None:
        if not (self.cost >= 0 and self.time >= 0 and self.cost + self.time > 0):
            raise InputError(f"objective weights must be >= 0 and not both 0, got (cost={self.cost}, time={self.time})")

    @classmethod
    def of(cls, value: Weights | tuple[float, float] | None) -> Weights:
        if value is None:
            return cls()
        if isinstance(value, Weights):
            return value
        try:
            cost, time = value
        except (TypeError, ValueError):
            raise InputError(f"weights must be a pair (cost weight, time weight), got {value!r}") from None
        return cls(float(cost), float(time))

    def label(self) -> str:
        def power(x: float) -> str:
            exponent = math.log2(x) if x > 0 else None
            return f"2^{exponent:g}" if exponent is not None and exponent.is_integer() and exponent > 1 else f"{x:g}"
        return f"({power(self.cost)}, {power(self.time)})"


def dollars_per_mb_s(platform: Platform) -> float:
    """Dollars of one MB for one second on the platform's cheapest tier per MB."""
    return min(tier.price_per_s / tier.memory_mb for tier in platform.tiers)


def problem_for(problem: Problem, plan: Plan) -> Problem:
    """``problem`` with the plan's micro-batch count, when the plan chose one."""
    return with_micro_batches(problem, plan.micro_batches)


def with_micro_batches(problem: Problem, micro_batches: int | None) -> Problem:
    """``problem`` whose workload cuts the batch into ``micro_batches`` (None: unchanged)."""
    if micro_batches is None or micro_batches == problem.workload.micro_batches:
        return problem
    workload = dataclasses.replace(problem.workload, micro_batches=micro_batches)
    return dataclasses.replace(problem, workload=workload)


@dataclass(frozen=True)
class Evaluation:
    """A plan's predicted seconds (per training iteration or per inference request), dollars
    for the same, cost in MB-second units for the weighted objective, and whether every
    function fits its memory."""

    model: str
    time_s: float
    dollars: float
    cost_units: float
    fits: bool
    detail: Any

    def objective(self, weights: Weights) -> float:
        return weights.cost * self.cost_units + weights.time * self.time_s

    def predictions(self) -> dict[str, Any]:
        return {"cost_model": self.model, "time_s": self.time_s, "dollars": self.dollars,
                "cost_mb_s": self.cost_units, "fits": self.fits}


def evaluate(problem: Problem, plan: Plan) -> Evaluation:
    """Time, dollars and fit of ``plan`` under the problem's cost model."""
    model = cost_model_for(problem)
    problem = problem_for(problem, plan)
    priced = model.price(problem, plan)
    return Evaluation(model.name, priced.time_s, priced.dollars, priced.dollars / dollars_per_mb_s(problem.platform),
                      priced.fits, priced.detail)


def annotate(plan: Plan, evaluation: Evaluation, **extra: Any) -> Plan:
    """``plan`` carrying its evaluation (and any solver facts) in ``predictions``."""
    return plan.with_predictions(**evaluation.predictions(), **extra)


def require_fit(problem: Problem, plan: Plan, evaluation: Evaluation) -> None:
    """Solvers never return a plan that overflows a function while claiming success."""
    if not evaluation.fits:
        raise PlanError(f"internal error: the plan {plan.ranges} on {plan.memory_mb} MB does not fit its memory "
                        f"under the {evaluation.model} model")
