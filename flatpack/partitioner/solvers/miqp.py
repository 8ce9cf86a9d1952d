"""miqp: FuncPipe's co-optimization of partition and resources as one mixed-integer program
(FuncPipe §3.4.1 eq. 3–7, App. B cost terms, App. C
linearization), solved with OR-Tools' CP-SAT.

What is modelled
----------------
Exactly :func:`flatpack.partitioner.cost.funcpipe.iteration` over exactly the space brute
force searches (:class:`~flatpack.partitioner.space.SearchSpace`): one data-parallel degree d
for all stages, a tier per stage, M from the allowed set.

* (M, d) is enumerated outside the solver: with it fixed, µ = ⌈M/d⌉, the (γ, δ) of the
  scatter-reduce and the sync buffers of eq. 3b are constants, so eq. 3b becomes a fixed
  property of each candidate stage and the (µ − 1)·Δ products of App. C eq. 19 become
  constant multiples. Where the platform caps its aggregate storage bandwidth, every
  worker's bandwidth is min(tier, cap/(d·S)), so the stage count S is enumerated too — in
  groups of S that give the same bandwidths (all S below the point where the cap binds are
  one group).
* Instead of FuncPipe's per-layer variables x_i, z_ij and the hat sums of eq. 4 (App. C
  items 1–2 need products of up to L binaries), a plan is a path of "arcs": one boolean per
  (first layer, last layer, tier) that fits memory (eq. 3b checked with
  ``common.stage_memory`` beforehand, so the memory constraint is exact and costs nothing).
  Every stage quantity of App. B is then a constant of its arc: compute (with the
  overlap slowdown β), the uploads and downloads at each side (a boundary's upload uses the
  left stage's bandwidth, its download the right one's), the scatter-reduce t_s (eq. 12).
* Symmetry breaking on tiers: an arc that another arc of the same stage beats in price and
  in every time term is left out (:func:`undominated_arcs`); no plan loses by the swap, and
  a warm start on a left-out arc maps onto its stand-in (``Subproblem.stand_ins``).
* The maxima of eq. 9 and eq. 11 are modelled as lower bounds only (Δ_f ≥ each candidate,
  Λ_i ≥ Λ_{i+1}, …): every objective here grows with them, so at an optimum each equals its
  max and App. C's big-M technique 3 is not needed. t_iter = t_f + max_s(t_b + t_s) (eq. 7)
  is one variable Z above one row per layer k for the stage covering k (G_{k+1}, the
  backward work of the stages after it, is the same whichever layer of the stage k is).
  Rows indexed by covered layer, not by first layer, because Σ x over the arcs covering k
  is 1 even in the LP relaxation: indexed by first layer, fractional stage starts diluted
  them and CP-SAT's bound at L = 32 stalled at a 3–4 % gap; indexed by layer it closes.
* The objective α₁·cost + α₂·time = (α₁·d/p)·t_iter·(Σ price + κ) with κ = α₂·p/(α₁·d)
  (p: dollars per MB-second, ``objective.dollars_per_mb_s``) is one product of two integer
  variables, t_iter and Q = Σ price + κ — the bilinear term of eq. 6, kept as a product
  (``add_multiplication_equality``), plus the linear cut t_iter·Q ≥ κ·t_iter +
  Σ_a price_a·(least t_iter of a plan through a)·x_a. Time-only weights minimize t_iter; an
  SLO goal minimizes d·t_iter·Σ price subject to t_iter ≤ SLO.

Integer scaling, and why it is safe
-----------------------------------
CP-SAT needs integers. Every time constant is rounded *up* to a tick τ and every price up to
a unit π, so the model's value of every plan is at least its true value and at most
(1 + tolerance) times it; the tolerance is computed per solve from the number of rounded
terms (t_iter sums at most 2·S + 2·(µ − 1) rounded constants, Q at most S + 1) and the least
t_iter and Q any plan can have, and reported as ``predictions["scaling_tolerance"]``. A plan
the model proves optimal is therefore within that tolerance of the true optimum, and the
plan returned is judged by the cost model itself (its predictions are ``evaluate``'s). An
SLO is imposed on the rounded-up time, so a returned plan never misses it; a plan whose time
is within the tolerance below the SLO can be missed (the warm start still offers it).

The integers stay below 2^``scale_bits`` = 2^40 (t_iter·Q; the bits are split between the
two so that both roundings cost about the same). Measured on 257–340 random small problems
with brute force as the truth (weights and SLO goals): every answer right at 2^36 and 2^40,
but CP-SAT 9.15 with presolve answered INFEASIBLE, or OPTIMAL at a worse plan, for 16–24 of
them at 2^44–2^52 (6 of 314 at 2^60 with presolve off) — the kind of presolve error reported
upstream (google/or-tools#5274). At 2^40 the guaranteed tolerance was 2e-5 median, 5e-4
worst, and the observed error 0. As a guard, an "infeasible" verdict on the subproblem that
holds the warm start, which satisfies every constraint, is not believed.

Warm start, bounds and the time limit
-------------------------------------
With ``hint="dp"`` (the default) the exact DP's plan comes first. It becomes a complete
solution hint (``add_hint`` on every variable) of its subproblem and the incumbent of all:
the objective is bounded by it, t_iter and Q get the domains any better plan must have, and
an arc is dropped before the model is built when the fastest plan through it cannot beat it.
Subproblems are solved the hint's first, then best-first by a cheap lower bound; each gets
an even share of what is left of ``time_limit_s``, and a second pass gives the time the
proven ones left over to those still open. A solve that runs out returns its best plan with
status "feasible" and the gap to the least lower bound of the open subproblems; with no plan
at all it raises PlanError saying what to change.

Backend: CP-SAT, chosen by measurement
--------------------------------------
``benchmarks/miqp_backends.py`` gives one (M, d) subproblem of random chains on 8
Lambda-like tiers (weights (1, 2¹⁹), batch 16, M = 4) to CP-SAT on this model and to SCIP,
CBC and HiGHS (pywraplp) on the same arc model in floating point, with the product
linearized per arc (App. C technique 2: w_a ≥ t_iter − T_ub·(1 − x_a), so that
t_iter·Q = κ·t_iter + Σ_a price_a·w_a) and the same valid inequalities; 2 threads. Seconds to
a proven optimum (every backend reached it; the 2-core machine was shared, load 3–5, so read
±50 %):

    warm: the exact plan as hint, its value as bound   CP-SAT     CBC        HiGHS*     SCIP
    L = 8,  d = 4 (µ = 1), two seeds                   0.01/0.04  0.04/0.11  0.01/0.02  0.06/0.09
    L = 16, d = 4, two seeds                           0.07/0.44  0.37/1.9   0.22/1.1   2.3/7.2
    L = 32, d = 4, two seeds                           8.3/12.1   12.1/7.5   14.5/21.4  60/52
    L = 16, d = 1 (µ = 4: the lag terms count)         3.4        12.0       28.7       92
    L = 16, d = 2 (µ = 2)                              5.3        4.7        10.6       39
    cold: no hint, no bound
    L = 16 / L = 32, d = 4                             0.9/11.5   0.9/8.5    2.2/17.5
    L = 16, d = 1 / d = 2                              39/6.6     29/5.6     13/8.6     50/28
    * unhinted: pywraplp's HiGHS wrapper segfaults on SetHint (ortools 9.15)

With the warm start miqp runs with by default, CP-SAT proved optimality first on 5 of the 8
instances (one tie) and within 2× of the best on the others (HiGHS 0.02 s against 0.04 s;
CBC 1.6× and 1.1× faster at L = 32 and d = 2), and 3.5× faster than CBC where the lag
maxima matter (d = 1). Cold, the floating-point MIPs did as well or better (HiGHS 3×
faster at d = 1), which is one more reason the DP warm start is the default. CBC is the
runner-up, and the one to switch to if the integer limit above ever costs too much
precision. CP-SAT and CBC ship inside the ortools wheel with no licence (FuncPipe's Gurobi
needs a token server, §4).

The whole solver on the same instances (d ∈ {1, 2, 4}, M = 4: three subproblems), 120 s,
seconds to proven optimality, two seeds (``--whole``):

    L = 8:  0.8/0.3 with the DP warm start (0.04–0.06 s of it the DP); 7.1/3.1 cold
    L = 16: 1.0/1.7 warm; 48/48 cold
    L = 32: 31/50 warm; cold not proven in 120 s (plans 4 % and 10 % above the optimum,
            reported gaps 13 % and 27 %)
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Sequence

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost.collectives import scatter_reduce_seconds
from flatpack.partitioner.cost.common import gradient_bytes, micro_batches_per_replica, stage_memory
from flatpack.units import mb
from flatpack.partitioner.cost.registry import FuncPipeModel
from flatpack.partitioner.objective import annotate, cost_model_for, dollars_per_mb_s, evaluate, with_micro_batches
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.solvers.base import CostSolver, Goal, better
from flatpack.partitioner.space import SearchSpace

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

BACKEND = "cp-sat"
DEFAULT_SCALE_BITS = 40   # t_iter·Q < 2^40; see "Integer scaling" for why not more
MIN_BITS = 8
MIN_RERUN_S = 0.5          # less time left than this is not worth another CP-SAT start
FLOAT_SLACK = 1e-9         # relative slack on float bounds, so that float noise never prunes a tie


# -- the constants of one candidate stage ---------------------------------------------------

@dataclass(frozen=True)
class Arc:
    """A candidate stage: layers ``start..end`` on ``memory_mb``, with App. B's terms as
    seconds under one subproblem's (M, d, bandwidths). ``in`` is the download of its input
    and upload of the gradient going back (the boundary below it, at this stage's bandwidth),
    ``out`` the upload of its output and download of the gradient coming back (the boundary
    above it); the first stage has no ``in``, the last no ``out``."""

    start: int
    end: int
    memory_mb: int
    price_per_s: float
    forward_path_s: float    # t̂_fc + out + in: its share of t_f^0 (eq. 8)
    forward_lag_s: float     # max(t̂_fc, out, in): its candidates for Δ_f (eq. 9)
    backward_path_s: float   # t̂_bc + out + in: its share of t_b of every stage below it (eq. 11)
    backward_own_s: float    # t̂_bc + out + t_s: its own t_b + t_s, lag aside (eq. 7, 11, 12)
    lag_own_s: float         # max(t̂_bc, out): its own candidates for Δ_b
    lag_s: float             # max(t̂_bc, out, in): its candidates for Δ_b of the stages below


@dataclass(frozen=True)
class Subproblem:
    """One (M, d) and a range of stage counts that give the same bandwidths; its arcs are
    the stages that fit memory (eq. 3b) under µ = ⌈M/d⌉."""

    micro_batches: int
    replicas: int
    per_replica: int                     # µ
    min_stages: int
    max_stages: int
    bandwidth: tuple[tuple[int, float], ...]   # (memory_mb, bytes/s) after the account-wide cap
    arcs: tuple[Arc, ...]
    num_layers: int
    # (start, end, memory_mb) of an arc left out because another arc of the same stage is no
    # worse in any term (:func:`undominated_arcs`) -> that arc's; a plan through the first
    # maps onto the second (a warm start from a plan on a dominated tier keeps its value)
    stand_ins: tuple[tuple[tuple[int, int, int], tuple[int, int, int]], ...] = ()

    def label(self) -> str:
        stages = (f"S={self.min_stages}" if self.min_stages == self.max_stages
                  else f"S={self.min_stages}..{self.max_stages}")
        return f"M={self.micro_batches}, d={self.replicas}, {stages}"

    def contains(self, plan: Plan, micro_batches: int) -> bool:
        return (micro_batches == self.micro_batches and plan.stages[0].replicas == self.replicas
                and self.min_stages <= len(plan.stages) <= self.max_stages)

    def path_of(self, plan: Plan) -> list[Arc] | None:
        """The plan's stages as this subproblem's arcs, a stage whose arc was left out as
        its stand-in (no worse in any term); None when one is not among them."""
        index = {(arc.start, arc.end, arc.memory_mb): arc for arc in self.arcs}
        stand_ins = dict(self.stand_ins)
        path: list[Arc] = []
        for stage in plan.stages:
            if stage.memory_mb is None:
                return None  # a stage without a tier is no arc
            key = (stage.start, stage.end, stage.memory_mb)
            arc = index.get(key)
            if arc is None and key in stand_ins:
                arc = index.get(stand_ins[key])
            if arc is None:
                return None
            path.append(arc)
        return path

    def with_arcs(self, arcs: Iterable[Arc]) -> Subproblem:
        return dataclasses.replace(self, arcs=tuple(arcs))


@dataclass(frozen=True)
class _StageTable:
    """What of a candidate stage does not depend on bandwidth."""

    forward_s: float
    backward_s: float
    gradient_bytes: int
    fits: bool


def subproblems(problem: Problem, space: SearchSpace | None = None, symmetry_breaking: bool = True) -> list[Subproblem]:
    """Every (M, d) of the space, split by stage counts where the bandwidth cap makes the
    bandwidths depend on S; arcs are the stages that fit memory, less those another arc of
    the same stage beats (:func:`undominated_arcs`) unless ``symmetry_breaking`` is False."""
    space = space or SearchSpace.of(problem)
    platform = problem.platform
    tiers = [platform.tier(memory) for memory in space.memory_mb]
    count = len(problem.chain)
    result = []
    for micro_batches, replicas in space.configurations():
        scoped = with_micro_batches(problem, micro_batches)
        per_replica = micro_batches_per_replica(scoped, replicas)
        table = _stage_table(scoped, tiers, replicas, per_replica)
        for low, high, bandwidth in _bandwidth_groups(platform.aggregate_bandwidth_bytes_s, tiers, replicas, count):
            arcs, stand_ins = _arcs(scoped, tiers, table, replicas, bandwidth), ()
            if symmetry_breaking:
                arcs, stand_ins = undominated_arcs(arcs)
            result.append(Subproblem(micro_batches, replicas, per_replica, low, high,
                                     tuple((tier.memory_mb, bandwidth[tier.memory_mb]) for tier in tiers),
                                     tuple(arcs), count, stand_ins))
    return result


_ARC_TERMS = ("price_per_s", "forward_path_s", "forward_lag_s", "backward_path_s", "backward_own_s", "lag_own_s",
              "lag_s")


def undominated_arcs(arcs: Sequence[Arc]) -> tuple[list[Arc], tuple]:
    """The arcs no other arc of the same stage (start, end) beats, and for each one left out
    the key of a kept arc that beats it (``Subproblem.stand_ins``).

    Symmetry breaking on tiers: t_iter is a sum of maxima of arc terms with non-negative
    coefficients and Σ price a sum, so swapping a stage's arc for one no worse in every term
    (``_ARC_TERMS``) leaves no plan worse under any weights or SLO; of arcs equal in every
    term (tiers past Lambda's compute and bandwidth plateaus at one price are not, but
    recomputed twins are) the first is kept. dp prunes its stage options by the same rule
    (``funcpipe_dp._undominated_tiers``)."""
    groups: dict[tuple[int, int], list[Arc]] = {}
    for arc in arcs:
        groups.setdefault((arc.start, arc.end), []).append(arc)
    kept: list[Arc] = []
    stand_ins = []
    for group in groups.values():
        terms = [tuple(getattr(arc, name) for name in _ARC_TERMS) for arc in group]

        def beats(better: int, worse: int) -> bool:
            no_worse = all(b <= w for b, w in zip(terms[better], terms[worse]))
            return no_worse and (terms[better] != terms[worse] or better < worse)

        survivors = [i for i in range(len(group)) if not any(beats(j, i) for j in range(len(group)) if j != i)]
        kept += [group[i] for i in survivors]
        for i in range(len(group)):
            if i not in survivors:
                winner = group[next(j for j in survivors if beats(j, i))]
                stand_ins.append(((group[i].start, group[i].end, group[i].memory_mb),
                                  (winner.start, winner.end, winner.memory_mb)))
    return kept, tuple(stand_ins)


def _bandwidth_groups(cap: float | None, tiers: Sequence[Tier], replicas: int,
                      count: int) -> list[tuple[int, int, dict[int, float]]]:
    """(S_low, S_high, bandwidth by tier) with the same bandwidths for every S in the range —
    computed as ``funcpipe._bandwidths`` does, so that the floats are identical."""
    groups: list[tuple[int, int, dict[int, float]]] = []
    for stages in range(1, count + 1):
        if cap is None:
            bandwidth = {tier.memory_mb: tier.bandwidth_bytes_s for tier in tiers}
        else:
            share = cap / (replicas * stages)
            bandwidth = {tier.memory_mb: min(tier.bandwidth_bytes_s, share) for tier in tiers}
        if groups and groups[-1][2] == bandwidth:
            groups[-1] = (groups[-1][0], stages, bandwidth)
        else:
            groups.append((stages, stages, bandwidth))
    return groups


def _stage_table(problem: Problem, tiers: Sequence[Tier], replicas: int,
                 per_replica: int) -> dict[tuple[int, int, int], _StageTable]:
    """Compute, gradients and memory fit of every (start, end, tier), summed in the order
    ``common.layer_times`` sums them so that the floats equal the cost model's."""
    micro = problem.workload.micro_batch_size
    copies = 2 if replicas > 1 else 0
    count = len(problem.chain)
    table = {}
    for tier in tiers:
        seconds = [problem.layer_seconds(index, tier, micro) for index in range(count)]
        for start in range(count):
            forward = backward = 0.0
            for end in range(start, count):
                forward += seconds[end][0]
                backward += seconds[end][1]
                need = stage_memory(problem, start, end, tier, micro_batches_in_flight=per_replica,
                                    sync_buffer_copies=copies)
                table[start, end, tier.memory_mb] = _StageTable(forward, backward,
                                                                gradient_bytes(problem, start, end), need.fits)
    return table


def _arcs(problem: Problem, tiers: Sequence[Tier], table: dict[tuple[int, int, int], _StageTable],
          replicas: int, bandwidth: dict[int, float]) -> list[Arc]:
    platform = problem.platform
    micro = problem.workload.micro_batch_size
    latency, slowdown, method = platform.storage_latency_s, platform.overlap_slowdown, problem.workload.sync
    count = len(problem.chain)
    boundary = [problem.boundary_bytes(index, micro) for index in range(count - 1)]
    arcs = []
    for (start, end, memory), stage in table.items():
        if not stage.fits:
            continue
        tier = next(tier for tier in tiers if tier.memory_mb == memory)
        width = bandwidth[memory]
        forward, backward = slowdown * stage.forward_s, slowdown * stage.backward_s
        inward = boundary[start - 1] / width + latency if start > 0 else 0.0
        outward = boundary[end] / width + latency if end < count - 1 else 0.0
        sync = scatter_reduce_seconds(stage.gradient_bytes, replicas, width, latency, method)
        arcs.append(Arc(
            start=start, end=end, memory_mb=memory, price_per_s=tier.price_per_s,
            forward_path_s=forward + outward + inward, forward_lag_s=max(forward, outward, inward),
            backward_path_s=backward + outward + inward, backward_own_s=backward + outward + sync,
            lag_own_s=max(backward, outward), lag_s=max(backward, outward, inward),
        ))
    return arcs


# -- the model evaluated on one path (floats for checks, ticks for hints) -------------------

@dataclass(frozen=True)
class PathValues:
    """The model's variables for one plan: t_iter = Σ forward_path + (µ−1)·Δ_f + Z."""

    forward_lag: float | int
    suffix_lag: tuple          # Λ_i, i = 0..L (Λ_L = 0): the largest lag_s of stages starting at ≥ i
    stage_lag: tuple           # Δ_b of the stage covering layer k: max(Λ_{k+1}, its lag_own)
    suffix_path: tuple         # G_i, i = 0..L: Σ backward_path of stages starting at ≥ i
    done: float | int          # Z = max over stages of t_b + t_s
    time: float | int          # t_iter
    price: float | int         # Σ price


def path_values(path: Sequence[Arc], per_replica: int, convert=lambda seconds: seconds) -> PathValues:
    """The model's values for the plan ``path`` with every constant passed through
    ``convert`` (identity: seconds, the cost model's numbers; rounding up to ticks: the values
    CP-SAT sees, used for the warm start)."""
    count = path[-1].end + 1
    by_start = {arc.start: arc for arc in path}
    suffix_lag = [0] * (count + 1)
    suffix_path = [0] * (count + 1)
    for i in range(count - 1, -1, -1):
        arc = by_start.get(i)
        suffix_lag[i] = max(suffix_lag[i + 1], convert(arc.lag_s)) if arc else suffix_lag[i + 1]
        suffix_path[i] = suffix_path[i + 1] + (convert(arc.backward_path_s) if arc else 0)
    covering = [next(arc for arc in path if arc.start <= k <= arc.end) for k in range(count)]
    stage_lag = [max(suffix_lag[k + 1], convert(covering[k].lag_own_s)) for k in range(count)]
    lags = per_replica - 1
    done = max(suffix_path[k + 1] + convert(covering[k].backward_own_s) + lags * stage_lag[k] for k in range(count))
    forward_lag = max(convert(arc.forward_lag_s) for arc in path)
    total = sum(convert(arc.forward_path_s) for arc in path) + lags * forward_lag + done
    return PathValues(forward_lag, tuple(suffix_lag), tuple(stage_lag), tuple(suffix_path), done, total,
                      sum(arc.price_per_s for arc in path))


def _shortest(arcs: Sequence[Arc], count: int, weight, longest: bool = False) -> tuple[list[float], list[float]]:
    """(from the first layer to each position, from each position to the end) of the
    shortest (or longest) path under ``weight``; inf where none."""
    sign = -1.0 if longest else 1.0
    before = [math.inf] * (count + 1)
    after = [math.inf] * (count + 1)
    before[0] = after[count] = 0.0
    by_start: dict[int, list[Arc]] = {}
    for arc in arcs:
        by_start.setdefault(arc.start, []).append(arc)
    for i in range(count):
        if before[i] == math.inf:
            continue
        for arc in by_start.get(i, ()):
            before[arc.end + 1] = min(before[arc.end + 1], before[i] + sign * weight(arc))
    for i in range(count - 1, -1, -1):
        for arc in by_start.get(i, ()):
            if after[arc.end + 1] < math.inf:
                after[i] = min(after[i], after[arc.end + 1] + sign * weight(arc))
    if longest:
        before = [-value if value < math.inf else math.inf for value in before]
        after = [-value if value < math.inf else math.inf for value in after]
    return before, after


def time_floors(arcs: Sequence[Arc], count: int) -> list[float]:
    """For each arc, a lower bound on t_iter of any plan that uses it: the cheapest path
    through it under :func:`_time_floor_weight`."""
    before, after = _shortest(arcs, count, _time_floor_weight)
    return [before[arc.start] + _time_floor_weight(arc) + after[arc.end + 1] for arc in arcs]


def _time_floor_weight(arc: Arc) -> float:
    """A lower bound on what an arc adds to t_iter: its forward share, and its backward share
    to the first stage's t_b (+ its own t_s when it is the first stage)."""
    return arc.forward_path_s + (arc.backward_own_s if arc.start == 0 else arc.backward_path_s)


# -- objective ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Objective:
    """The true objective of a plan of one subproblem: ``factor``·t_iter·(Σ price + ``offset``),
    or ``factor``·t_iter when ``product`` is False (time-only weights)."""

    factor: float
    offset: float
    product: bool
    slo_s: float | None

    @classmethod
    def of(cls, goal: Goal, replicas: int, unit: float) -> _Objective:
        if goal.slo_s is not None:
            return cls(float(replicas), 0.0, True, goal.slo_s)
        weights = goal.weights
        if weights.cost == 0:
            return cls(weights.time, 0.0, False, None)
        factor = weights.cost * replicas / unit
        return cls(factor, weights.time * unit / (weights.cost * replicas), True, None)

    def value(self, time_s: float, price: float) -> float:
        return self.factor * time_s * (price + self.offset) if self.product else self.factor * time_s


@dataclass(frozen=True)
class _Scaling:
    tick_s: float
    price_unit: float
    offset_units: int
    time_cap: int          # largest t_iter in ticks the model allows
    tolerance: float       # model value ≤ (1 + tolerance)·true value, for every plan

    def ticks(self, seconds: float) -> int:
        return math.ceil(seconds / self.tick_s)

    def units(self, price: float) -> int:
        return math.ceil(price / self.price_unit)


@dataclass
class _Outcome:
    """What solving one subproblem gave."""

    subproblem: Subproblem
    status: str                      # optimal | infeasible | feasible | unknown | pruned
    plan: Plan | None = None
    objective_model: int | None = None
    bound_model: float | None = None
    lower_bound: float = 0.0         # on the true objective of this subproblem's plans
    seconds: float = 0.0
    arcs: int = 0
    tolerance: float = 0.0           # the scaling's relative tolerance

    @property
    def proven(self) -> bool:
        return self.status in ("optimal", "infeasible", "pruned")


# -- the solver -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Miqp(CostSolver):
    """FuncPipe's MIQP on CP-SAT; see the module docstring.

    ``time_limit_s`` bounds CP-SAT's search summed over the subproblems (building models and
    the warm start come on top and are reported); ``workers`` is CP-SAT's ``num_workers``;
    ``hint`` names the solver whose plan warm-starts the search ("dp", or None for a cold
    start); ``scale_bits`` bounds the integers of the objective, t_iter·Q < 2^scale_bits (see
    "Integer scaling" in the module docstring before raising it); ``seed`` is CP-SAT's random
    seed.
    """

    name: ClassVar[str] = "miqp"
    time_limit_s: float = 60.0
    workers: int = 2
    hint: str | None = "dp"
    scale_bits: int = DEFAULT_SCALE_BITS
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise InputError(f"miqp time_limit_s must be > 0 seconds, got {self.time_limit_s!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise InputError(f"miqp workers must be a positive integer, got {self.workers!r}")
        if not isinstance(self.scale_bits, int) or not 2 * MIN_BITS <= self.scale_bits <= 60:
            raise InputError(f"miqp scale_bits must be an integer in [{2 * MIN_BITS}, 60], got {self.scale_bits!r}")

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        _refuse_other_models(problem)
        started = time.perf_counter()
        warm, note = self._warm_start(problem, goal)
        return self.solve_from(problem, goal, warm, note, hint_s=time.perf_counter() - started)

    def solve_from(self, problem: Problem, goal: Goal, hint_plan: Plan | None, hint_note: str = "given",
                   hint_s: float = 0.0) -> Plan | None:
        """:meth:`solve` warm-started from ``hint_plan`` (None: cold)."""
        _refuse_other_models(problem)
        started = time.perf_counter()
        space = SearchSpace.of(problem)
        parts = subproblems(problem, space)
        _require_some_fit(problem, space, parts)
        build_s = time.perf_counter() - started
        if hint_plan is not None and not evaluate(problem, hint_plan).fits:
            hint_plan, hint_note = None, f"{hint_note}: the plan does not fit memory; ignored"
        best_plan, best_score = None, None
        if hint_plan is not None:
            best_plan, best_score = hint_plan, _score(problem, goal, hint_plan)
            if best_score is None:  # misses the SLO: no use as an incumbent
                best_plan = hint_plan = None
                hint_note = f"{hint_note}: the plan misses the SLO; ignored"

        unit = dollars_per_mb_s(problem.platform)
        holds_hint = [False] * len(parts)
        if hint_plan is not None:
            hint_micro = _micro_batches(problem, hint_plan)
            holds_hint = [part.contains(hint_plan, hint_micro) for part in parts]
        # the hint's own subproblem first (its optimum is the one to beat), then best-first by
        # a cheap lower bound, so that an early good plan prunes the later subproblems
        floors = [_prepare(part, _Objective.of(goal, part.replicas, unit), None, self.scale_bits)[2]
                  for part in parts]
        order = sorted(range(len(parts)), key=lambda i: (
            not holds_hint[i], floors[i]))
        outcomes: dict[int, _Outcome] = {}
        deadline = time.perf_counter() + self.time_limit_s
        # pass 1 shares the time among the subproblems; pass 2 gives what the proven ones left
        # to those still open, warm-started from their best plan
        for rerun in (False, True):
            todo = [index for index in order if not rerun or not outcomes[index].proven]
            for position, index in enumerate(todo):
                part = parts[index]
                remaining = deadline - time.perf_counter()
                if rerun and remaining < MIN_RERUN_S:
                    break
                previous = outcomes.get(index)
                warm = previous.plan if previous is not None and previous.plan is not None else hint_plan
                own_hint = warm if warm is not None and part.contains(warm, _micro_batches(problem, warm)) else None
                outcome = self._solve_part(problem, part, _Objective.of(goal, part.replicas, unit),
                                           best_score[0] if best_score is not None else None, own_hint,
                                           max(remaining, 0.0) / (len(todo) - position))
                if previous is not None:
                    outcome.seconds += previous.seconds
                    if outcome.plan is None and not outcome.proven:
                        outcome.plan, outcome.objective_model = previous.plan, previous.objective_model
                    outcome.lower_bound = max(outcome.lower_bound, previous.lower_bound)
                outcomes[index] = outcome
                if outcome.plan is not None:
                    score = _score(problem, goal, outcome.plan)
                    if score is not None and better(score, best_score):
                        best_plan, best_score = outcome.plan, score
        ordered = [outcomes[index] for index in order if index in outcomes]
        return self._result(problem, goal, best_plan, best_score, hint_plan, hint_note, ordered,
                            time.perf_counter() - started + hint_s, build_s, hint_s)

    # -- pieces ---------------------------------------------------------------------------

    def _warm_start(self, problem: Problem, goal: Goal) -> tuple[Plan | None, str]:
        if self.hint is None:
            return None, "none"

        try:
            solver = get_solver(self.hint)
        except (PlanError, ImportError) as err:
            return None, f"{self.hint} unavailable: {err}"
        solve = getattr(solver, "solve", None)  # duck-typed: any solver with solve(problem, goal)
        if solve is None:
            raise InputError(f"miqp hint {self.hint!r} is not a cost-model solver with solve(problem, goal)")
        try:
            plan = solve(problem, goal)
        except PlanError as err:
            return None, f"{self.hint} failed: {err}"
        if plan is None:
            return None, f"{self.hint} found no plan for {goal.describe()}"
        return plan, self.hint

    def _solve_part(self, problem: Problem, part: Subproblem, objective: _Objective, incumbent: float | None,
                    hint_plan: Plan | None, budget_s: float) -> _Outcome:
        started = time.perf_counter()
        part, scaling, lower = _prepare(part, objective, incumbent, self.scale_bits)
        if scaling is None:
            return _Outcome(part, "pruned", lower_bound=math.inf, seconds=time.perf_counter() - started)
        outcome = _Outcome(part, "unknown", lower_bound=lower, arcs=len(part.arcs), tolerance=scaling.tolerance)
        model = _CpModel(part, objective, scaling, incumbent)
        path = part.path_of(hint_plan) if hint_plan is not None else None
        if path is not None:
            model.hint(path)
        status, values = model.solve(budget_s, self.workers, self.seed)
        outcome.status = status
        outcome.seconds = time.perf_counter() - started
        if status == "infeasible" and path is not None and model.admits(path):
            # the hint satisfies every constraint, so this "infeasible" is CP-SAT's error (seen
            # with products beyond 2^40, see "Integer scaling"); trust nothing it proved here
            outcome.status = "unknown"
            outcome.plan = hint_plan
            return outcome
        if status == "infeasible":
            # nothing in this subproblem is as good as the incumbent (or meets the SLO)
            outcome.lower_bound = math.inf
            return outcome
        if values is not None:
            outcome.plan = Plan(tuple(StagePlan(arc.start, arc.end, arc.memory_mb, part.replicas)
                                      for arc in values["path"]),
                                part.num_layers, self.name, micro_batches=part.micro_batches)
            outcome.objective_model = values["objective"]
        outcome.bound_model = values["bound"] if values is not None else model.bound
        bound = outcome.bound_model
        if bound is not None:
            outcome.lower_bound = max(lower, model.true_from_model(bound) / (1 + scaling.tolerance))
        if status == "optimal":
            # CP-SAT returns a solution with every optimal status (solve()), so values was set
            assert outcome.objective_model is not None
            outcome.lower_bound = max(outcome.lower_bound, model.true_from_model(outcome.objective_model)
                                      / (1 + scaling.tolerance))
        return outcome

    def _result(self, problem: Problem, goal: Goal, best_plan: Plan | None, best_score, hint_plan: Plan | None,
                hint_note: str, outcomes: list[_Outcome], total_s: float, build_s: float,
                hint_s: float) -> Plan | None:
        proven = all(outcome.proven for outcome in outcomes)
        if best_plan is None:
            if proven:
                if goal.slo_s is not None:
                    return None
                raise PlanError(f"miqp: no plan for {goal.describe()} in any of {len(outcomes)} subproblems")
            raise PlanError(
                f"miqp: CP-SAT found no plan within time_limit_s={self.time_limit_s:g} s over {len(outcomes)} "
                f"subproblems ((M, d) choices and stage-count groups) and had no warm start ({hint_note}); "
                "raise time_limit_s, keep hint='dp', or use solver='dp' (exact and fast)")
        evaluation = evaluate(problem, best_plan)
        value = best_score[0]
        lower = min((outcome.lower_bound for outcome in outcomes), default=math.inf)
        gap = 0.0 if proven else max(0.0, (value - lower) / value) if value > 0 and lower < math.inf else 0.0
        from_cp_sat = hint_plan is None or best_plan is not hint_plan
        chosen = next((outcome for outcome in outcomes if outcome.plan is best_plan), None)
        tolerance = max((outcome.tolerance for outcome in outcomes), default=0.0)
        # the hint's own predictions (its solver's statistics) would be mistaken for ours
        plan = dataclasses.replace(best_plan, solver=self.name, predictions={},
                                   micro_batches=_micro_batches(problem, best_plan))
        return annotate(
            plan, evaluation,
            status="optimal" if proven else "feasible",
            gap=gap, objective=value, lower_bound=lower if lower < math.inf else value,
            objective_model=chosen.objective_model if chosen else None,
            objective_bound_model=chosen.bound_model if chosen else None,
            scaling_tolerance=tolerance,
            solve_s=total_s, build_s=build_s, hint_s=hint_s,
            search_s=sum(outcome.seconds for outcome in outcomes),
            solver_backend=BACKEND, time_limit_s=self.time_limit_s, workers=self.workers,
            hint=hint_note, plan_source="cp-sat" if from_cp_sat else f"hint ({hint_note}), not improved on",
            subproblems=len(outcomes), subproblems_proven=sum(outcome.proven for outcome in outcomes),
            subproblem_results=[{"subproblem": outcome.subproblem.label(), "status": outcome.status,
                                 "seconds": round(outcome.seconds, 3), "arcs": outcome.arcs}
                                for outcome in outcomes],
        )


def _score(problem: Problem, goal: Goal, plan: Plan):
    evaluation = evaluate(problem, plan)
    if not evaluation.fits:
        return None
    return goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)


def _micro_batches(problem: Problem, plan: Plan) -> int:
    return plan.micro_batches_for(problem.workload)


def _refuse_other_models(problem: Problem) -> None:
    model = cost_model_for(problem)
    if isinstance(model, FuncPipeModel):
        return
    what = ("inference (Gillis's fork-join model)" if problem.workload.mode == "infer"
            else f"training on {problem.platform.name} under the {model.name} model (per-stage replicas or GPU "
                 "containers)")
    raise PlanError(f"solver 'miqp' is FuncPipe's MIQP and models only FuncPipe's serverless training pipeline; "
                    f"this problem is {what}. Use solver='dp', which handles every cost model")


def _require_some_fit(problem: Problem, space: SearchSpace, parts: Sequence[Subproblem]) -> None:
    """PlanError naming the layers that fit no allowed tier, with what would fit them."""
    count = len(problem.chain)
    if any(_shortest(part.arcs, count, lambda arc: 1.0)[0][count] < math.inf for part in parts):
        return
    covered = {layer for part in parts for arc in part.arcs for layer in range(arc.start, arc.end + 1)}
    platform = problem.platform
    lines = []
    for layer in range(count):
        if layer in covered:
            continue
        needs = []
        for micro_batches, replicas in space.configurations():
            scoped = with_micro_batches(problem, micro_batches)
            mu = micro_batches_per_replica(scoped, replicas)
            largest = platform.tier(max(space.memory_mb))
            need = stage_memory(scoped, layer, layer, largest, micro_batches_in_flight=mu,
                                sync_buffer_copies=2 if replicas > 1 else 0)
            needs.append((need.total, micro_batches, replicas, need))
        total, micro_batches, replicas, need = min(needs, key=lambda item: item[0])
        holding = [tier.memory_mb for tier in platform.tiers
                   if stage_memory(with_micro_batches(problem, micro_batches), layer, layer, tier,
                                   micro_batches_in_flight=micro_batches_per_replica(
                                       with_micro_batches(problem, micro_batches), replicas),
                                   sync_buffer_copies=2 if replicas > 1 else 0).fits]
        fix = (f"a tier of {min(holding)} MB would hold it (allow it with options memory_mb)" if holding
               else "no tier of the platform holds it: use a smaller batch, more micro-batches, an optimizer with "
                    "less state, or a target with larger tiers")
        lines.append(f"layer {layer} ({problem.chain[layer].name}) needs at least {mb(total)} alone "
                     f"(M={micro_batches}, d={replicas}: {need.describe()}); {fix}")
    if not lines:
        lines.append("every layer fits some tier alone, but no cut of the chain fits throughout")
    raise PlanError(f"miqp: no plan fits the memory of the allowed tiers {list(space.memory_mb)} MB of "
                    f"{platform.name}:\n  " + "\n  ".join(lines))


def _prepare(part: Subproblem, objective: _Objective, incumbent: float | None,
             bits: int) -> tuple[Subproblem, _Scaling | None, float]:
    """Drop the arcs no plan better than ``incumbent`` (or within the SLO) can use, and choose
    the integer scaling from the bounds that leaves. Returns (part, None, lower bound) when
    no plan of the part can be better."""
    count = part.num_layers
    lags = part.per_replica - 1
    prices = [arc.price_per_s for arc in part.arcs]
    if not prices:
        return part, None, math.inf
    cheapest = min(prices)
    min_stages = max(part.min_stages, 1)
    price_floor = min_stages * cheapest                # Σ price of any plan here
    q_floor = price_floor + objective.offset          # Q = Σ price + κ of any plan here
    time_cap = objective.slo_s if objective.slo_s is not None else math.inf
    if incumbent is not None:
        time_cap = min(time_cap, incumbent * (1 + FLOAT_SLACK) / (objective.factor * q_floor)
                       if objective.product else incumbent * (1 + FLOAT_SLACK) / objective.factor)
    # dropping an arc can strand others (no complete plan through them any more): repeat
    while True:
        floors = time_floors(part.arcs, count)
        kept = [arc for arc, time_s in zip(part.arcs, floors)
                if time_s < math.inf and time_s <= time_cap * (1 + FLOAT_SLACK)
                and (incumbent is None or objective.value(time_s, arc.price_per_s + (min_stages - 1) * cheapest)
                     <= incumbent * (1 + FLOAT_SLACK))]
        if len(kept) == len(part.arcs):
            break
        part = part.with_arcs(kept)
    if not part.arcs:
        return part, None, math.inf
    time_floor = min(floors)
    lower = objective.value(time_floor, price_floor)
    longest, _ = _shortest(part.arcs, count, lambda arc: arc.forward_path_s + arc.backward_path_s, longest=True)
    crude = (longest[count] + max(arc.backward_own_s for arc in part.arcs)
             + lags * (max(arc.forward_lag_s for arc in part.arcs) + max(arc.lag_s for arc in part.arcs)))
    time_ub = max(min(crude, time_cap), time_floor)
    rounded_terms = 2 * min(part.max_stages, count) + 2 * lags + 2
    if not objective.product:
        tick = _tick(time_ub, 1 << bits)
        return part, _Scaling(tick, 1.0, 0, (1 << bits) + rounded_terms,
                              _relative(rounded_terms * tick, time_floor)), lower
    q_ub = min(part.max_stages, count) * max(prices) + objective.offset
    if incumbent is not None and time_floor > 0:
        q_ub = min(q_ub, incumbent * (1 + FLOAT_SLACK) / (objective.factor * time_floor))
    q_ub = max(q_ub, q_floor)
    # split the bits of t_iter·Q so that both roundings cost about the same relative error
    time_spread = rounded_terms * time_ub / time_floor if time_floor > 0 else 1.0
    price_spread = (count + 1) * q_ub / q_floor
    time_bits = round((bits + math.log2(time_spread / price_spread)) / 2)
    time_bits = min(max(time_bits, MIN_BITS), bits - MIN_BITS)
    tick = _tick(time_ub, 1 << time_bits)
    price_unit = q_ub / (1 << (bits - time_bits))
    tolerance = (1 + _relative(rounded_terms * tick, time_floor)) * (1 + _relative((count + 1) * price_unit,
                                                                                    q_floor)) - 1
    scaling = _Scaling(tick, price_unit, math.ceil(objective.offset / price_unit),
                       (1 << time_bits) + rounded_terms, tolerance)
    return part, scaling, lower


def _tick(time_ub: float, steps: int) -> float:
    return time_ub / steps if time_ub > 0 else 1.0


def _relative(error: float, floor: float) -> float:
    return error / floor if floor > 0 else math.inf


class _CpModel:
    """The CP-SAT model of one subproblem (see the module docstring for the formulation)."""

    def __init__(self, part: Subproblem, objective: _Objective, scaling: _Scaling, incumbent: float | None):
        # start-up time: ortools' CP-SAT is loaded by a miqp solve alone
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.part, self.objective, self.scaling = part, objective, scaling
        self.bound: float | None = None
        count, arcs = part.num_layers, part.arcs
        self.model = cp_model.CpModel()
        self.x = [self.model.new_bool_var(f"x{arc.start}_{arc.end}_{arc.memory_mb}") for arc in arcs]
        starting: dict[int, list[int]] = {i: [] for i in range(count)}
        ending: dict[int, list[int]] = {i: [] for i in range(count)}
        for index, arc in enumerate(arcs):
            starting[arc.start].append(index)
            ending[arc.end].append(index)
        covering = [[a for a, arc in enumerate(arcs) if arc.start <= k <= arc.end] for k in range(count)]
        self._tile_the_chain(starting, ending)
        # with lags (µ > 1) only; Λ and G have one variable per layer, Λ_L = G_L = 0 beside them
        self.forward_lag: cp_model.IntVar | None = None
        self.suffix_lag: list[cp_model.IntVar] = []
        self.stage_lag: list[cp_model.IntVar] = []
        if part.per_replica > 1:
            self._add_lags(starting, covering)
        floors = self._add_iteration_time(starting, covering)
        self.price: cp_model.IntVar | None = None
        self.product: cp_model.IntVar | None = None
        target = self._add_price(floors) if objective.product else self.time
        self.limit = None
        if incumbent is not None:
            # only plans at least as good as the incumbent, up to the rounding
            self.limit = math.floor(self.model_from_true(incumbent) * (1 + scaling.tolerance)) + 1
            self.model.add(target <= self.limit)
        self.model.minimize(target)

    def _weighted(self, indices: Iterable[int], coefficients: Sequence[int]) -> Any:
        """Σ coefficient_a · x_a over the arcs ``indices``."""
        indices = list(indices)
        return self.cp.LinearExpr.weighted_sum([self.x[a] for a in indices], [coefficients[a] for a in indices])

    def _tile_the_chain(self, starting: dict[int, list[int]], ending: dict[int, list[int]]) -> None:
        """A path from layer 0 to the last layer: one stage starts at 0, stages tile the chain,
        between the subproblem's least and most stages."""
        total, x, model, count = self.cp.LinearExpr.sum, self.x, self.model, self.part.num_layers
        model.add(total([x[a] for a in starting[0]]) == 1)
        for i in range(1, count):
            model.add(total([x[a] for a in ending[i - 1]]) == total([x[a] for a in starting[i]]))
        model.add(total([x[a] for a in ending[count - 1]]) == 1)
        if self.part.min_stages > 1 or self.part.max_stages < count:
            model.add_linear_constraint(total(x), self.part.min_stages, self.part.max_stages)

    def _add_lags(self, starting: dict[int, list[int]], covering: list[list[int]]) -> None:
        """Δ_f, Λ_i and the Δ_b of the stage covering each layer (with lags, µ > 1, only)."""
        model, ticks, count, arcs = self.model, self.scaling.ticks, self.part.num_layers, self.part.arcs
        forward_lag = [ticks(arc.forward_lag_s) for arc in arcs]
        lag, lag_own = [ticks(arc.lag_s) for arc in arcs], [ticks(arc.lag_own_s) for arc in arcs]
        # Δ_f ≥ the lag of the stage covering layer k, for every k (exactly one covers it,
        # which makes these rows tighter in the LP than one row per arc)
        self.forward_lag = model.new_int_var(0, max(forward_lag), "forward_lag")
        for k in range(count):
            model.add(self.forward_lag >= self._weighted(covering[k], forward_lag))
        top = max(lag)
        # Λ_i: the largest lag of the stages starting at i or later (Λ_L = 0)
        self.suffix_lag = [model.new_int_var(0, top, f"suffix_lag{i}") for i in range(count)]
        suffix_lag = [*self.suffix_lag, 0]
        for i in range(count):
            model.add(self.suffix_lag[i] >= suffix_lag[i + 1])
            model.add(self.suffix_lag[i] >= self._weighted(starting[i], lag))
        # Δ_b of the stage covering layer k: its own compute and upload, and everything above
        # it (the stages starting after k). Indexed by covered layer rather than by first
        # layer: Σ over the arcs covering k of x is 1 even in the LP, so these rows are
        # not diluted by fractional stage starts
        self.stage_lag = [model.new_int_var(0, top, f"stage_lag{k}") for k in range(count)]
        for k in range(count):
            model.add(self.stage_lag[k] >= suffix_lag[k + 1])
            model.add(self.stage_lag[k] >= self._weighted(covering[k], lag_own))

    def _add_iteration_time(self, starting: dict[int, list[int]], covering: list[list[int]]) -> list[int]:
        """G_i, Z and t_iter (under the SLO when there is one); returns each arc's floor in
        ticks, the fastest plan through it."""
        model, ticks, cap, scaling = self.model, self.scaling.ticks, self.scaling.time_cap, self.scaling
        count, arcs, lags = self.part.num_layers, self.part.arcs, self.part.per_replica - 1
        backward_path = [ticks(arc.backward_path_s) for arc in arcs]
        backward_own = [ticks(arc.backward_own_s) for arc in arcs]
        forward_path = [ticks(arc.forward_path_s) for arc in arcs]
        # G_i: backward compute and transfers of the stages starting at i or later
        self.suffix_path = [model.new_int_var(0, cap, f"suffix_path{i}") for i in range(count)]
        suffix_path = [*self.suffix_path, 0]
        for i in range(count):
            model.add(self.suffix_path[i] == suffix_path[i + 1] + self._weighted(starting[i], backward_path))
        # Z ≥ t_b + t_s of the stage covering layer k: G_{k+1} is the backward work of the
        # stages after it, whichever layer of the stage k is
        self.done = model.new_int_var(0, cap, "done")
        for k in range(count):
            stage_lag = lags * self.stage_lag[k] if lags > 0 else 0
            model.add(self.done >= suffix_path[k + 1] + self._weighted(covering[k], backward_own) + stage_lag)
        self.time = model.new_int_var(0, cap, "t_iter")
        model.add(self.time == self._weighted(range(len(arcs)), forward_path)
                  + (lags * self.forward_lag if self.forward_lag is not None else 0) + self.done)
        if self.objective.slo_s is not None:
            model.add(self.time <= math.floor(self.objective.slo_s / scaling.tick_s))
        # t_iter is at least the fastest plan through the stage covering layer k: redundant
        # for integer plans, a much better LP bound for fractional ones
        floors = [math.floor(seconds / scaling.tick_s) for seconds in time_floors(arcs, count)]
        for k in range(count):
            model.add(self.time >= self._weighted(covering[k], floors))
        return floors

    def _add_price(self, floors: list[int]) -> Any:
        """Q (the plan's price per second) and t_iter·Q, the objective's product; returns it."""
        model, scaling, arcs, count = self.model, self.scaling, self.part.arcs, self.part.num_layers
        units = [scaling.units(arc.price_per_s) for arc in arcs]
        price_cap = scaling.offset_units + min(self.part.max_stages, count) * max(units)
        self.price = model.new_int_var(0, price_cap, "price")
        model.add(self.price == scaling.offset_units + self._weighted(range(len(arcs)), units))
        self.product = model.new_int_var(0, scaling.time_cap * price_cap, "t_iter_x_price")
        model.add_multiplication_equality(self.product, [self.time, self.price])
        # t_iter·Q = κ·t_iter + Σ_a price_a·(t_iter·x_a) ≥ κ·t_iter + Σ_a price_a·floor_a·x_a:
        # a linear bound on the product that the LP relaxation of the product lacks
        model.add(self.product >= scaling.offset_units * self.time
                  + self._weighted(range(len(arcs)), [unit * floor for unit, floor in zip(units, floors)]))
        return self.product

    def model_from_true(self, value: float) -> float:
        return value / self._unit()

    def true_from_model(self, value: float) -> float:
        return value * self._unit()

    def _unit(self) -> float:
        scaling, objective = self.scaling, self.objective
        if objective.product:
            return objective.factor * scaling.tick_s * scaling.price_unit
        return objective.factor * scaling.tick_s

    def hint(self, path: Sequence[Arc]) -> None:
        """A complete hint: the path's arcs and every auxiliary variable's value on it."""
        chosen = {(arc.start, arc.end, arc.memory_mb) for arc in path}
        for variable, arc in zip(self.x, self.part.arcs):
            self.model.add_hint(variable, (arc.start, arc.end, arc.memory_mb) in chosen)
        # in ticks, so every value is an int (sums and maxima of Scaling.ticks); int() says so
        values = path_values(path, self.part.per_replica, self.scaling.ticks)
        if self.forward_lag is not None:
            self.model.add_hint(self.forward_lag, int(values.forward_lag))
            for i in range(self.part.num_layers):
                self.model.add_hint(self.suffix_lag[i], values.suffix_lag[i])
                self.model.add_hint(self.stage_lag[i], values.stage_lag[i])
        for i in range(self.part.num_layers):
            self.model.add_hint(self.suffix_path[i], values.suffix_path[i])
        self.model.add_hint(self.done, int(values.done))
        self.model.add_hint(self.time, int(values.time))
        if self.price is not None and self.product is not None:  # both or neither (objective.product)
            self.model.add_hint(self.price, self._price_units(path))
            self.model.add_hint(self.product, self._target_of(path, values))

    def admits(self, path: Sequence[Arc]) -> bool:
        """Whether the plan ``path`` meets this model's own bounds (SLO and incumbent)."""
        values = path_values(path, self.part.per_replica, self.scaling.ticks)
        slo = self.objective.slo_s
        if values.time > self.scaling.time_cap:
            return False
        if slo is not None and values.time > math.floor(slo / self.scaling.tick_s):
            return False
        return self.limit is None or self._target_of(path, values) <= self.limit

    def _price_units(self, path: Sequence[Arc]) -> int:
        return self.scaling.offset_units + sum(self.scaling.units(arc.price_per_s) for arc in path)

    def _target_of(self, path: Sequence[Arc], values: PathValues) -> int:
        """The objective variable's value for ``path`` (``values`` in ticks): t_iter, or t_iter·Q."""
        time_ticks = int(values.time)
        return time_ticks * self._price_units(path) if self.objective.product else time_ticks

    def solve(self, budget_s: float, workers: int, seed: int) -> tuple[str, dict[str, Any] | None]:
        # start-up time: ortools' CP-SAT is loaded by a miqp solve alone
        from ortools.sat.python import cp_model

        solver = cp_model.CpSolver()
        solver.parameters.max_time_in_seconds = max(budget_s, 0.01)
        solver.parameters.num_workers = workers
        solver.parameters.random_seed = seed
        code = solver.solve(self.model)
        if code == cp_model.MODEL_INVALID:
            raise PlanError(f"internal error: miqp built an invalid CP-SAT model: {self.model.validate()}")
        status = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
                  cp_model.INFEASIBLE: "infeasible"}.get(code, "unknown")
        self.bound = solver.best_objective_bound if status != "infeasible" else None
        if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, None
        path = sorted((arc for variable, arc in zip(self.x, self.part.arcs) if solver.boolean_value(variable)),
                      key=lambda arc: arc.start)
        return status, {"path": path, "objective": round(solver.objective_value),
                        "bound": solver.best_objective_bound}
