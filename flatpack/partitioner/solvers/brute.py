"""brute: every plan in the search space, priced by the cost model — the ground truth the
exact solvers are tested against. Exponential: for chains of a few layers."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import ClassVar, Iterator, Sequence

from flatpack.errors import PlanError
from flatpack.partitioner.objective import Evaluation, annotate, cost_model_for, evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import CostSolver, Goal, better
from flatpack.partitioner.space import SearchSpace

DEFAULT_MAX_PLANS = 2_000_000


def cut_ranges(count: int) -> Iterator[list[tuple[int, int]]]:
    """Every way to cut layers 0..count−1 into contiguous stages."""
    for mask in range(1 << max(count - 1, 0)):
        cuts = [i for i in range(count - 1) if mask >> i & 1]
        starts, ends = [0, *(cut + 1 for cut in cuts)], [*cuts, count - 1]
        yield list(zip(starts, ends))


def _per_stage_degrees(problem: Problem, space: SearchSpace, micro_batches: int) -> tuple[int, ...]:
    if problem.workload.mode == "infer":
        # a group runs on the master alone (1) or is split over 2..max_workers workers
        return (1, *range(2, space.max_workers + 1))
    return space.replicas_for(micro_batches)


def plans(problem: Problem, space: SearchSpace | None = None) -> Iterator[Plan]:
    """Every plan of the space: cuts × a tier per stage (one tier for all functions under
    Gillis) × a replica degree (one for the whole pipeline, or one per stage under PipeDream
    and for fork-join groups) × M, as the cost model's ``tier_per_stage`` and
    ``degree_per_stage`` say."""
    space = space or SearchSpace.of(problem)
    model = cost_model_for(problem)
    count = len(problem.chain)
    for micro_batches in space.micro_batches:
        plan_micro = micro_batches if problem.workload.mode == "train" else None
        degrees = _per_stage_degrees(problem, space, micro_batches)
        for ranges in cut_ranges(count):
            if model.tier_per_stage:
                tier_choices: Iterator = itertools.product(space.memory_mb, repeat=len(ranges))
            else:
                tier_choices = ((memory,) * len(ranges) for memory in space.memory_mb)
            for tiers in tier_choices:
                if model.degree_per_stage:
                    replica_choices: Iterator = itertools.product(degrees, repeat=len(ranges))
                else:
                    replica_choices = ((degree,) * len(ranges) for degree in degrees)
                for replicas in replica_choices:
                    stages = tuple(StagePlan(start, end, memory, degree)
                                   for (start, end), memory, degree in zip(ranges, tiers, replicas))
                    yield Plan(stages, count, "brute", micro_batches=plan_micro)


def plan_count(problem: Problem, space: SearchSpace | None = None) -> int:
    """How many plans :func:`plans` yields, without generating them."""
    space = space or SearchSpace.of(problem)
    model = cost_model_for(problem)
    count = len(problem.chain)
    tiers = len(space.memory_mb)
    total = 0
    for micro_batches in space.micro_batches:
        degrees = len(_per_stage_degrees(problem, space, micro_batches))
        for stages in range(1, count + 1):
            cuts = math.comb(count - 1, stages - 1)
            tier_ways = tiers ** stages if model.tier_per_stage else tiers
            replica_ways = degrees ** stages if model.degree_per_stage else degrees
            total += cuts * tier_ways * replica_ways
    return total


@dataclass(frozen=True)
class Brute(CostSolver):
    """Exhaustive search; refuses spaces larger than ``max_plans``."""

    name: ClassVar[str] = "brute"
    max_plans: int = DEFAULT_MAX_PLANS

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        return self.solve_all(problem, [goal])[0]

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        """Prices every plan once and keeps the best for each goal."""
        space = SearchSpace.of(problem)
        total = plan_count(problem, space)
        if total > self.max_plans:
            raise PlanError(f"brute force would price {total:,} plans, more than its limit of {self.max_plans:,}; "
                            "use solver='dp' or 'miqp', or narrow the space (options memory_mb, replicas, "
                            "micro_batches) or the chain (coarsen{layers=N})")
        started = time.perf_counter()
        best: list[tuple[Plan, Evaluation] | None] = [None] * len(goals)
        scores: list[tuple[float, float] | None] = [None] * len(goals)
        any_fits = False
        for plan in plans(problem, space):
            evaluation = evaluate(problem, plan)
            if not evaluation.fits:
                continue
            any_fits = True
            for index, goal in enumerate(goals):
                score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
                if score is not None and better(score, scores[index]):
                    best[index], scores[index] = (plan, evaluation), score
        if not any_fits:
            raise PlanError(f"no plan among {total:,} fits the memory of {problem.platform.name}'s tiers "
                            f"{list(space.memory_mb)} MB; allow larger tiers, more stages or a smaller batch")
        elapsed = time.perf_counter() - started
        return [None if found is None or score is None else
                annotate(found[0], found[1], status="optimal", objective=score[0], plans_priced=total,
                         solve_s=elapsed)
                for found, score in zip(best, scores)]
