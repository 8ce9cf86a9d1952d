"""Plans under Hydrozoa's hybrid-parallel model (``cost/hydrozoa.py``): an exact DP, and
Hydrozoa's own planner as a heuristic solver.

``solve`` (used by ``dp``) is exact over the space ``brute`` enumerates: micro-batch counts
M, a uniform data-parallel degree A, any cut into B stages and a tier per stage. For fixed
(M, A), with µ = ⌈M/A⌉ micro-batches per worker group, an iteration takes

    T = Σ(f + b) + 2·Σc + (µ − 1)(t_k + r_1) + max_j T^(D)_j

(Hydrozoa §3.3, §3.4, App. A.1)
with t_k = max(f, c), r_1 = max(b, c) over stages and cuts, and costs T·A·P dollars, P the
sum of the stages' prices. Hydrozoa's own DP (App. A.2) fixes bounds on t_k and r_1 from a
grid of V values and is exact only as V grows (its Theorem 1). Here a label-setting DP over
(first unplanned layer, last stage's tier) keeps, per partial plan, the sums Σf, Σb, Σc, the
maxima t_k, r_1, max T^(D) and the price P, and drops a label b when another label a is no
dearer and

    S_a + (µ − 1)·[(t_a − t_b)⁺ + (r_a − r_b)⁺] + (D_a − D_b)⁺ ≤ S_b,   S = Σf + Σb + 2Σc,

with each maximum first raised to the least value the remaining layers must add to it: for
every completion, T(a + completion) ≤ T(b + completion) and P likewise, and both goals —
α₁·dollars + α₂·T, and dollars within an SLO (ties by T) — are non-decreasing in T and P.
Branch and bound (a lower bound on any completion's T and P against the best plan so far,
first found by a narrow beam pass) keeps the label sets small. Sums are formed in the cost
model's order, so a plan's T is the cost model's to the bit.

``Hydrozoa`` is the paper's planner: Alg. 1's A×B strategy selection over a cluster size,
App. A.2's partitioner with V bounds per lag, and §3.3's micro-batch size and count search.
"""

from __future__ import annotations

import heapq
import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import numpy as np

from flatpack.errors import PlanError
from flatpack.partitioner.cost.collectives import AllReduceTerms
from flatpack.partitioner.cost.common import stage_memory
from flatpack.units import mb
from flatpack.partitioner.cost.hydrozoa import model_parallel_seconds
from flatpack.partitioner.cost.registry import HydrozoaModel
from flatpack.partitioner.objective import (Evaluation, annotate, dollars_per_mb_s, evaluate, require_fit,
                                            with_micro_batches)
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import CostSolver, Goal, better
from flatpack.partitioner.solvers.pipedream_dp import StageMemory
from flatpack.partitioner.space import SearchSpace
from flatpack.partitioner.workload import divisors_up_to

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

SOLVER = "dp"
BEAM_WIDTH = 8            # labels per state in the pass that finds a first incumbent
BOUND_SLACK = 1e-9        # relative slack on bounds, so float rounding never prunes an optimum


def sync_overheads(problem: Problem) -> AllReduceTerms:
    """The all-reduce's terms (Hydrozoa's α, β; the calibration's δ, γ), as ``evaluate`` reads them."""
    return HydrozoaModel.of_options(problem.options).sync_terms(problem)


class ShardTables:
    """Per-stage and per-cut figures for one (M, A), computed as ``cost/hydrozoa.py`` does."""

    def __init__(self, problem: Problem, memory_mb: tuple[int, ...], micro_batches: int, groups: int,
                 memory: StageMemory):
        self.count = count = len(problem.chain)
        self.memory_mb = memory_mb
        self.micro_batches = micro_batches
        self.groups = groups
        self.per_group = math.ceil(micro_batches / groups)   # µ
        self.tiers: list[Tier] = [problem.platform.tier(memory) for memory in memory_mb]
        self.prices = [tier.price_per_s for tier in self.tiers]
        sync_terms = sync_overheads(problem)
        micro = problem.workload.micro_batch_size
        layer = [[problem.layer_seconds(i, tier, micro) for i in range(count)] for tier in self.tiers]
        grads = [problem.layer_profile(i).grad_bytes for i in range(count)]
        # stage[i][t]: (f, b, T^(D)) of layers i..i+k for k = 0.. while the stage fits its memory
        self.stage: list[list[list[tuple[float, float, float]]]] = []
        for i in range(count):
            per_tier = []
            for t, tier in enumerate(self.tiers):
                rows: list[tuple[float, float, float]] = []
                forward = backward = 0.0
                sync = 0
                for j in range(i, count):
                    if not memory.need(problem, i, j, tier, micro_batches_in_flight=self.per_group).fits:
                        break  # a longer stage needs at least as much memory
                    forward += layer[t][j][0]
                    backward += layer[t][j][1]
                    sync += grads[j]
                    rows.append((forward, backward, sync_terms.seconds(sync, groups, tier.bandwidth_bytes_s)))
                per_tier.append(rows)
            self.stage.append(per_tier)
        # comm[j][p][t]: c of the cut after layer j between a stage on tier p and one on tier t
        self.comm = []
        for j in range(count - 1):
            nbytes = problem.boundary_bytes(j, micro)
            self.comm.append([[nbytes / min(a.bandwidth_bytes_s, b.bandwidth_bytes_s) for b in self.tiers]
                              for a in self.tiers])
        # least_cut[position][tier]: a floor under the next cut, hence under both lags
        self.least_cut = [[self._least_comm(position, tier) for tier in range(len(self.tiers))]
                          for position in range(count + 1)]
        self._bounds(layer, grads, sync_terms)
        self._next: dict[tuple[int, int | None], NextStages] = {}

    def _bounds(self, layer: list[list[tuple[float, float]]], grads: list[int], sync_terms: AllReduceTerms) -> None:
        """What layers i.. must still add, whatever the plan: floors under t_k, r_1 and
        max T^(D) (the stage holding layer l costs at least l alone on its best tier), and
        the least Σ(f + b) + 2Σc and the least price of any completion (additive, so exact
        by a DP from the last layer back)."""
        count, tiers = self.count, range(len(self.tiers))
        self.floor_forward = [0.0] * (count + 1)
        self.floor_backward = [0.0] * (count + 1)
        self.floor_sync = [0.0] * (count + 1)
        for i in range(count - 1, -1, -1):
            self.floor_forward[i] = max(self.floor_forward[i + 1], min(layer[t][i][0] for t in tiers))
            self.floor_backward[i] = max(self.floor_backward[i + 1], min(layer[t][i][1] for t in tiers))
            sync = min(sync_terms.seconds(grads[i], self.groups, self.tiers[t].bandwidth_bytes_s) for t in tiers)
            self.floor_sync[i] = max(self.floor_sync[i + 1], sync)
        # rest_time[i][p]: after a stage on tier p (len(tiers): none) that ends at layer i − 1
        self.rest_time = [[math.inf] * (len(self.tiers) + 1) for _ in range(count + 1)]
        self.rest_time[count] = [0.0] * (len(self.tiers) + 1)
        self.rest_price = [math.inf] * count + [0.0]
        for i in range(count - 1, -1, -1):
            for t in tiers:
                for offset, (forward, backward, _) in enumerate(self.stage[i][t]):
                    end = i + offset
                    self.rest_price[i] = min(self.rest_price[i], self.prices[t] + self.rest_price[end + 1])
                    after = forward + backward + self.rest_time[end + 1][t]
                    for p in range(len(self.tiers) + 1):
                        cut = 2 * self.comm[i - 1][p][t] if i > 0 and p < len(self.tiers) else 0.0
                        self.rest_time[i][p] = min(self.rest_time[i][p], after + cut)

    def next_stages(self, position: int, tier: int | None) -> NextStages:
        """Every stage that can start at ``position`` after a stage on ``tier`` (None: the
        first stage), with what a bound needs, as arrays; cached per state."""
        key = (position, tier)
        if key not in self._next:
            self._next[key] = NextStages.of(self, position, tier)
        return self._next[key]

    def _least_comm(self, position: int, tier: int) -> float:
        """The cut into the next stage, after a stage on ``tier`` ending at position − 1,
        takes at least its bytes over the faster of the two bandwidths (none at the ends)."""
        if position == 0 or position == self.count:
            return 0.0
        return min(self.comm[position - 1][tier])


@dataclass(frozen=True)
class NextStages:
    """The stages that can start at one state, flattened: stage figures, the cut into
    them, their price, and the state after them with its completion bounds."""

    after: list[int]          # the position after the stage
    tier: list[int]
    forward: np.ndarray       # the stage's f and b
    backward: np.ndarray
    comm: np.ndarray          # the cut into the stage (0 for the first stage)
    sync: np.ndarray
    price: np.ndarray
    rest_time: np.ndarray
    rest_price: np.ndarray
    floor_forward: np.ndarray
    floor_backward: np.ndarray
    floor_sync: np.ndarray

    @classmethod
    def of(cls, tables: ShardTables, position: int, tier: int | None) -> NextStages:
        rows: list[tuple] = []
        for nxt, stages in enumerate(tables.stage[position]):
            comm = tables.comm[position - 1][tier][nxt] if tier is not None else 0.0
            for offset, (forward, backward, sync) in enumerate(stages):
                after = position + offset + 1
                rest = tables.rest_time[after][nxt]
                if rest == math.inf:
                    continue  # the layers after this stage fit no tier
                cut = tables.least_cut[after][nxt]
                rows.append((after, nxt, forward, backward, comm, sync, tables.prices[nxt], rest,
                             tables.rest_price[after], max(tables.floor_forward[after], cut),
                             max(tables.floor_backward[after], cut), tables.floor_sync[after]))
        columns = list(zip(*rows)) if rows else [()] * 12
        arrays = [np.array(column, dtype=float) for column in columns[2:]]
        forward, backward, comm, sync, price, rest, rest_price, floor_f, floor_b, floor_s = arrays
        return cls(list(columns[0]), list(columns[1]), forward, backward, comm, sync, price, rest, rest_price,
                   floor_f, floor_b, floor_s)


class Label(NamedTuple):
    """A partial plan of layers 0..position−1 (see the module docstring for the fields)."""

    forward: float
    backward: float
    comm: float
    forward_lag: float
    backward_lag: float
    sync: float
    price: float
    previous: Label | None
    stage: tuple[int, int, int] | None   # (start, end, tier) of its last stage

    def model_parallel(self, per_group: int) -> float:
        """T^(M), summed as ``hydrozoa.model_parallel_seconds`` sums it."""
        return (self.forward + self.backward + 2 * self.comm
                + (per_group - 1) * (self.forward_lag + self.backward_lag))

    def iteration(self, per_group: int) -> float:
        return self.model_parallel(per_group) + self.sync


@dataclass(frozen=True)
class Extensions:
    """One label followed by each stage of ``nexts``, as arrays; ``label(i)`` makes the
    i-th into a Label (only the ones a pass keeps are ever made)."""

    parent: Label
    position: int
    nexts: NextStages
    forward: np.ndarray
    backward: np.ndarray
    comm: np.ndarray
    forward_lag: np.ndarray
    backward_lag: np.ndarray
    sync: np.ndarray
    price: np.ndarray

    def label(self, index: int) -> Label:
        after, tier = self.nexts.after[index], self.nexts.tier[index]
        return Label(float(self.forward[index]), float(self.backward[index]), float(self.comm[index]),
                     float(self.forward_lag[index]), float(self.backward_lag[index]), float(self.sync[index]),
                     float(self.price[index]), self.parent, (self.position, after - 1, tier))


Pending = tuple[float, Extensions, int]   # (bound, extensions, index)


def _raised(label: Label, tables: ShardTables, position: int, tier: int | None) -> tuple[float, float, float, float]:
    """(S, t_k, r_1, max T^(D)) with each maximum raised to the floor the rest must add."""
    cut = tables.least_cut[position][tier] if tier is not None else 0.0
    return (label.forward + label.backward + 2 * label.comm,
            max(label.forward_lag, tables.floor_forward[position], cut),
            max(label.backward_lag, tables.floor_backward[position], cut),
            max(label.sync, tables.floor_sync[position]))


def non_dominated(labels: list[Label], tables: ShardTables, position: int, tier: int | None) -> list[Label]:
    """The labels of one state that no other label of it dominates (module docstring).
    Cheapest first, each checked against the kept ones at once with numpy."""
    lag = tables.per_group - 1
    keyed = sorted((((label.price, *_raised(label, tables, position, tier)), label) for label in labels),
                   key=lambda item: item[0])
    kept_keys = np.empty((len(keyed), 4))
    kept: list[Label] = []
    for (_, total, fwd, bwd, sync), label in keyed:
        if kept:
            other = kept_keys[:len(kept)]
            reach = (other[:, 0] + lag * (np.maximum(other[:, 1] - fwd, 0.0) + np.maximum(other[:, 2] - bwd, 0.0))
                     + np.maximum(other[:, 3] - sync, 0.0))
            if (reach <= total).any():
                continue
        kept_keys[len(kept)] = (total, fwd, bwd, sync)
        kept.append(label)
    return kept


class HybridSearch:
    """Branch and bound over every (M, A)'s label DP, sharing one incumbent."""

    def __init__(self, problem: Problem, goal: Goal):
        self.problem = problem
        self.goal = goal
        self.unit = dollars_per_mb_s(problem.platform)
        self.best_score: tuple[float, float] | None = None
        self.best: tuple[Label, ShardTables] | None = None
        self.labels_kept = 0

    def score(self, tables: ShardTables, time_s: float, price: float) -> tuple[float, float] | None:
        dollars = time_s * tables.groups * price
        return self.goal.score(time_s, dollars / self.unit, dollars)

    def cutoff(self) -> float:
        """Labels whose bound exceeds this cannot beat the incumbent (the largest float,
        not inf, so that a bound of inf — an SLO missed — is always cut)."""
        if self.best_score is None:
            return sys.float_info.max
        return self.best_score[0] + BOUND_SLACK * abs(self.best_score[0])

    def run(self, tables: ShardTables, beam: int | None) -> float:
        """One pass left to right; ``beam`` keeps that many labels per state (a quick pass
        for an incumbent), None every non-dominated one (the exact pass). Returns the best
        primary score this pass reached (inf when none)."""
        count, tier_count = tables.count, len(tables.tiers)
        # pending[position][tier]: (bound, extensions, index) for the labels whose last stage,
        # on that tier, ends at position − 1; made into Labels only when a pass keeps them
        pending: list[list[list[Pending]]] = [[[] for _ in range(tier_count)] for _ in range(count + 1)]
        cutoff = self.cutoff()
        self._extend(tables, Label(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, None, None), 0, None, pending, cutoff)
        for position in range(1, count):
            for tier in range(tier_count):
                if beam is not None:
                    # the quick pass: the most promising labels by bound, no dominance
                    labels = [extensions.label(index) for _, extensions, index
                              in heapq.nsmallest(beam, pending[position][tier], key=lambda item: item[0])]
                else:
                    labels = non_dominated([extensions.label(index) for _, extensions, index
                                            in pending[position][tier]], tables, position, tier)
                    self.labels_kept += len(labels)
                for label in labels:
                    self._extend(tables, label, position, tier, pending, cutoff)
        reached = math.inf
        for tier in range(tier_count):
            for _, extensions, index in pending[count][tier]:
                label = extensions.label(index)
                score = self.score(tables, label.iteration(tables.per_group), label.price)
                if score is None:
                    continue
                reached = min(reached, score[0])
                if better(score, self.best_score):
                    self.best_score, self.best = score, (label, tables)
        return reached

    def _extend(self, tables: ShardTables, label: Label, position: int, tier: int | None,
                pending: list[list[list[Pending]]], cutoff: float) -> None:
        """Every stage that can follow ``label``, kept when its bound makes the cutoff; all
        next stages at once, in numpy, since this is the inner loop. The bound: the sums so
        far plus the least Σ(f + b) + 2Σc of any completion, the maxima raised to their
        floors, and the price so far plus the least price of any completion."""
        nexts = tables.next_stages(position, tier)
        if not nexts.after:
            return
        comm = label.comm + nexts.comm if tier is not None else np.full(len(nexts.after), label.comm)
        extensions = Extensions(
            label, position, nexts,
            forward=label.forward + nexts.forward,
            backward=label.backward + nexts.backward,
            comm=comm,
            forward_lag=np.maximum(np.maximum(label.forward_lag, nexts.comm), nexts.forward),
            backward_lag=np.maximum(np.maximum(label.backward_lag, nexts.comm), nexts.backward),
            sync=np.maximum(label.sync, nexts.sync),
            price=label.price + nexts.price)
        fastest = (extensions.forward + extensions.backward + 2 * comm + nexts.rest_time
                   + (tables.per_group - 1) * (np.maximum(extensions.forward_lag, nexts.floor_forward)
                                               + np.maximum(extensions.backward_lag, nexts.floor_backward))
                   + np.maximum(extensions.sync, nexts.floor_sync))
        bound = self.primaries(tables, fastest * (1 - BOUND_SLACK),
                               (extensions.price + nexts.rest_price) * (1 - BOUND_SLACK))
        keep = np.flatnonzero(bound <= cutoff)
        for index, value in zip(keep.tolist(), bound[keep].tolist()):
            pending[nexts.after[index]][nexts.tier[index]].append((value, extensions, index))

    def primaries(self, tables: ShardTables, time_s: np.ndarray, price: np.ndarray) -> np.ndarray:
        """The goal's primary score (``Goal.score``'s formula, on arrays) of plans taking
        ``time_s`` at ``price`` per second of one worker group; inf where the SLO is missed."""
        dollars = time_s * tables.groups * price
        if self.goal.slo_s is not None:
            return np.where(time_s > self.goal.slo_s, np.inf, dollars)
        weights = self.goal.weights
        return weights.cost * (dollars / self.unit) + weights.time * time_s


def plan_of(label: Label, tables: ShardTables, solver: str = SOLVER) -> Plan:
    stages = []
    current: Label | None = label
    while current is not None and current.stage is not None:
        start, end, tier = current.stage
        stages.append(StagePlan(start, end, tables.memory_mb[tier], tables.groups))
        current = current.previous
    return Plan(tuple(reversed(stages)), tables.count, solver, micro_batches=tables.micro_batches)


def solve(problem: Problem, goal: Goal, space: SearchSpace | None = None) -> Plan | None:
    """The plan of ``space`` that best meets ``goal`` under Hydrozoa's model; None when no
    plan meets the SLO; PlanError when no plan fits memory for any (M, A)."""
    if problem.workload.mode != "train":
        raise PlanError("the Hydrozoa DP plans training; use the Gillis fork-join DP for inference")
    space = space or SearchSpace.of(problem)
    memory = StageMemory()
    all_tables = [ShardTables(with_micro_batches(problem, micro_batches), space.memory_mb, micro_batches, groups,
                              memory) for micro_batches, groups in space.configurations()]
    fitting = [tables for tables in all_tables if every_layer_fits(tables)]
    if not fitting:
        raise PlanError(unfit_message(problem, space))
    search = HybridSearch(problem, goal)
    promise = [search.run(tables, beam=BEAM_WIDTH) for tables in fitting]
    # the most promising (M, A) first, so that its optimum prunes the others
    for _, index in sorted(zip(promise, range(len(fitting)))):
        search.run(fitting[index], beam=None)
    if search.best is None:
        return None
    label, tables = search.best
    plan = plan_of(label, tables)
    evaluation = evaluate(problem, plan)
    require_fit(problem, plan, evaluation)
    return annotate(plan, evaluation, status="optimal", labels_kept=search.labels_kept)


def every_layer_fits(tables: ShardTables) -> bool:
    """Some plan fits iff every layer fits some tier on its own (one layer per stage),
    since a stage needs at least the memory of each of its layers."""
    return all(any(rows for rows in tables.stage[i]) for i in range(tables.count))


def unfit_message(problem: Problem, space: SearchSpace) -> str:
    """A layer that fits no tier on its own, at the (M, A) where it comes closest."""
    closest = None
    for micro_batches, groups in space.configurations():
        sub = with_micro_batches(problem, micro_batches)
        per_group = math.ceil(micro_batches / groups)
        for index in range(len(problem.chain)):
            need = min((stage_memory(sub, index, index, problem.platform.tier(memory),
                                     micro_batches_in_flight=per_group) for memory in space.memory_mb),
                       key=lambda need: need.total - need.limit)
            if need.fits:
                continue
            if closest is None or need.total - need.limit < closest[0].total - closest[0].limit:
                closest = (need, index, micro_batches, groups, per_group)
            break  # this (M, A) is blocked; look at the next
    assert closest is not None, "unfit_message is for problems where no plan fits"
    need, index, micro_batches, groups, per_group = closest
    return (f"no Hydrozoa plan fits: layer {index} ({problem.chain[index].name}) alone needs {mb(need.total)} "
            f"({need.describe()}) with M = {micro_batches} and A = {groups} ({per_group} micro-batches in flight "
            f"per worker group), more than the {mb(need.limit)} of the best tier in {list(space.memory_mb)} MB. "
            "Allow a larger tier (option memory_mb), more data parallelism (option replicas: fewer micro-batches "
            "per group), or a smaller batch")


# -- Hydrozoa's own planner, as a heuristic solver --------------------------------------------
#
# Hydrozoa plans in three nested steps, reproduced here:
#
# * §3.3 "Selecting Size and Number of Microbatches": micro-batch sizes in increasing powers
#   of two until they no longer fit GPU memory, then a binary search on the count. Our
#   workload fixes the global batch, so the size fixes the count (M = batch / size, a
#   divisor of the batch); the exponential phase walks the sizes 1, 2, 4, … that divide the
#   batch (M = batch, batch/2, …) until no strategy fits (sizes before the first that fits
#   are passed over), and the binary phase searches the divisors between the last count
#   that fit and the first that did not for the smallest (largest micro-batch) that fits.
# * §3.4, Alg. 1: for a cluster of c workers, every model-parallel degree B = 1..c with
#   data-parallel degree A = ⌊c/B⌋ ("maximizes the level of data-parallelism while not
#   exceeding the desired VMs"; here the largest allowed degree ≤ ⌊c/B⌋), keeping the
#   lowest modelled runtime. The paper takes c from the user; without ``cluster_size`` we
#   run Alg. 1 for c = 1, 2, 4, … and let the goal choose among the winners.
# * App. A.2: the partitioner. Hydrozoa has one VM type, so each tier is tried on its own
#   for every stage. For each of V×V bounds on t_k and r_1 (evenly spaced over their
#   possible ranges), a DP C(k, j) finds the cut of the first j layers into k shards with
#   the least communication Σc whose shards and cuts respect the bounds (and fit memory);
#   per shard count k it keeps the partition of least T^(M).

DEFAULT_BOUNDS = 8        # V, per lag


@dataclass(frozen=True)
class Strategy:
    """One A×B strategy Hydrozoa's planner considered, with its modelled figures."""

    plan: Plan
    cluster: int
    time_s: float
    dollars: float
    cost_units: float
    fits: bool

    def describe(self) -> dict[str, Any]:
        stages = self.plan.stages
        return {"cluster": self.cluster, "data_parallel": stages[0].replicas, "model_parallel": len(stages),
                "memory_mb": stages[0].memory_mb, "time_s": self.time_s, "dollars": self.dollars}


def partitions_by_shards(problem: Problem, memory: StageMemory, tier: Tier, per_group: int,
                         bounds: int) -> dict[int, list[tuple[int, int]]]:
    """Hydrozoa's partitioner (App. A.2) on one tier: for each shard count k, the cut of
    least T^(M) among the least-communication cuts under each of ``bounds``² (t_k, r_1)
    bounds. Shards must fit memory with ``per_group`` micro-batches in flight."""
    count = len(problem.chain)
    micro = problem.workload.micro_batch_size
    times = [problem.layer_seconds(i, tier, micro) for i in range(count)]
    forward = np.array([f for f, _ in times])
    backward = np.array([b for _, b in times])
    comm = np.array([problem.boundary_bytes(j, micro) / tier.bandwidth_bytes_s for j in range(count - 1)])
    prefix_f = np.concatenate([[0.0], np.cumsum(forward)])
    prefix_b = np.concatenate([[0.0], np.cumsum(backward)])
    # shard[u, j]: layers u..j as one shard (u <= j); its f and b, and whether it fits
    shard_f = prefix_f[None, 1:] - prefix_f[:-1, None]
    shard_b = prefix_b[None, 1:] - prefix_b[:-1, None]
    ordered = np.triu(np.ones((count, count), dtype=bool))
    fits = np.zeros((count, count), dtype=bool)
    for u in range(count):
        for j in range(u, count):
            if not memory.need(problem, u, j, tier, micro_batches_in_flight=per_group).fits:
                break  # a longer shard needs at least as much
            fits[u, j] = True
    # the cut into a shard starting at u > 0 is the one after layer u − 1
    into = np.concatenate([[0.0], comm])
    largest_comm = float(comm.max()) if len(comm) else 0.0
    forward_bounds = np.linspace(float(forward.min()), max(float(forward.sum()), largest_comm), bounds)
    backward_bounds = np.linspace(float(backward.min()), max(float(backward.sum()), largest_comm), bounds)
    lines = (prefix_f.tolist(), prefix_b.tolist(), into.tolist())
    best: dict[int, tuple[float, list[tuple[int, int]]]] = {}
    seen: set[tuple[tuple[int, int], ...]] = set()
    masks: set[bytes] = set()
    for bound_f in forward_bounds:
        for bound_b in backward_bounds:
            allowed = ordered & fits & (shard_f <= bound_f) & (shard_b <= bound_b)
            allowed[1:] &= (into[1:] <= min(bound_f, bound_b))[:, None]
            if allowed.tobytes() in masks:
                continue  # neighbouring bounds often allow the same shards
            masks.add(allowed.tobytes())
            for shards, ranges in _least_comm_cuts(allowed, into).items():
                if tuple(ranges) in seen:
                    continue  # several bounds often give the same cut
                seen.add(tuple(ranges))
                model_parallel = _model_parallel(ranges, *lines, per_group)
                if shards not in best or model_parallel < best[shards][0]:
                    best[shards] = (model_parallel, ranges)
    return {shards: ranges for shards, (_, ranges) in best.items()}


def _least_comm_cuts(allowed: np.ndarray, into: np.ndarray) -> dict[int, list[tuple[int, int]]]:
    """C(k, j) = min_u C(k − 1, u − 1) + c_u over allowed shards u..j (App. A.2), for every
    k; the cut of all layers into k shards, when one exists."""
    count = allowed.shape[0]
    cost = np.where(allowed[0], 0.0, np.inf)   # C(1, j)
    choices: list[list[int]] = [[0] * count]
    found: dict[int, list[tuple[int, int]]] = {}
    for shards in range(1, count + 1):
        if shards > 1:
            previous = np.concatenate([[np.inf], cost[:-1]])   # C(k − 1, u − 1) for u = 0..n−1
            candidates = np.where(allowed, (previous + into)[:, None], np.inf)
            choice = candidates.argmin(axis=0)
            cost = candidates[choice, np.arange(count)]
            choices.append(choice.tolist())
        if np.isinf(cost).all():
            break
        if np.isfinite(cost[-1]):
            found[shards] = _trace_back(choices, count - 1)
    return found


def _trace_back(choices: list[list[int]], end: int) -> list[tuple[int, int]]:
    ranges = []
    for choice in reversed(choices):
        start = choice[end]
        ranges.append((start, end))
        end = start - 1
    return list(reversed(ranges))


def _model_parallel(ranges: list[tuple[int, int]], prefix_f: list[float], prefix_b: list[float], into: list[float],
                    per_group: int) -> float:
    """T^(M) of a cut on one tier (App. A.1), for ranking the partitioner's candidates."""
    shard_f = [prefix_f[end + 1] - prefix_f[start] for start, end in ranges]
    shard_b = [prefix_b[end + 1] - prefix_b[start] for start, end in ranges]
    comm = [0.0] + [into[start] for start, _ in ranges[1:]]
    return model_parallel_seconds(shard_f, shard_b, comm, per_group)[0]


@dataclass(frozen=True)
class Hydrozoa(CostSolver):
    """Hydrozoa's planner (Hydrozoa §3.3, §3.4 Alg. 1, App. A.2): a
    heuristic, not exact — one tier for all stages, V×V lag bounds, and the micro-batch
    search of §3.3 (see the comment above for each step and how it is adapted). ``solve``
    returns the best strategy it considered under the goal, with the search in
    ``predictions["search"]``.

    ``bounds`` is V. Options read: ``cluster_size`` (Alg. 1's desired workers; default
    1, 2, 4, … up to the largest degree times the layers), ``micro_batches`` (only these
    counts are tried, in the exponential phase), ``memory_mb`` and ``replicas`` (as for
    every solver).
    """

    name: ClassVar[str] = "hydrozoa"
    bounds: int = DEFAULT_BOUNDS

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        if problem.workload.mode != "train":
            raise PlanError("Hydrozoa's planner plans training; use the Gillis fork-join DP for inference")
        if self.bounds < 1:
            raise PlanError(f"Hydrozoa's partitioner needs at least 1 bound per lag, got bounds={self.bounds}")
        space = SearchSpace.of(problem)
        planner = _Planner(problem, goal, space, self.bounds)
        planner.search_micro_batches()
        if not planner.fitted:
            raise PlanError(_planner_unfit_message(problem, space, planner))
        if planner.best is None:
            return None
        best = planner.best
        return annotate(best.plan, evaluate(problem, best.plan), status="heuristic",
                        strategy=f"{best.plan.stages[0].replicas}x{len(best.plan.stages)}", search=planner.trace)


class _Planner:
    """The state of one run of Hydrozoa's planner: caches, the trace and the best so far."""

    def __init__(self, problem: Problem, goal: Goal, space: SearchSpace, bounds: int):
        self.problem = problem
        self.goal = goal
        self.space = space
        self.bounds = bounds
        self.memory = StageMemory()
        self.trace: list[dict[str, Any]] = []
        self.best: Strategy | None = None
        self.best_score: tuple[float, float] | None = None
        self.fitted = False
        self.probed: set[int] = set()
        # the replica degrees asked for, up to the most micro-batches any probe may use
        most = self.space.micro_batches if problem.options.micro_batches is not None else (problem.workload.batch,)
        self.degrees = SearchSpace.of(with_micro_batches(problem, max(most))).replicas
        # keyed by (the workload's micro_batches, None when unset; memory_mb; per_group)
        self.partitions: dict[tuple[int | None, int, int], dict[int, list[tuple[int, int]]]] = {}
        self.evaluations: dict[Plan, Evaluation] = {}

    def search_micro_batches(self) -> None:
        """§3.3: sizes in increasing powers of two until nothing fits, then a binary search
        on the count between the last fitting and the first failing size. Counts divide the
        batch (a micro-batch holds whole samples)."""
        batch = self.problem.workload.batch
        if self.problem.options.micro_batches is not None:
            counts = sorted(self.space.micro_batches, reverse=True)
        else:
            counts = [batch // 2 ** k for k in range(batch.bit_length()) if batch % 2 ** k == 0]
        last_fit = None
        for count in counts:
            if self.probe(count, "size"):
                last_fit = count
            elif last_fit is not None:
                if self.problem.options.micro_batches is None:
                    self._binary_search(count, last_fit)
                return

    def _binary_search(self, failing: int, fitting: int) -> None:
        """The fewest micro-batches (largest micro-batch) between ``failing`` and
        ``fitting`` that fit, among the counts that divide the batch."""
        between = [count for count in divisors_up_to(self.problem.workload.batch, fitting) if count > failing]
        low, high = 0, len(between) - 1   # between[high] = fitting fits
        while low < high:
            middle = (low + high) // 2
            if self.probe(between[middle], "count"):
                high = middle
            else:
                low = middle + 1

    def probe(self, micro_batches: int, phase: str) -> bool:
        """Alg. 1 on every tier and cluster size at M = ``micro_batches``; True when some
        strategy fits memory."""
        if micro_batches in self.probed:
            return any(entry["fits"] for entry in self.trace if entry["micro_batches"] == micro_batches)
        self.probed.add(micro_batches)
        sub = with_micro_batches(self.problem, micro_batches)
        degrees = tuple(d for d in self.degrees if d <= micro_batches)
        winners = [winner for winner in (self._select(sub, micro_batches, degrees, memory_mb, cluster)
                                         for memory_mb in self.space.memory_mb
                                         for cluster in self._cluster_sizes(degrees))
                   if winner is not None]
        fitting = [winner for winner in winners if winner.fits]
        self.fitted = self.fitted or bool(fitting)
        chosen = None
        for winner in fitting:
            score = self.goal.score(winner.time_s, winner.cost_units, winner.dollars)
            if score is not None and better(score, self.best_score):
                self.best_score, self.best = score, winner
            if score is not None and (chosen is None or better(score, chosen[0])):
                chosen = (score, winner)
        self.trace.append({"phase": phase, "micro_batches": micro_batches,
                           "micro_batch_size": self.problem.workload.batch / micro_batches,
                           "fits": bool(fitting), "chosen": chosen[1].describe() if chosen else None,
                           "alg1": _distinct([winner.describe() for winner in fitting])})
        return bool(fitting)

    def _cluster_sizes(self, degrees: tuple[int, ...]) -> list[int]:
        given = self.problem.options.cluster_size
        if given is not None:
            if not isinstance(given, int) or isinstance(given, bool) or given < 1:
                raise PlanError(f"option cluster_size (Alg. 1's desired workers) must be a positive integer, "
                                f"got {given!r}")
            return [given]
        largest = max(degrees, default=1) * len(self.problem.chain)
        return [2 ** k for k in range(largest.bit_length()) if 2 ** k <= largest]

    def _select(self, sub: Problem, micro_batches: int, degrees: tuple[int, ...], memory_mb: int,
                cluster: int) -> Strategy | None:
        """Alg. 1: the A×B strategy of least modelled time with A·B ≤ ``cluster``."""
        best: Strategy | None = None
        for shards in range(1, min(cluster, len(sub.chain)) + 1):
            allowed = [d for d in degrees if d <= cluster // shards]
            if not allowed:
                continue
            groups = max(allowed)
            ranges = self._partitions(sub, memory_mb, math.ceil(micro_batches / groups)).get(shards)
            if ranges is None:
                continue
            strategy = self._strategy(ranges, memory_mb, groups, micro_batches, cluster)
            if strategy.fits and (best is None or strategy.time_s < best.time_s):
                best = strategy
        return best

    def _partitions(self, sub: Problem, memory_mb: int, per_group: int) -> dict[int, list[tuple[int, int]]]:
        key = (sub.workload.micro_batches, memory_mb, per_group)
        if key not in self.partitions:
            tier = sub.platform.tier(memory_mb)
            self.partitions[key] = partitions_by_shards(sub, self.memory, tier, per_group, self.bounds)
        return self.partitions[key]

    def _evaluation(self, plan: Plan) -> Evaluation:
        if plan not in self.evaluations:
            self.evaluations[plan] = evaluate(self.problem, plan)
        return self.evaluations[plan]

    def _strategy(self, ranges: list[tuple[int, int]], memory_mb: int, groups: int, micro_batches: int,
                  cluster: int) -> Strategy:
        stages = tuple(StagePlan(start, end, memory_mb, groups) for start, end in ranges)
        plan = Plan(stages, len(self.problem.chain), Hydrozoa.name, micro_batches=micro_batches)
        evaluation = self._evaluation(plan)
        return Strategy(plan, cluster, evaluation.time_s, evaluation.dollars, evaluation.cost_units, evaluation.fits)


def _distinct(strategies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per strategy (A, B, tier), at the smallest cluster size that chose it."""
    seen: dict[tuple[int, int, int], dict[str, Any]] = {}
    for strategy in sorted(strategies, key=lambda entry: entry["cluster"]):
        seen.setdefault((strategy["data_parallel"], strategy["model_parallel"], strategy["memory_mb"]), strategy)
    return list(seen.values())


def _planner_unfit_message(problem: Problem, space: SearchSpace, planner: _Planner) -> str:
    tried = sorted(planner.probed, reverse=True)
    return (f"Hydrozoa's planner found no strategy that fits memory: it tried M = {tried} on tiers "
            f"{list(space.memory_mb)} MB with one tier for every shard. Allow a larger tier (option memory_mb), "
            "more data parallelism (option replicas), or use solver='dp', which also mixes tiers")
