"""Pareto fronts of plans over (time, dollars), FuncPipe's recommendation, and the SLO pick.

Every plan here carries ``predictions["time_s"]`` and ``predictions["dollars"]`` (see
``objective.annotate``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.plan import Plan

RECOMMEND_EFFICIENCY = 0.8   # FuncPipe §5.1: the fastest plan with δ ≥ 0.8


def time_of(plan: Plan) -> float:
    return float(plan.predictions["time_s"])


def dollars_of(plan: Plan) -> float:
    return float(plan.predictions["dollars"])


def dominates(a: Plan, b: Plan) -> bool:
    """``a`` is no slower and no dearer than ``b``, and better in one of the two."""
    ta, ca, tb, cb = time_of(a), dollars_of(a), time_of(b), dollars_of(b)
    return ta <= tb and ca <= cb and (ta < tb or ca < cb)


def non_dominated(plans: Iterable[Plan]) -> list[Plan]:
    """The plans no other plan dominates, fastest first, one per (time, dollars) point."""
    ordered = sorted(plans, key=lambda plan: (time_of(plan), dollars_of(plan)))
    front: list[Plan] = []
    for plan in ordered:
        if front and dollars_of(plan) >= dollars_of(front[-1]):
            continue  # as slow as the last kept plan or slower, and no cheaper
        front.append(plan)
    return front


def efficiency(plan: Plan, cheapest: Plan) -> float:
    """FuncPipe's δ = (t_cost/t_p − 1)/(c_p/c_cost − 1) (FuncPipe §5.1): the
    speed-up over the cheapest plan per unit of extra cost. A plan as cheap as the cheapest
    and faster is infinitely efficient; one as cheap and no faster scores 0."""
    speedup = time_of(cheapest) / time_of(plan) - 1
    extra_cost = dollars_of(plan) / dollars_of(cheapest) - 1
    if extra_cost <= 0:
        return float("inf") if speedup > 0 else 0.0
    return speedup / extra_cost


def recommend(plans: Sequence[Plan], threshold: float = RECOMMEND_EFFICIENCY) -> int:
    """Index of FuncPipe's recommendation: the fastest plan whose δ against the cheapest plan
    is at least ``threshold``; the cheapest plan when none is."""
    if not plans:
        raise PlanError("cannot recommend from an empty set of plans")
    cheapest = min(range(len(plans)), key=lambda i: (dollars_of(plans[i]), time_of(plans[i])))
    best = cheapest
    for index, plan in enumerate(plans):
        if index == cheapest or efficiency(plan, plans[cheapest]) < threshold:
            continue
        if time_of(plan) < time_of(plans[best]):
            best = index
    return best


def cheapest_within(plans: Iterable[Plan], slo_s: float) -> Plan | None:
    """The cheapest plan whose time meets ``slo_s`` (ties: the faster), or None."""
    meeting = [plan for plan in plans if time_of(plan) <= slo_s]
    return min(meeting, key=lambda plan: (dollars_of(plan), time_of(plan))) if meeting else None


@dataclass(frozen=True)
class Front:
    """Non-dominated plans, fastest first, and the recommended one's index."""

    plans: tuple[Plan, ...]
    recommended: int

    @classmethod
    def of(cls, plans: Iterable[Plan], threshold: float = RECOMMEND_EFFICIENCY) -> Front:
        kept = non_dominated(plans)
        if not kept:
            raise PlanError("no plan to build a front from")
        return cls(tuple(kept), recommend(kept, threshold))

    @property
    def recommendation(self) -> Plan:
        return self.plans[self.recommended]

    def check(self) -> None:
        """Raises unless the points are mutually non-dominated."""
        for a in self.plans:
            for b in self.plans:
                if a is not b and dominates(a, b):
                    raise PlanError(f"front point {a.ranges} dominates {b.ranges}")

    def to_json(self) -> dict:
        return {"recommended": self.recommended, "plans": [plan.to_json() for plan in self.plans]}
