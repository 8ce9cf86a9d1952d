"""Calibration: what was measured inside the target, which overrides the catalog's models.
Two measurements write this one format, alone or together:

* ``flatpack profile --target`` (:mod:`flatpack.backends.profiling`): per-layer seconds per
  memory tier (FuncPipe's profiler runs every layer on every memory tier in the cloud,
  FuncPipe §4 and App. B), for one graph;
* ``flatpack calibrate --target`` (:mod:`flatpack.backends.target_calibration`): the target
  itself, for any model: per tier the compute speed relative to the profiling host per op
  class, upload and download bandwidth, cold and warm invoke latency, the optimizer step's
  seconds per parameter byte; the store's per-request latency as a fitted exponentially
  modified Gaussian (``store_latency``), the polling overhead of a wait, and the host's
  cores (the local backend's workers and store share them).

The file is JSON (``docs/platforms.md`` has an example)::

    {
      "format": "flatpack-calibration",
      "schema_version": 1,
      "platform": "aws-lambda",
      "graph_hash": "9f2c...",            # the profiled graph's hash, or null
      "layers": ["conv1", "block1", ...],  # the chain's layer names, in order
      "tiers": {
        "1024": {
          "forward_s":  [[per_sample_s, fixed_s], ...],   # one line per layer
          "backward_s": [[per_sample_s, fixed_s], ...],
          "bandwidth_bytes_s": 24000000.0                 # optional, FuncPipe's W_j
        }
      },
      "storage_latency_s": 0.035,          # optional, FuncPipe's t_lat
      "overlap_slowdown": 1.08,            # optional, FuncPipe's beta
      "provenance": {"measured": "2026-11-20", "region": "us-east-1"}   # optional, free text
    }

Schema version 2 (``flatpack calibrate``) adds, all optional, and makes ``layers`` optional
(a target calibration has none; its tiers then hold no ``forward_s``/``backward_s``)::

      "target": {"name": "local", "region": null, "date": "2026-11-25T10:00:00+00:00",
                 "host": "Intel Xeon ...", "flatpack_version": "0.1.0", "threads": 1},
      "tiers": {"1024": {"compute_ratio": {"conv": 1.7, "matmul": 1.8, "elementwise": 1.7},
                         "upload_bytes_s": 2.3e7, "download_bytes_s": 2.4e7,
                         "invoke_cold_s": 1.9, "invoke_warm_s": 1.8,
                         "optimizer_s_per_byte": {"sgd": 1e-10, "sgd-momentum": 2e-10, "adam": 4e-10},
                         "task_overhead_s": {      # by the number of workers the probe ran
                             "2": {"forward": 0.0021, "backward": 0.0007, "upload": 0.0018,
                                   "download": 0.0012, "step": 0.0031, "iteration": 0.0045},
                             "4": {"forward": 0.0034, ..., "sync": 0.012}}}},
      "store_latency": {"distribution": "exponnorm", "K": 1.2, "loc": 0.002, "scale": 0.0005,
                        "samples": 120},      # scipy.stats.exponnorm's parameters, seconds
      "poll_overhead_s": 0.0021,              # a wait's mean delay after its key was written
      "host_cores": 2,                        # local backend: cores the workers and store share
      "request_cpu_s": {"put": 0.004, "get": 0.0025, "miss": 0.0018,   # local backend: host CPU of
                        "put_per_byte": 1e-8, "get_per_byte": 2e-9},  # a request, client + server
      "collective": {"skipped": "no GPU ..."} # or, --target gpu-container, CollectiveFit's fields:
                    # {"ranks": 2, "backend": "gloo", "device": "cpu", "device_name": "cpu",
                    #  "sizes_bytes": [...], "point_to_point_s": [...],
                    #  "all_reduce_s": {"2": [...], "3": [...]},   # by the number of ranks
                    #  "latency_s": ..., "bandwidth_bytes_s": ..., "alpha_s_per_byte": ...,
                    #  "beta_s": ..., "per_call_s": ..., "copy_s_per_byte": ..., "ring_error": ...}

A version 1 file still loads.

Seconds are :class:`~flatpack.ir.profile.Linear` lines ``per_sample * micro_batch + fixed``.
A tier that is not in the file falls back to the platform model: :meth:`Calibration.seconds`
answers exact tiers only and never interpolates between them, because compute time is not
linear in memory (the vCPU share saturates at the thread count) and a guess between two
measurements would look measured while being a model.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import statistics
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from flatpack.atomic import write_atomic
from flatpack.errors import InputError
from flatpack.safeio import MiB, load_json
from flatpack.ir.profile import Linear
from flatpack.platform.catalog import RequestCpu

if TYPE_CHECKING:
    from flatpack.platform.catalog import Platform

FORMAT = "flatpack-calibration"
SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
OP_CLASSES = ("conv", "matmul", "elementwise")


# a calibration holds per-layer lines of a model's chain: a few MB for the largest
CALIBRATION_FILE_LIMIT = 256 * MiB
# no measured figure (seconds, bytes per second, a ratio) comes near this; a larger one is an
# overflow waiting to happen in a cost model, not a measurement
MAX_FIGURE = 1e15
MAX_TIER_MB = 1_048_576   # a memory tier of 1 TiB
MAX_WORKERS = 1_024


def _number(value: Any, where: str, positive: bool = False) -> float:
    # an int is finite however large (math.isfinite of a 400-digit one overflows); MAX_FIGURE bounds it
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or (isinstance(value, float) and not math.isfinite(value)):
        raise InputError(f"calibration file: {where} must be a finite number, got {value!r:.60}")
    if value < 0 or (positive and value == 0):
        raise InputError(f"calibration file: {where} must be {'positive' if positive else 'non-negative'}, "
                         f"got {value!r}")
    if value > MAX_FIGURE:
        raise InputError(f"calibration file: {where} is {value!r:.40}, above the largest figure a calibration may hold "
                         f"({MAX_FIGURE:g})")
    return float(value)


def _count_key(key: Any, high: int) -> int | None:
    """A JSON object key naming a whole number from 1 to ``high`` (ASCII digits: Python's
    isdigit also takes superscripts, which int() refuses), else None."""
    text = str(key)
    if not (text.isascii() and text.isdigit()) or len(text) > 12:
        return None
    number = int(text)
    return number if 1 <= number <= high else None


def _lines(data: Any, count: int, where: str) -> tuple[Linear, ...]:
    if not isinstance(data, list):
        raise InputError(f"calibration file: {where} must be a list of [per_sample_seconds, fixed_seconds] "
                         f"pairs, got {type(data).__name__}")
    if len(data) != count:
        raise InputError(f"calibration file: {where} has {len(data)} lines but the file names {count} layers; "
                         "each tier needs one line per layer")
    lines = []
    for index, pair in enumerate(data):
        if not isinstance(pair, list) or len(pair) != 2:
            raise InputError(f"calibration file: {where}[{index}] must be [per_sample_seconds, fixed_seconds], "
                             f"got {pair!r}")
        lines.append(Linear(_number(pair[0], f"{where}[{index}][0]"), _number(pair[1], f"{where}[{index}][1]")))
    return tuple(lines)


def _ratios(data: Any, where: str, positive: bool = True) -> dict[str, float]:
    if not isinstance(data, dict):
        raise InputError(f"calibration file: {where} must map names to numbers, got {type(data).__name__}")
    return {str(name): _number(value, f"{where}.{name}", positive=positive) for name, value in data.items()}


# the tasks of a stage worker whose fixed seconds ``flatpack calibrate`` measures by running
# small pipelines on the tier (backends.task_overheads; the terms of funcpipe.Overheads)
TASK_KINDS = ("forward", "backward", "upload", "download", "sync", "step", "iteration", "request", "fork")


def _task_overheads(data: Any, where: str) -> dict[int, dict[str, float]]:
    if not isinstance(data, dict) or not all(_count_key(key, MAX_WORKERS) for key in data):
        raise InputError(f"calibration file: {where} must map worker counts (\"2\", \"4\", at most {MAX_WORKERS}) "
                         "to task seconds")
    found = {}
    for key, terms in data.items():
        # a task can take less than the equations say (a mean below the model): >= 0, not > 0
        seconds = _ratios(terms, f"{where}.{key}", positive=False)
        unknown = sorted(set(seconds) - set(TASK_KINDS))
        if unknown:
            raise InputError(f"calibration file: {where}.{key} names {', '.join(unknown)}; the tasks measured are "
                             f"{', '.join(TASK_KINDS)}")
        found[int(key)] = seconds
    return found


@dataclass(frozen=True)
class TierCalibration:
    """What was measured on one memory tier. Per layer (``flatpack profile --target``):
    forward and backward lines, optionally FuncPipe's W_j. Of the target (``flatpack
    calibrate``): the compute time of each op class relative to the profiling host
    (tier seconds / host seconds at the same thread count), each direction's bandwidth, the
    invoke latency of a first and a second start, the optimizer step's seconds per
    parameter byte per optimizer, and each worker task's seconds beyond what the model's
    equations give it (``task_overhead_s``: by the number of workers the probe pipeline ran
    with, then by task kind, :data:`TASK_KINDS`; ``backends.task_overheads``)."""

    forward_s: tuple[Linear, ...] = ()
    backward_s: tuple[Linear, ...] = ()
    bandwidth_bytes_s: float | None = None
    compute_ratio: Mapping[str, float] = field(default_factory=dict, hash=False)
    upload_bytes_s: float | None = None
    download_bytes_s: float | None = None
    invoke_cold_s: float | None = None
    invoke_warm_s: float | None = None
    # transfer seconds an idle link sends beyond its rate (a token bucket's burst), fitted with
    # the bandwidth from probes of two sizes (target_calibration.link_fit); None: not measured
    burst_s: float | None = None
    optimizer_s_per_byte: Mapping[str, float] = field(default_factory=dict, hash=False)
    task_overhead_s: Mapping[int, Mapping[str, float]] = field(default_factory=dict, hash=False)

    @property
    def link_bytes_s(self) -> float | None:
        """The one bandwidth W_j FuncPipe's equations take: the per-layer file's, else the
        harmonic mean of the measured upload and download (a transfer's time is bytes/W, so
        a round of one upload and one download takes 2·bytes/W)."""
        if self.bandwidth_bytes_s is not None:
            return self.bandwidth_bytes_s
        if self.upload_bytes_s and self.download_bytes_s:
            return 2 / (1 / self.upload_bytes_s + 1 / self.download_bytes_s)
        return None

    @property
    def speed_ratio(self) -> float | None:
        """Tier seconds per host second for a layer of unknown op class: the median of the
        op classes measured (their spread is in the file, per class)."""
        return statistics.median(self.compute_ratio.values()) if self.compute_ratio else None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        if self.forward_s:
            data["forward_s"] = [line.to_json() for line in self.forward_s]
            data["backward_s"] = [line.to_json() for line in self.backward_s]
        for name in ("bandwidth_bytes_s", "upload_bytes_s", "download_bytes_s", "invoke_cold_s", "invoke_warm_s",
                     "burst_s"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        for name in ("compute_ratio", "optimizer_s_per_byte"):
            if getattr(self, name):
                data[name] = dict(getattr(self, name))
        if self.task_overhead_s:
            data["task_overhead_s"] = {str(workers): dict(self.task_overhead_s[workers])
                                       for workers in sorted(self.task_overhead_s)}
        return data

    @classmethod
    def from_json(cls, tier: Any, key: str, layer_count: int) -> TierCalibration:
        if not isinstance(tier, dict):
            raise InputError(f"calibration file: tier {key} MB must be an object of measurements")
        where = f"tiers[{key}]"
        lines: dict[str, tuple[Linear, ...]] = {}
        if layer_count:
            lines = {kind: _lines(tier.get(kind), layer_count, f"{where}.{kind}")
                     for kind in ("forward_s", "backward_s")}
        figures = {name: _number(tier[name], f"{where}.{name}", positive=True)
                   for name in ("bandwidth_bytes_s", "upload_bytes_s", "download_bytes_s")
                   if tier.get(name) is not None}
        figures.update({name: _number(tier[name], f"{where}.{name}")
                        for name in ("invoke_cold_s", "invoke_warm_s", "burst_s") if tier.get(name) is not None})
        # keyword arguments of three kinds (per-layer lines, figures, per-kind ratios), by field name
        ratios: dict[str, Any] = {name: _ratios(tier[name], f"{where}.{name}")
                                  for name in ("compute_ratio", "optimizer_s_per_byte") if tier.get(name) is not None}
        if tier.get("task_overhead_s") is not None:
            ratios["task_overhead_s"] = _task_overheads(tier["task_overhead_s"], f"{where}.task_overhead_s")
        fields: dict[str, Any] = {**lines, **figures, **ratios}
        return cls(**fields)


@dataclass(frozen=True)
class StoreLatency:
    """Seconds of one store request, as an exponentially modified Gaussian (Gillis §IV-B
    models function-communication delay so): ``scipy.stats.exponnorm(K, loc, scale)``,
    fitted to ``samples`` measured requests. Its mean, loc + K·scale, is FuncPipe's t_lat."""

    k: float
    loc: float
    scale: float
    samples: int

    @property
    def mean_s(self) -> float:
        return self.loc + self.k * self.scale

    @classmethod
    def fit(cls, seconds: Sequence[float]) -> StoreLatency:
        """Maximum-likelihood fit of measured request seconds (scipy, on the invoker's side)."""
        # start-up time: scipy.stats takes ~1 s to load, and only a fit of measured latencies needs it
        from scipy.stats import exponnorm

        if len(seconds) < 8:
            raise InputError(f"fitting a latency distribution needs at least 8 measured requests, got {len(seconds)}; "
                             "raise round_trips")
        data = [float(value) for value in seconds]
        # start the likelihood search at the method-of-moments estimate (skewness γ gives the
        # exponential's share): from scipy's default start it can end at a degenerate K
        mean, spread = statistics.fmean(data), statistics.pstdev(data)
        skew = sum((value - mean) ** 3 for value in data) / (len(data) * spread ** 3) if spread > 0 else 0.0
        share = min(max(skew / 2, 0.01), 0.95) ** (1 / 3)
        tau, sigma = spread * share, max(spread * math.sqrt(1 - share ** 2), 1e-9)
        k, loc, scale = exponnorm.fit(data, tau / sigma, loc=mean - tau, scale=sigma)
        return cls(float(k), float(loc), float(scale), len(data))

    def to_json(self) -> dict[str, Any]:
        return {"distribution": "exponnorm", "K": self.k, "loc": self.loc, "scale": self.scale,
                "samples": self.samples, "mean_s": self.mean_s}

    @classmethod
    def from_json(cls, data: Any) -> StoreLatency:
        if not isinstance(data, dict) or data.get("distribution") != "exponnorm":
            raise InputError("calibration file: \"store_latency\" must be {\"distribution\": \"exponnorm\", "
                             "\"K\": ..., \"loc\": ..., \"scale\": ..., \"samples\": ...}")
        loc = data.get("loc")
        # a location may be negative; NaN fails the comparison, so it is refused too
        if isinstance(loc, bool) or not isinstance(loc, (int, float)) or not -MAX_FIGURE <= loc <= MAX_FIGURE:
            raise InputError(f"calibration file: store_latency.loc must be a finite number from {-MAX_FIGURE:g} to "
                             f"{MAX_FIGURE:g}, got {loc!r:.40}")
        return cls(_number(data.get("K"), "store_latency.K", positive=True), float(loc),
                   _number(data.get("scale"), "store_latency.scale", positive=True),
                   int(_number(data.get("samples", 0), "store_latency.samples")))


@dataclass(frozen=True)
class CollectiveFit:
    """What ``flatpack calibrate --target gpu-container`` measured between ``ranks`` ranks of
    the rank program's backend and device (``runtime.collective_probe``): the medians per
    message size of one point-to-point message and of the all-reduce among each number of
    ranks measured (2 up to ``ranks``); the message's latency and bandwidth D; and the
    all-reduce's terms fitted to them (``cost.collectives.fit_ring``): Hydrozoa's α (seconds
    per byte) and β (seconds per round), δ (``per_call_s``) and γ (``copy_s_per_byte``);
    ``ring_error``: the fit's largest relative error over the sizes and counts."""

    ranks: int
    backend: str
    device: str
    device_name: str
    sizes_bytes: tuple[int, ...]
    point_to_point_s: tuple[float, ...]
    all_reduce_s: Mapping[int, tuple[float, ...]]
    latency_s: float
    bandwidth_bytes_s: float
    alpha_s_per_byte: float
    beta_s: float
    per_call_s: float
    copy_s_per_byte: float
    ring_error: float

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["sizes_bytes"] = list(self.sizes_bytes)
        data["point_to_point_s"] = list(self.point_to_point_s)
        data["all_reduce_s"] = {str(count): list(self.all_reduce_s[count]) for count in sorted(self.all_reduce_s)}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CollectiveFit:
        where = "collective"
        missing = [field.name for field in dataclasses.fields(cls) if field.name not in data]
        if missing:
            raise InputError(f"calibration file: \"collective\" lacks {', '.join(missing)} (or say why it was not "
                             "measured with {\"skipped\": \"...\"})")
        ranks = data["ranks"]
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 2 <= ranks <= MAX_WORKERS:
            raise InputError(f"calibration file: collective.ranks must be an integer of 2 or more (at most "
                             f"{MAX_WORKERS}), got {ranks!r:.60}")
        sizes = data["sizes_bytes"]

        def series(values: Any, name: str) -> tuple[float, ...]:
            if not isinstance(values, list) or not isinstance(sizes, list) or len(values) != len(sizes) \
                    or len(values) < 2:
                raise InputError(f"calibration file: {where}.{name} must be a list of one number per message size "
                                 "(two sizes or more)")
            return tuple(_number(value, f"{where}.{name}[{index}]", positive=True)
                         for index, value in enumerate(values))

        sizes_bytes = tuple(int(n) for n in series(sizes, "sizes_bytes"))
        if list(sizes_bytes) != sorted(set(sizes_bytes)):
            raise InputError(f"calibration file: {where}.sizes_bytes must increase, got {list(sizes_bytes)}")
        all_reduce = data["all_reduce_s"]
        if not isinstance(all_reduce, dict) or not all_reduce or not all(
                (_count_key(count, ranks) or 0) >= 2 for count in all_reduce):
            raise InputError(f"calibration file: {where}.all_reduce_s must map rank counts (\"2\" to \"{ranks}\") to "
                             "seconds per message size")
        for name in ("backend", "device", "device_name"):
            if not isinstance(data[name], str) or len(data[name]) > 256:
                raise InputError(f"calibration file: {where}.{name} must be a string")
        return cls(ranks=ranks, backend=str(data["backend"]), device=str(data["device"]),
                   device_name=str(data["device_name"]),
                   sizes_bytes=sizes_bytes,
                   point_to_point_s=series(data["point_to_point_s"], "point_to_point_s"),
                   all_reduce_s={int(count): series(values, f"all_reduce_s.{count}")
                                 for count, values in all_reduce.items()},
                   latency_s=_number(data["latency_s"], f"{where}.latency_s"),
                   bandwidth_bytes_s=_number(data["bandwidth_bytes_s"], f"{where}.bandwidth_bytes_s", positive=True),
                   **{name: _number(data[name], f"{where}.{name}")
                      for name in ("alpha_s_per_byte", "beta_s", "per_call_s", "copy_s_per_byte", "ring_error")})


@dataclass(frozen=True)
class TargetInfo:
    """Where and when a target calibration was measured, and by what."""

    name: str
    date: str
    host: str
    flatpack_version: str
    region: str | None = None
    threads: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> TargetInfo:
        if not isinstance(data, dict):
            raise InputError("calibration file: \"target\" must be an object (name, date, host, flatpack_version)")
        missing = [key for key in ("name", "date", "host", "flatpack_version") if key not in data]
        if missing:
            raise InputError(f"calibration file: \"target\" lacks {', '.join(missing)}")
        threads = data.get("threads", 1)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_WORKERS:
            raise InputError(f"calibration file: target.threads must be a positive integer, got {threads!r}")
        return cls(str(data["name"]), str(data["date"]), str(data["host"]), str(data["flatpack_version"]),
                   None if data.get("region") is None else str(data["region"]), threads)


@dataclass(frozen=True)
class Calibration:
    """What was measured inside ``platform``: per memory tier (MB), seconds of the chain
    ``layer_names`` of the graph ``graph_hash`` (none for a target calibration), and the
    target's own figures (:class:`TierCalibration`, :class:`StoreLatency`)."""

    platform: str
    layer_names: tuple[str, ...]
    tiers: Mapping[int, TierCalibration] = field(hash=False)
    graph_hash: str | None = None
    storage_latency_s: float | None = None
    overlap_slowdown: float | None = None
    provenance: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    target: TargetInfo | None = None
    store_latency: StoreLatency | None = None
    poll_overhead_s: float | None = None
    host_cores: int | None = None
    collective: Mapping[str, Any] = field(default_factory=dict, hash=False)
    request_cpu: RequestCpu | None = None

    def __post_init__(self) -> None:
        if not self.platform:
            raise InputError("a calibration names the platform it was measured on")
        if not self.layer_names and self.target is None:
            raise InputError("a calibration covers at least one layer, or is a target calibration (flatpack calibrate)")
        if not self.tiers:
            raise InputError("a calibration holds at least one memory tier")
        for memory_mb, tier in self.tiers.items():
            for kind in ("forward_s", "backward_s"):
                if len(getattr(tier, kind)) != len(self.layer_names):
                    raise InputError(f"calibration: tier {memory_mb} MB has {len(getattr(tier, kind))} {kind} "
                                     f"lines for {len(self.layer_names)} layers")
        if self.overlap_slowdown is not None and self.overlap_slowdown < 1:
            raise InputError(f"calibration: overlap_slowdown (beta) must be >= 1, got {self.overlap_slowdown}")
        if self.host_cores is not None and self.host_cores < 1:
            raise InputError(f"calibration: host_cores must be at least 1, got {self.host_cores}")

    @property
    def tiers_mb(self) -> tuple[int, ...]:
        return tuple(sorted(self.tiers))

    @property
    def digest(self) -> str:
        """sha256 of the file's canonical JSON: what a plan records to say which calibration
        it was made with."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    @functools.cached_property
    def collective_fit(self) -> CollectiveFit | None:
        """The measured collective (``flatpack calibrate --target gpu-container``), or None
        where the file says why it was not measured or has none. Parsed once: Hydrozoa's
        model reads it for every plan it prices."""
        if not self.collective or "skipped" in self.collective:
            return None
        return CollectiveFit.from_json(self.collective)

    @property
    def request_latency_s(self) -> float | None:
        """FuncPipe's t_lat: the fitted distribution's mean, else the file's figure."""
        return self.store_latency.mean_s if self.store_latency is not None else self.storage_latency_s

    # -- use -------------------------------------------------------------------------------

    def check_against(self, layer_names: Sequence[str], graph_hash: str | None,
                      platform: str | None = None) -> None:
        """Refuses a calibration measured for another graph or platform. ``graph_hash`` or
        ``platform`` given as ``None`` is not checked; a target calibration (no layers)
        fits every graph."""
        rerun = "re-run calibration on this graph (after the same passes) on the target"
        if platform is not None and platform != self.platform:
            raise InputError(f"the calibration file was measured on {self.platform!r} but the target is "
                             f"{platform!r}; calibrate on {platform!r} or compile for {self.platform!r}")
        if not self.layer_names:
            return
        if graph_hash is not None and self.graph_hash is not None and graph_hash != self.graph_hash:
            raise InputError(f"the calibration file is for graph {self.graph_hash!r} but this graph hashes to "
                             f"{graph_hash!r}; {rerun}")
        names = list(layer_names)
        for index, (expected, found) in enumerate(zip(names, self.layer_names)):
            if expected != found:
                raise InputError(f"calibration does not match the chain at layer {index}: expected {expected!r}, "
                                 f"found {found!r}; {rerun}")
        if len(names) != len(self.layer_names):
            index = min(len(names), len(self.layer_names))
            detail = (f"expected {names[index]!r}, found nothing" if len(names) > len(self.layer_names)
                      else f"expected nothing, found {self.layer_names[index]!r}")
            raise InputError(f"calibration covers {len(self.layer_names)} layers but the chain has {len(names)}; "
                             f"first difference at layer {index}: {detail}; {rerun}")

    def seconds(self, layer_index: int, memory_mb: int, micro_batch: float) -> tuple[float, float] | None:
        """Forward and backward seconds of one micro-batch of layer ``layer_index`` on the
        ``memory_mb`` tier, or ``None`` when that tier has no per-layer lines (the caller
        then uses :meth:`speed_ratio` or the platform's model). Exact tiers only: no
        interpolation between tiers."""
        if not self.layer_names:
            return None
        if not 0 <= layer_index < len(self.layer_names):
            raise InputError(f"layer index {layer_index} is outside the calibrated chain of "
                             f"{len(self.layer_names)} layers")
        tier = self.tiers.get(memory_mb)
        if tier is None or not tier.forward_s:
            return None
        return tier.forward_s[layer_index].at(micro_batch), tier.backward_s[layer_index].at(micro_batch)

    def speed_ratio(self, memory_mb: int, threads: int) -> float | None:
        """Tier seconds per profiling-host second on the ``memory_mb`` tier, measured by
        ``flatpack calibrate`` at ``target.threads`` threads; ``None`` for a tier it did
        not measure or a profile taken at another thread count (a ratio at one thread count
        says nothing of another: intra-op speed-up is not linear)."""
        tier = self.tiers.get(memory_mb)
        if tier is None or self.target is None or threads != self.target.threads:
            return None
        return tier.speed_ratio

    def task_overhead(self, memory_mb: int, kind: str, workers: int) -> float:
        """Seconds a ``kind`` task (:data:`TASK_KINDS`) of a worker on the tier takes beyond
        the model's equations with ``workers`` workers running (they share the host on the
        local backend): the probe pipelines' figure at that count, else the line through the
        two nearest counts measured (beyond them, the nearest two's slope), at least 0; a
        kind measured at one count only is that figure. 0 where the tier or the kind was not
        measured."""
        tier = self.tiers.get(memory_mb)
        if tier is None:
            return 0.0
        points = sorted((count, terms[kind]) for count, terms in tier.task_overhead_s.items() if kind in terms)
        if not points:
            return 0.0
        if len(points) == 1:
            return points[0][1]
        below = [point for point in points if point[0] <= workers]
        above = [point for point in points if point[0] >= workers]
        if below and above:
            (x0, y0), (x1, y1) = below[-1], above[0]
        elif above:
            (x0, y0), (x1, y1) = points[0], points[1]
        else:
            (x0, y0), (x1, y1) = points[-2], points[-1]
        if x0 == x1:
            return y0
        return max(0.0, y0 + (y1 - y0) * (workers - x0) / (x1 - x0))

    def burst_seconds(self, memory_mb: int) -> float:
        """Transfer seconds the tier's idle link sends beyond its rate (0 where not measured)."""
        tier = self.tiers.get(memory_mb)
        if tier is None or tier.burst_s is None:
            return 0.0
        return tier.burst_s

    def optimizer_seconds(self, memory_mb: int, optimizer: str, parameter_bytes: float) -> float | None:
        """Seconds of one optimizer step over ``parameter_bytes`` on the tier, when measured."""
        tier = self.tiers.get(memory_mb)
        if tier is None or optimizer not in tier.optimizer_s_per_byte:
            return None
        return tier.optimizer_s_per_byte[optimizer] * parameter_bytes

    def apply(self, platform: Platform) -> Platform:
        """``platform`` with this file's measured bandwidth, storage latency, β, polling
        overhead and host cores in place of the catalog's, each source noting that it was
        measured."""
        self.check_against(self.layer_names, None, platform.name)
        bandwidth = {mb: tier.link_bytes_s for mb, tier in self.tiers.items() if tier.link_bytes_s}
        when = self.target.date if self.target is not None else self.provenance.get("measured")
        note = "measured inside the target by calibration" + (f" ({when})" if when else "")
        sources = dict(platform.sources)
        changes: dict[str, Any] = {}
        if bandwidth:
            changes["measured_bandwidth"] = {**platform.measured_bandwidth, **bandwidth}
            changes["tiers"] = tuple(replace(t, bandwidth_bytes_s=bandwidth[t.memory_mb])
                                     if t.memory_mb in bandwidth else t for t in platform.tiers)
            sources["measured_bandwidth"] = f"tiers {sorted(bandwidth)} MB: {note}"
        measured = {"storage_latency_s": self.request_latency_s, "overlap_slowdown": self.overlap_slowdown,
                    "poll_overhead_s": self.poll_overhead_s, "host_cores": self.host_cores,
                    "request_cpu": self.request_cpu}
        for name, value in measured.items():
            if value is not None:
                changes[name] = value
                sources[name] = note
        return replace(platform, sources=sources, **changes)

    # -- files -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "platform": self.platform,
            "graph_hash": self.graph_hash, "layers": list(self.layer_names),
            "tiers": {str(mb): self.tiers[mb].to_json() for mb in self.tiers_mb},
        }
        for name in ("storage_latency_s", "overlap_slowdown", "poll_overhead_s", "host_cores"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.target is not None:
            data["target"] = self.target.to_json()
        if self.store_latency is not None:
            data["store_latency"] = self.store_latency.to_json()
        if self.request_cpu is not None:
            data["request_cpu_s"] = self.request_cpu.to_json()
        if self.collective:
            data["collective"] = dict(self.collective)
        if self.provenance:
            data["provenance"] = dict(self.provenance)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Calibration:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"not a flatpack calibration file: expected a JSON object with \"format\": "
                             f"\"{FORMAT}\"")
        version = data.get("schema_version")
        if version not in READABLE_VERSIONS:
            raise InputError(f"calibration file schema version {version!r} is not supported; this flatpack "
                             f"reads versions {', '.join(map(str, READABLE_VERSIONS))}: re-run calibration with this "
                             "flatpack")
        required = ("platform", "layers", "tiers") if version == 1 else ("platform", "tiers")
        missing = [key for key in required if key not in data]
        if missing:
            raise InputError(f"calibration file lacks {', '.join(missing)}")
        layers = data.get("layers") or []
        if not isinstance(layers, list) or not all(isinstance(name, str) for name in layers):
            raise InputError("calibration file: \"layers\" must be a list of layer names")
        graph_hash = data.get("graph_hash")
        if graph_hash is not None and not isinstance(graph_hash, str):
            raise InputError(f"calibration file: \"graph_hash\" must be a string or null, got {graph_hash!r}")
        if not isinstance(data["tiers"], dict):
            raise InputError("calibration file: \"tiers\" must map memory sizes in MB to measurements")
        tiers = {}
        for key, tier in data["tiers"].items():
            if _count_key(key, MAX_TIER_MB) is None:
                raise InputError(f"calibration file: tier key {key!r:.60} is not a memory size in MB (1 to "
                                 f"{MAX_TIER_MB:,})")
            tiers[int(key)] = TierCalibration.from_json(tier, str(key), len(layers))
        optional: dict[str, Any] = {name: _number(data[name], name)
                                    for name in ("storage_latency_s", "overlap_slowdown", "poll_overhead_s")
                                    if data.get(name) is not None}
        if data.get("host_cores") is not None:
            cores = _number(data["host_cores"], "host_cores", positive=True)
            if not cores.is_integer() or cores > 65_536:
                raise InputError(f"calibration file: host_cores must be a whole number of cores (1 to 65,536), got "
                                 f"{data['host_cores']!r}")
            optional["host_cores"] = int(cores)
        if data.get("target") is not None:
            optional["target"] = TargetInfo.from_json(data["target"])
        if data.get("store_latency") is not None:
            optional["store_latency"] = StoreLatency.from_json(data["store_latency"])
        if data.get("request_cpu_s") is not None:
            optional["request_cpu"] = RequestCpu.from_json(data["request_cpu_s"], "calibration file: request_cpu_s")
        collective = data.get("collective") or {}
        if not isinstance(collective, dict):
            raise InputError("calibration file: \"collective\" must be an object")
        if collective and "skipped" not in collective:
            CollectiveFit.from_json(collective)   # refused here, where the file is read, not in a solver
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise InputError("calibration file: \"provenance\" must be an object of strings")
        if not isinstance(data["platform"], str) or len(data["platform"]) > 256:
            raise InputError("calibration file: \"platform\" must be a platform's name (a string)")
        return cls(platform=data["platform"], layer_names=tuple(layers), tiers=tiers, graph_hash=graph_hash,
                   provenance={str(k): str(v) for k, v in provenance.items()}, collective=collective, **optional)

    def save(self, path: str | os.PathLike) -> Path:
        # a reader never sees half a file, and two demos calibrating into the shared cache at once
        # both succeed
        return write_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Calibration:
        """A calibration file, read with the bounded reader (no NaN, no duplicate keys, bounded
        size and depth); a bad value is an InputError naming the file and the field."""
        data = load_json(path, limit=CALIBRATION_FILE_LIMIT, what=f"calibration file {path}")
        try:
            return cls.from_json(data)
        except InputError as error:
            raise InputError(f"{path}: {error}") from None
