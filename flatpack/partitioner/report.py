"""Plans for people: the front as a terminal table, each plan's time and cost stage by stage
under the cost model that priced it, and the same as JSON.

A :class:`Selection` is what ``flatpack plan`` shows: the plans (fastest first), the one it
picks and why — FuncPipe's recommendation on a front, the cheapest plan within an SLO, or
the optimum of one weight pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from flatpack.errors import PlanError
from flatpack.units import MIB
from flatpack.partitioner.cost.funcpipe import PipelineCost
from flatpack.partitioner.cost.gillis import ForkJoinCost
from flatpack.partitioner.cost.hydrozoa import HybridCost
from flatpack.partitioner.cost.pipedream import PipeDreamCost
from flatpack.partitioner.cost.registry import label_of
from flatpack.partitioner.objective import Evaluation, evaluate
from flatpack.table import format_table, plural
from flatpack.partitioner.pareto import RECOMMEND_EFFICIENCY, Front, dollars_of, efficiency, time_of
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem

MARK = "★"
REPORT_KIND = "flatpack-plans"
REPORT_SCHEMA_VERSION = 1
KINDS = ("front", "slo", "weights", "fixed")


@dataclass(frozen=True)
class Selection:
    """``plans`` fastest first; ``chosen`` indexes the one picked; ``reason`` says why in a
    few words (it labels the table's marker and the plot's highlighted point)."""

    plans: tuple[Plan, ...]
    chosen: int
    kind: str
    reason: str
    slo_s: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PlanError(f"selection kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not 0 <= self.chosen < len(self.plans):
            raise PlanError(f"selection index {self.chosen} is outside its {len(self.plans)} plan(s)")

    @classmethod
    def of_front(cls, front: Front) -> Selection:
        return cls(tuple(front.plans), front.recommended, "front", "recommended")

    @classmethod
    def within_slo(cls, plan: Plan, slo_s: float) -> Selection:
        return cls((plan,), 0, "slo", f"cheapest within {slo_s:g} s", slo_s)

    @classmethod
    def of_weights(cls, plan: Plan, label: str) -> Selection:
        return cls((plan,), 0, "weights", f"optimum of weights {label}")

    @classmethod
    def of_cuts(cls, plan: Plan, label: str) -> Selection:
        """The one plan whose cuts the user fixed (``--stages``, ``--split-points``)."""
        return cls((plan,), 0, "fixed", label)

    @property
    def chosen_plan(self) -> Plan:
        return self.plans[self.chosen]


# -- the table of plans -------------------------------------------------------------------------

def unit_of(problem: Problem) -> str:
    """What one plan's time and dollars are for: a training iteration or an inference request."""
    return "request" if problem.workload.mode == "infer" else "iteration"


def front_table(problem: Problem, selection: Selection) -> str:
    """One row per plan — stages, layer ranges, tiers, replicas (workers per group for
    inference), M, time, dollars, MB·s, δ on a front — and the marker on the chosen one."""
    inference = problem.workload.mode == "infer"
    on_front = selection.kind == "front"
    cheapest = min(selection.plans, key=lambda plan: (dollars_of(plan), time_of(plan)))
    header = ["#", "stages", "layers", "tiers MB", "workers" if inference else "replicas", "M", "time s",
              f"$ per {unit_of(problem)}", "MB·s"]
    if on_front:
        header.append("δ")
    rows = []
    for index, plan in enumerate(selection.plans):
        row = [str(index), str(len(plan.stages)), _layer_ranges(plan), _tiers(plan), _replicas(plan),
               "-" if inference else str(plan.micro_batches_for(problem.workload)),
               f"{time_of(plan):.4g}", f"{dollars_of(plan):.3e}", _mb_s(plan)]
        if on_front:
            row.append(_efficiency(plan, cheapest))
        row.append(f"{MARK} {selection.reason}" if index == selection.chosen else "")
        rows.append(row)
    numeric = {0, 1, 5, 6, 7, 8, 9} if on_front else {0, 1, 5, 6, 7, 8}
    header.append("")
    return format_table(header, rows, numeric=numeric)


def _layer_ranges(plan: Plan) -> str:
    return " ".join(_range(stage.start, stage.end) + (RECOMPUTE_MARK if stage.recompute else "")
                    for stage in plan.stages)


def _tiers(plan: Plan) -> str:
    return " ".join("-" if stage.memory_mb is None else str(stage.memory_mb) for stage in plan.stages)


def _replicas(plan: Plan) -> str:
    degrees = plan.replicas
    # FuncPipe and Hydrozoa give every stage one degree: print it once
    return str(degrees[0]) if len(set(degrees)) == 1 else " ".join(map(str, degrees))


def _mb_s(plan: Plan) -> str:
    value = plan.predictions.get("cost_mb_s")
    return "-" if value is None else f"{float(value):,.1f}"


def _efficiency(plan: Plan, cheapest: Plan) -> str:
    if plan is cheapest:
        return "-"
    value = efficiency(plan, cheapest)
    return "∞" if math.isinf(value) else f"{value:.2f}"


def explain(problem: Problem, selection: Selection) -> str:
    """A sentence under the table: what the marker means."""
    chosen = selection.chosen_plan
    if selection.kind == "slo":
        return (f"{MARK} plan {selection.chosen}: the cheapest plan whose {unit_of(problem)} time meets the SLO of "
                f"{selection.slo_s:g} s ({time_of(chosen):.4g} s, {_percent(time_of(chosen), selection.slo_s)} of it)")
    if selection.kind == "fixed":
        return (f"{MARK} plan {selection.chosen}: the cuts asked for ({selection.reason}), each stage the replicas "
                "asked for (one unless --replicas or --stage-replicas says) on the smallest memory tier that fits, "
                "priced by the cost model")
    if selection.kind == "weights":
        return (f"{MARK} plan {selection.chosen}: the {selection.reason}, minimizing α₁·MB·s + α₂·seconds "
                "(FuncPipe eq. 3a)")
    if selection.reason == "fastest":
        return f"{MARK} plan {selection.chosen}: the fastest plan on the front"
    cheapest = min(range(len(selection.plans)),
                   key=lambda i: (dollars_of(selection.plans[i]), time_of(selection.plans[i])))
    if len(selection.plans) == 1:
        return f"{MARK} plan 0: the only plan on the front (every weight pair gives it)"
    if selection.chosen == cheapest:
        return (f"{MARK} plan {selection.chosen}: the cheapest; no faster plan buys its speed-up efficiently "
                f"enough (δ ≥ {RECOMMEND_EFFICIENCY:g}, FuncPipe §5.1)")
    return (f"{MARK} plan {selection.chosen}: the fastest plan whose speed-up over the cheapest per unit of extra "
            f"cost, δ, is at least {RECOMMEND_EFFICIENCY:g} (FuncPipe §5.1)")


def _percent(part: float, whole: float | None) -> str:
    return "-" if not whole else f"{100 * part / whole:.0f}%"


# -- one plan, stage by stage -------------------------------------------------------------------

def stage_breakdown(problem: Problem, plan: Plan, evaluation: Evaluation | None = None) -> str:
    """The plan's time and dollars by stage (group, shard) under the cost model that prices
    it, with each stage's share of the cost and its memory by part."""
    evaluation = evaluation or evaluate(problem, plan)
    detail = evaluation.detail
    if isinstance(detail, PipelineCost):
        return _funcpipe_breakdown(problem, plan, detail, evaluation)
    if isinstance(detail, ForkJoinCost):
        return _gillis_breakdown(problem, detail, evaluation)
    if isinstance(detail, HybridCost):
        return _hydrozoa_breakdown(problem, detail, evaluation)
    if isinstance(detail, PipeDreamCost):
        return _pipedream_breakdown(problem, detail, evaluation)
    raise PlanError(f"no breakdown for the cost model {evaluation.model!r} ({type(detail).__name__})")


def _summary(problem: Problem, evaluation: Evaluation) -> str:
    fits = "" if evaluation.fits else "   DOES NOT FIT its memory"
    return (f"{label_of(evaluation.model)} model: {evaluation.time_s:.4g} s and "
            f"${evaluation.dollars:.3e} per {unit_of(problem)} ({evaluation.cost_units:,.1f} MB·s){fits}")


def _price(problem: Problem, memory_mb: int) -> float:
    return problem.platform.tier(memory_mb).price_per_s


def _memory(need_bytes: float, tier_mb: int) -> str:
    return f"{need_bytes / MIB:,.1f}/{tier_mb}"


def _share(part: float, total: float) -> str:
    return f"{100 * part / total:.0f}%" if total > 0 else "-"


def _memory_lines(stages: Sequence[Any], label: str) -> list[str]:
    return [f"  {label} {stage.index} memory: {stage.memory.describe()}" for stage in stages]


def _funcpipe_breakdown(problem: Problem, plan: Plan, cost: PipelineCost, evaluation: Evaluation) -> str:
    micro_batches = plan.micro_batches_for(problem.workload)
    lines = [
        _summary(problem, evaluation),
        f"  d = {plural(cost.replicas, 'replica')} of every stage, M = {micro_batches} micro-batches of "
        f"{cost.micro_batch_size:g} samples (µ = {cost.micro_batches_per_replica} per replica), "
        f"{cost.sync_method} scatter-reduce",
        f"  forward pass {cost.forward_s:.4g} s = first micro-batch {cost.first_forward_s:.4g} s + "
        f"(µ−1)·Δ_f {(cost.micro_batches_per_replica - 1) * cost.forward_lag_s:.4g} s; then the slowest stage's "
        f"backward and sync ({cost.iteration_s - cost.forward_s:.4g} s)",
        "",
    ]
    rows = []
    for stage in cost.stages:
        dollars = cost.iteration_s * cost.replicas * _price(problem, stage.memory_mb)
        rows.append([str(stage.index), _range(stage.start, stage.end) + (RECOMPUTE_MARK if stage.recompute else ""),
                     str(stage.memory_mb), str(cost.replicas),
                     f"{stage.forward_s:.4g}", f"{stage.backward_s:.4g}", f"{stage.backward_done_s:.4g}",
                     f"{stage.sync_s:.4g}", _memory(stage.memory_needed_bytes, stage.memory_mb),
                     f"{dollars:.3e}", _share(dollars, cost.dollars_per_iteration)])
    header = ["stage", "layers", "tier MB", "replicas", "fwd s/µb", "bwd s/µb", "bwd done s", "sync s",
              "memory MB need/tier", "$ per iteration", "share"]
    lines.append(_indent(format_table(header, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8, 9, 10})))
    if any(stage.recompute for stage in cost.stages):
        lines.append(f"  {RECOMPUTE_MARK.strip()}: the stage recomputes its activations in the backward (its bwd s/µb "
                     "includes the forward again; its memory keeps only inputs, outputs and one micro-batch's "
                     "activations)")
    lines.extend(_memory_lines(cost.stages, "stage"))
    for cut in cost.boundaries:
        lines.append(f"  cut after layer {cut.after_layer}: {cut.bytes / MIB:,.2f} MB per micro-batch; forward "
                     f"up {cut.forward_upload_s:.4g} s + down {cut.forward_download_s:.4g} s, gradients back up "
                     f"{cut.backward_upload_s:.4g} s + down {cut.backward_download_s:.4g} s")
    return "\n".join(lines)


def _gillis_breakdown(problem: Problem, cost: ForkJoinCost, evaluation: Evaluation) -> str:
    platform = problem.platform
    price = _price(problem, cost.memory_mb)
    lines = [
        _summary(problem, evaluation),
        f"  every function {cost.memory_mb} MB; {plural(cost.invocations, 'invocation')}; billed "
        f"{cost.billed_s:.4g} s at {cost.granularity_s:g} s granularity: duration ${cost.duration_dollars:.3e} + "
        f"requests ${cost.request_dollars:.3e}",
        "",
    ]
    master_dollars = platform.billed_seconds(cost.latency_s) * price + platform.price_per_request
    rows = [["master", "all", "-", "-", "-", "-", f"{cost.latency_s:.4g}", "-",
             f"{cost.master_weight_bytes / MIB:,.1f}", f"{master_dollars:.3e}",
             _share(master_dollars, cost.dollars_per_request)]]
    for group in cost.groups:
        dollars = group.workers * (platform.billed_seconds(group.worker_duration_s) * price
                                   + platform.price_per_request)
        where = ("master" if group.workers == 0
                 else f"{group.workers} workers" + (" + master" if group.on_master else ""))
        rows.append([str(group.index), _range(group.start, group.end), where, f"{group.partition_compute_s:.4g}",
                     f"{group.transfer_s:.4g}", f"{group.delay_s:.4g}", f"{group.latency_s:.4g}",
                     f"{group.worker_duration_s:.4g}" if group.workers else "-",
                     f"{group.partition_weight_bytes / MIB:,.1f}",
                     f"{dollars:.3e}", _share(dollars, cost.dollars_per_request)])
    header = ["group", "layers", "runs on", "compute s", "transfer s", "delay s", "latency s", "worker s",
              "weights MB", "$ per request", "share"]
    lines.append(_indent(format_table(header, rows, numeric={3, 4, 5, 6, 7, 8, 9, 10})))
    lines.append(f"  the master runs for the whole latency; weights per function must stay under "
                 f"{cost.memory_limit_bytes / MIB:,.1f} MB (the tier less the runtime)")
    return "\n".join(lines)


def _hydrozoa_breakdown(problem: Problem, cost: HybridCost, evaluation: Evaluation) -> str:
    lines = [
        _summary(problem, evaluation),
        f"  A = {cost.data_parallel} data-parallel group(s) × B = {cost.model_parallel} shard(s), M = "
        f"{cost.micro_batches} micro-batches of {cost.micro_batch_size:g} samples per group",
        f"  model-parallel pass {cost.model_parallel_s:.4g} s + gradient all-reduce {cost.sync_s:.4g} s",
        "",
    ]
    rows = []
    for shard in cost.shards:
        dollars = cost.iteration_s * cost.data_parallel * _price(problem, shard.memory_mb)
        rows.append([str(shard.index), _range(shard.start, shard.end), str(shard.memory_mb),
                     str(cost.data_parallel), f"{shard.forward_s:.4g}", f"{shard.backward_s:.4g}",
                     f"{shard.comm_in_s:.4g}", f"{shard.allreduce_s:.4g}",
                     _memory(shard.memory_needed_bytes, shard.memory_mb), f"{dollars:.3e}",
                     _share(dollars, cost.dollars_per_iteration)])
    header = ["shard", "layers", "tier MB", "replicas", "fwd s/µb", "bwd s/µb", "comm in s", "all-reduce s",
              "memory MB need/tier", "$ per iteration", "share"]
    lines.append(_indent(format_table(header, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8, 9, 10})))
    lines.extend(_memory_lines(cost.shards, "shard"))
    return "\n".join(lines)


def _pipedream_breakdown(problem: Problem, cost: PipeDreamCost, evaluation: Evaluation) -> str:
    lines = [
        _summary(problem, evaluation),
        f"  {cost.micro_batches} micro-batches × the slowest step {cost.slowest_s:.4g} s ({cost.bottleneck}); "
        f"{plural(cost.workers, 'worker')} in all",
        "",
    ]
    rows = []
    for stage in cost.stages:
        dollars = cost.iteration_s * stage.replicas * _price(problem, stage.memory_mb)
        rows.append([str(stage.index), _range(stage.start, stage.end), str(stage.memory_mb), str(stage.replicas),
                     f"{stage.compute_s:.4g}", f"{stage.sync_s:.4g}", f"{stage.time_s:.4g}", str(stage.in_flight),
                     _memory(stage.memory_needed_bytes, stage.memory_mb), f"{dollars:.3e}",
                     _share(dollars, cost.dollars_per_iteration)])
    header = ["stage", "layers", "tier MB", "replicas", "compute s/µb", "sync s", "step s", "in flight",
              "memory MB need/tier", "$ per iteration", "share"]
    lines.append(_indent(format_table(header, rows, numeric={0, 2, 3, 4, 5, 6, 7, 8, 9, 10})))
    lines.extend(_memory_lines(cost.stages, "stage"))
    for cut in cost.cuts:
        lines.append(f"  cut after layer {cut.after_layer}: {cut.bytes / MIB:,.2f} MB per micro-batch, "
                     f"{cut.time_s:.4g} s there and back")
    return "\n".join(lines)


RECOMPUTE_MARK = " R"   # after a stage's layers: it recomputes its activations in the backward


def _range(start: int, end: int) -> str:
    return str(start) if start == end else f"{start}-{end}"


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else line for line in text.splitlines())


# -- the whole report ---------------------------------------------------------------------------

def text_report(problem: Problem, selection: Selection, title: str) -> str:
    """Title, the table, what the marker means, then the chosen plan stage by stage."""
    chosen = selection.chosen_plan
    count = len(selection.plans)
    what = {"front": f"Pareto front: {plural(count, 'plan')}, fastest first", "slo": "SLO mode",
            "weights": "weighted mode", "fixed": "fixed cuts"}
    parts = [title, what[selection.kind], "", front_table(problem, selection), "", explain(problem, selection), "",
             f"plan {selection.chosen} ({selection.reason}) by stage — " + stage_breakdown(problem, chosen)]
    return "\n".join(parts)


def proof_summary(selection: Selection, time_limit_s: float) -> str:
    """What the exact solver proved within ``time_limit_s`` per solve, plan by plan: proven
    optimal, or its best plan found with the gap to the proven lower bound on its goal's
    objective (the ``status``, ``gap`` and ``lower_bound`` of its predictions)."""
    lines = [f"proofs within the time limit of {time_limit_s:g} s per solve:"]
    for index, plan in enumerate(selection.plans):
        facts = plan.predictions
        if facts.get("status") == "optimal":
            lines.append(f"  plan {index}: proven optimal")
        elif "gap" in facts and "lower_bound" in facts:
            lines.append(f"  plan {index}: {facts.get('status', 'feasible')}, gap {100 * facts['gap']:.2f} % to the "
                         f"proven lower bound {facts['lower_bound']:.6g} on its objective")
        else:
            lines.append(f"  plan {index}: {facts.get('status', 'no status')} (the solver reports no bound)")
    return "\n".join(lines)


def report_json(problem: Problem, selection: Selection, context: dict[str, Any] | None = None) -> dict[str, Any]:
    """The selection as JSON-ready data: every plan with its predictions and its cost
    model's full breakdown."""
    plans = []
    for plan in selection.plans:
        evaluation = evaluate(problem, plan)
        plans.append({**plan.to_json(), "breakdown": evaluation.detail.to_json()})
    return {
        "kind": REPORT_KIND,
        "schema_version": REPORT_SCHEMA_VERSION,
        **(context or {}),
        "unit": unit_of(problem),
        "selection": selection.kind,
        "reason": selection.reason,
        "slo_s": selection.slo_s,
        "chosen": selection.chosen,
        "plans": plans,
    }
