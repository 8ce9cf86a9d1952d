"""What the sampling solvers (``rl``, ``bayes``) share: the decisions one plan makes, how
they become a :class:`Plan`, and the incumbent — the best plan priced so far for a goal.

The decisions are exactly those of :class:`SearchSpace` (and so of ``brute`` and the exact
solvers), so that a sampling solver's answer can be compared with the exact optimum:

* a cut after each of the first L−1 layers;
* a memory tier per stage — one for every function under Gillis (§IV-B: all functions get
  the same memory);
* a degree — one data-parallel degree d for the whole pipeline under FuncPipe and Hydrozoa,
  one per stage under PipeDream, one per fork-join group under Gillis (1: the master runs
  the group alone; r > 1: r workers);
* for training, the micro-batch count M; the replica degrees offered depend on it (d ≤ M).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost.registry import CostModel
from flatpack.partitioner.objective import Evaluation, annotate, cost_model_for, evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import Goal, better
from flatpack.partitioner.space import SearchSpace


@dataclass(frozen=True)
class DecisionSpace:
    """The choices of one plan for ``problem``, in the order the solvers make them."""

    num_layers: int
    mode: str
    model: CostModel
    memory_mb: tuple[int, ...]
    micro_batches: tuple[int, ...]
    space: SearchSpace

    @classmethod
    def of(cls, problem: Problem) -> DecisionSpace:
        """The space's choices; an M that leaves every replica degree idle (d > M for all d
        offered) is no choice, so that every M here has a degree to go with it."""
        space = SearchSpace.of(problem)
        micro_batches = tuple(count for count in space.micro_batches
                              if problem.workload.mode == "infer" or space.replicas_for(count))
        return cls(len(problem.chain), problem.workload.mode, cost_model_for(problem), space.memory_mb,
                   micro_batches, space)

    @property
    def tier_per_stage(self) -> bool:
        return self.model.tier_per_stage

    @property
    def degree_per_stage(self) -> bool:
        return self.model.degree_per_stage

    @property
    def all_degrees(self) -> tuple[int, ...]:
        """Every degree any M allows, in increasing order."""
        return tuple(sorted({d for count in self.micro_batches for d in self.degrees_for(count)}))

    def degrees_for(self, micro_batches: int) -> tuple[int, ...]:
        """Degrees allowed at M = ``micro_batches``: replica degrees d ≤ M for training; for a
        fork-join group 1 (the master alone) or 2..max_workers workers."""
        if self.mode == "infer":
            return (1, *range(2, self.space.max_workers + 1))
        return self.space.replicas_for(micro_batches)

    def plan(self, cuts: Sequence[bool], tiers: Sequence[int], degrees: Sequence[int], micro_batches: int,
             solver: str) -> Plan:
        """The plan these decisions make. ``cuts[i]``: a stage ends after layer i (L−1 of them).
        ``tiers`` and ``degrees``: one per stage, or one for all stages where the cost model
        shares it (extra entries are ignored, so a solver may give one per layer slot)."""
        if len(cuts) != self.num_layers - 1:
            raise PlanError(f"{len(cuts)} cut decisions for a chain of {self.num_layers} layers; give L-1")
        ends = [index for index, cut in enumerate(cuts) if cut] + [self.num_layers - 1]
        starts = [0, *(end + 1 for end in ends[:-1])]
        count = len(ends)
        stage_tiers = _per_stage(tiers, count, self.tier_per_stage, "tiers")
        stage_degrees = _per_stage(degrees, count, self.degree_per_stage, "degrees")
        allowed = self.degrees_for(micro_batches)
        for degree in stage_degrees:
            if degree not in allowed:
                raise PlanError(f"degree {degree} is not among {list(allowed)} at M={micro_batches}")
        stages = tuple(StagePlan(start, end, memory, degree)
                       for start, end, memory, degree in zip(starts, ends, stage_tiers, stage_degrees))
        return Plan(stages, self.num_layers, solver, micro_batches=micro_batches if self.mode == "train" else None)


def _per_stage(values: Sequence[int], count: int, per_stage: bool, what: str) -> list[int]:
    if not values:
        raise PlanError(f"no {what} given")
    if not per_stage:
        return [values[0]] * count
    if len(values) < count:
        raise PlanError(f"{len(values)} {what} for {count} stages")
    return list(values[:count])


@dataclass
class Incumbent:
    """Prices plans for one goal (each distinct plan once) and keeps the best that fits and
    meets the goal's SLO, so that a sampling solver returns the best plan it saw and never a
    plan that overflows memory or misses the SLO."""

    problem: Problem
    goal: Goal
    solver: str
    cache: dict[Plan, Evaluation] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    samples: int = 0
    best: Plan | None = None
    best_evaluation: Evaluation | None = None
    best_score: tuple[float, float] | None = None
    best_at: int = 0
    fitting: int = 0
    fastest: Plan | None = None         # the fastest fitting plan, SLO or not
    fastest_s: float = float("inf")

    def price(self, plan: Plan) -> Evaluation:
        """The plan's evaluation, counted as one sample; updates the incumbent."""
        self.samples += 1
        evaluation = self.cache.get(plan)
        if evaluation is None:
            evaluation = self.cache[plan] = evaluate(self.problem, plan)
        if not evaluation.fits:
            return evaluation
        self.fitting += 1
        if evaluation.time_s < self.fastest_s:
            self.fastest, self.fastest_s = plan, evaluation.time_s
        score = self.goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
        if score is not None and better(score, self.best_score):
            self.best, self.best_evaluation, self.best_score, self.best_at = plan, evaluation, score, self.samples
        return evaluation

    def result(self, **facts: object) -> Plan | None:
        """The best plan, annotated; None when no sampled plan met the goal's SLO. Raises when
        nothing sampled fit memory (the exact solvers' error, reached by sampling)."""
        if self.best is None:
            if self.fitting == 0:
                raise PlanError(f"solver {self.solver!r} priced {self.samples:,} plans and none fits the memory of "
                                f"{self.problem.platform.name}'s tiers; allow larger tiers or more stages, raise its "
                                "budget, or try solver='dp', which is exact")
            return None
        assert self.best_evaluation is not None and self.best_score is not None
        return annotate(self.best, self.best_evaluation, status="heuristic", objective=self.best_score[0],
                        samples=self.samples, distinct_plans=len(self.cache), best_at_sample=self.best_at,
                        solve_s=time.perf_counter() - self.started, **facts)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread for the duration, restored afterwards: the learning solvers' tensors
    (policy networks, GP matrices) are too small to split, and on two busy cores the thread
    pool only adds synchronization (measured: an rl episode 0.6 ms on one thread, 13 ms on
    two; a 40-evaluation bayes solve 4.0 s against 11.5 s)."""
    # start-up time: torch takes ~1 s to load, and of the solvers only the learning ones (rl, bayes) use it
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def positive(value: float, what: str, solver: str) -> None:
    """Guard for the sampling solvers' budgets."""
    if not value > 0:
        raise InputError(f"{solver} {what} must be > 0, got {value!r}")


def _rank(goal: Goal, evaluation: Evaluation) -> tuple[int, float, float]:
    """Hill-climbing order: plans meeting the goal by their score, then fitting plans that
    miss the SLO by their time (towards the SLO), then plans that overflow memory."""
    if not evaluation.fits:
        return 2, 0.0, 0.0
    score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
    if score is None:
        return 1, evaluation.time_s, 0.0
    return 0, *score


def neighbours(space: DecisionSpace, plan: Plan) -> Iterator[Plan]:
    """Plans one decision away: a cut removed (the merged stage keeps the first stage's tier
    and degree) or added (both halves keep the stage's), one stage's tier or degree changed
    (every stage's where the cost model shares it), or another M (degrees above it lowered)."""
    stages = list(plan.stages)
    micro = plan.micro_batches if plan.micro_batches is not None else space.micro_batches[0]

    def build(new_stages: list[StagePlan], new_micro: int = micro) -> Plan:
        return dataclasses.replace(plan, stages=tuple(new_stages), predictions={},
                                   micro_batches=new_micro if space.mode == "train" else None)

    for index in range(len(stages) - 1):
        first, second = stages[index], stages[index + 1]
        yield build([*stages[:index], dataclasses.replace(first, end=second.end), *stages[index + 2:]])
    for index, stage in enumerate(stages):
        for cut in range(stage.start, stage.end):
            yield build([*stages[:index], dataclasses.replace(stage, end=cut),
                         dataclasses.replace(stage, start=cut + 1), *stages[index + 1:]])
    for index, stage in enumerate(stages):
        for memory in space.memory_mb:
            if memory != stage.memory_mb:
                yield build([dataclasses.replace(other, memory_mb=memory)
                             if not space.tier_per_stage or position == index else other
                             for position, other in enumerate(stages)])
        if not space.tier_per_stage:
            break
    for index, stage in enumerate(stages):
        for degree in space.degrees_for(micro):
            if degree != stage.replicas:
                yield build([dataclasses.replace(other, replicas=degree)
                             if not space.degree_per_stage or position == index else other
                             for position, other in enumerate(stages)])
        if not space.degree_per_stage:
            break
    if space.mode == "train":
        for count in space.micro_batches:
            if count != micro:
                allowed = space.degrees_for(count)
                yield build([dataclasses.replace(stage, replicas=max(d for d in allowed if d <= stage.replicas))
                             for stage in stages], count)


def hill_climb(incumbent: Incumbent, space: DecisionSpace, start: Plan, deadline: float) -> int:
    """Best-improvement local search from ``start`` over :func:`neighbours`, pricing through
    ``incumbent`` (which keeps the best plan); returns the rounds that improved. Stops at a
    local optimum or at ``deadline``."""
    current = dataclasses.replace(start, predictions={})
    current_rank = _rank(incumbent.goal, incumbent.price(current))
    rounds = 0
    while time.perf_counter() < deadline:
        best, best_rank = None, current_rank
        for candidate in neighbours(space, current):
            rank = _rank(incumbent.goal, incumbent.price(candidate))
            if rank < best_rank:
                best, best_rank = candidate, rank
            if time.perf_counter() >= deadline:
                break
        if best is None:
            return rounds
        current, current_rank, rounds = best, best_rank, rounds + 1
    return rounds
