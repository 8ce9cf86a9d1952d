"""What each task of a stage worker costs on a target beyond the model's equations, measured
by running a small pipeline there: ``flatpack calibrate``'s last step (issue 19).

FuncPipe's equations give a forward its layers' compute, a transfer its bytes over the
bandwidth plus one request's latency, the optimizer its step. A worker does more: it seeds
the micro-batch's RNG, hands each tensor between its compute, upload and download lanes,
serializes it, waits for the producer's key, writes its markers, timeline and progress, and
each of those runs at the tier's CPU share. On the local backend (2 shared cores, 0.29 vCPU at
512 MB) that is about 2–4 ms per task, as much as a small stage's compute.

How: a probe pipeline of narrow linear layers (:func:`probe_model`; its compute is a
fraction of a millisecond, so a task's seconds are almost all overhead) is compiled for the
target on the tier with the calibration measured so far (the tier's compute ratios, store
latency, polling, bandwidth), deployed with the target's backend and trained
``PROBE_ITERATIONS`` iterations of ``PROBE_MICRO_BATCHES`` micro-batches with Adam in each
of ``PROBE_LAYOUTS``: as one stage (1 worker: no transfers between stages; its download
term comes from its prefetched inputs and targets, t_in's requests), as two stages with one
replica each (2 workers) and with two each (4 workers, which also synchronize). Every task
of their timelines after the first ``SKIP`` iterations (cold start, warm-up) is set beside
the model's duration for it (``funcpipe.iteration`` with the measured terms, the task terms
still 0); each term is the mean of measured − modelled, at least 0, per worker count. Means,
not medians: the model sums these tasks, and the slow ones (the first forward of an
iteration, beside its reports) are part of the sum. On the local backend the workers share
the host's cores and every term grows with their number; the model reads the terms at a
plan's worker count, on the line through the nearest two counts measured. The iterations
being predicted later never feed them: they are measured once per target, like the rest of
the file.

The terms (keys of ``TierCalibration.task_overhead_s``; docs/cost_models.md, "Measured
terms"): ``forward``, ``backward`` (a task's seconds beyond t̂_fc, t̂_bc); ``upload`` (beyond
o/W + t_lat); ``download`` (from the producer's upload to the tensor in hand, beyond
o/W + t_lat + t_poll); ``sync`` (a synchronization, d > 1, beyond eq. 12's t_s); ``step``
(from the synchronization's end, or the stage's last backward or gradient upload if later,
to its update's end, beyond t_opt,s); ``iteration`` (the first stage's update end, or its
next input's prefetch end if later, to its next iteration's first forward); for serving
(:func:`measure_serving`), ``request`` and ``fork``.
"""

from __future__ import annotations

import itertools
import statistics
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from flatpack.compiler import compile as compile_model
from flatpack.partitioner.cost import funcpipe, gillis
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions, ProfileWarning
from flatpack.runtime.timeline import Event

PROBE_ITERATIONS = 8
PROBE_MICRO_BATCHES = 4
PROBE_BATCH = 64
SKIP = 2          # iteration 0 pays the cold start, iteration 1 warms the caches


PROBE_WIDTH = 32
# (stages, replicas per stage) of each probe run: 1, 2 and 4 workers. The terms grow with the
# workers sharing a host, and a one-stage plan (one worker) is measured rather than read off
# the line through 2 and 4: that line put rnn-3's 1 × 1 plan +34 % over its measured iteration.
PROBE_LAYOUTS = ((1, 1), (2, 1), (2, 2))


def probe_model() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """Two stages' worth of narrow linear layers (every task kind occurs, both transfer
    directions included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, PROBE_WIDTH), nn.ReLU(), nn.Linear(PROBE_WIDTH, PROBE_WIDTH), nn.ReLU(),
                          nn.Linear(PROBE_WIDTH, 10))
    return model, (torch.zeros(PROBE_BATCH // PROBE_MICRO_BATCHES, 32),)


def probe_batches(iterations: int) -> list[tuple[tuple[torch.Tensor], torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [((torch.randn(PROBE_BATCH, 32, generator=generator),),
             torch.randint(0, 10, (PROBE_BATCH,), generator=generator)) for _ in range(iterations)]


def measure_tier(target: str, memory_mb: int, calibration: Any, deploy: Callable[[Any], Any], *,
                 iterations: int = PROBE_ITERATIONS, timeout_s: float = 300.0) -> dict[int, dict[str, float]]:
    """Runs the probe pipeline for ``target`` on ``memory_mb`` with ``calibration`` (the
    target's figures measured so far) in each of ``PROBE_LAYOUTS`` (stages, replicas per
    stage), ``iterations`` iterations each, deployed with ``deploy``; returns the task terms
    by the number of workers that ran (:func:`fit`)."""
    if iterations <= SKIP:
        raise ValueError(f"the probe pipeline needs more than {SKIP} iterations (the first {SKIP} are not measured)")
    terms = {}
    for stages, replicas in PROBE_LAYOUTS:
        cost, events = _run_probe(target, memory_mb, calibration, deploy, stages, replicas, iterations, timeout_s)
        terms[stages * replicas] = fit(cost, events)
    return terms


def probe_workers() -> tuple[int, ...]:
    """The numbers of workers the probe pipelines run with, in order."""
    return tuple(stages * replicas for stages, replicas in PROBE_LAYOUTS)


def _run_probe(target: str, memory_mb: int, calibration: Any, deploy: Callable[[Any], Any], stages: int,
               replicas: int, iterations: int, timeout_s: float) -> tuple[Any, list[Event]]:
    model, example = probe_model()
    micro = PROBE_BATCH // PROBE_MICRO_BATCHES
    workload = Workload("train", batch=PROBE_BATCH, micro_batches=PROBE_MICRO_BATCHES, optimizer="adam")
    with warnings.catch_warnings():
        # layers this small have times flat in the batch size, which the profiler warns of;
        # the probe runs at the micro-batch size it was profiled at
        warnings.simplefilter("ignore", ProfileWarning)
        compiled = compile_model(model, example, target=target, workload=workload, calibration=calibration,
                                 profile=ProfileOptions(batch_sizes=(micro // 2, micro), repeats=5, progress=False),
                                 solver=_ProbeStages(memory_mb, stages, replicas), replicas=(replicas,),
                                 memory_mb=(memory_mb,))
    problem, plan = compiled.problem, compiled.plan
    assert problem is not None     # compiled with a profile and a workload: it has a problem
    cost = funcpipe.iteration(problem, plan, funcpipe.Overheads.of(problem, plan))
    deployment = deploy(compiled)
    try:
        result = deployment.train(probe_batches(iterations), iterations=iterations, optimizer="adam",
                                  loss="cross_entropy", micro_batches=PROBE_MICRO_BATCHES,
                                  checkpoint_every=iterations, timeout_s=timeout_s)
    finally:
        deployment.teardown()
    return cost, list(result.events)


class _ProbeStages:
    """The probe's solver: with two stages its first layer in stage 0 and the rest in stage 1,
    with one every layer in it; on one tier, each stage with ``replicas``."""

    name = "probe"

    def __init__(self, memory_mb: int, stages: int, replicas: int) -> None:
        self.memory_mb, self.stages, self.replicas = memory_mb, stages, replicas

    def __call__(self, problem: Any) -> Any:
        layers = len(problem.chain)
        ranges = Plan.from_cuts([0] if self.stages == 2 else [], layers).ranges
        return Plan(tuple(StagePlan(start, end, self.memory_mb, self.replicas) for start, end in ranges), layers,
                    solver=self.name, micro_batches=problem.workload.micro_batches)


def fit(cost: Any, events: Iterable[Event], *, skip: int = SKIP) -> dict[str, float]:
    """The task terms of one probe run: ``cost`` is what ``funcpipe.iteration`` models for
    the probe pipeline of one or two stages (no task terms), ``events`` its timeline. Per
    kind, the mean of measured − modelled seconds over the tasks of iterations ``skip`` on, at
    least 0; a kind with no task in the timeline is left out."""
    pairs = _samples(cost, list(events), skip)
    return {kind: max(0.0, statistics.fmean(measured - modelled for modelled, measured in values))
            for kind, values in sorted(pairs.items())}


def _samples(cost: Any, events: list[Event], skip: int) -> dict[str, list[tuple[float, float]]]:
    """(modelled, measured) seconds per task kind of one probe run's timeline."""
    # with two stages each upload and download is of one direction: a middle stage would
    # move both under the same (stage, iteration, micro-batch). One stage has no boundary: its
    # only downloads are its prefetched inputs and targets, t_in of the model (µ·t_in bounds t_iter), whose
    # two requests a prefetch makes are the download term's samples there (:func:`_prefetch`)
    if len(cost.stages) not in (1, 2):
        raise ValueError("the task terms are fitted on a pipeline of one or two stages")
    boundaries = len(cost.stages) == 2
    kept = [event for event in events if event.iteration >= skip]
    # a micro-batch belongs to one replica of each stage: (stage, iteration, kind, micro-batch)
    # names one task; a replica's whole-iteration tasks are named by their replica instead
    tasks = {(event.stage, event.iteration, event.kind, event.micro_batch): event
             for event in kept if event.micro_batch is not None}
    whole = {(event.stage, event.replica, event.iteration, event.kind): event
             for event in kept if event.micro_batch is None and event.lane == "compute"}
    ready = _ready_times(kept, tasks)
    pairs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for (stage, _, kind, _), event in tasks.items():
        seconds = event.end - event.start
        if kind in ("forward", "backward"):
            modelled = cost.stages[stage].forward_s if kind == "forward" else cost.stages[stage].backward_s
            pairs[kind].append((modelled, event.end - ready[id(event)]))
        elif not boundaries:
            if kind == "prefetch":
                pairs["download"].append(_prefetch(cost, seconds))
        elif kind == "upload":
            # activations go up from the first stage, gradients from the second
            boundary = cost.boundaries[0]
            pairs["upload"].append((boundary.forward_upload_s if stage == 0 else boundary.backward_upload_s,
                                    event.end - ready[id(event)]))
        elif kind == "download":
            found = _download(event, tasks, cost)
            if found is not None:
                pairs["download"].append(found)
    replicas = cost.replicas
    for (stage, replica, iteration, kind), update in whole.items():
        if kind != "update":
            continue
        sync = whole.get((stage, replica, iteration, "sync"))
        if sync is not None and replicas > 1:
            pairs["sync"].append((cost.stages[stage].sync_s, sync.end - sync.start))
        # the update waits for the synchronization, the stage's last backward and the last
        # upload of its gradients (which the model counts on the stage below, in its t_b)
        waited = [e.end for (s, i, k, m), e in tasks.items()
                  if s == stage and i == iteration and m % replicas == replica and k in ("backward", "upload")]
        if sync is not None:
            waited.append(sync.end)
        if waited:
            # the model's update without the task terms it is measuring (the probe's calibration has none)
            pairs["step"].append((cost.overheads.step(stage), update.end - max(waited)))
        if stage == 0:
            following = [e for (s, i, k, m), e in tasks.items()
                         if s == 0 and i == iteration + 1 and k == "forward" and m % replicas == replica]
            if following:
                first = min(following, key=lambda e: e.start)
                # a forward that waited for its prefetched input waited on the prefetch lane,
                # which the model prices by t_in (µ·t_in bounds t_iter); the gap counts from when both the
                # update and that input were done. The probe's compute is so small that its
                # prefetch lane is the longer chain: from the update's end alone the one-stage
                # probe read a 15-19 ms gap, and bert-large's 1 x 1 plan was predicted +55 %
                prefetch = (tasks.get((0, iteration + 1, "prefetch", first.micro_batch))
                            if first.micro_batch is not None else None)
                ready = max(update.end, prefetch.end) if prefetch is not None else update.end
                pairs["iteration"].append((0.0, first.start - ready))
    return pairs


def _ready_times(events: list[Event], tasks: Mapping[tuple, Event]) -> dict[int, float]:
    """When each forward, backward and upload could have started (keyed by ``id(event)``):
    the latest end among the task before it on its worker's lane in the same iteration and
    the tasks of its own worker it reads (a later stage's forward its input's download, a
    backward its gradient's download, an upload the forward or backward that made it); its
    start when nothing precedes it in the iteration. Measured from there, a task's term
    holds the hand-off that wakes it (a lane's thread noticing its input, the worker loop
    between tasks) beside its own work; the model adds each term on the task's path, where the
    hand-offs are spent. From its start alone, rnn-3's 2 × 1 1F1B plan measured 138 ms against
    87 predicted with every task's duration within 1-2 ms of the model: 1-5 ms passed between
    an input's arrival and the task that read it (BENCHMARKS.md, issue 19's seventh pass)."""
    lanes: dict[tuple, list[Event]] = defaultdict(list)
    for event in events:
        lanes[(event.stage, event.replica, event.iteration, event.lane)].append(event)
    previous: dict[int, float] = {}
    for lane in lanes.values():
        lane.sort(key=lambda event: event.start)
        for before, after in itertools.pairwise(lane):
            previous[id(after)] = before.end
    ready = {}
    for (stage, iteration, kind, micro_batch), event in tasks.items():
        # a forward reads its input: a later stage's downloaded, the first stage's prefetched
        # (the prefetch lane is priced by t_in's bound, µ·t_in ≤ t_iter: a wait for it counted
        # here too would be paid twice, and on every forward of a model whose compute hides
        # its prefetches; from the previous task alone the probe's 1-worker forward read 1-2 ms
        # more, and 1 x 1 plans were predicted 17-33 % over, issue 44). An iteration's first
        # forward counts from its start: the gap before it, from the update or that input, is
        # the iteration term's. A backward reads the gradient of its output (downloaded, but on
        # the last stage); the first stage uploads activations, a later one the gradient of its input
        first_forward = kind == "forward" and stage == 0 and id(event) not in previous
        read = {"forward": () if first_forward else ("prefetch",) if stage == 0 else ("download",),
                "backward": ("download",), "upload": ("forward",) if stage == 0 else ("backward",)}.get(kind, ())
        ends = [tasks[(stage, iteration, name, micro_batch)].end for name in read
                if (stage, iteration, name, micro_batch) in tasks]
        if id(event) in previous:
            ends.append(previous[id(event)])
        ready[id(event)] = min(max(ends), event.start) if ends else event.start
    return ready


def _prefetch(cost: Any, seconds: float) -> tuple[float, float]:
    """A one-stage probe's prefetch of a micro-batch's input and target, as (modelled,
    measured) seconds of one of its two requests: the model's t_in (``Overheads.input_s``,
    the task terms still 0) prices o_in/W + t_lat for the input and t_lat for the target, and
    ``Overheads.of`` adds the download term to each of the two."""
    return cost.overheads.input_s / 2, seconds / 2


def _download(event: Event, tasks: Mapping[tuple, Event], cost: Any) -> tuple[float, float] | None:
    """A download's (modelled, measured) seconds, measured from its producer's upload (or its
    own start, if later) to its end: the wait for the producer is the pipeline's, not the
    task's."""
    if event.stage > 0:      # activations from the first stage
        producer = tasks.get((0, event.iteration, "upload", event.micro_batch))
        modelled = cost.boundaries[0].forward_download_s
    else:                    # gradients from the second
        producer = tasks.get((1, event.iteration, "upload", event.micro_batch))
        modelled = cost.boundaries[0].backward_download_s
    if producer is None:
        return None
    return modelled, event.end - max(event.start, producer.end)


# --- serving: Gillis's fork-join ------------------------------------------------------------

SERVING_REQUESTS = PROBE_ITERATIONS + 1     # timed requests, after 2 warm-ups
SERVING_PARTITIONS = (2, 4)      # the middle layer split by channel over this many workers
SERVING_WORKLOAD = Workload("infer", batch=1, micro_batches=1)


def measure_serving(target: str, memory_mb: int, calibration: Any, deploy: Callable[[Any], Any], *,
                    requests: int = SERVING_REQUESTS, timeout_s: float = 300.0) -> dict[int, dict[str, float]]:
    """What a fork-join request costs beyond Gillis's equations on the tier, by the number of
    functions serving it: ``request`` (the master alone: the request's upload, the master's
    wait for it, the response's upload and the invoker's wait) and ``fork`` (a group split
    over p workers, beyond the request's: the master's puts and waits of the partitions).
    The probe model (:func:`probe_model`, batch 1) is served with the master alone, then with
    its middle layer split by channel over each of ``SERVING_PARTITIONS`` workers; each
    figure is the median over ``requests`` requests after 2 warm-ups, less what
    ``gillis.latency`` models (with the calibration's delay distribution), at least 0."""
    model, _ = probe_model()
    model.eval()
    layers = _serving_layers(model, target, memory_mb, calibration)
    terms: dict[int, dict[str, float]] = {}
    request = 0.0
    for partitions in (1, *SERVING_PARTITIONS):
        # the middle layer on its own, split (the master computes the rest); alone: one stage
        stages = ((StagePlan(0, layers - 1, memory_mb, 1),) if partitions == 1 else
                  (StagePlan(0, 0, memory_mb, 1), StagePlan(1, 1, memory_mb, partitions, split="channel"),
                   StagePlan(2, layers - 1, memory_mb, 1)))
        compiled = _serving_compile(model, target, calibration, plan=Plan(stages, layers, "probe"))
        measured = _serve_probe(compiled, deploy, requests, timeout_s)
        assert compiled.problem is not None     # compiled with a profile and a workload
        cost = gillis.latency(compiled.problem, compiled.plan)
        residual = measured - cost.latency_s
        if partitions == 1:
            request = max(0.0, residual)
            terms.setdefault(cost.invocations, {})["request"] = request
        else:
            terms.setdefault(cost.invocations, {})["fork"] = max(0.0, residual - request)
    return terms


def _serving_compile(model: nn.Module, target: str, calibration: Any, **choice: Any) -> Any:
    """The probe model compiled to serve batch 1 on ``target``; ``choice``: the plan, or how
    to make one."""
    with warnings.catch_warnings():
        # layers this small have times flat in the batch size, which the profiler warns of
        warnings.simplefilter("ignore", ProfileWarning)
        return compile_model(model, (torch.zeros(1, 32),), target=target, workload=SERVING_WORKLOAD,
                             calibration=calibration,
                             profile=ProfileOptions(batch_sizes=(1, 2), repeats=5, progress=False), **choice)


def _serving_layers(model: nn.Module, target: str, memory_mb: int, calibration: Any) -> int:
    """How many layers the probe model's chain has after the passes (a split needs 3)."""
    problem = _serving_compile(model, target, calibration, stages=1, memory_mb=(memory_mb,)).problem
    assert problem is not None     # compiled with a profile and a workload
    layers = len(problem.chain)
    if layers < 3:
        raise ValueError(f"the serving probe needs 3 layers after the passes, the probe model has {layers}")
    return layers


def _serve_probe(compiled: Any, deploy: Callable[[Any], Any], requests: int, timeout_s: float) -> float:
    """The median latency of ``requests`` requests of ``compiled`` deployed with ``deploy``,
    after 2 warm-ups."""
    generator = torch.Generator().manual_seed(0)
    latencies = []
    deployment = deploy(compiled)
    try:
        for index in range(requests + 2):
            deployment.infer(torch.randn(1, 32, generator=generator), wait_timeout_s=timeout_s)
            if index >= 2:       # the first requests start and load the functions
                latencies.append(deployment.last_latency_s)
        deployment.stop_inference()
    finally:
        deployment.teardown()
    return statistics.median(latencies)
