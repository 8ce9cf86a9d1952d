"""Exact plans under PipeDream's model (``cost/pipedream.py``): per-stage tiers and replicas.

PipeDream's partitioner (the PipeDream dissertation §5.3.2) computes A(j, m),
the least time per micro-batch of the slowest stage for the first j layers on m workers. Our
objective also prices the workers: an iteration of M micro-batches takes M·A and costs
M·A·P dollars, P = Σ_s replicas_s·price_s, so the weighted objective is
M·A·(α₁·P/u + α₂) and the SLO objective M·A·P subject to M·A ≤ SLO — both non-decreasing
in A and in P. That makes bottleneck enumeration exact:

* For a threshold τ on A, let P*(τ) be the least price of a plan whose every stage time
  T(i→j, m) = max(compute/m, ring all-reduce) and every cut 2·a/B is at most τ and whose
  every stage fits its memory. The optimum is min over τ of the objective at (τ, P*(τ)),
  and only the τ among the stage and cut times can be a plan's A.
* P*(τ) is non-increasing in τ, so its breakpoints — the only τ worth scoring — are found
  by divide and conquer over the sorted thresholds (equal prices at both ends of a range
  mean no breakpoint inside), and a range is skipped when its best conceivable score,
  (smallest τ in it, price at its top end), cannot beat the incumbent.
* P*(τ) is a DP over stages from right to left, because PipeDream's weight stashing keeps
  ⌈(workers in stages s..S) / m_s⌉ versions on stage s (§5.3.3): the memory of a stage
  depends on the workers after it. A state (first layer i, first stage's tier) keeps the
  (workers, price) pairs no other pair beats in both. Within τ, a stage's best replica
  count for a given suffix is the smallest that is fast enough and whose
  m·(versions that fit − 1) admits the suffix's workers: more replicas only add price and
  workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from flatpack.errors import PlanError
from flatpack.partitioner.cost.common import MemoryNeed, StageTensors, memory_need, stage_memory, stage_tensors
from flatpack.units import mb
from flatpack.partitioner.cost.pipedream import stage_seconds
from flatpack.partitioner.objective import annotate, dollars_per_mb_s, evaluate, require_fit, with_micro_batches
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import Goal, better
from flatpack.partitioner.space import SearchSpace

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

SOLVER = "dp"
BOUND_SLACK = 1e-9        # relative slack on bounds, so float rounding never prunes an optimum


class StageMemory:
    """``stage_memory`` of any stage, with each stage's sums (``stage_tensors``, which do not
    depend on M or the tier) formed once and shared by every M and tier a solver tries."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[int, int], StageTensors] = {}

    def need(self, problem: Problem, start: int, end: int, tier: Tier, *, micro_batches_in_flight: float,
             weight_versions: int = 1) -> MemoryNeed:
        key = (start, end)
        if key not in self._tensors:
            self._tensors[key] = stage_tensors(problem, start, end)
        return memory_need(problem, self._tensors[key], tier, micro_batches_in_flight=micro_batches_in_flight,
                           weight_versions=weight_versions)


def max_versions(problem: Problem, memory: StageMemory, start: int, end: int, tier: Tier, cap: int) -> int:
    """The most (weights, activations) versions, at most ``cap``, that layers start..end
    can keep on ``tier`` (0 when even one does not fit), as ``stage_memory`` counts them."""
    def fits(versions: int) -> bool:
        return memory.need(problem, start, end, tier, micro_batches_in_flight=versions,
                           weight_versions=versions).fits

    one = memory.need(problem, start, end, tier, micro_batches_in_flight=1, weight_versions=1)
    if not one.fits:
        return 0
    per_version = one.activations + one.weights
    if per_version <= 0:
        return cap
    # memory is linear in the versions but for rounding: estimate, then step to the exact edge
    versions = min(cap, max(1, (one.limit - (one.total - per_version)) // per_version))
    while versions < cap and fits(versions + 1):
        versions += 1
    while versions > 1 and not fits(versions):
        versions -= 1
    return versions


class StageTables:
    """Stage times, memory caps and cut times for one M, computed as ``cost/pipedream.py``
    computes them (same sums in the same order), so thresholds compare to the bit."""

    def __init__(self, problem: Problem, memory_mb: tuple[int, ...], replicas: tuple[int, ...],
                 memory: StageMemory):
        self.problem = problem
        self.count = count = len(problem.chain)
        self.memory_mb = memory_mb
        self.tiers = [problem.platform.tier(memory) for memory in memory_mb]
        self.replicas = replicas
        self.prices = [tier.price_per_s for tier in self.tiers]
        # tiers by bandwidth: a cut is fast enough for every next tier at or above some rank
        self.by_bandwidth = sorted(range(len(self.tiers)), key=lambda t: self.tiers[t].bandwidth_bytes_s)
        micro = problem.workload.micro_batch_size
        layer = [[problem.layer_seconds(i, tier, micro) for i in range(count)] for tier in self.tiers]
        grads = [problem.layer_profile(i).grad_bytes for i in range(count)]
        most = max(replicas)
        # time[i][j][t][k]: T(i→j, replicas[k]); versions[i][j][t]: weight-stashing cap
        self.time: list[list[list[list[float]]]] = []
        self.versions: list[list[list[int]]] = []
        for i in range(count):
            times_i, versions_i = [], []
            forward = [0.0] * len(self.tiers)
            backward = [0.0] * len(self.tiers)
            sync = 0
            for j in range(i, count):
                sync += grads[j]
                times_j, versions_j = [], []
                for t, tier in enumerate(self.tiers):
                    forward[t] += layer[t][j][0]
                    backward[t] += layer[t][j][1]
                    times_j.append([stage_seconds(forward[t] + backward[t], sync, r, tier.bandwidth_bytes_s)
                                    for r in replicas])
                    versions_j.append(max_versions(problem, memory, i, j, tier, 1 + (count - 1 - j) * most))
                times_i.append(times_j)
                versions_i.append(versions_j)
            self.time.append(times_i)
            self.versions.append(versions_i)
        self.cut = []
        for j in range(count - 1):
            nbytes = problem.boundary_bytes(j, micro)
            self.cut.append([[2 * nbytes / min(a.bandwidth_bytes_s, b.bandwidth_bytes_s) for b in self.tiers]
                             for a in self.tiers])

    def stage(self, start: int, end: int, tier: int) -> list[float]:
        return self.time[start][end - start][tier]

    def max_versions(self, start: int, end: int, tier: int) -> int:
        return self.versions[start][end - start][tier]

    def thresholds(self) -> list[float]:
        """Every value A can take: the time of each stage that fits, and of each cut."""
        values = set()
        for i in range(self.count):
            for j in range(i, self.count):
                for t in range(len(self.tiers)):
                    if self.max_versions(i, j, t):
                        values.update(self.stage(i, j, t))
        for row in self.cut:
            for times in row:
                values.update(times)
        return sorted(values)


class Entry(NamedTuple):
    """A suffix plan starting at some layer: its workers, its price per second, and how it
    was built (first stage, then the entry for the rest)."""

    workers: int
    price: float
    start: int
    end: int
    tier: int
    replicas: int
    rest: Entry | None


def non_dominated(entries: list[Entry]) -> list[Entry]:
    """Entries no other entry matches or beats in both workers and price."""
    kept: list[Entry] = []
    for entry in sorted(entries, key=lambda e: (e.workers, e.price)):
        if not kept or entry.price < kept[-1].price:
            kept.append(entry)
    return kept


def cheapest_within(tables: StageTables, tau: float) -> Entry | None:
    """P*(τ): the cheapest plan whose stages and cuts all take at most ``tau`` and whose
    stages all fit, by a DP from the last layer back to the first."""
    count, tier_count = tables.count, len(tables.tiers)
    order = tables.by_bandwidth
    # merged[i][k]: the non-dominated entries starting at layer i on a tier of bandwidth rank >= k
    merged: list[list[list[Entry]]] = [[] for _ in range(count + 1)]
    for start in range(count - 1, -1, -1):
        fronts = [_stage_front(tables, tau, start, t, merged) for t in range(tier_count)]
        merged_here: list[list[Entry]] = [[] for _ in range(tier_count + 1)]
        for rank in range(tier_count - 1, -1, -1):
            merged_here[rank] = non_dominated(fronts[order[rank]] + merged_here[rank + 1])
        merged[start] = merged_here
    front = merged[0][0]
    return min(front, key=lambda e: e.price) if front else None


def _stage_front(tables: StageTables, tau: float, start: int, tier: int,
                 merged: list[list[list[Entry]]]) -> list[Entry]:
    """Non-dominated suffix plans whose first stage starts at ``start`` on ``tier``."""
    count = tables.count
    price = tables.prices[tier]
    entries: list[Entry] = []
    for end in range(start, count):
        versions = tables.max_versions(start, end, tier)
        times = tables.stage(start, end, tier)
        fast = [r for r, seconds in zip(tables.replicas, times) if seconds <= tau]
        if not versions or not fast:
            break  # a longer stage needs more memory and more time for every replica count
        if end == count - 1:
            replicas = fast[0]
            entries.append(Entry(replicas, replicas * price, start, end, tier, replicas, None))
            continue
        rank = _first_fast_rank(tables, tau, end, tier)
        if rank is None:
            continue
        for rest in merged[end + 1][rank]:
            # ⌈(r + rest)/r⌉ versions fit iff rest ≤ r·(versions − 1)
            replicas = next((r for r in fast if rest.workers <= r * (versions - 1)), None)
            if replicas is not None:
                entries.append(Entry(replicas + rest.workers, replicas * price + rest.price, start, end, tier,
                                     replicas, rest))
    return non_dominated(entries)


def _first_fast_rank(tables: StageTables, tau: float, end: int, tier: int) -> int | None:
    """The lowest bandwidth rank of a next tier for which the cut after ``end`` is within
    ``tau`` (the cut time falls as the next tier's bandwidth rises)."""
    row = tables.cut[end][tier]
    for rank, other in enumerate(tables.by_bandwidth):
        if row[other] <= tau:
            return rank
    return None


def plan_of(entry: Entry, tables: StageTables, micro_batches: int) -> Plan:
    stages = []
    current: Entry | None = entry
    while current is not None:
        stages.append(StagePlan(current.start, current.end, tables.memory_mb[current.tier], current.replicas))
        current = current.rest
    return Plan(tuple(stages), tables.count, SOLVER, micro_batches=micro_batches)


@dataclass
class Incumbent:
    """The best plan found so far and its score under the goal."""

    goal: Goal
    unit: float
    score: tuple[float, float] | None = None
    plan: Plan | None = None
    scored: int = 0

    def offer(self, problem: Problem, plan: Plan) -> None:
        evaluation = evaluate(problem, plan)
        self.scored += 1
        score = self.goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
        if evaluation.fits and score is not None and better(score, self.score):
            self.score, self.plan = score, annotate(plan, evaluation, status="optimal")

    def beaten(self, time_s: float, dollars: float) -> bool:
        """True when a plan no faster than ``time_s`` and no cheaper than ``dollars`` can
        neither meet the SLO nor beat the incumbent."""
        time_s, dollars = time_s * (1 - BOUND_SLACK), dollars * (1 - BOUND_SLACK)
        bound = self.goal.score(time_s, dollars / self.unit, dollars)
        if bound is None:
            return True
        if self.score is None:
            return False
        return bound[0] > self.score[0] + BOUND_SLACK * abs(self.score[0])


def solve(problem: Problem, goal: Goal, space: SearchSpace | None = None) -> Plan | None:
    """The plan of ``space`` that best meets ``goal`` under PipeDream's model; None when no
    plan meets the SLO; PlanError when no plan fits memory for any M."""
    if problem.workload.mode != "train":
        raise PlanError("the PipeDream DP plans training; use the Gillis fork-join DP for inference")
    space = space or SearchSpace.of(problem)
    incumbent = Incumbent(goal, dollars_per_mb_s(problem.platform))
    fitting = False
    memory = StageMemory()
    for micro_batches in space.micro_batches:
        sub = with_micro_batches(problem, micro_batches)
        tables = StageTables(sub, space.memory_mb, space.replicas_for(micro_batches), memory)
        if cheapest_within(tables, math.inf) is None:
            continue
        fitting = True
        search_thresholds(problem, tables, micro_batches, incumbent)
    if not fitting:
        raise PlanError(unfit_message(problem, space))
    if incumbent.plan is None:
        return None
    require_fit(problem, incumbent.plan, evaluate(problem, incumbent.plan))
    return incumbent.plan.with_predictions(plans_scored=incumbent.scored)


def search_thresholds(problem: Problem, tables: StageTables, micro_batches: int, incumbent: Incumbent) -> None:
    """Scores P*(τ) at every breakpoint τ that could beat the incumbent (see the module
    docstring): binary search for the smallest feasible τ, then divide and conquer."""
    thresholds = tables.thresholds()
    slo = incumbent.goal.slo_s
    if slo is not None:
        thresholds = [tau for tau in thresholds if micro_batches * tau <= slo]
    if not thresholds:
        return
    top = cheapest_within(tables, thresholds[-1])
    if top is None:
        return
    low = _smallest_feasible(tables, thresholds)
    bottom = cheapest_within(tables, thresholds[low])
    assert bottom is not None
    for entry in (bottom, top):
        incumbent.offer(problem, plan_of(entry, tables, micro_batches))
    stack = [(low, len(thresholds) - 1, bottom.price, top.price)]
    while stack:
        lo, hi, price_lo, price_hi = stack.pop()
        if hi - lo <= 1 or price_lo == price_hi:
            continue  # no breakpoint strictly inside
        fastest = micro_batches * thresholds[lo + 1]
        if incumbent.beaten(fastest, fastest * price_hi):
            continue
        mid = (lo + hi) // 2
        entry = cheapest_within(tables, thresholds[mid])
        assert entry is not None  # feasibility is monotone in τ
        incumbent.offer(problem, plan_of(entry, tables, micro_batches))
        stack.append((mid, hi, entry.price, price_hi))
        stack.append((lo, mid, price_lo, entry.price))


def _smallest_feasible(tables: StageTables, thresholds: list[float]) -> int:
    lo, hi = 0, len(thresholds) - 1  # thresholds[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if cheapest_within(tables, thresholds[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    return lo


def unfit_message(problem: Problem, space: SearchSpace) -> str:
    """Why no plan fits: the layer that fits no tier on its own, else weight stashing."""
    micro_batches = max(space.micro_batches)  # the smallest micro-batches need the least memory
    sub = with_micro_batches(problem, micro_batches)
    tiers = [problem.platform.tier(memory) for memory in space.memory_mb]
    roomiest = max(tiers, key=lambda tier: stage_memory(sub, 0, 0, tier, micro_batches_in_flight=1).limit)
    for index in range(len(problem.chain)):
        need = stage_memory(sub, index, index, roomiest, micro_batches_in_flight=1)
        if not need.fits:
            return (f"no PipeDream plan fits: layer {index} ({problem.chain[index].name}) alone needs "
                    f"{mb(need.total)} ({need.describe()}) at M = {micro_batches}, more than the "
                    f"{mb(need.limit)} of the roomiest tier, {roomiest.memory_mb} MB. Allow a larger tier "
                    "(option memory_mb), more micro-batches (option micro_batches) or a smaller batch")
    whole = stage_memory(sub, 0, len(problem.chain) - 1, roomiest, micro_batches_in_flight=1)
    return (f"no PipeDream plan fits: every layer fits a {roomiest.memory_mb} MB tier alone, but the whole model "
            f"needs {mb(whole.total)} of the tier's {mb(whole.limit)}, and any earlier stage of a pipeline keeps "
            "at least two weight and activation versions (PipeDream's weight stashing, §5.3.3). Allow a larger "
            "tier (option memory_mb), more replicas for early stages (option replicas) or a smaller batch")
