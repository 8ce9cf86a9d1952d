"""What each task of a stage worker costs on a target beyond the model's equations, measured
by running a small pipeline there: ``flatpack calibrate``'s last step (issue 19).

FuncPipe's equations give a forward its layers' compute, a transfer its bytes over the
bandwidth plus one request's latency, the optimizer its step. A worker does more: it seeds
the micro-batch's RNG, hands each tensor between its compute, upload and download lanes,
serializes it, waits for the producer's key, writes its markers, timeline and progress, and
each of those runs at the tier's CPU share. On the local backend (2 shared cores, 0.29 vCPU at
512 MB) that is about 2–4 ms per task, as much as a small stage's compute.

How: two-stage probe pipelines (:func:`probe_model`, one narrow and one wide,
``PROBE_WIDTHS``; both stages on the tier, one replica, ``PROBE_MICRO_BATCHES`` micro-batches,
Adam) are compiled for the target with the calibration measured so far (the tier's compute
ratios, store latency, polling, bandwidth), deployed with the target's backend and trained
``PROBE_ITERATIONS`` iterations each. Every task of their timelines after the first ``SKIP``
iterations (cold start, warm-up) is set beside the model's duration for it
(``funcpipe.iteration`` with the measured terms, the task terms still 0). Compute tasks give
measured = β·modelled + o by least squares over both widths: β is FuncPipe's compute slowdown
beside communication (§3.4.2, which its profiler measures in the target too), o the fixed cost
of a forward or a backward; every other kind's term is its mean residual. Each term is at
least 0 and divided by the probe's own host contention κ (the model multiplies it back by a
plan's κ). The iterations being predicted later never feed it: it is measured once per
target, like the rest of the file.

The terms (keys of ``TierCalibration.task_overhead_s``; docs/cost_models.md, "Measured
terms"): ``forward``, ``backward`` (a task's seconds beyond t̂_fc, t̂_bc); ``upload`` (beyond
o/W + t_lat); ``download`` (from the producer's upload to the tensor in hand, beyond
o/W + t_lat + t_poll); ``step`` (from the stage's last backward, or the upload of its last
gradient, to its update's end, beyond t_s + t_opt,s); ``iteration`` (the first stage's update
end to its next iteration's first forward).
"""

from __future__ import annotations

import statistics
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy
import torch
from torch import nn

from flatpack.runtime.timeline import Event

PROBE_ITERATIONS = 8
PROBE_MICRO_BATCHES = 4
PROBE_BATCH = 64
SKIP = 2          # iteration 0 pays the cold start, iteration 1 warms the caches


# the probe's hidden width: a narrow one whose compute is a fraction of a millisecond (the
# task's seconds are then almost all overhead) and a wide one whose compute is several
# milliseconds on a small tier, so that the fit can tell a fixed cost from a slowdown
PROBE_WIDTHS = (32, 768)


def probe_model(width: int) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Two stages' worth of linear layers of ``width`` (every task kind occurs, both
    transfer directions included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 10))
    return model, (torch.zeros(PROBE_BATCH // PROBE_MICRO_BATCHES, 32),)


def probe_batches(iterations: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [((torch.randn(PROBE_BATCH, 32, generator=generator),),
             torch.randint(0, 10, (PROBE_BATCH,), generator=generator)) for _ in range(iterations)]


@dataclass(frozen=True)
class TaskTerms:
    """What the probe pipelines of one tier measured: each task kind's fixed seconds beyond
    the model (``seconds``, keys of ``calibration.TASK_KINDS``) and the compute slowdown
    beside the worker's own transfers (FuncPipe's β, ≥ 1)."""

    seconds: Mapping[str, float]
    compute_slowdown: float


def measure_tier(target: str, memory_mb: int, calibration: Any, deploy: Callable[[Any], Any], *,
                 iterations: int = PROBE_ITERATIONS, timeout_s: float = 300.0) -> TaskTerms:
    """Runs the probe pipeline of each of ``PROBE_WIDTHS`` for ``target`` on ``memory_mb``
    with ``calibration`` (the target's figures measured so far), ``iterations`` iterations
    each, deployed with ``deploy``, and fits the task terms to their timelines (:func:`fit`)."""
    if iterations <= SKIP:
        raise ValueError(f"the probe pipeline needs more than {SKIP} iterations (the first {SKIP} are not measured)")
    runs = [_run_probe(target, memory_mb, calibration, deploy, width, iterations, timeout_s) for width in PROBE_WIDTHS]
    return fit(runs)


def _run_probe(target: str, memory_mb: int, calibration: Any, deploy: Callable[[Any], Any], width: int,
               iterations: int, timeout_s: float) -> tuple[Any, list[Event], float]:
    from flatpack.compiler import compile as compile_model
    from flatpack.ir.profiler import ProfileOptions, ProfileWarning
    from flatpack.partitioner.cost import funcpipe
    from flatpack.partitioner.workload import Workload

    model, example = probe_model(width)
    micro = PROBE_BATCH // PROBE_MICRO_BATCHES
    workload = Workload("train", batch=PROBE_BATCH, micro_batches=PROBE_MICRO_BATCHES, optimizer="adam")
    with warnings.catch_warnings():
        # layers this small have times flat in the batch size, which the profiler warns of;
        # the probe runs at the micro-batch size it was profiled at
        warnings.simplefilter("ignore", ProfileWarning)
        compiled = compile_model(model, example, target=target, workload=workload, calibration=calibration,
                                 profile=ProfileOptions(batch_sizes=(micro // 2, micro), repeats=5, progress=False),
                                 solver=_TwoStages(memory_mb), replicas=(1,), memory_mb=(memory_mb,))
    problem, plan = compiled.problem, compiled.plan
    overheads = funcpipe.Overheads.of(problem, plan)
    cost = funcpipe.iteration(problem, plan, overheads)
    deployment = deploy(compiled)
    try:
        result = deployment.train(probe_batches(iterations), iterations=iterations, optimizer="adam",
                                  loss="cross_entropy", micro_batches=PROBE_MICRO_BATCHES,
                                  checkpoint_every=iterations, timeout_s=timeout_s)
    finally:
        deployment.teardown()
    return cost, list(result.events), overheads.contention


class _TwoStages:
    """The probe's solver: its first layer in stage 0, the rest in stage 1, on one tier."""

    name = "probe"

    def __init__(self, memory_mb: int) -> None:
        self.memory_mb = memory_mb

    def __call__(self, problem: Any) -> Any:
        from flatpack.partitioner.plan import Plan, StagePlan

        layers = len(problem.chain)
        ranges = Plan.from_cuts([0], layers).ranges
        return Plan(tuple(StagePlan(start, end, self.memory_mb, 1) for start, end in ranges), layers,
                    solver=self.name, micro_batches=problem.workload.micro_batches)


def fit(runs: Sequence[tuple[Any, Iterable[Event], float]], *, skip: int = SKIP) -> TaskTerms:
    """The task terms of probe runs, each ``(cost, events, contention)``: a two-stage,
    one-replica pipeline's modelled ``funcpipe.PipelineCost`` (no task terms, β = 1), its
    timeline and its host contention κ. Tasks from iteration ``skip`` on.

    Compute (forward and backward together): least squares of measured = β·modelled + o_kind
    over every task of every run; β below 1 (the model already slower than the worker) is
    taken as 1 and the o's as the mean residuals. Every other kind: the mean of
    measured − modelled. Means, not medians: the model sums these tasks, and the slow ones
    (the first forward of an iteration, beside its reports) are part of the sum. Each o at
    least 0 and over κ (the model multiplies it back by a plan's κ)."""
    samples: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for cost, events, contention in runs:
        for kind, pairs in _samples(cost, events, skip).items():
            samples[kind].extend((modelled, measured, contention) for modelled, measured in pairs)
    compute = [(kind, modelled, measured, contention) for kind in ("forward", "backward")
               for modelled, measured, contention in samples.get(kind, ())]
    slowdown = 1.0
    if compute and len({round(modelled, 6) for _, modelled, _, _ in compute}) > 2:
        kinds = sorted({kind for kind, *_ in compute})
        design = numpy.array([[modelled] + [float(kind == other) for other in kinds]
                              for kind, modelled, _, _ in compute])
        solution, *_ = numpy.linalg.lstsq(design, numpy.array([measured for *_, measured, _ in compute]), rcond=None)
        slowdown = max(1.0, float(solution[0]))
    seconds = {}
    for kind, values in sorted(samples.items()):
        factor = slowdown if kind in ("forward", "backward") else 1.0
        residual = statistics.fmean((measured - factor * modelled) / max(1.0, contention)
                                    for modelled, measured, contention in values)
        seconds[kind] = max(0.0, residual)
    return TaskTerms(seconds, slowdown)


def _samples(cost: Any, events: Iterable[Event], skip: int) -> dict[str, list[tuple[float, float]]]:
    """(modelled, measured) seconds per task kind of one probe run's timeline."""
    # with two stages each upload and download is of one direction: a middle stage would
    # move both under the same (stage, iteration, micro-batch)
    if cost.replicas != 1 or len(cost.stages) != 2:
        raise ValueError("the task terms are fitted on a pipeline of two stages with one replica each")
    kept = [event for event in events if event.iteration >= skip and event.replica == 0]
    by_key = {(event.stage, event.iteration, event.kind, event.micro_batch): event for event in kept}
    pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for event in kept:
        seconds = event.end - event.start
        if event.kind in ("forward", "backward") and event.micro_batch is not None:
            stage = cost.stages[event.stage]
            pairs[event.kind].append((stage.forward_s if event.kind == "forward" else stage.backward_s, seconds))
        elif event.kind == "upload" and event.micro_batch is not None:
            # activations go up from the first stage, gradients from the second
            boundary = cost.boundaries[0]
            pairs["upload"].append((boundary.forward_upload_s if event.stage == 0 else boundary.backward_upload_s,
                                    seconds))
        elif event.kind == "download" and event.micro_batch is not None:
            found = _download(event, by_key, cost)
            if found is not None:
                pairs["download"].append(found)
    for (stage, iteration, kind, _), update in by_key.items():
        if kind != "update":
            continue
        # the update waits for the stage's last backward and for the last upload of its
        # gradients (which the model counts on the stage below, in its t_b)
        waited = [e.end for (s, i, k, m), e in by_key.items()
                  if s == stage and i == iteration and m is not None and k in ("backward", "upload")]
        if waited:
            pairs["step"].append((cost.stages[stage].sync_s + _optimizer(cost, stage), update.end - max(waited)))
        if stage == 0:
            following = [e.start for (s, i, k, m), e in by_key.items()
                         if s == 0 and i == iteration + 1 and k == "forward"]
            if following:
                pairs["iteration"].append((0.0, min(following) - update.end))
    return pairs


def _download(event: Event, by_key: Mapping[tuple, Event], cost: Any) -> tuple[float, float] | None:
    """A download's (modelled, measured) seconds, measured from its producer's upload (or its
    own start, if later) to its end: the wait for the producer is the pipeline's, not the
    task's."""
    if event.stage > 0:      # activations from the first stage
        producer = by_key.get((0, event.iteration, "upload", event.micro_batch))
        modelled = cost.boundaries[0].forward_download_s
    else:                    # gradients from the second
        producer = by_key.get((1, event.iteration, "upload", event.micro_batch))
        modelled = cost.boundaries[0].backward_download_s
    if producer is None:
        return None
    return modelled, event.end - max(event.start, producer.end)


def _optimizer(cost: Any, stage: int) -> float:
    overheads = cost.overheads
    if overheads is None or stage >= len(overheads.optimizer_s):
        return 0.0
    return overheads.optimizer_s[stage]
