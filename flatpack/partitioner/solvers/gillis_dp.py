"""Exact fork-join inference plans under Gillis's model (``cost/gillis.py``).

Gillis (§IV-B) finds the latency-optimal plan with
a DP L(i, j, m) over layers, groups and memory, and turns to reinforcement learning for the
cheapest plan within an SLO (§IV-C) because billed cost "resists" that DP. On this cost
model the SLO problem is still exactly solvable, with a label-setting DP:

* One memory size m for all functions (§IV-B), so each size is solved on its own.
* Walking the chain left to right, a group of layers i..j either runs on the master alone
  (replicas 1: its forward time, and its weights join the master's) or is split over
  r ≥ 2 workers by channel or by batch, whichever of the two ``cost/gillis.py`` says can run
  it (both are options; the plan's ``StagePlan.split`` records the one chosen). The request's latency T is the sum of
  the group latencies; the workers' billed durations and requests are a sum over groups.
  The master's billed duration ⌈T/D⌉·D (§IV-C) is not additive, but it is a non-decreasing
  function of T, so the DP keeps T unrounded and rounds once, at the end.
* A DP state (layers 0..k−1 planned) therefore keeps every label (T, worker dollars, master
  weight bytes) that no other label beats in all three: the objective, weighted
  α₁·dollars + α₂·T or dollars within an SLO (ties by T), is non-decreasing in each, and
  the master-memory budget is a bound on the third. When the budget can hold every
  layer's weights, the third dimension cannot bind and is dropped.
* Branch and bound keeps the label sets small: a label is dropped when even the fastest
  completion (the latency-optimal DP of §IV-B over the remaining layers) with no extra
  worker cost scores worse than the best plan known — first found by a narrow beam pass.

The result is the optimum over groupings, worker counts and splits, up to float rounding:
at least as good as the best plan ``brute`` enumerates (its plans leave each split to
``gillis.choose_split``, the one of lower latency; the DP weighs both against the goal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from flatpack.errors import PlanError
from flatpack.partitioner.cost.common import memory_limit
from flatpack.units import mb
from flatpack.partitioner.cost.gillis import SPLITS, Group, _default_delay, group_cost
from flatpack.partitioner.objective import annotate, dollars_per_mb_s, evaluate, require_fit
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import Goal, better
from flatpack.partitioner.space import SearchSpace

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

SOLVER = "dp"
MASTER_ALONE = 1          # a stage's replicas when the master runs the group by itself
BEAM_WIDTH = 4            # labels per state in the pass that finds a first incumbent
BOUND_SLACK = 1e-9        # relative slack on bounds, so float rounding never prunes an optimum


@dataclass(frozen=True)
class GroupOption:
    """One way to run layers start..end: on the master alone or over ``workers`` workers."""

    start: int
    end: int
    replicas: int            # the plan's replicas: 1 = master alone, r > 1 = r workers
    latency_s: float         # the group's share of the request latency
    worker_dollars: float    # the workers' billed durations and requests
    master_bytes: int        # weights the master keeps for this group
    split: str | None = None  # how r > 1 workers divide the group (``StagePlan.split``)


class Label(NamedTuple):
    """A partial plan of layers 0..k−1: its latency so far, its workers' dollars, the
    master's weight bytes, and the previous label with the group that extended it."""

    latency_s: float
    worker_dollars: float
    master_bytes: int
    previous: Label | None
    option: GroupOption | None


class TierTables:
    """Everything the DP needs about one memory size, computed the way ``cost/gillis.py``
    computes it (same sums in the same order), so that latencies agree to the bit."""

    def __init__(self, problem: Problem, memory_mb: int, degrees: tuple[int, ...]):
        platform = problem.platform
        self.problem = problem
        self.tier: Tier = platform.tier(memory_mb)
        self.memory_mb = memory_mb
        limit, runtime = memory_limit(problem, self.tier)
        self.runtime_bytes = runtime
        self.budget = limit - runtime
        self.count = len(problem.chain)
        batch = problem.workload.batch
        self.forward = [problem.layer_inference_seconds(i, self.tier, batch) for i in range(self.count)]
        self.weights = [problem.layer_profile(i).param_bytes + problem.layer_profile(i).buffer_bytes
                        for i in range(self.count)]
        delay = _default_delay(problem)
        self.fork_delay = {r: delay.expected_max(r) for r in degrees if r > MASTER_ALONE}
        self.degrees = degrees
        self.price = self.tier.price_per_s
        self.request_price = platform.price_per_request
        self.platform = platform
        # options[i][j]: the ways to run layers i..j as one group (empty for j < i)
        self.options = [[self._group_options(i, j) if j >= i else [] for j in range(self.count)]
                        for i in range(self.count)]
        self.rest_latency = self._fastest_completions()
        # with room for every layer's weights on the master, its budget cannot bind
        self.master_can_bind = sum(self.weights) > self.budget

    def _group_options(self, start: int, end: int) -> list[GroupOption]:
        """The master alone, if the group's weights fit it, and each worker count and split
        that can run the group and whose partition fits a worker; latency and worker dollars
        from ``gillis.group_cost``, the function ``gillis.latency`` calls."""
        forward = sum(self.forward[start:end + 1])
        weights = sum(self.weights[start:end + 1])
        options = []
        if weights <= self.budget:
            options.append(GroupOption(start, end, MASTER_ALONE, forward / 1, 0.0, weights))
        for workers in self.degrees:
            if workers == MASTER_ALONE:
                continue
            for split in SPLITS:
                try:
                    cost = group_cost(self.problem, self.tier, Group(start, end, workers, False, split), forward,
                                      weights, self.fork_delay[workers])
                except PlanError:
                    continue
                if cost.partition_weight_bytes > self.budget:
                    continue
                duration = cost.worker_duration_s
                dollars = workers * (self.platform.billed_seconds(duration) * self.price + self.request_price)
                options.append(GroupOption(start, end, workers, cost.latency_s, dollars, 0, split))
        return options

    def _fastest_completions(self) -> list[float]:
        """rest[k]: the least latency of layers k..n−1 over all groupings whose groups fit on
        their own, the master's shared budget ignored (Gillis's latency DP, §IV-B) — a lower
        bound for any completion."""
        rest = [0.0] * (self.count + 1)
        for start in range(self.count - 1, -1, -1):
            best = math.inf
            for end in range(start, self.count):
                for option in self.options[start][end]:
                    best = min(best, option.latency_s + rest[end + 1])
            rest[start] = best
        return rest

    def dollars(self, latency_s: float, worker_dollars: float) -> float:
        """Dollars of a request: the master billed for the whole latency, plus the workers."""
        return self.platform.billed_seconds(latency_s) * self.price + self.request_price + worker_dollars


def solve(problem: Problem, goal: Goal, space: SearchSpace | None = None) -> Plan | None:
    """The plan of ``space`` that best meets ``goal`` under Gillis's fork-join model; None
    when no plan meets the goal's SLO; PlanError when no plan fits memory at any size."""
    if problem.workload.mode != "infer":
        raise PlanError("the Gillis fork-join DP plans inference; use the FuncPipe, Hydrozoa or PipeDream "
                        "solvers for training workloads")
    space = space or SearchSpace.of(problem)
    degrees = (MASTER_ALONE, *range(2, space.max_workers + 1))
    tables = [TierTables(problem, memory, degrees) for memory in space.memory_mb]
    fitting = [table for table in tables if fits_somehow(table)]
    if not fitting:
        raise PlanError(unfit_message(problem, tables, space))
    unit = dollars_per_mb_s(problem.platform)
    search = Search(goal, unit)
    for table in fitting:
        search.run(table, beam=BEAM_WIDTH)
    for table in fitting:
        search.run(table, beam=None)
    if search.best_label is None:
        return None
    plan = plan_of(search.best_label, search.best_table, problem)
    evaluation = evaluate(problem, plan)
    require_fit(problem, plan, evaluation)
    return annotate(plan, evaluation, status="optimal", labels_kept=search.labels_kept)


class Search:
    """Branch and bound over the label DP of each memory size, sharing one incumbent."""

    def __init__(self, goal: Goal, unit: float):
        self.goal = goal
        self.unit = unit
        self.best_score: tuple[float, float] | None = None
        self.best_label: Label | None = None
        self.best_table: TierTables | None = None
        self.labels_kept = 0

    def score(self, table: TierTables, latency_s: float, worker_dollars: float) -> tuple[float, float] | None:
        dollars = table.dollars(latency_s, worker_dollars)
        return self.goal.score(latency_s, dollars / self.unit, dollars)

    def hopeless(self, table: TierTables, label: Label, position: int) -> bool:
        """True when no completion of ``label`` can beat the incumbent or meet the SLO."""
        fastest = (label.latency_s + table.rest_latency[position]) * (1 - BOUND_SLACK)
        bound = self.score(table, fastest, label.worker_dollars)
        if bound is None:
            return True
        if self.best_score is None:
            return False
        primary, best = bound[0], self.best_score[0]
        return primary > best + BOUND_SLACK * abs(best)

    def run(self, table: TierTables, beam: int | None) -> None:
        """One pass over the chain; ``beam`` keeps only that many labels per state (a quick
        pass for an incumbent), None keeps every non-dominated label (the exact pass)."""
        count = table.count
        pending: list[list[Label]] = [[] for _ in range(count + 1)]
        pending[0].append(Label(0.0, 0.0, 0, None, None))
        for position in range(count):
            labels = [label for label in pending[position] if not self.hopeless(table, label, position)]
            labels = non_dominated(labels, table.master_can_bind)
            if beam is not None:
                labels = sorted(labels, key=lambda label: self._rank(table, label, position))[:beam]
            self.labels_kept += len(labels) if beam is None else 0
            for label in labels:
                self._extend(table, label, position, pending)
        for label in pending[count]:
            score = self.score(table, label.latency_s, label.worker_dollars)
            if score is not None and better(score, self.best_score):
                self.best_score, self.best_label, self.best_table = score, label, table

    def _rank(self, table: TierTables, label: Label, position: int) -> tuple[float, float]:
        fastest = label.latency_s + table.rest_latency[position]
        score = self.score(table, fastest, label.worker_dollars)
        return score if score is not None else (math.inf, math.inf)

    @staticmethod
    def _extend(table: TierTables, label: Label, position: int, pending: list[list[Label]]) -> None:
        for end in range(position, table.count):
            for option in table.options[position][end]:
                master = label.master_bytes + option.master_bytes
                if master > table.budget:
                    continue
                pending[end + 1].append(Label(label.latency_s + option.latency_s,
                                              label.worker_dollars + option.worker_dollars, master, label, option))


def non_dominated(labels: list[Label], master_can_bind: bool) -> list[Label]:
    """The labels no other label matches or beats in latency, worker dollars and (when
    the master's budget can bind) master bytes; one of any group of equal labels."""
    ordered = sorted(labels, key=lambda label: (label.latency_s, label.worker_dollars, label.master_bytes))
    kept: list[Label] = []
    if not master_can_bind:
        for label in ordered:
            if not kept or label.worker_dollars < kept[-1].worker_dollars:
                kept.append(label)
        return kept
    for label in ordered:
        if any(other.worker_dollars <= label.worker_dollars and other.master_bytes <= label.master_bytes
               for other in kept):
            continue
        kept.append(label)
    return kept


def plan_of(label: Label, table: TierTables | None, problem: Problem) -> Plan:
    """The plan a final label stands for, groups in chain order."""
    assert table is not None
    stages = []
    while label.option is not None:
        option = label.option
        stages.append(StagePlan(option.start, option.end, table.memory_mb, option.replicas, split=option.split))
        assert label.previous is not None
        label = label.previous
    return Plan(tuple(reversed(stages)), len(problem.chain), SOLVER)


def unsplittable(table: TierTables) -> list[int]:
    """Layers that no group holding them can split over workers whose partitions fit:
    they can only run on the master."""
    split = [False] * table.count
    for start in range(table.count):
        for end in range(start, table.count):
            if any(option.replicas > MASTER_ALONE for option in table.options[start][end]):
                split[start:end + 1] = [True] * (end + 1 - start)
    return [i for i in range(table.count) if not split[i]]


def fits_somehow(table: TierTables) -> bool:
    """False when the layers only the master can run do not fit on it together: then no
    plan fits this size (the search finds out about the other sizes)."""
    return sum(table.weights[i] for i in unsplittable(table)) <= table.budget


def unfit_message(problem: Problem, tables: list[TierTables], space: SearchSpace) -> str:
    """What does not fit on the roomiest size, by how much, and what to change."""
    table = max(tables, key=lambda t: t.budget)
    stuck = unsplittable(table)
    need = sum(table.weights[i] for i in stuck)
    names = ", ".join(f"{i} ({problem.chain[i].name})" for i in stuck[:6]) + (" …" if len(stuck) > 6 else "")
    split = (f"split over up to {space.max_workers} workers" if space.max_workers >= 2
             else "with no workers to split them over (max_workers < 2)")
    return (f"no fork-join plan fits any memory size in {list(space.memory_mb)} MB: even on {table.memory_mb} MB, "
            f"which leaves {mb(max(table.budget, 0))} for weights after the {mb(table.runtime_bytes)} runtime, "
            f"layers {names} cannot be {split} and together need {mb(need)} of weights on the master. "
            "Allow more workers per group (option max_workers), a larger memory size (option memory_mb), "
            "or serve a smaller model")
