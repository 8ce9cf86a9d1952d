"""The host bound: on the local backend an iteration takes at least the CPU it asks of the
host's cores, over those cores (issue 19, tenth pass; docs/cost_models.md, "The host bound").

FuncPipe's equations, and the schedule ``report.predicted_schedule`` simulates with them,
follow an iteration's critical path: each worker's lanes wait only for each other. That is
a cloud function's situation, whose CPU is its own. A local run's workers, its invoker and
its S3 server share the host's C cores, and once their work together fills the cores every
task waits for CPU as well: the demo's 2 x 2 vgg16 plan kept the 2-core VM 98 % busy, 595
core-ms an iteration, and measured 307 ms = 595 / 2 + 9 (BENCHMARKS.md, issue 19's tenth
pass). Hence

    t_iter ≥ t_host = (compute + Σ requests' CPU + misses · c_miss + lists · c_get) / C

where C is the host's cores: every one of them the run's. Issue 44 measured what a run gets
of them where other work shares the host (``benchmarks/cpu_accounting.py``: each of the run's
processes from ``/proc``) and tried dividing by the share calibrate measured
(``RequestCpu.cores_obtained``): on the 2-core VM at a load average of 15-41 from other agents
the run's processes got 0.30-0.76 cores from one plan to the next, minutes apart, and the
calibration's reading (0.19-0.29) put the ten plans of the fidelity benchmark 38-414 % over
(MAPE 186 %, where C = 2 left the critical path 47 % under): a share read minutes before a
run does not predict it, so C stays the host's cores and the share is only reported.

with each store request's CPU, client and server together, measured by ``flatpack
calibrate`` (``platform.request_cpu``, :class:`~flatpack.platform.catalog.RequestCpu`), and
the requests counted from the plan and the runtime's protocol:

* the workers: each upload of the simulated schedule a put, each download a get (the
  boundary's bytes); the first stage's input downloads (µ per replica) and the last stage's
  targets; a synchronization (d > 1) puts d chunks and gets 2(d − 1), each ŝ/d bytes, and
  writes the two straggler markers; every worker's progress report and timeline;
* the invoker: an iteration's data and targets (M puts each), the last stage's reports, and
  a list of the reports every ``INVOKER_POLL_S`` of the iteration (and of the markers, d > 1);
* polls: a download that waits for its producer misses (``store.wait_misses``, each get
  taking t_lat·κ, the model's request time) for as long as its lane idles before it in the
  simulated schedule; so does each get of a synchronization (d > 1), for a peer's upload of
  one chunk, and the first also for the peers that start their sync later
  (``_sync_waits_s``). Where the bound exceeds the critical path the waits stretch, and so do
  the gets and sleeps of the polls: the count holds.

The compute is the layers' tier seconds times the tier's CPU share (the throttle sleeps the
rest), and the optimizer step likewise. Not counted: the workers' own Python beyond their
requests (serialization, the lanes' hand-offs, the timeline) and checkpoints. With the
syncs' polls counted (issue 19's eleventh pass) the count came to 86-130 % of the host's busy
CPU over the fidelity benchmark's 13 plans, 12 of them within 15 % (56-78 % before, where the
2 x 2 plans' sync polls were most of the gap). A per-worker term for the rest, fitted by the
probe pipelines from the host's busy CPU, read 0-50 ms per worker and iteration from one
calibration to the next and put the 2 x 2 plans 15-53 % over their measured iterations (twice
measured, twice rejected): it is not in the bound. The bound sets the prediction only where
the count exceeds the critical path; it is a count, not a guaranteed lower bound (resnet50's
2 x 2 plan read 468 core-ms counted against 359 busy in the same benchmark run).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.common import layer_times, recompute_seconds, stage_tier
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.platform.catalog import Platform, RequestCpu
from flatpack.runtime.function import cpu_share
from flatpack.runtime.store import wait_misses
from flatpack.runtime.timeline import Event

# the invoker polls its workers' reports this often (backends.functions.POLL_S is this figure)
INVOKER_POLL_S = 0.05


@dataclass(frozen=True)
class HostLoad:
    """What one iteration asks of a shared host's CPU, and the least time that takes."""

    cores: int
    compute_s: float       # layers' forward and backward and the optimizer step, CPU seconds
    request_s: float       # every put and get that finds its key (workers and invoker), the lists' aside
    requests: int          # how many those are
    misses: int            # polls that found no key
    miss_s: float          # their CPU seconds
    lists: float           # the invoker's lists in the iteration (one poll every INVOKER_POLL_S)
    list_s: float          # their CPU seconds

    @property
    def cpu_s(self) -> float:
        return self.compute_s + self.request_s + self.miss_s + self.list_s

    def terms(self) -> dict[str, float]:
        """The count's CPU seconds by term (``benchmarks/cpu_accounting.py`` prints them)."""
        return {"compute (layers, optimizer step)": self.compute_s,
                f"requests that find their key ({self.requests})": self.request_s,
                f"polls' misses ({self.misses})": self.miss_s, f"invoker's lists ({self.lists:.1f})": self.list_s}

    @property
    def bound_s(self) -> float:
        """t_host: the iteration's CPU seconds over the host's cores."""
        return self.cpu_s / self.cores


def shares_host(platform: Platform) -> bool:
    """Whether ``platform``'s workers, invoker and store share one host whose request CPU was
    measured: the local backend with a calibration from ``flatpack calibrate --target local``."""
    return platform.kind == "local" and platform.host_cores is not None and platform.request_cpu is not None


def host_load(problem: Problem, plan: Plan, cost: funcpipe.PipelineCost, events: Iterable[Event], *,
              reads_target: bool = True) -> HostLoad | None:
    """The host load of one iteration of ``plan`` whose critical path ``cost`` predicts (with
    the measured terms) and ``events`` lays out (its simulated schedule); None where the
    platform shares no host or its request CPU was not measured (nothing then bounds the
    prediction)."""
    platform = problem.platform
    if not shares_host(platform):
        return None
    cpu, cores = platform.request_cpu, platform.host_cores
    assert cpu is not None and cores is not None     # shares_host checked both
    events = list(events)
    found_s, found = _request_cpu_s(problem, plan, cost, events, cpu, reads_target)
    # a poll's get takes a request's time, t_lat stretched by κ as the model's requests are.
    # Where the host bound exceeds the critical path every wait stretches, and so do the
    # polls' gets (and their sleeps' wake-ups wait for a core): the count of misses holds
    request_wall_s = platform.storage_latency_s * (cost.overheads.contention if cost.overheads is not None else 1.0)
    misses = sum(wait_misses(seconds, request_wall_s) for seconds in _download_idle_s(events))
    misses += sum(wait_misses(seconds, request_wall_s) for seconds in _sync_waits_s(cost, events, request_wall_s))
    base = HostLoad(cores=cores, compute_s=_compute_cpu_s(problem, plan, cost), request_s=found_s,
                    requests=found, misses=misses, miss_s=misses * cpu.miss_s, lists=0.0,
                    list_s=0.0)
    # the invoker lists every INVOKER_POLL_S of the iteration, however long it takes: at the
    # critical path's length, or where the bound is longer, at t = (CPU + ρ·t)/C, ρ the lists'
    # CPU per second, t = CPU / (C − ρ)
    per_second = _lists_per_poll(plan) / INVOKER_POLL_S
    at_critical_path = dataclasses.replace(base, lists=per_second * cost.iteration_s,
                                           list_s=per_second * cost.iteration_s * cpu.get_s)
    rate = per_second * cpu.get_s
    if at_critical_path.bound_s <= cost.iteration_s or rate >= base.cores:
        return at_critical_path
    iteration_s = base.cpu_s / (base.cores - rate)
    return dataclasses.replace(base, lists=per_second * iteration_s, list_s=rate * iteration_s)


def _compute_cpu_s(problem: Problem, plan: Plan, cost: funcpipe.PipelineCost) -> float:
    """Every replica's µ forwards and backwards and its optimizer step, in CPU seconds: tier
    seconds times the tier's CPU share, which the local throttle stretches them by."""
    threads = problem.options.threads
    micro = problem.workload.micro_batch_size
    overheads = cost.overheads or funcpipe.Overheads()
    total = 0.0
    for index, stage in enumerate(plan.stages):
        tier = stage_tier(problem, stage, index)
        forward, backward = layer_times(problem, stage.start, stage.end, tier, micro)
        passes = cost.micro_batches_per_replica * (forward + recompute_seconds(forward, backward, stage.recompute))
        optimizer = overheads.optimizer_s[index] if index < len(overheads.optimizer_s) else 0.0
        # the optimizer's figure is stretched by κ where κ·v > 1 (funcpipe.Overheads.of): undone here
        optimizer /= funcpipe.compute_stretch(overheads.contention, tier)
        total += stage.replicas * (passes + optimizer) * cpu_share(tier.vcpus, threads)
    return total


def _request_cpu_s(problem: Problem, plan: Plan, cost: funcpipe.PipelineCost, events: list[Event],
                   cpu: RequestCpu, reads_target: bool) -> tuple[float, int]:
    """CPU seconds (each request at ``cpu``'s figures) and count of the iteration's requests
    that find their key, the invoker's polls excepted (they depend on the iteration's length)."""
    micro = problem.workload.micro_batch_size
    mu = cost.micro_batches_per_replica
    replicas = cost.replicas
    workers = replicas * len(plan.stages)
    seconds, count = 0.0, 0

    def add(requests: int, each_s: float) -> None:
        nonlocal seconds, count
        seconds += requests * each_s
        count += requests

    for event in events:
        if event.kind == "upload":
            add(1, cpu.put(event.nbytes))
        elif event.kind == "download":
            add(1, cpu.get(event.nbytes))
    if problem.input_bytes is not None:
        add(replicas * mu, cpu.get(problem.boundary_bytes(-1, micro)))
    if reads_target:
        add(replicas * mu, cpu.get(0))
    if replicas > 1:
        for stage in cost.stages:
            chunk = stage.sync_bytes / replicas
            add(replicas * replicas, cpu.put(chunk))
            add(replicas * 2 * (replicas - 1), cpu.get(chunk))
        add(workers * 2, cpu.put(1))                  # the straggler markers, "forwarded" and "computed"
    add(workers * 2, cpu.put(0))                      # each worker's progress report and timeline
    # the invoker: the iteration's data and targets, then the last stage's reports
    add(problem.workload.micro_batch_count, cpu.put(problem.boundary_bytes(-1, micro)
                                                    if problem.input_bytes is not None else 0))
    if reads_target:
        add(problem.workload.micro_batch_count, cpu.put(0))
    add(replicas, cpu.get(0))
    return seconds, count


def _lists_per_poll(plan: Plan) -> int:
    """The invoker's lists at each poll: the progress reports', and the markers' where a stage
    has replicas (the straggler watch)."""
    return 1 + (1 if any(stage.replicas > 1 for stage in plan.stages) else 0)


def _sync_waits_s(cost: funcpipe.PipelineCost, events: list[Event], request_wall_s: float) -> list[float]:
    """Per get of every synchronization (d > 1), how long it waits for its key. Each replica
    makes 2(d − 1) gets (its chunk from every peer, then every peer's reduced chunk;
    ``collectives.scatter_reduce``), and each is issued as the peer starts uploading what it
    reads, so it polls for one chunk's upload as the model prices an upload: t_lat·κ + (ŝ/d)/W
    + o_u. The first also waits for the peers that start their sync later than this replica
    in the simulated schedule (each replica's sync is one task there, from its own backwards'
    end). The demo's job (2 x 2, 30 iterations, every get counted in every process) made 17.7
    sync misses an iteration; this counts 20, t_lat·κ + (ŝ/d)/W alone 8, and t_s less the
    gets' own transfers (t_s carries o_sync) 32 (BENCHMARKS.md, issue 19's eleventh pass)."""
    replicas = cost.replicas
    if replicas < 2:
        return []
    starts: dict[int, dict[int, float]] = defaultdict(dict)
    for event in events:
        if event.kind == "sync":
            starts[event.stage][event.replica] = event.start
    gets = 2 * (replicas - 1)
    overheads = cost.overheads or funcpipe.Overheads()
    waits = []
    for stage, by_replica in starts.items():
        figures = cost.stages[stage]
        # the model's upload of a chunk: the request, the bytes, and the upload task's term o_u
        # (serialization and the request's CPU beyond t_lat, as on every upload it prices)
        chunk_upload_s = (request_wall_s + figures.sync_bytes / replicas / figures.bandwidth_bytes_s
                          + overheads.task("upload", stage))
        latest = max(by_replica.values())
        for start in by_replica.values():
            waits.append(latest - start + chunk_upload_s)
            waits += [chunk_upload_s] * (gets - 1)
    return waits


def _download_idle_s(events: list[Event]) -> list[float]:
    """Per download of the simulated schedule, how long its lane idled before it: a wait that
    long polls before its key appears (the lane issues the next download as soon as the last
    one ends, and the first at the iteration's start)."""
    lanes: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for event in events:
        if event.kind == "download":
            lanes[(event.stage, event.replica)].append(event)
    idle = []
    for downloads in lanes.values():
        free = 0.0
        for event in sorted(downloads, key=lambda e: e.start):
            idle.append(max(0.0, event.start - free))
            free = event.end
    return idle
