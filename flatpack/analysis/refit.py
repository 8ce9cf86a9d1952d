"""Re-planning from a finished run (issue 19, item 3): ``flatpack plan --from-run RUN_DIR``
and ``compile(..., measured=RUN_DIR)``.

A run's timeline says what each stage's forward, backward, upload and optimizer step took.
:func:`refit` turns it into a per-layer calibration (``platform.calibration``, the format
``flatpack profile --target`` writes) for the tiers the run used: each layer's predicted
line is scaled by its stage's measured-over-predicted ratio (the timeline times stages, not
layers, so the layers of a stage share its ratio), t_lat is re-fitted as an activation
upload's seconds beyond its bytes at the stage's bandwidth (uploads, because a download's
time includes waiting for its producer: as ``analysis.report.calibrate`` does), and the
optimizer step's seconds per byte from the stage's measured update. :func:`replan` solves
again on that calibration, over the tiers the run measured (the run says nothing of other
tiers), and reports the old plan, the new plan and the predicted saving.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Any, Iterable

from flatpack.errors import InputError, PlanError
from flatpack.ir.profile import Linear
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.common import gradient_bytes, layer_times
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers import get_solver
from flatpack.platform.calibration import Calibration, TierCalibration
from flatpack.runtime.timeline import summarize

EVENTS_FILE = "events.json"      # a run directory's timeline (``flatpack run`` writes it)
COMPILED_DIR = "compiled"


def _ratio(measured: float | None, predicted: float, task_s: float = 0.0) -> float | None:
    """Measured over predicted compute of a stage's tasks, each less the task term both
    include (the seeded RNG, lane hand-offs: ``Overheads``'s o_f or o_b, which the re-fit
    calibration keeps as a term of its own rather than folding it into the layers' lines)."""
    compute = predicted - task_s
    if not measured or compute <= 0:
        return None
    return max(measured - task_s, 0.0) / compute


def refit(problem: Problem, plan: Plan, events: Iterable[Any], *, skip_first: int = 2,
          source: str = "a run") -> Calibration:
    """A per-layer :class:`~flatpack.platform.calibration.Calibration` of the tiers ``plan``
    ran on, fitted to ``events`` (the iterations after ``skip_first``)."""

    events = list(events)
    measured = summarize(events, skip_first=skip_first)
    if measured.iteration_s is None or not measured.stages:
        raise InputError(f"{source} recorded no iteration to fit; train at least {skip_first + 1} iterations")
    # the iterations the figures keep, by position: an epoch of a re-planned or elastic run
    # starts at its own number, and its first iterations are cold starts as a run's are
    kept = set(measured.kept)
    cost = funcpipe.predicted(problem, plan)
    terms = cost.overheads or funcpipe.Overheads()
    micro = problem.workload.micro_batch_size
    previous = problem.calibration
    factors: dict[int, list[tuple[float, float]]] = {}
    stage_factor: list[tuple[float, float]] = []
    optimizer: dict[int, list[float]] = {}
    for index, (stage, predicted) in enumerate(zip(plan.stages, cost.stages)):
        found = measured.stages[index] if index < len(measured.stages) else None
        forward = _ratio(found.forward_s if found else None, predicted.forward_s, terms.task("forward", index))
        backward = _ratio(found.backward_s if found else None, predicted.backward_s, terms.task("backward", index))
        pair = (forward or 1.0, backward or 1.0)
        stage_factor.append(pair)
        factors.setdefault(predicted.memory_mb, []).append(pair)
        grads = gradient_bytes(problem, stage.start, stage.end)
        if found is not None and found.update_s and grads:
            # the update less the step's task term, which the re-fit keeps as a term of its own
            optimizer.setdefault(predicted.memory_mb, []).append(
                max(found.update_s - terms.task("step", index), 0.0) / grads)
    tiers = {}
    for memory_mb, pairs in factors.items():
        tier = problem.platform.tier(memory_mb)
        # layers of stages on another tier take this tier's median ratio
        median = (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs))
        forward_lines, backward_lines = [], []
        for index in range(len(problem.chain)):
            owner = next(s for s, stage in enumerate(plan.stages) if stage.start <= index <= stage.end)
            forward_factor, backward_factor = (stage_factor[owner] if cost.stages[owner].memory_mb == memory_mb
                                               else median)
            forward_s, backward_s = layer_times(problem, index, index, tier, micro)
            profile = problem.layer_profile(index)
            forward_lines.append(_scaled(profile.forward_s, micro, forward_s * forward_factor))
            backward_lines.append(_scaled(profile.backward_s, micro, backward_s * backward_factor))
        per_byte = optimizer.get(memory_mb)
        # the task terms the probe pipelines measured by worker count: the run measured its
        # own plan's tasks, not those of the plans the solver compares (other boundaries,
        # other worker counts). Without them a one-stage vgg16 run re-planned to two stages
        # on a predicted 18 % saving that measured 18 % slower (BENCHMARKS.md, "sixth pass")
        known = previous.tiers.get(memory_mb) if previous is not None else None
        tiers[memory_mb] = TierCalibration(tuple(forward_lines), tuple(backward_lines), tier.bandwidth_bytes_s,
                                           optimizer_s_per_byte=(
                                               {problem.workload.optimizer: statistics.median(per_byte)}
                                               if per_byte else {}),
                                           task_overhead_s=known.task_overhead_s if known is not None else {})
    # activation and gradient uploads wait for no producer: their seconds beyond bytes/W and
    # the upload's task term are the request's own. A one-stage run has none (its prefetches
    # are two requests each, and on the local backend a big one hides the request inside the
    # emulated link's time: vgg16's read t_lat = 0), so it keeps the latency it had
    overheads = [event.seconds - event.nbytes / cost.stages[event.stage].bandwidth_bytes_s
                 - terms.task("upload", event.stage)
                 for event in events if event.kind == "upload" and event.micro_batch is not None
                 and event.iteration in kept and event.stage < len(cost.stages)]
    platform = problem.platform
    return Calibration(
        platform=platform.name, layer_names=tuple(layer.name for layer in problem.chain), tiers=tiers,
        graph_hash=getattr(previous, "graph_hash", None) or None,
        storage_latency_s=max(statistics.median(overheads), 0.0) if overheads else platform.storage_latency_s,
        poll_overhead_s=platform.poll_overhead_s, host_cores=platform.host_cores,
        provenance={"measured": f"re-fitted from the timeline of {source}",
                    "method": "per stage measured/predicted forward and backward, each less its task term, applied "
                              "to its layers' lines; t_lat from activation and gradient uploads (a one-stage run: "
                              "the latency it ran with); optimizer step from the stage's update less its task term; "
                              "the task terms of the calibration it ran with"})


def _scaled(host: Linear, micro: float, seconds: float) -> Linear:
    """``host``'s line scaled to take ``seconds`` at ``micro`` (its shape kept)."""
    at = host.at(micro)
    if at <= 0:
        return Linear(0.0, seconds)
    factor = seconds / at
    return Linear(host.per_sample * factor, host.fixed * factor)


def fitted_problem(problem: Problem, calibration: Calibration) -> Problem:
    """``problem`` under the re-fitted ``calibration`` (:func:`refit`), its search limited
    to the tiers the run measured (the run says nothing of other tiers)."""
    options = problem.options.with_changes(memory_mb=tuple(sorted(calibration.tiers)))
    return dataclasses.replace(problem, calibration=calibration, platform=calibration.apply(problem.platform),
                               options=options)


def prediction_error(predicted_s: float, measured_s: float) -> float:
    """|predicted − measured| / measured: how far a prediction of an iteration was off."""
    return abs(predicted_s / measured_s - 1)


@dataclass(frozen=True)
class Replan:
    """What re-planning from a run found: the plan that ran and the one the re-fitted
    model prefers, each with its predicted iteration time under the re-fit."""

    old: Plan
    new: Plan
    old_predicted_s: float
    new_predicted_s: float
    measured_s: float
    calibration: Calibration
    # |predicted / measured - 1| of the model as it stood before the re-fit, on the plan that
    # ran: how far it can be off on this host. A plan predicted faster by less is not adopted
    model_error: float = 0.0
    # the fastest other plan and its seconds when its saving was within model_error (kept out)
    within_error: tuple[Plan, float] | None = None

    @property
    def saving_s(self) -> float:
        return self.old_predicted_s - self.new_predicted_s

    def describe(self) -> str:
        def shape(plan: Plan) -> str:
            return " | ".join(f"layers {s.start}-{s.end} × {s.replicas} on {s.memory_mb} MB" for s in plan.stages)

        lines = [f"measured iteration of the run: {self.measured_s * 1000:.1f} ms",
                 f"old plan: {shape(self.old)}: {self.old_predicted_s * 1000:.1f} ms predicted with the re-fit",
                 f"new plan: {shape(self.new)}: {self.new_predicted_s * 1000:.1f} ms predicted"]
        if self.new == self.old and self.within_error is not None:
            other, seconds = self.within_error
            saving = (self.old_predicted_s - seconds) / self.old_predicted_s
            lines.append(f"the fastest other plan, {shape(other)}, is predicted {saving * 100:.1f}% faster: less than "
                         f"the model's own error on this run before the re-fit ({self.model_error * 100:.1f}%), so "
                         "the saving is not distinguishable from that error: keep the run's plan")
        elif self.new == self.old:
            lines.append("the run's plan is still the fastest the re-fitted model finds: keep it")
        else:
            lines.append(f"predicted saving: {self.saving_s * 1000:.1f} ms per iteration "
                         f"({self.saving_s / self.old_predicted_s * 100:.1f}%)")
        return "\n".join(lines)


def replan(problem: Problem, plan: Plan, events: Iterable[Any], *, solver: str = "dp", skip_first: int = 2,
           source: str = "a run") -> Replan:
    """Re-fits ``problem`` to ``events`` of ``plan`` (:func:`refit`) and solves again over
    the tiers the run used; the new plan is the fastest predicted among the solver's front
    and the old plan (so it is never predicted slower than the plan that ran), and only when
    its predicted saving exceeds the model's own error on this run before the re-fit
    (``Replan.model_error``): the re-fit measures the stages and transfers that ran, not the
    new boundaries, workers and contention a different plan brings, so a smaller saving is
    within what the model gets wrong (fidelity.py: vgg16's 1 × 1 re-planned to 3 stages on a
    predicted 9 % saving measured 2.1× slower while the model was 39 % off on the run)."""

    events = list(events)
    calibration = refit(problem, plan, events, skip_first=skip_first, source=source)
    fitted = fitted_problem(problem, calibration)
    solving = get_solver(solver)
    front = getattr(solving, "front", None)  # duck-typed: a cost-model solver's front, else its one plan
    candidates = list(front(fitted).plans) if front is not None else [solving(fitted)]
    old_s = funcpipe.predicted(fitted, plan).iteration_s
    best, best_s = plan, old_s
    for candidate in candidates:
        try:
            seconds = funcpipe.predicted(fitted, candidate).iteration_s
        except PlanError:
            continue   # a plan the measured model cannot price (e.g. per-stage degrees)
        if seconds < best_s:
            best, best_s = candidate, seconds
    measured_s = summarize(events, skip_first=skip_first).iteration_s
    assert measured_s is not None  # refit above refused events without a measured iteration
    model_error = prediction_error(funcpipe.predicted(problem, plan).iteration_s, measured_s)
    if best != plan and (old_s - best_s) / old_s <= model_error:
        return Replan(plan, plan, old_s, old_s, measured_s, calibration, model_error, (best, best_s))
    return Replan(plan, best, old_s, best_s, measured_s, calibration, model_error)
