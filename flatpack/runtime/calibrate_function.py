"""The calibration function: measures what a target's memory tier does that no profile of
the model says (``flatpack calibrate``, issue 19). It is deployed like a stage (the local
backend starts it as a process held to the tier's CPU share and link; a cloud backend ships
it in the deploy bundle, since it is part of the flatpack package every function runs) and
started with a role of kind ``"calibrate"`` whose ``stage`` carries the tier's memory size.

It reads its :class:`CalibrateSpec` from ``<run>/calibrate/spec/m<MB>`` and writes a
:class:`CalibrateResult` to ``<run>/calibrate/result/m<MB>/<invocation>``. A cold
invocation (0) measures everything; a warm one (1, 2, ...) times the compute and optimizer
probes again, further readings of the tier's speed, and says when it was ready, so that the
invoker can time a second start.

What it measures, compute on the tier's own clock (an emulated tier: CPU seconds over its
usable vCPUs, ``runtime.function.emulated_clock``, as the profiler function times layers, so
that whatever else the host runs does not inflate the figure; a real platform: wall time):

* compute: one probe per op class (conv, matmul, elementwise), the same code the invoker
  times on the profiling host (:func:`time_op_classes`), so their ratio maps host seconds
  to the tier's seconds;
* the store: the seconds of each small request (put and get of a few bytes), kept as
  samples for the invoker to fit an exponentially modified Gaussian (scipy is not in a
  function's image); upload and download of ``probe_bytes`` through the tier's link, and
  of a quarter of it after the link idled (:data:`IDLE_S`): the two sizes give the
  link's rate and how much an idle link sends beyond it (a token bucket's burst);
  the extra seconds a ``wait`` for a key takes beyond the moment its producer wrote it
  (the polling overhead: ``Store.wait`` backs off up to 5 ms between polls);
* the optimizer step: seconds per parameter byte of each optimizer a stage can run.

A GPU container would also measure its collective's α, β; this function records why it did
not (no GPU, or fewer than two for a collective) instead of a number that was not measured.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from flatpack.cpus import measured_cpus, on_each_cpu
from flatpack.runtime.function import Role, emulated_clock, tier_link
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store

CALIBRATE_KIND = "calibrate"
SPEC_FORMAT = "flatpack-calibrate-spec"
RESULT_FORMAT = "flatpack-calibrate-result"
OP_CLASSES = ("conv", "matmul", "elementwise")
STEP_OPTIMIZERS = ("sgd", "sgd-momentum", "adam")   # the names LayerProfile.optimizer_state_bytes uses
SMALL_OBJECT_BYTES = 64


def calibrate_role(keys: RunKeys, memory_mb: int, invocation: int, digest: str = "") -> Role:
    """The role of the ``invocation``-th calibration function of the ``memory_mb`` tier
    (``stage`` carries the memory size, as a profiler function's does, so a backend sizes
    the function by it; ``start_iteration`` carries the invocation: 0 cold, 1 or more warm)."""
    return Role(spec_key=keys.calibrate("spec", memory_mb), stage=memory_mb, replica=0,
                start_iteration=invocation, end_iteration=invocation, kind=CALIBRATE_KIND, digest=digest)


@dataclass(frozen=True)
class CalibrateSpec:
    """What one tier's calibration function measures. ``vcpus`` and ``emulate_cpu``: hold
    compute to the tier's share (local backend) or not (the platform enforces its own).
    ``bandwidth_bytes_s``: the tier's link as the local backend emulates it (None on a
    real platform, whose link is its own). ``round_trips``: small requests timed for the
    latency distribution. ``probe_bytes`` and ``transfer_repeats``: the bandwidth probe
    (and a probe of ``probe_bytes // SMALL_PROBE_PARTS`` bytes as often).
    ``optimizer_parameters``: float32 parameters the optimizer step is timed on.
    ``link_only``: time the transfer probes alone (an emulated tier whose CPU share another
    tier's function measures: ``target_calibration.alike_tiers``)."""

    run: str
    memory_mb: int
    vcpus: float
    emulate_cpu: bool
    bandwidth_bytes_s: float | None
    threads: int = 1
    round_trips: int = 60
    polls: int = 12
    probe_bytes: int = 4 << 20
    transfer_repeats: int = 3
    compute_repeats: int = 15
    optimizer_parameters: int = 1 << 20
    link_only: bool = False

    def dumps(self) -> bytes:
        return json.dumps({"format": SPEC_FORMAT, **asdict(self)}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> CalibrateSpec:
        data = json.loads(raw)
        if data.pop("format", None) != SPEC_FORMAT:
            raise ValueError(f"not a calibrate spec (expected \"format\": \"{SPEC_FORMAT}\")")
        return cls(**data)


@dataclass(frozen=True)
class CalibrateResult:
    """What one invocation measured (seconds). A warm invocation reports ``ready_at`` and
    times the compute and optimizer probes again; the requests, polls and transfers are the
    cold one's only (a ``link_only`` spec's: the transfers alone). ``started_at`` /
    ``ready_at``: the function's clock when its interpreter started and when it was ready to
    work (torch imported, spec read)."""

    memory_mb: int
    invocation: int
    started_at: float
    ready_at: float
    compute_s: dict[str, float] = field(default_factory=dict)
    request_s: list[float] = field(default_factory=list)
    poll_overhead_s: list[float] = field(default_factory=list)
    upload_s: list[float] = field(default_factory=list)
    download_s: list[float] = field(default_factory=list)
    probe_bytes: int = 0
    # the same transfers of small_probe_bytes, each after the link idled (empty: an earlier flatpack)
    small_upload_s: list[float] = field(default_factory=list)
    small_download_s: list[float] = field(default_factory=list)
    small_probe_bytes: int = 0
    optimizer_s_per_byte: dict[str, float] = field(default_factory=dict)
    collective: dict[str, Any] = field(default_factory=dict)

    def dumps(self) -> bytes:
        return json.dumps({"format": RESULT_FORMAT, **asdict(self)}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> CalibrateResult:
        data = json.loads(raw)
        if data.pop("format", None) != RESULT_FORMAT:
            raise ValueError(f"not a calibrate result (expected \"format\": \"{RESULT_FORMAT}\")")
        return cls(**data)


# --- probes shared with the invoker, which times the same code on the profiling host ----


# untimed rounds before the timed ones: the first calls pay lazy initialisation and page faults
WARMUP_ROUNDS = 3
# a tensor this large, freed before the probes (see _steady_allocator)
_SETTLING_BYTES = 24 << 20


def _steady_allocator() -> None:
    """Allocates and frees one large tensor. glibc's malloc serves a block above its mmap
    threshold (128 KB at first) by a fresh ``mmap`` whose every page faults on first touch,
    and raises the threshold to a block's size when such a block is freed: a worker's
    threshold is raised after its first micro-batch frees its activations, a fresh process's
    is not. Without this a probe's or Adam's multi-megabyte temporaries fault on every call in
    one process and not in another: a fresh process's conv over 2 MB ran 6 ms against 2.2 ms
    in the same process later, and Adam's seconds per byte read 1.8 to 8.0 ns in three runs."""
    settling = torch.empty(_SETTLING_BYTES // 4)
    del settling


def _op_probes() -> dict[str, Callable[[], Any]]:
    """One small computation per op class, a fraction of a millisecond to a few at one
    thread: long enough to time on the tier's clock. The matmul and elementwise probes write into buffers
    allocated once: a fresh 2 MB result each call is served by ``mmap`` or the heap depending
    on the allocator's history in that process, and the page faults of the first made the
    elementwise ratio swing 5× between the host and a function (0.21 to 2.25 on one host)."""
    generator = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 3, padding=1)
    image = torch.randn(4, 16, 32, 32, generator=generator)
    left = torch.randn(192, 192, generator=generator)
    right = torch.randn(192, 192, generator=generator)
    product = torch.empty(192, 192)
    vector = torch.randn(1 << 19, generator=generator)
    scratch = torch.empty_like(vector)

    def run_conv() -> Any:
        with torch.no_grad():
            return conv(image)

    def run_elementwise() -> Any:
        return torch.mul(vector, 1.5, out=scratch).add_(0.5).relu_()

    return {"conv": run_conv, "matmul": lambda: torch.mm(left, right, out=product), "elementwise": run_elementwise}


def time_op_classes(repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Seconds by ``clock`` of each op class's probe: the median over ``repeats`` rounds,
    after ``WARMUP_ROUNDS`` untimed ones, on each of the CPUs ``flatpack.cpus.measured_cpus`` gives in turn
    (``flatpack.cpus``: a vCPU's speed moves on its own), averaged over the CPUs. In a
    function of an emulated tier: the tier's own clock
    (CPU seconds over its usable vCPUs, ``runtime.function.emulated_clock``, as the profiler
    function times layers), so that other load on the host does not inflate the ratio (this
    run's own workers' contention is the cost model's κ); on a real platform: wall time.
    On the host: CPU seconds of this process at the same thread count. A round runs each
    probe once, so a stretch of load on the host (a preempted probe returns to a cold cache)
    falls on every op class alike rather than on whichever was being timed."""
    _steady_allocator()
    probes = _op_probes()

    def on_this_cpu() -> dict[str, float]:
        for _ in range(WARMUP_ROUNDS):   # also refills this CPU's caches after the move
            for probe in probes.values():
                probe()
        runs: dict[str, list[float]] = {name: [] for name in probes}
        for _ in range(repeats):
            for name, probe in probes.items():
                began = clock()
                probe()
                runs[name].append(clock() - began)
        return {name: statistics.median(seconds) for name, seconds in runs.items()}

    per_cpu = on_each_cpu(on_this_cpu, measured_cpus(torch.get_num_threads()))
    return {name: statistics.mean(reading[name] for reading in per_cpu) for name in probes}


def time_optimizer_steps(parameters: int, repeats: int, clock: Callable[[], float]) -> dict[str, float]:
    """Seconds per parameter byte of one optimizer step, per optimizer a stage can run (the
    optimizers and settings the host profiler uses for their state bytes): the median of
    ``repeats`` steps on each CPU ``flatpack.cpus.measured_cpus`` gives in turn, averaged over them."""
    _steady_allocator()
    weight = torch.nn.Parameter(torch.zeros(parameters))
    weight.grad = torch.full_like(weight, 1e-3)
    makers = {"sgd": lambda: torch.optim.SGD([weight], lr=0.1),
              "sgd-momentum": lambda: torch.optim.SGD([weight], lr=0.1, momentum=0.9),
              "adam": lambda: torch.optim.Adam([weight], lr=0.1)}
    per_byte = {}
    for name in STEP_OPTIMIZERS:
        optimizer = makers[name]()
        optimizer.step()   # the first step creates the state

        def on_this_cpu() -> float:
            optimizer.step()   # untimed: refills this CPU's caches after the move
            runs = []
            for _ in range(repeats):
                began = clock()
                optimizer.step()
                runs.append(clock() - began)
            return statistics.median(runs)

        per_byte[name] = (statistics.mean(on_each_cpu(on_this_cpu, measured_cpus(torch.get_num_threads())))
                          / (parameters * weight.element_size()))
    return per_byte


# --- the function ---------------------------------------------------------------------


def _requests(store: Store, keys: RunKeys, spec: CalibrateSpec) -> list[float]:
    small = bytes(SMALL_OBJECT_BYTES)
    key = keys.calibrate("probe", spec.memory_mb, 0)
    seconds = []
    for _ in range(spec.round_trips):
        began = time.perf_counter()
        store.put(key, small)
        middle = time.perf_counter()
        store.get(key)
        seconds.extend((middle - began, time.perf_counter() - middle))
    return seconds


def _poll_overheads(store: Store, keys: RunKeys, spec: CalibrateSpec) -> list[float]:
    """Seconds a ``wait`` returns after its key was written: a writer thread puts the key
    a few milliseconds into the wait, as a producer stage does while its consumer polls."""
    overheads = []
    for index in range(spec.polls):
        key = keys.calibrate("probe", spec.memory_mb, 100 + index)
        written: list[float] = []

        def produce() -> None:
            time.sleep(0.002 + 0.0007 * index)    # spread over the back-off's intervals
            store.put(key, b"1")
            written.append(time.perf_counter())

        writer = threading.Thread(target=produce)
        writer.start()
        store.wait(key, 30)
        seen = time.perf_counter()
        writer.join()
        overheads.append(max(0.0, seen - written[0]))
    return overheads


# a quarter: at every tier up to 3 GB of the local catalog (70 MB/s) its time at the link's
# rate, 15 ms or more, is past the local link's 10 ms burst, so both sizes lie on one line
SMALL_PROBE_PARTS = 4
# the link idles this long before each small probe: a token-bucket link banks its burst while
# idle (the local backend's: 10 ms of its rate), as a pipeline's link does between a stage's
# transfers, so the small probe sees what a transfer after a compute task sees
IDLE_S = 0.05


def _transfers(store: Store, keys: RunKeys, spec: CalibrateSpec, probe_bytes: int | None = None,
               idle_s: float = 0.0) -> tuple[list[float], list[float]]:
    """Seconds of ``transfer_repeats`` puts and gets of ``probe_bytes`` (default the spec's),
    each pair after ``idle_s`` of an idle link."""
    payload = bytes(spec.probe_bytes if probe_bytes is None else probe_bytes)
    key = keys.calibrate("probe", spec.memory_mb, 1)
    uploads, downloads = [], []
    for _ in range(spec.transfer_repeats):
        if idle_s:
            time.sleep(idle_s)
        began = time.perf_counter()
        store.put(key, payload)
        middle = time.perf_counter()
        store.get(key)
        uploads.append(middle - began)
        downloads.append(time.perf_counter() - middle)
    return uploads, downloads


def _link_probes(link: Store, keys: RunKeys, spec: CalibrateSpec) -> dict[str, Any]:
    """The bandwidth probes through the tier's ``link``, as :class:`CalibrateResult`'s fields:
    ``probe_bytes`` each way, then a quarter of it after the link idled."""
    uploads, downloads = _transfers(link, keys, spec)
    small_bytes = spec.probe_bytes // SMALL_PROBE_PARTS
    small_uploads, small_downloads = _transfers(link, keys, spec, small_bytes, IDLE_S)
    return {"upload_s": uploads, "download_s": downloads, "probe_bytes": spec.probe_bytes,
            "small_upload_s": small_uploads, "small_download_s": small_downloads, "small_probe_bytes": small_bytes}


def _collective() -> dict[str, Any]:
    """The GPU collective's α, β need two ranks on two GPUs; say why they were not measured."""
    if not torch.cuda.is_available():
        return {"skipped": "no GPU in this function: the collective's alpha, beta are GPU containers' figures"}
    if torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} GPU: a collective's alpha, beta need two ranks on two GPUs"}
    return {"skipped": "multi-GPU collective timing is not implemented by this calibration function"}


def run_calibrate(store: Store, role: Role, raw_spec: bytes, started: float) -> int:
    """Measures this function's tier and writes a :class:`CalibrateResult`; returns 0 once
    written. A failure (the store) raises, for the worker to record in its status."""
    ready = time.time()
    spec = CalibrateSpec.loads(raw_spec)
    keys = RunKeys(spec.run)
    invocation = role.start_iteration
    torch.set_num_threads(spec.threads)
    clock = emulated_clock(spec.vcpus, spec.threads) if spec.emulate_cpu else time.perf_counter
    link = tier_link(store, spec.bandwidth_bytes_s)     # the link a stage of this tier gets
    if spec.link_only:
        # an emulated tier of a CPU share another tier's function measures: its link is its own
        result = CalibrateResult(spec.memory_mb, invocation, started, ready, collective=_collective(),
                                 **_link_probes(link, keys, spec))
        store.put(keys.calibrate("result", spec.memory_mb, invocation), result.dumps())
        return 0
    # the compute and optimizer probes first, while no request of this function is being
    # served: the store server's work shares the host's cores with them, and timed after the
    # transfers the 512 MB tier's ratios read 1.0-1.6x the throttle's 1/share and Adam's
    # seconds per byte 1.8-8.0 ns in three runs on one host
    compute_s = time_op_classes(spec.compute_repeats, clock)
    optimizer_s_per_byte = time_optimizer_steps(spec.optimizer_parameters, spec.compute_repeats, clock)
    if invocation > 0:
        # warm: when it was ready, and the compute probes again: a further reading of the
        # tier's speed, which the invoker sets beside the others (target_calibration._tiers)
        result = CalibrateResult(spec.memory_mb, invocation, started, ready, compute_s=compute_s,
                                 optimizer_s_per_byte=optimizer_s_per_byte)
        store.put(keys.calibrate("result", spec.memory_mb, invocation), result.dumps())
        return 0
    transfers = _link_probes(link, keys, spec)
    result = CalibrateResult(
        memory_mb=spec.memory_mb, invocation=invocation, started_at=started, ready_at=ready,
        compute_s=compute_s,
        request_s=_requests(link, keys, spec), poll_overhead_s=_poll_overheads(link, keys, spec),
        optimizer_s_per_byte=optimizer_s_per_byte, collective=_collective(), **transfers)
    store.put(keys.calibrate("result", spec.memory_mb, invocation), result.dumps())
    return 0
