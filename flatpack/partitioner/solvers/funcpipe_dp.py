"""Exact optimum of FuncPipe's co-optimization (FuncPipe §3.4, eq. 3–7) by
dynamic programming over the chain with dominance labels and bounds.

What makes the problem hard for a plain DP: t_iter (``cost.funcpipe.iteration``) has
bottleneck terms — (µ−1)·Δ_f with Δ_f the largest forward stage or transfer anywhere, and
per stage (µ−1)·Δ_b(s) with Δ_b(s) the largest backward term from stage s up — and
max_s(t_b,s + t_s,s) couples each stage's synchronization with everything after it; the
cost multiplies t_iter by the plan's total price. So the best plan for a suffix of the
chain depends on more than one number, and optimal substructure only holds for sets of
non-dominated partial plans.

The algorithm, for each (M, d) of the search space (and for each stage count S when the
platform caps bandwidth per account, since each worker's share then depends on S):

* Right to left over the chain. A label is a plan of the suffix starting at layer i whose
  first stage has tier k, summarized by five numbers that determine every completion's
  time and cost: V = Σ(forward + backward) + 2·Σ(transfers); P = Σ price; Δ_f and Δ_b of
  the suffix; and Q = max over the suffix's stages t of (µ−1)·Δ_b(t) + t_s,t − (the
  backward work between i and t). With V, P, Δ_f, Δ_b, Q of the whole chain,
  t_iter = V + (µ−1)·Δ_f + Q: Q(0) is max_s(t_b,s + t_s,s) minus the backward sum. Prepending
  a stage updates all five exactly (:func:`_extend`).
* A label is dropped when another of the same state is no worse for every completion
  (:func:`_dominance_keys`). Any prefix completes a label to
  t_iter = V + W + (µ−1)·max(Δ_f, a) + max(max_s[(µ−1)·max(Δ_b, y_s) + z_s], Q + c)
  with a, y_s, z_s, c, W ≥ 0 fixed by the prefix, a maximum of sums of V, (µ−1)·Δ_f,
  (µ−1)·Δ_b and Q; one label beats another for every prefix when it is no worse in each such
  sum that can decide the maximum — V, V + (µ−1)·Δ_f, V + (µ−1)·Δ_b, V + (µ−1)·(Δ_f + Δ_b),
  V + Q, V + (µ−1)·Δ_f + Q — and in P. This keeps far fewer labels than asking for every
  number apart (as the reference does): a label whose Δ_f is larger but whose V is smaller
  by more than (µ−1) times the difference is dominated too.
* A label is also dropped when a lower bound on any completion's objective already exceeds
  the best complete plan found (the incumbent). The bound completes the label with the
  prefixes of a left-to-right pass (:func:`_prefix_fronts`): the work and bottlenecks of
  one prefix together, the price, the forward part and the first stage's sync at their
  least (:meth:`_Search._lower_scores`). Goals that price the plan take the price with the
  work and bottlenecks too, one band of prefix prices at a time
  (:func:`_priced_prefix_fronts`): the prefixes with the least bottlenecks have the most
  stages and cost the most, and a cost-weighted score is t_iter times the price, so bounding
  each at its own least let millions of labels through (issue 42: 17M and 21.5M labels for
  the two cost-weighted goals of BERT-Large at L = 128, against about 0.2M with the bands).
* The incumbent comes from a first pass that keeps only the most promising labels per state
  (a beam), which yields a good complete plan quickly; the exact pass then prunes with it.
  Before either pass, each configuration (M, d) is bounded by its last stage alone
  (:meth:`_Search.unsearched_bound`): the beam visits them from the least bound up, and one
  whose bound exceeds the incumbent is not searched (all its labels would be pruned).
  ``tests/unit/test_dp_priced_bound.py`` checks that the bands stand for every fitting
  prefix, that the screen never exceeds a configuration's optimum, and that dp's optima
  equal brute force's and the reference's, on profiles as built and perturbed.

Weighted goals minimize t_iter·(α₁·d·P/u + α₂) (u: dollars per MB·s); SLO goals minimize
t_iter·d·P subject to t_iter ≤ SLO. Both are monotone in every label number, which is what
makes dominance and the bounds exact.

``reference=True`` runs the algorithm as it stood before issue 20 — every label number
compared on its own, and the bound with each prefix quantity at its own least (work, price,
slowest layer) — kept to compare plans and label counts against, not as the default.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np

from flatpack.errors import PlanError
from flatpack.partitioner.cost.collectives import scatter_reduce_coefficients
from flatpack.partitioner.cost.common import (memory_limit, memory_need, micro_batches_per_replica, recompute_seconds,
                                              stage_tensor_rows)
from flatpack.partitioner.cost.funcpipe import check_layers_fit
from flatpack.partitioner.objective import (FUNCPIPE_WEIGHTS, Weights, annotate, dollars_per_mb_s, evaluate,
                                            with_micro_batches)
from flatpack.partitioner.pareto import non_dominated
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import Goal, better
from flatpack.partitioner.space import SearchSpace

if TYPE_CHECKING:
    from flatpack.platform.catalog import Tier

V, P, DF, DB, Q = range(5)
BEAM_WIDTH = 16
_FRONT_BATCH = 32          # first batch of :func:`_front` (it doubles up to the max)
_FRONT_BATCH_MAX = 256
_PRICE_BAND = 1.01           # the ratio of prices one row of a priced prefix front spans
_BOUND_CELLS = 1 << 20      # labels × prefixes evaluated at once by the bound
_PREFIX_FRONT_LIMIT = 32    # rows per prefix front (:func:`_merged`)
_RELATIVE_SLACK = 1e-12   # bounds are compared with this much slack, so float noise never prunes an optimum


@dataclass
class _Chain:
    """Per-(M, d, S) numbers of the chain on every tier, as arrays."""

    micro_batches: int
    replicas: int
    mu: int
    stage_count: int | None          # S when bandwidth depends on it, else None
    tiers: list[Tier]
    price: np.ndarray                # (K,) dollars per second of one worker
    bandwidth: np.ndarray            # (K,) bytes per second
    latency: float
    forward_prefix: np.ndarray       # (K, L+1) slowdown-scaled forward seconds, prefix sums
    backward_prefix: np.ndarray
    out_bytes: np.ndarray            # (L,) bytes after each layer per micro-batch (last unused)
    fits: list[np.ndarray]           # fits[i][j - i]: (K,) bool, stage i..j fits on option k
    gradients: list[list[float]]     # gradients[i][j - i]: bytes the stage synchronizes
    sync_method: str
    # per option k: whether the stage recomputes its activations (tiers[k] is then listed once
    # per flag the workload allows, so "recompute" is chosen like a tier)
    recompute: np.ndarray
    _stage_options: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> int:
        return self.forward_prefix.shape[1] - 1

    def stage_seconds(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        return (self.forward_prefix[:, end + 1] - self.forward_prefix[:, start],
                self.backward_prefix[:, end + 1] - self.backward_prefix[:, start])

    def transfer(self, after: int | np.ndarray, tiers: np.ndarray | slice = slice(None)) -> np.ndarray:
        """o/W + t_lat for the boundary after layer ``after``, at each tier's bandwidth (or,
        with arrays for both, for each (boundary, option) pair)."""
        return self.out_bytes[after] / self.bandwidth[tiers] + self.latency

    def sync(self, start: int, end: int) -> np.ndarray:
        return self._sync(np.array([self.gradients[start][end - start]]))[0]

    def _sync(self, gradients: np.ndarray) -> np.ndarray:
        """(n, K) seconds to synchronize each of ``gradients`` bytes at each option's
        bandwidth: FuncPipe's t_s = γ·s/w + δ·t_lat (``scatter_reduce_coefficients``; 0 for
        one replica), for a whole row of stages at once."""
        if self.replicas == 1:
            return np.zeros((len(gradients), len(self.tiers)))
        gamma, delta = scatter_reduce_coefficients(self.sync_method, self.replicas)
        return gamma * gradients[:, None] / self.bandwidth[None, :] + delta * self.latency

    def stage_row(self, start: int) -> _StageRow:
        """Every stage from ``start``: the options worth trying and their seconds, computed
        once per chain (the beam pass, the exact pass, the prefix fronts and every goal of a
        front read them)."""
        if start not in self._stage_options:
            self._stage_options[start] = self._row(start)
        return self._stage_options[start]

    def stage_options(self, start: int, end: int) -> _StageOptions | None:
        """Stage start..end alone (None when it fits no option): a row of :meth:`stage_row`."""
        row = self.stage_row(start)
        offset = end - start
        if offset >= len(row.kept) or not row.kept[offset].any():
            return None
        return _StageOptions(np.flatnonzero(row.kept[offset]), row.forward[offset], row.backward[offset],
                             row.sync[offset])

    def _row(self, start: int) -> _StageRow:
        fits = np.array(self.fits[start], dtype=bool).reshape(-1, len(self.tiers))      # (E, K)
        ends = start + np.arange(len(fits))
        forward = (self.forward_prefix[:, ends + 1] - self.forward_prefix[:, [start]]).T
        backward = (self.backward_prefix[:, ends + 1] - self.backward_prefix[:, [start]]).T
        sync = self._sync(np.array(self.gradients[start], dtype=float))
        return _StageRow(_undominated_tiers(self, fits, forward, backward, sync), forward, backward, sync)

    @cached_property
    def kept_table(self) -> np.ndarray:
        """(L, E, K) bool: ``[start, end − start, k]`` whether option k is worth trying for the
        stage start..end (:meth:`stage_row`'s ``kept``, padded with False), for passes that
        take every stage ending at one layer at once."""
        longest = max(len(row) for row in self.fits)
        table = np.zeros((self.layers, longest, len(self.tiers)), dtype=bool)
        for start in range(self.layers):
            kept = self.stage_row(start).kept
            table[start, :len(kept)] = kept
        return table

    @cached_property
    def prefix_bounds(self) -> _PrefixBounds:
        return _prefix_bounds(self)

    @cached_property
    def prefix_fronts(self) -> list[np.ndarray]:
        """Per layer i, (n, 4) rows W_p, Δ_f, Δ_b (and Σ price) of the prefixes of layers 0..i−1 that the
        bound takes together (:func:`_prefix_fronts`): a slow single-stage prefix has the
        least work, a many-stage one the least bottleneck, and no prefix has both."""
        return _prefix_fronts(self)

    @cached_property
    def priced_prefix_fronts(self) -> list[np.ndarray]:
        """Per layer i, rows W_p, Δ_f, Δ_b, P_p bounding the prefixes of layers 0..i−1 one band
        of prices at a time (:func:`_priced_prefix_fronts`), for goals that price the plan."""
        return _priced_prefix_fronts(self)


@dataclass(frozen=True)
class _StageRow:
    """The stages start..start+e of one first layer, as (E, K) arrays over options."""

    kept: np.ndarray         # fitting options no other fitting option beats for the stage
    forward: np.ndarray      # seconds
    backward: np.ndarray
    sync: np.ndarray


@dataclass(frozen=True)
class _StageOptions:
    tiers: np.ndarray        # fitting tiers no other fitting tier beats for this stage
    forward: np.ndarray      # (K,) seconds per tier
    backward: np.ndarray
    sync: np.ndarray


@dataclass
class _Labels:
    """Non-dominated partial plans of the suffixes starting at one layer, all first tiers."""

    values: np.ndarray       # (n, 5): V, P, Δ_f, Δ_b, Q
    tier: np.ndarray         # (n,) tier index of the first stage
    end: np.ndarray          # (n,) last layer of the first stage
    next_row: np.ndarray     # (n,) row in the labels of layer end + 1 (−1: last stage)
    count: np.ndarray        # (n,) stages in the suffix


def _empty_labels() -> _Labels:
    return _Labels(np.empty((0, 5)), np.empty(0, int), np.empty(0, int), np.empty(0, int), np.empty(0, int))


@dataclass
class _Objective:
    """The goal as a function of (t_iter, P) for one (M, d)."""

    goal: Goal
    replicas: int
    dollars_per_unit: float

    def score(self, times: np.ndarray, prices: np.ndarray) -> np.ndarray:
        """Primary score, +inf where the SLO is missed or the label cannot be completed
        (an unreachable prefix has infinite bounds)."""
        with np.errstate(invalid="ignore"):
            scores = np.asarray(self._score(times, prices), dtype=float)
        # nan (inf · 0) is an uncompletable label; nan_to_num did the same at 3× the cost
        scores[np.isnan(scores)] = np.inf
        return scores

    def least_score(self, times: np.ndarray, label_prices: np.ndarray, row_prices: np.ndarray) -> np.ndarray:
        """Per label (row of ``times``), the least of :meth:`score` over the prefixes (columns)
        whose times are ``times`` and whose prices add ``row_prices`` to ``label_prices``. A
        weighted goal's score is t·(c·P + α₂) with c = α₁·d/u: two operations per cell
        instead of :meth:`score`'s eight (every number here is finite, so no nan arises)."""
        if self.goal.slo_s is not None:
            return self.score(times, label_prices[:, None] + row_prices[None, :]).min(axis=1)
        weights = self.goal.weights
        rate = weights.cost * self.replicas / self.dollars_per_unit
        factors = (rate * label_prices + weights.time)[:, None] + (rate * row_prices)[None, :]
        return (times * factors).min(axis=1)

    def _score(self, times: np.ndarray, prices: np.ndarray) -> np.ndarray:
        dollars = times * self.replicas * prices
        if self.goal.slo_s is not None:
            return np.where(times <= self.goal.slo_s * (1 + _RELATIVE_SLACK), dollars, np.inf)
        weights = self.goal.weights
        return weights.cost * dollars / self.dollars_per_unit + weights.time * times


class _Staircase:
    """The (t_iter, dollars) points of the plans found so far, as a staircase: a label whose
    least time and least dollars some found plan already matches cannot add a point to the
    front (the comparison leaves ``_RELATIVE_SLACK``, so float noise prunes no new point)."""

    def __init__(self) -> None:
        self.times = np.empty(0)
        self.cheapest = np.empty(0)    # least dollars among the points no slower than times[i]

    def add(self, times: np.ndarray, dollars: np.ndarray) -> None:
        points = np.concatenate([np.stack([self.times, self.cheapest], axis=1),
                                 np.stack([times, dollars], axis=1)])
        points = points[np.lexsort((points[:, 1], points[:, 0]))]
        self.times, self.cheapest = points[:, 0], np.minimum.accumulate(points[:, 1])

    def dominates(self, times: np.ndarray, dollars: np.ndarray) -> np.ndarray:
        if len(self.times) == 0:
            return np.zeros(len(times), dtype=bool)
        slower = np.searchsorted(self.times, times * (1 - _RELATIVE_SLACK), side="right") - 1
        return (slower >= 0) & (self.cheapest[np.maximum(slower, 0)] <= dollars * (1 - _RELATIVE_SLACK))


class _OutOfTime(Exception):
    """The exact pass reached the deadline (caught by :func:`_solve_goal`)."""


@dataclass
class Result:
    plan: Plan
    score: tuple[float, float]


@dataclass
class _Stats:
    labels_kept: int = 0
    labels_built: int = 0
    searches: int = 0


def _stage_tensor_table(problem: Problem) -> list[list]:
    """stage_tensors(i, j) for every stage whose weights alone fit the largest limit."""
    largest = max(memory_limit(problem, tier)[0] for tier in problem.platform.tiers)
    table = []
    for start in range(len(problem.chain)):
        row = []
        for tensors in stage_tensor_rows(problem, start):
            if tensors.weights + tensors.gradients + tensors.optimizer > largest and row:
                break  # more layers only add bytes
            row.append(tensors)
        table.append(row)
    return table


def _chain(problem: Problem, tensors: list[list], tiers: list[Tier], micro_batches: int, replicas: int,
           stage_count: int | None) -> _Chain:
    problem = with_micro_batches(problem, micro_batches)
    # each (tier, recompute) pair is one option of a stage: a recomputing option has the tier's
    # price and bandwidth, a backward longer by the forward and a smaller memory need
    choices = problem.workload.recompute_choices
    recompute = [flag for _ in tiers for flag in choices]
    platform = problem.platform
    micro = problem.workload.micro_batch_size
    mu = micro_batches_per_replica(problem, replicas)
    count = len(problem.chain)
    # per tier, then repeated per recompute flag (the layer times do not depend on the flag)
    seconds = np.array([[problem.layer_seconds(index, tier, micro) for index in range(count)] for tier in tiers])
    tiers = [tier for tier in tiers for _ in choices]
    seconds = np.repeat(seconds.reshape(-1, count, 2), len(choices), axis=0)          # (K, L, 2)
    backward_seconds = np.array([recompute_seconds(seconds[k, :, 0], seconds[k, :, 1], flag)
                                 for k, flag in enumerate(recompute)])
    forward = np.concatenate([np.zeros((len(tiers), 1)), np.cumsum(seconds[..., 0], axis=1)], axis=1)
    backward = np.concatenate([np.zeros((len(tiers), 1)), np.cumsum(backward_seconds, axis=1)], axis=1)
    bandwidth = np.array([tier.bandwidth_bytes_s for tier in tiers], dtype=float)
    if platform.aggregate_bandwidth_bytes_s is not None and stage_count is not None:
        bandwidth = np.minimum(bandwidth, platform.aggregate_bandwidth_bytes_s / (replicas * stage_count))
    slowdown = platform.overlap_slowdown
    out_bytes = np.array([problem.boundary_bytes(index, micro) for index in range(count)], dtype=float)
    limit, base = np.array([memory_limit(problem, tier) for tier in tiers], dtype=float).reshape(-1, 2).T
    flag_column = [choices.index(flag) for flag in recompute]
    sync_copies = 2 if replicas > 1 else 0
    fits, gradients = [], []

    def need(stage, flag: bool) -> int:
        """The stage's need apart from the runtime base (each tier adds its own)."""
        need = memory_need(problem, stage, tiers[0], micro_batches_in_flight=mu, sync_buffer_copies=sync_copies,
                           recompute=flag)
        return need.total - need.base

    for row in tensors:
        needs = np.array([[need(stage, flag) for flag in choices] for stage in row], dtype=float)    # (E, flags)
        fits.append(needs[:, flag_column] + base[None, :] <= limit[None, :])
        gradients.append([stage.gradients for stage in row])
    return _Chain(micro_batches, replicas, mu, stage_count, tiers, np.array([t.price_per_s for t in tiers]),
                  bandwidth, platform.storage_latency_s, slowdown * forward, slowdown * backward, out_bytes,
                  fits, gradients, problem.workload.sync, np.array(recompute, dtype=bool))


@dataclass
class _PrefixBounds:
    """Lower bounds on what layers 0..i−1 add to any plan, for each i (a left-to-right DP
    over the same fitting stages, each quantity minimized on its own, so their sum is a
    valid bound): ``work[i, k]`` the least Σ(forward + backward) + 2·Σ transfers and
    ``forward[i, k]`` the least Σ forward + Σ transfers of a prefix whose last stage has tier
    k, its upload across boundary i−1 included; ``price[i]`` the least Σ price;
    ``forward_lag[i]`` and ``backward_lag[i]`` the slowest single layer on its fastest tier;
    ``first_sync`` the least synchronization of a first stage. (The work and bottlenecks
    the default bound takes together are :func:`_prefix_fronts`.)"""

    work: np.ndarray
    forward: np.ndarray
    price: np.ndarray
    forward_lag: np.ndarray
    backward_lag: np.ndarray
    first_sync: float


def _prefix_bounds(chain: _Chain) -> _PrefixBounds:
    count, tiers = chain.layers, len(chain.tiers)
    forward = np.diff(chain.forward_prefix, axis=1)     # (K, L)
    backward = np.diff(chain.backward_prefix, axis=1)
    work = np.full((count + 1, tiers), np.inf)
    forward_only = np.full((count + 1, tiers), np.inf)
    price = np.full(count + 1, np.inf)
    price[0] = 0.0
    longest = max(len(row) for row in chain.fits)
    for end in range(count - 1):           # stage start..end, then boundary ``end`` into layer end + 1
        # every stage start..end that some option holds, as (S, K) arrays, one row per start
        starts = np.array([start for start in range(max(0, end + 1 - longest), end + 1)
                           if end - start < len(chain.fits[start])], dtype=int)
        fits = np.array([chain.fits[start][end - start] for start in starts], dtype=bool).reshape(-1, tiers)
        starts, fits = starts[fits.any(axis=1)], fits[fits.any(axis=1)]
        if len(starts) == 0:
            continue
        fwd = (chain.forward_prefix[:, [end + 1]] - chain.forward_prefix[:, starts]).T
        bwd = (chain.backward_prefix[:, [end + 1]] - chain.backward_prefix[:, starts]).T
        # the download into a stage is at its own option's bandwidth; any option may precede it
        downloads = np.array([chain.transfer(start - 1) if start > 0 else np.zeros(tiers)
                              for start in starts]).reshape(-1, tiers)
        first = starts == 0
        before_work = np.where(first[:, None], 0.0, work[starts].min(axis=1)[:, None] + 2 * downloads)
        before_forward = np.where(first[:, None], 0.0, forward_only[starts].min(axis=1)[:, None] + downloads)
        upload = chain.transfer(end)
        work[end + 1] = np.where(fits, fwd + bwd + before_work + 2 * upload, np.inf).min(axis=0)
        forward_only[end + 1] = np.where(fits, fwd + before_forward + upload, np.inf).min(axis=0)
        cheapest = np.where(fits, chain.price[None, :], np.inf).min(axis=1)
        price[end + 1] = (price[starts] + cheapest).min()
    forward_lag = np.concatenate([[0.0], np.maximum.accumulate(forward.min(axis=0))])
    backward_lag = np.concatenate([[0.0], np.maximum.accumulate(backward.min(axis=0))])
    first_sync = 0.0
    if chain.replicas > 1:
        first_sync = float(chain.sync(0, 0).min())   # more layers only add gradients
    return _PrefixBounds(work, forward_only, price, forward_lag, backward_lag, first_sync)


def _prefix_fronts(chain: _Chain) -> list[np.ndarray]:
    """For each i, the prefixes of layers 0..i−1 (their last stage's upload across boundary
    i−1 included) as rows W_p, Δ_f, Δ_b (and Σ price, unused here), reduced to those no other
    beats for every suffix: a suffix with bottlenecks (x, y) meets
    W_p + (µ−1)·(max(Δ_f, x) + max(Δ_b, y)) in t_iter, so the keys are
    :func:`_dominance_keys`' sums with W_p for V; and where d > 1, the bound's synchronization
    term (µ−1)·max(Δ_f, x) + F_min + Q has the prefix's Δ_f without W_p (F_min is the same
    for every prefix), so (µ−1)·Δ_f alone is a key too: a prefix with less work but a larger
    Δ_f must not stand for one with a smaller Δ_f there (with d = 1, Q ≤ (µ−1)·Δ_b and that
    term never exceeds the other). A left-to-right pass over the same stages and tiers as the
    search, without Q and synchronization (the bound takes those at their least); the bound
    of goals that price the plan reads :func:`_priced_prefix_fronts` instead."""
    lag = chain.mu - 1
    fronts = [np.zeros((1, 4))] + [np.empty((0, 4)) for _ in range(chain.layers)]
    for end in range(chain.layers - 1):       # stage start..end, then boundary ``end`` into layer end + 1
        rows = _prefix_extensions(chain, fronts, end)
        if rows is None:
            continue
        work, forward_lag, backward_lag = rows[:, 0], lag * rows[:, 1], lag * rows[:, 2]
        keys = [work, work + forward_lag, work + backward_lag, work + forward_lag + backward_lag]
        if chain.replicas > 1:     # the synchronization term's Δ_f alone (docstring)
            keys.append(forward_lag)
        front = rows[_pareto(np.stack(keys, axis=1), np.zeros(len(rows), dtype=int))]
        fronts[end + 1] = _merged(front, _PREFIX_FRONT_LIMIT)
    return fronts


def _priced_prefix_fronts(chain: _Chain) -> list[np.ndarray]:
    """For each i, rows W_p, Δ_f, Δ_b, P_p (Σ price) standing for every prefix of layers
    0..i−1, one per band of prices ``_PRICE_BAND`` wide: the least of each column over the
    prefixes whose price falls in the band. A cost-weighted score multiplies t_iter by the
    price, and the prefixes with the least bottlenecks are the ones with many stages, the
    dearest: bounding time and price of one band together (rather than each at its least
    over every prefix, as :func:`_prefix_fronts` with :attr:`_PrefixBounds.price` does)
    keeps that trade-off, and prunes most labels of the cost-weighted goals (issue 42).
    Each row is no larger than any prefix of its band in any column, and every prefix is in
    some band, so the bound over the rows (and over their extensions, which only add and
    take maxima) is a lower bound."""
    lag = chain.mu - 1
    fronts = [np.zeros((1, 4))] + [np.empty((0, 4)) for _ in range(chain.layers)]
    for end in range(chain.layers - 1):
        rows = _prefix_extensions(chain, fronts, end)
        if rows is None:
            continue
        bands = np.floor(np.log(rows[:, 3]) / math.log(_PRICE_BAND)).astype(int)   # every price > 0
        order = np.argsort(bands, kind="stable")
        firsts = np.flatnonzero(np.diff(bands[order], prepend=bands[order[0]] - 1))
        least = np.minimum.reduceat(rows[order], firsts, axis=0)
        work, forward_lag, backward_lag = least[:, 0], lag * least[:, 1], lag * least[:, 2]
        keys = [work, work + forward_lag, work + backward_lag, work + forward_lag + backward_lag, least[:, 3]]
        if chain.replicas > 1:
            keys.append(forward_lag)
        fronts[end + 1] = least[_pareto(np.stack(keys, axis=1), np.zeros(len(least), dtype=int))]
    return fronts


def _prefix_extensions(chain: _Chain, fronts: list[np.ndarray], end: int) -> np.ndarray | None:
    """Rows W_p, Δ_f, Δ_b, P_p of every prefix of layers 0..end+1−1 whose last stage start..end
    (on each option worth trying) extends a row of ``fronts[start]``, its upload across
    boundary ``end`` included; None when no stage ending at ``end`` extends a prefix. All
    starts in one numpy pass."""
    kept = chain.kept_table
    candidates = np.arange(max(0, end + 1 - kept.shape[1]), end + 1)
    usable = kept[candidates, end - candidates].any(axis=1)
    fitting = cast("list[bool]", usable.tolist())   # a 1-d array's list (numpy's stubs allow a scalar)
    starts = [start for start, fits in zip(candidates.tolist(), fitting) if fits and len(fronts[start])]
    if not starts:
        return None
    before = np.concatenate([fronts[start] for start in starts])
    origin = np.repeat(starts, [len(fronts[start]) for start in starts])
    row, option = np.nonzero(kept[origin, end - origin])                 # every (prefix, option) pair
    first, before = origin[row], before[row]
    fwd = chain.forward_prefix[option, end + 1] - chain.forward_prefix[option, first]
    bwd = chain.backward_prefix[option, end + 1] - chain.backward_prefix[option, first]
    upload = chain.transfer(end, option)
    # the download into the stage is at its own option's bandwidth (none into the first stage)
    download = np.where(first > 0, chain.transfer(first - 1, option), 0.0)
    rows = np.empty((len(row), 4))
    rows[:, 0] = before[:, 0] + fwd + bwd + 2 * (upload + download)
    rows[:, 1] = np.maximum(before[:, 1], np.maximum(np.maximum(fwd, upload), download))
    rows[:, 2] = np.maximum(before[:, 2], np.maximum(np.maximum(bwd, upload), download))
    rows[:, 3] = before[:, 3] + chain.price[option]
    return rows


def _merged(rows: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` rows, each the least of a run of neighbours by work: a row no larger
    than every row it stands for, so a bound taken over them (and over their extensions,
    which only add and take maxima) is still a lower bound — looser, but the fronts stop
    growing with the chain (AmoebaNet's reach hundreds of rows at L = 64)."""
    if len(rows) <= limit:
        return rows
    ordered = rows[np.argsort(rows[:, 0], kind="stable")]
    starts = np.linspace(0, len(ordered), limit, endpoint=False).astype(int)
    return np.minimum.reduceat(ordered, starts, axis=0)


def _dominance_keys(values: np.ndarray, lag: int, prices_matter: bool, synchronizes: bool,
                    componentwise: bool = False) -> np.ndarray:
    """(n, k) keys of labels ``values`` (V, P, Δ_f, Δ_b, Q) such that a label no worse in
    every key than another is no worse for every completion (``lag``: µ − 1).

    By default, the sums that can decide t_iter's maximum (module docstring). Each is
    needed only where its terms can matter: P when the goal prices the plan; the Δ sums
    when µ > 1; the Q sums when d > 1 (with d = 1, Q ≤ (µ−1)·Δ_b − the download and the
    first stage's term (µ−1)·Δ_b always reaches the maximum). Each key is a sum of the
    numbers ``componentwise`` compares one by one, so whatever that keeps this also
    drops, and more. ``componentwise``: V, P, Δ_f, Δ_b, Q each on its own (the reference)."""
    volume = values[:, V]
    keys = [volume]
    if prices_matter:
        keys.append(values[:, P])
    if componentwise:
        keys += [values[:, DF], values[:, DB]] if lag > 0 else []
        keys += [values[:, Q]] if synchronizes else []
        return np.stack(keys, axis=1)
    if lag > 0:
        forward_lag, backward_lag = lag * values[:, DF], lag * values[:, DB]
        keys += [volume + forward_lag, volume + backward_lag, volume + forward_lag + backward_lag]
    if synchronizes:
        keys += [volume + values[:, Q], volume + lag * values[:, DF] + values[:, Q]]
    return np.stack(keys, axis=1)


def _pareto(keys: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Indices of the rows no other row of the same group dominates in ``keys`` (one row
    kept among equal ones)."""
    if len(keys) <= 1:
        return np.arange(len(keys))
    if (groups == groups[0]).all():
        return _front(keys)
    kept_rows = []
    for group in np.unique(groups):
        members = np.flatnonzero(groups == group)
        kept_rows.append(members[_front(keys[members])])
    return np.sort(np.concatenate(kept_rows))


def _front(keys: np.ndarray) -> np.ndarray:
    """Positions of the non-dominated rows of ``keys`` (the first of equal rows), sorted.

    The rows are ordered so that a row's dominators all come before it: by the sum of the
    keys normalized to [0, 1] (floating-point sums are monotone, so a dominator's is no
    larger), ties by the keys themselves. Then, repeatedly, the first rows still undecided
    are a batch whose non-dominated members are on the front (whatever could dominate them
    came earlier and is on the front or was dominated by it), and every later row one of
    them dominates is dropped at once. The strongest rows come first and remove most
    others in the first rounds; the batch doubles as the front is found."""
    count = keys.shape[0]
    if count <= 1:
        return np.arange(count)
    low, high = keys.min(axis=0), keys.max(axis=0)
    strength = ((keys - low) / np.where(high > low, high - low, 1.0)).sum(axis=1)
    order = np.lexsort((*keys.T[::-1], strength))
    ordered = keys[order]
    undecided = np.arange(count)
    kept = []
    size = _FRONT_BATCH
    while len(undecided):
        head, undecided = undecided[:size], undecided[size:]
        head_keys = ordered[head]
        beaten = _no_worse(head_keys, head_keys) & np.tri(len(head), k=-1, dtype=bool)
        winners = ~beaten.any(axis=1)
        kept.append(head[winners])
        if len(undecided):
            undecided = undecided[~_no_worse(head_keys[winners], ordered[undecided]).any(axis=1)]
        size = min(2 * size, _FRONT_BATCH_MAX)
    return np.sort(order[np.concatenate(kept)])


def _no_worse(rows: np.ndarray, others: np.ndarray) -> np.ndarray:
    """(len(others), len(rows)) bool: whether rows[j] is no worse than others[i] in every
    key (one column at a time: no (n, m, k) temporary)."""
    result = rows[None, :, 0] <= others[:, None, 0]
    for column in range(1, rows.shape[1]):
        result &= rows[None, :, column] <= others[:, None, column]
    return result


class _Search:
    """One right-to-left pass for one (M, d, S)."""

    def __init__(self, chain: _Chain, objective: _Objective, incumbent: float, beam: int | None,
                 stats: _Stats, reference: bool = False, deadline: float | None = None,
                 staircase: _Staircase | None = None) -> None:
        self.chain = chain
        self.deadline = deadline
        self.staircase = staircase            # the exact front's pass prunes with it, not the incumbent
        self.complete_from = chain.layers     # labels[i] for i ≥ this are complete
        self.objective = objective
        self.incumbent = incumbent
        self.beam = beam
        self.stats = stats
        self.bounds = chain.prefix_bounds
        self.reference = reference           # the pre-issue-20 filter and bound, for comparison
        self.prices_matter = objective.goal.slo_s is not None or objective.goal.weights.cost > 0
        self.labels: list[_Labels] = [_empty_labels() for _ in range(chain.layers + 1)]

    def run(self) -> tuple[float, float, int] | None:
        """(score, t_iter, row) of the best complete plan, or None."""
        chain = self.chain
        for start in range(chain.layers - 1, -1, -1):
            if self.deadline is not None and time.perf_counter() > self.deadline:
                raise _OutOfTime
            self.labels[start] = self._labels_from(start)
            self.complete_from = start
        first = self.labels[0]
        if chain.stage_count is not None:
            keep = first.count == chain.stage_count
        else:
            keep = np.ones(len(first.tier), dtype=bool)
        if not keep.any():
            return None
        times = self._times(first.values)
        scores = np.where(keep, self.objective.score(times, first.values[:, P]), np.inf)
        best_rows = np.flatnonzero(scores == scores.min())
        row = int(best_rows[np.argmin(times[best_rows])])
        if not np.isfinite(scores[row]):
            return None
        return float(scores[row]), float(times[row]), row

    def proven_bound(self) -> float:
        """A lower bound on the score of every plan of this configuration, from what the pass
        has done so far (none of it, a part, or all): every plan either has a stage starting at
        some i ≥ ``complete_from``, so its suffix from i is a label there, one that dominates
        it (whose bound is no larger: the bound is a completion of the label) or one pruned for
        a bound above the incumbent; or its last stage starts before, which the bound of that
        last stage alone covers."""
        least = min(self.incumbent, self.unsearched_bound())
        for start in range(self.complete_from, self.chain.layers):
            if len(self.labels[start].tier):
                least = min(least, float(self._lower_scores(start, self.labels[start].values)[0].min()))
        return least

    def unsearched_bound(self) -> float:
        """A lower bound on the score of every plan whose last stage starts before
        ``complete_from`` (before :meth:`run`: every plan of the configuration), from the
        bound of that last stage alone; +inf when there is none."""
        chain = self.chain
        least = math.inf
        last = chain.layers - 1
        for start in range(self.complete_from):
            if last - start >= len(chain.fits[start]):
                continue   # the last stage from here holds more than any tier
            options = chain.stage_options(start, last)
            if options is None:
                continue
            values, tier = self._last_stage(last, options)[:2]
            if start > 0:
                _enter(values, chain.transfer(start - 1, tier))
            least = min(least, float(self._lower_scores(start, values)[0].min()))
        return least

    def _times(self, values: np.ndarray) -> np.ndarray:
        return values[:, V] + (self.chain.mu - 1) * values[:, DF] + values[:, Q]

    def _labels_from(self, start: int) -> _Labels:
        chain = self.chain
        last = chain.layers - 1
        parts: list[tuple] = []
        options = chain.stage_options(start, last)
        if options is not None:
            parts.append(self._last_stage(last, options))
        row = chain.stage_row(start)
        ends = [end for end in range(start, min(start + len(row.kept), last))
                if len(self.labels[end + 1].tier) and row.kept[end - start].any()]
        if ends:
            parts.append(self._extend(start, row, ends))
        if not parts:
            return _empty_labels()
        values = np.concatenate([part[0] for part in parts])
        tier, end, next_row, count = (np.concatenate([part[i] for part in parts]) for i in range(1, 5))
        if start > 0:
            _enter(values, chain.transfer(start - 1, tier))
        self.stats.labels_built += len(values)
        keep, bounded = self._within_bounds(start, values, count)
        values, tier, end, next_row, count = values[keep], tier[keep], end[keep], next_row[keep], count[keep]
        # labels with different stage counts compete only when S is free
        groups = count if chain.stage_count is not None else np.zeros(len(count), dtype=int)
        if self.beam is None:
            rows = _pareto(self._keys(values), groups)
        else:  # a heuristic pass: the best few by bound, then the non-dominated among them
            # (ranked by the bounds the pruning computed, where it did)
            scores, times = self._lower_scores(start, values) if bounded is None else (bounded[0][keep],
                                                                                       bounded[1][keep])
            rows = _best_per_group(scores, times, groups, np.arange(len(values)), 4 * self.beam)
            rows = rows[_pareto(self._keys(values[rows]), groups[rows])]
            rows = _best_per_group(scores, times, groups, rows, self.beam)
        self.stats.labels_kept += len(rows)
        return _Labels(values[rows], tier[rows], end[rows], next_row[rows], count[rows])

    def _keys(self, values: np.ndarray) -> np.ndarray:
        return _dominance_keys(values, self.chain.mu - 1, self.prices_matter, self.chain.replicas > 1,
                               self.reference)

    def _last_stage(self, end: int, options: _StageOptions) -> tuple:
        tiers, forward, backward, sync = options.tiers, options.forward, options.backward, options.sync
        mu = self.chain.mu
        values = np.stack([forward[tiers] + backward[tiers], self.chain.price[tiers], forward[tiers],
                           backward[tiers], (mu - 1) * backward[tiers] + sync[tiers]], axis=1)
        n = len(tiers)
        return values, tiers, np.full(n, end), np.full(n, -1), np.ones(n, dtype=int)

    def _extend(self, start: int, row: _StageRow, ends: list[int]) -> tuple:
        """Prepend each stage start..end (``ends``) on each of its options to every label of
        end + 1 (whose values already hold the download across boundary ``end``, see
        :func:`_enter`), all stages in one numpy pass: per layer, the Python work is a few
        calls however many stages and labels there are."""
        chain = self.chain
        blocks = [self.labels[end + 1] for end in ends]
        sizes = np.array([len(block.tier) for block in blocks])
        old = np.concatenate([block.values for block in blocks])
        offsets = np.repeat(np.array(ends) - start, sizes)                  # stage end − start, per old label
        rows = np.arange(len(old)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        label, option = np.nonzero(row.kept[offsets])                        # every (old label, option) pair
        offset = offsets[label]
        old = old[label]
        fwd, bwd, sync = row.forward[offset, option], row.backward[offset, option], row.sync[offset, option]
        upload = chain.transfer(start + offset, option)                      # at this stage's bandwidth
        values = np.empty((len(label), 5))
        values[:, V] = fwd + bwd + 2 * upload + old[:, V]
        values[:, P] = chain.price[option] + old[:, P]
        values[:, DF] = np.maximum(np.maximum(fwd, upload), old[:, DF])
        values[:, DB] = np.maximum(np.maximum(bwd, upload), old[:, DB])
        values[:, Q] = np.maximum((chain.mu - 1) * values[:, DB] + sync, old[:, Q] - (bwd + upload))
        counts = np.concatenate([block.count for block in blocks])
        return values, option, start + offset, rows[label], counts[label] + 1

    def _lower_scores(self, start: int, values: np.ndarray, coarse: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Lower bounds on the score and t_iter of any completion of each label (``coarse``,
        or the reference: each prefix quantity at its own least, cheaper and no tighter).

        With the prefix's work W_p (forward, backward, its upload across boundary start−1),
        its forward part F_p and its own bottleneck terms A_p = max over its stages of
        (µ−1)·Δ_b + t_s, and the label's values with the download into it included:
        t_iter = W_p + V + (µ−1)·Δ_f + max(A_p, Q − (W_p − F_p)) with Δ_f the larger of the
        label's and the prefix's, and A_p ≥ (µ−1)·Δ_b + t_s of the first stage, so
        t_iter ≥ V + (µ−1)·Δ_f + max(W_p + (µ−1)·Δ_b + t_s, F_p + Q): the least over the
        prefix fronts (W_p, Δ_f, Δ_b of one prefix together), t_s and F_p at their least.
        The price is the label's plus the least a prefix adds."""
        chain = self.chain
        if start == 0:
            times = self._times(values)
            return self.objective.score(times, values[:, P]), times
        bounds = self.bounds
        if self.reference or coarse:   # each prefix quantity at its own least
            df = np.maximum(values[:, DF], bounds.forward_lag[start])
            db = np.maximum(values[:, DB], bounds.backward_lag[start])
            prefix_terms = (chain.mu - 1) * db + bounds.first_sync
            times = (values[:, V] + (chain.mu - 1) * df
                     + np.maximum(bounds.work[start].min() + prefix_terms, bounds.forward[start].min() + values[:, Q]))
            return self.objective.score(times, values[:, P] + bounds.price[start]), times
        priced = self.prices_matter
        front = chain.priced_prefix_fronts[start] if priced else chain.prefix_fronts[start]
        times = np.full(len(values), np.inf)
        if len(front) == 0:   # no prefix fits
            return times.copy(), times
        lag = chain.mu - 1
        # the terms of one side computed once: (µ−1)·Δ of the rows and of the labels, the
        # rows' work with the sync, the labels' F_min + Q; then five (labels × rows) operations
        row_forward, row_backward, row_work = lag * front[:, 1], lag * front[:, 2], front[:, 0] + bounds.first_sync
        label_forward, label_backward = lag * values[:, DF], lag * values[:, DB]
        label_sync = bounds.forward[start].min() + values[:, Q]
        scores = np.full(len(values), np.inf)
        step = max(1, _BOUND_CELLS // len(front))
        for first in range(0, len(values), step):      # labels × prefixes, in slices that fit memory
            part = slice(first, first + step)
            prefix_times = np.maximum(label_backward[part, None], row_backward[None, :])
            prefix_times += row_work[None, :]
            np.maximum(prefix_times, label_sync[part, None], out=prefix_times)
            prefix_times += np.maximum(label_forward[part, None], row_forward[None, :])
            prefix_times += values[part, V, None]
            times[part] = prefix_times.min(axis=1)
            if priced:   # each prefix's time with its own price
                scores[part] = self.objective.least_score(prefix_times, values[part, P], front[:, 3])
        if not priced:
            scores = self.objective.score(times, values[:, P] + bounds.price[start])
        return scores, times

    def _within_bounds(self, start: int, values: np.ndarray,
                       count: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
        """Which labels may still complete to a plan that beats the incumbent (or, for the
        exact front, add a point to it); with the (score, t_iter) bounds of every label the
        full bound was computed for (+inf for the others), or None where it was not run."""
        keep = np.ones(len(values), dtype=bool)
        bounded = None
        if self.chain.stage_count is not None:
            keep &= count + (start > 0) <= self.chain.stage_count
        if np.isfinite(self.incumbent) or self.objective.goal.slo_s is not None:
            # the coarse bound first: the labels it already prunes skip the costlier one
            for coarse in (True, False) if not self.reference else (True,):
                rows = np.flatnonzero(keep)
                scores, times = self._lower_scores(start, values[rows], coarse)
                keep[rows] = np.isfinite(scores) & (scores <= self.incumbent * (1 + _RELATIVE_SLACK))
                if not coarse or self.reference:
                    bounded = (np.full(len(values), np.inf), np.full(len(values), np.inf))
                    bounded[0][rows], bounded[1][rows] = scores, times
        if self.staircase is not None:
            _, times = self._lower_scores(start, values)
            prices = values[:, P] + self.bounds.price[start]
            keep &= np.isfinite(times) & ~self.staircase.dominates(times, times * self.chain.replicas * prices)
        return keep, bounded

    def complete_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows, t_iter and dollars of the complete plans the pass kept (after :meth:`run`)."""
        first = self.labels[0]
        rows = np.arange(len(first.tier))
        if self.chain.stage_count is not None:
            rows = rows[first.count == self.chain.stage_count]
        times = self._times(first.values[rows])
        return rows, times, times * self.chain.replicas * first.values[rows, P]

    def plan(self, row: int, num_layers: int) -> Plan:
        stages = []
        start = 0
        labels = self.labels[0]
        while True:
            end = int(labels.end[row])
            option = int(labels.tier[row])
            stages.append(StagePlan(start, end, self.chain.tiers[option].memory_mb, self.chain.replicas,
                                    recompute=bool(self.chain.recompute[option])))
            next_row = int(labels.next_row[row])
            if next_row < 0:
                break
            start = end + 1
            labels, row = self.labels[start], next_row
        return Plan(tuple(stages), num_layers, "dp", micro_batches=self.chain.micro_batches)


def _best_per_group(scores: np.ndarray, times: np.ndarray, groups: np.ndarray, rows: np.ndarray,
                    width: int) -> np.ndarray:
    """Of ``rows``, the ``width`` with the least bound ``scores`` (then ``times``) in each group,
    sorted."""
    chosen = []
    for group in np.unique(groups[rows]):
        members = rows[groups[rows] == group]
        chosen.extend(members[np.lexsort((times[members], scores[members]))][:width])
    return np.sort(np.array(chosen, dtype=int))


def _undominated_tiers(chain: _Chain, fits: np.ndarray, forward: np.ndarray, backward: np.ndarray,
                       sync: np.ndarray) -> np.ndarray:
    """(E, K) bool: per stage (row), the fitting options no other fitting option beats: one
    that is no dearer, no slower to compute, synchronize or transfer (bandwidth) serves every
    completion at least as well (on Lambda, tiers past the compute and bandwidth plateaus
    only cost more). Of equal options the first is kept."""
    count, options = fits.shape
    # columns where smaller is better; bandwidth enters negated
    traits = np.stack([np.broadcast_to(chain.price, (count, options)), forward, backward, sync,
                       np.broadcast_to(-chain.bandwidth, (count, options))], axis=2)         # (E, K, 5)
    # [e, k, k']: option k' fits and is no worse than k for stage e
    no_worse = np.all(traits[:, None, :, :] <= traits[:, :, None, :], axis=3) & fits[:, None, :]
    strictly = np.any(traits[:, None, :, :] < traits[:, :, None, :], axis=3)
    earlier_twin = no_worse & ~strictly & np.tri(options, k=-1, dtype=bool)[None]
    beaten = (no_worse & strictly).any(axis=2) | earlier_twin.any(axis=2)
    return fits & ~beaten


def _enter(values: np.ndarray, download: np.ndarray) -> None:
    """Fold the download across the boundary before a suffix into its labels, in place.

    That transfer depends only on the suffix's first tier, so with it folded in, labels of
    suffixes with different first tiers compete in one dominance set: a stage prepended on
    tier k then adds its upload and sees V + 2·down, max(Δ, down) and Q − down, which is
    exactly what the boundary contributes (FuncPipe App. B: t_fd = t_bu = o/W_upper + t_lat)."""
    values[:, V] += 2 * download
    values[:, DF] = np.maximum(values[:, DF], download)
    values[:, DB] = np.maximum(values[:, DB], download)
    values[:, Q] -= download


def _coverable(chain: _Chain) -> bool:
    """Whether fitting stages can tile the whole chain (a later layer may fit nowhere)."""
    reachable = [False] * chain.layers + [True]
    for start in range(chain.layers - 1, -1, -1):
        reachable[start] = any(fits.any() and reachable[start + offset + 1]
                               for offset, fits in enumerate(chain.fits[start]))
    return reachable[0]


def _configurations(problem: Problem, space: SearchSpace) -> list[tuple[int, int, int | None]]:
    """(M, d, S) to search; S only when an account-wide bandwidth cap makes each worker's
    share depend on the number of stages."""
    capped = problem.platform.aggregate_bandwidth_bytes_s is not None
    stage_counts: list[int | None] = list(range(1, len(problem.chain) + 1)) if capped else [None]
    return [(m, d, s) for m, d in space.configurations() for s in stage_counts]


def solve(problem: Problem, goal: Goal, space: SearchSpace | None = None,
          reference: bool = False, time_limit_s: float | None = None) -> Plan | None:
    """The plan minimizing ``goal`` under FuncPipe's model over the whole search space, or
    None when no plan meets the goal's SLO. Raises PlanError when nothing fits memory.
    ``reference`` runs the pre-issue-20 algorithm (module docstring); both are exact.
    ``time_limit_s``: past it the exact pass stops, and the plan is the best found, with
    status "feasible", ``lower_bound`` (proven) and ``gap`` in its predictions."""
    return solve_all(problem, [goal], space, reference, time_limit_s)[0]


def solve_all(problem: Problem, goals: Sequence[Goal], space: SearchSpace | None = None,
              reference: bool = False, time_limit_s: float | None = None) -> list[Plan | None]:
    """:func:`solve` for several goals (a front), sharing the per-(M, d) tables, and seeding
    each goal's incumbent with the best of the plans found for the earlier goals;
    ``time_limit_s`` bounds the whole call (a goal reached after it gets its beam plan and
    its bound)."""
    started = time.perf_counter()
    deadline = None if time_limit_s is None else started + time_limit_s
    space = space or SearchSpace.of(problem)
    configurations, chains = _tables(problem, space)
    return _solve_goals(problem, space, goals, configurations, chains, time.perf_counter() - started, reference,
                        deadline)


def _solve_goals(problem: Problem, space: SearchSpace, goals: Sequence[Goal], configurations: list, chains: dict,
                 setup_s: float, reference: bool, deadline: float | None) -> list[Plan | None]:
    plans: list[Plan | None] = []
    for goal in goals:
        seed = _best_seed(problem, goal, [plan for plan in plans if plan is not None])
        plans.append(_solve_goal(problem, goal, chains, configurations, seed, setup_s, reference, deadline))
    if all(plan is None for plan in plans) and all(goal.slo_s is None for goal in goals):
        _raise_nothing_fits(problem, space)
    return plans


def exact_front(problem: Problem, space: SearchSpace | None = None, reference: bool = False) -> list[Plan]:
    """Every non-dominated (t_iter, dollars) plan of the search space, fastest first (one plan
    per point). FuncPipe's four weight pairs are solved first (their optima are points of
    the front and seed the staircase); then each configuration's pass keeps every label no
    found plan matches in both least time and least dollars, and adds its complete plans.
    Each weight pair's optimum is a point of the result, tagged in ``weights``."""
    started = time.perf_counter()
    space = space or SearchSpace.of(problem)
    configurations, chains = _tables(problem, space)
    goals = [Goal(Weights(*pair)) for pair in FUNCPIPE_WEIGHTS]
    weighted = _solve_goals(problem, space, goals, configurations, chains, time.perf_counter() - started, reference,
                            None)
    optima = [(goal, plan) for goal, plan in zip(goals, weighted) if plan is not None]
    anchors = [plan for _, plan in optima]
    staircase = _Staircase()
    staircase.add(np.array([plan.predictions["time_s"] for plan in anchors]),
                  np.array([plan.predictions["dollars"] for plan in anchors]))
    unit = dollars_per_mb_s(problem.platform)
    stats = _Stats()
    found: list[Plan] = list(anchors)
    for config in configurations:
        chain = chains[config]
        # a cost-weighted goal so that the filter keeps the price; the staircase does the pruning
        search = _Search(chain, _Objective(Goal(Weights(1.0, 0.0)), chain.replicas, unit), math.inf, None, stats,
                         reference, staircase=staircase)
        stats.searches += 1
        search.run()
        rows, times, dollars = search.complete_points()
        keep = np.flatnonzero(~staircase.dominates(times, dollars))
        found += [search.plan(int(rows[index]), len(problem.chain)) for index in keep]
        staircase.add(times[keep], dollars[keep])
    solve_s = time.perf_counter() - started
    labels = {"labels_built": stats.labels_built, "labels_kept": stats.labels_kept}
    front = non_dominated([annotate(plan, evaluate(problem, plan), status="optimal", **labels) for plan in found])
    return [plan.with_predictions(solve_s=solve_s, front="exact",
                                  weights=[goal.weights.label() for goal, anchor in optima
                                           if _same_point(plan, anchor)])
            for plan in front]


def _same_point(plan: Plan, other: Plan) -> bool:
    return (math.isclose(plan.predictions["time_s"], other.predictions["time_s"], rel_tol=1e-9)
            and math.isclose(plan.predictions["dollars"], other.predictions["dollars"], rel_tol=1e-9))


def _tables(problem: Problem, space: SearchSpace) -> tuple[list, dict]:
    """The configurations (M, d, S) to search and each one's :class:`_Chain`; PlanError when
    no configuration can tile the chain with stages that fit."""
    tiers = [problem.platform.tier(memory) for memory in space.memory_mb]
    tensors = _stage_tensor_table(problem)
    configurations = _configurations(problem, space)
    chains = {config: _chain(problem, tensors, tiers, *config) for config in configurations}
    if not any(_coverable(chain) for chain in chains.values()):
        _raise_nothing_fits(problem, space)
    return configurations, chains


def _best_seed(problem: Problem, goal: Goal, plans: list[Plan]) -> Result | None:
    """The best of ``plans`` under ``goal``: any feasible plan's score bounds the optimum."""
    best = None
    for plan in plans:
        evaluation = evaluate(problem, plan)
        score = goal.score(evaluation.time_s, evaluation.cost_units, evaluation.dollars)
        if score is not None and better(score, best.score if best else None):
            best = Result(plan, score)
    return best


def _solve_goal(problem: Problem, goal: Goal, chains: dict, configurations: list, seed: Result | None,
                setup_s: float, reference: bool, deadline: float | None = None) -> Plan | None:
    """The best plan for ``goal``; past ``deadline``, the best plan so far with status
    "feasible", the proven lower bound and the gap (the beam pass runs on past the deadline
    until it has a plan, so that there is one to return whenever one exists)."""
    started = time.perf_counter()
    unit = dollars_per_mb_s(problem.platform)
    stats = _Stats()
    # pass 1: a beam per configuration, for an incumbent; pass 2: exact, pruned by it, the
    # configurations in the order of their beam results (the best first prunes the most)
    # Each configuration's bound comes first (cheap): the beam visits the most promising first,
    # and a configuration whose bound is above the incumbent is not searched at all (its labels
    # would all be pruned; the reference searches every one, as before issue 42).
    best = seed
    incumbent = seed.score[0] if seed else math.inf
    beam_scores: dict = {}
    open_bounds: list[float] = []     # configurations the deadline left unproven
    screens = {} if reference else {config: _Search(chains[config], _Objective(goal, chains[config].replicas, unit),
                                                    math.inf, None, stats).unsearched_bound()
                                    for config in configurations}
    for beam in (BEAM_WIDTH, None):
        order = sorted(configurations, key=lambda config: (beam_scores.get(config, math.inf), screens.get(config, 0)))
        for config in order:
            if screens.get(config, -math.inf) > incumbent * (1 + _RELATIVE_SLACK):
                continue
            chain = chains[config]
            search = _Search(chain, _Objective(goal, chain.replicas, unit), incumbent, beam, stats, reference,
                             deadline if beam is None else None)
            out_of_time = deadline is not None and best is not None and time.perf_counter() > deadline
            if open_bounds or out_of_time:   # bound this configuration without searching it
                open_bounds.append(search.proven_bound())
                continue
            stats.searches += 1
            try:
                found = search.run()
            except _OutOfTime:
                open_bounds.append(search.proven_bound())
                continue
            if found is None:
                continue
            score, time_s, row = found
            beam_scores.setdefault(config, score)
            if better((score, time_s), best.score if best else None):
                best = Result(search.plan(row, len(problem.chain)), (score, time_s))
                incumbent = min(incumbent, score)
    if best is None:
        if open_bounds:
            raise PlanError(f"dp found no plan for {goal.describe()} before its time limit, and cannot yet say "
                            "whether one exists; raise time_limit_s or drop it (dp then runs to the proof)")
        return None
    solve_s = time.perf_counter() - started
    value = best.score[0]
    lower = min([value, *open_bounds])
    gap = (value - lower) / value if value > 0 else 0.0
    return annotate(best.plan, evaluate(problem, best.plan), status="feasible" if open_bounds else "optimal",
                    objective=value, lower_bound=lower, gap=gap, solve_s=solve_s + setup_s, setup_s=setup_s,
                    labels_built=stats.labels_built, labels_kept=stats.labels_kept, searches=stats.searches,
                    configurations_unproven=len(open_bounds))


def _raise_nothing_fits(problem: Problem, space: SearchSpace) -> None:
    """Every stage overflows every tier at every (M, d): say which layer and by how much."""
    check_layers_fit(problem, replicas=min(space.replicas))
    raise PlanError(f"no plan fits the memory of {problem.platform.name}'s tiers {list(space.memory_mb)} MB at "
                    f"micro_batches {list(space.micro_batches)} and replicas {list(space.replicas)}; allow larger "
                    "tiers, more micro-batches (smaller ones) or an optimizer with less state")
