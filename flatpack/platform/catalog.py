"""The platform catalog: memory tiers, vCPU share, bandwidth, latency, prices and limits of
each target, as data with the source of every number beside it.

A :class:`Platform` is plain data. ``tiers`` are the default configurations a solver
considers (FuncPipe's eight memory sizes on Lambda); :meth:`Platform.tier` gives any allowed
configuration, derived by the platform's :class:`Scaling` rule (serverless functions, where
one memory knob sets vCPU share, bandwidth and price) or looked up among discrete
configurations (GPU containers). :meth:`Platform.compute_seconds` is the host-to-tier
compute-time model; a calibration file measured inside the target overrides it
(:mod:`flatpack.platform.calibration`). ``docs/platforms.md`` has the same numbers as tables.

Every number carries a source in ``Platform.sources``: a paper in ``../shared/papers/`` (beside the repository)
(by section), a provider's public documentation page, a measurement on the build host, or
the word "assumption" with the reason. :meth:`Platform.missing_sources` lists numbers
without one; the unit tests require it to be empty for every built-in platform.
"""

from __future__ import annotations

import bisect
import math
import numbers
import os
import re
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Mapping

from flatpack.errors import InputError
from flatpack.registry import Registry
from flatpack.table import format_table
from flatpack.units import GBIT_S, GIB, MB_S, MIB

if TYPE_CHECKING:
    from flatpack.ir.profile import HostInfo

KINDS = ("serverless", "container", "local")

# Where the numbers come from. Papers are cited by name and section (docs/papers.md lists them).
FUNCPIPE = "FuncPipe"
GILLIS = "Gillis"
HYDROZOA = "Hydrozoa"
SLSML = "slsML"
AWS_PRICING = "AWS Lambda pricing, https://aws.amazon.com/lambda/pricing/ (us-east-1, x86, first duration tier)"
AWS_MEMORY = "AWS Lambda developer guide, 'Configure Lambda function memory' (configuration-memory)"
AWS_QUOTAS = "AWS Lambda developer guide, 'Lambda quotas' (gettingstarted-limits)"
AWS_10GB_BLOG = "AWS News Blog, 'New for AWS Lambda - Functions with Up to 10 GB of Memory and 6 vCPUs' (Dec 2020)"
FC_BILLING = ("Alibaba Cloud Function Compute 3.0, 'Pay-as-you-go' billing page "
              "(alibabacloud.com/help/en/functioncompute/fc-3-0/product-overview/pay-as-you-go-billing-method-1)")
FC_LIMITS = ("Alibaba Cloud Function Compute 3.0, 'Limits' page "
             "(alibabacloud.com/help/en/functioncompute/fc-3-0/product-overview/limits-of-usage)")
FC_INSTANCES = ("Alibaba Cloud Function Compute, 'Instance types and instance modes' page "
                "(alibabacloud.com/help/en/function-compute/latest/instance-types-and-instance-modes)")
AS_OF = "public price list, as of 2026-11"
MEASURED_RSS = ("measured on the build host: 227 MB resident after `import torch, flatpack` "
                "(torch 2.13.0+cpu, Python 3), rounded up to 256 MiB for the handler, the store "
                "client and allocator slack (the rounding is an assumption)")


@dataclass(frozen=True)
class Tier:
    """One worker configuration: what a function of ``memory_mb`` (or a container) gets.

    ``memory_mb`` is in MiB, as the providers count it (Lambda's 128 MB is 128 × 2^20
    bytes). ``vcpus`` is the CPU share in vCPU-seconds per second, not a core count.
    ``gpu_memory_mb`` bounds what a GPU stage may keep on the device; 0 without a GPU.
    """

    memory_mb: int
    vcpus: float
    bandwidth_bytes_s: float     # W_j in FuncPipe: the worker's bandwidth to storage or peers
    price_per_s: float           # dollars per second of one worker of this tier
    gpus: int = 0
    gpu_model: str | None = None
    gpu_memory_mb: int = 0

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * MIB

    @property
    def price_per_hour(self) -> float:
        return self.price_per_s * 3600

    def label(self) -> str:
        gpu = f", {self.gpus}x {self.gpu_model}" if self.gpus else ""
        return f"{self.memory_mb} MB ({self.vcpus:g} vCPU{gpu})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Tier:
        return cls(int(data["memory_mb"]), float(data["vcpus"]), float(data["bandwidth_bytes_s"]),
                   float(data["price_per_s"]), int(data.get("gpus", 0)), data.get("gpu_model"),
                   int(data.get("gpu_memory_mb", 0)))


def _interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), flat beyond either end."""
    xs = [point[0] for point in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1]
    right = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[right - 1], points[right]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class Scaling:
    """How a serverless platform derives a tier from its one knob, the memory size.

    vCPU share = memory / ``mb_per_vcpu``, clamped to [``min_vcpus``, ``max_vcpus``], rounded
    to ``vcpu_step`` where the provider sells steps, and capped at ``host_vcpu_cap`` for the
    local emulation. Bandwidth is interpolated in memory through ``bandwidth_points``
    ``(memory_mb, bytes_per_s)``. Price per second = ``price_per_gb_s`` × memory in GiB +
    ``price_per_vcpu_s`` × vCPUs (Alibaba bills both; Lambda bills memory only).
    """

    memory_step_mb: int
    mb_per_vcpu: float
    max_vcpus: float
    bandwidth_points: tuple[tuple[float, float], ...]
    price_per_gb_s: float
    price_per_vcpu_s: float = 0.0
    min_vcpus: float = 0.0
    vcpu_step: float = 0.0
    host_vcpu_cap: float | None = None

    def __post_init__(self) -> None:
        if self.memory_step_mb < 1 or self.mb_per_vcpu <= 0 or self.max_vcpus <= 0:
            raise InputError("a Scaling needs memory_step_mb >= 1, mb_per_vcpu > 0 and max_vcpus > 0")
        if not self.bandwidth_points or any(b < a for (a, _), (b, _) in zip(self.bandwidth_points,
                                                                              self.bandwidth_points[1:])):
            raise InputError("Scaling.bandwidth_points must be a non-empty list of (memory_mb, bytes_per_s) "
                             "sorted by memory")

    def vcpus(self, memory_mb: int) -> float:
        share = min(max(memory_mb / self.mb_per_vcpu, self.min_vcpus), self.max_vcpus)
        if self.vcpu_step:
            share = max(round(share / self.vcpu_step) * self.vcpu_step, self.min_vcpus)
            share = round(share, 6)   # 0.05 steps accumulate float noise; keep them printable
        if self.host_vcpu_cap is not None:
            share = min(share, self.host_vcpu_cap)
        return share

    def tier(self, memory_mb: int) -> Tier:
        vcpus = self.vcpus(memory_mb)
        price = self.price_per_gb_s * memory_mb / 1024 + self.price_per_vcpu_s * vcpus
        return Tier(memory_mb, vcpus, _interpolate(self.bandwidth_points, memory_mb), price)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["bandwidth_points"] = [list(point) for point in self.bandwidth_points]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Scaling:
        values = dict(data)
        values["bandwidth_points"] = tuple((float(m), float(b)) for m, b in data["bandwidth_points"])
        return cls(**values)


@dataclass(frozen=True)
class RequestCpu:
    """Host CPU seconds one store request costs the client that sends it and the server that
    answers it together, on a host where both run (the local backend: every worker, the
    invoker and the S3 server share its cores). ``flatpack calibrate --target local`` times
    it (``backends.request_cpu.measure_request_cpu``): a put, a get of a key that is
    there, a get of one that is not yet (a poll's miss), each a fixed part plus seconds per
    byte moved. ``analysis.host_load`` sums them over an iteration's requests.

    ``cores_obtained``: (processes, cores) pairs, what that many busy processes, each in its
    own session as the local backend starts its workers, got of the host's cores together
    when calibrate measured it (``cpus.cores_obtained``; issue 44). Fewer than the host's
    cores says other work shares the host: ``flatpack calibrate`` prints it, and
    ``benchmarks/fidelity.py`` records it beside each run. The host bound does not divide by
    it (``analysis.host_load`` says why). Empty: not measured."""

    put_s: float
    get_s: float
    miss_s: float
    put_s_per_byte: float = 0.0
    get_s_per_byte: float = 0.0
    cores_obtained: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        values = {name: getattr(self, name) for name in ("put_s", "get_s", "miss_s", "put_s_per_byte",
                                                          "get_s_per_byte")}
        bad = {name: value for name, value in values.items() if not (math.isfinite(value) and value >= 0)}
        if bad:
            raise InputError(f"request CPU seconds must be finite and non-negative, got {bad}")
        counts = [processes for processes, _ in self.cores_obtained]
        if counts != sorted(set(counts)) or any(processes < 1 or not (math.isfinite(cores) and cores > 0)
                                                for processes, cores in self.cores_obtained):
            raise InputError(f"cores_obtained must pair distinct, increasing process counts (at least 1) with a "
                             f"positive number of cores, got {self.cores_obtained!r:.200}")

    def put(self, nbytes: float) -> float:
        return self.put_s + self.put_s_per_byte * nbytes

    def get(self, nbytes: float) -> float:
        return self.get_s + self.get_s_per_byte * nbytes

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"put": self.put_s, "get": self.get_s, "miss": self.miss_s,
                                "put_per_byte": self.put_s_per_byte, "get_per_byte": self.get_s_per_byte}
        if self.cores_obtained:
            data["cores_obtained"] = {str(processes): cores for processes, cores in self.cores_obtained}
        return data

    @classmethod
    def from_json(cls, data: Any, where: str = "request_cpu") -> RequestCpu:
        names = {"put": "put_s", "get": "get_s", "miss": "miss_s", "put_per_byte": "put_s_per_byte",
                 "get_per_byte": "get_s_per_byte"}
        if not isinstance(data, Mapping) or not {"put", "get", "miss"} <= set(data):
            raise InputError(f"{where} must be an object with put, get and miss seconds (and optionally "
                             f"put_per_byte, get_per_byte), got {data!r:.200}")
        unknown = sorted(set(data) - set(names) - {"cores_obtained"})
        if unknown:
            raise InputError(f"{where} has unknown keys {unknown}; it takes {', '.join(names)}, cores_obtained")
        values: dict[str, Any] = {}
        if "cores_obtained" in data:
            values["cores_obtained"] = _cores_obtained(data["cores_obtained"], f"{where}.cores_obtained")
        for key, value in data.items():
            if key == "cores_obtained":
                continue
            # finite, not negative and at most an hour: a request's CPU cost, not an overflow
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
                raise InputError(f"{where}.{key} must be a non-negative number of seconds (at most 3600), got "
                                 f"{value!r:.60}")
            values[names[key]] = float(value)
        return cls(**values)


def _cores_obtained(data: Any, where: str) -> tuple[tuple[int, float], ...]:
    """A calibration file's ``{"processes": cores}`` as sorted pairs."""
    if not isinstance(data, Mapping):
        raise InputError(f"{where} must map process counts to the cores they got, got {data!r:.100}")
    pairs = []
    for key, value in data.items():
        if not str(key).isdigit() or not 1 <= int(key) <= 4096:
            raise InputError(f"{where}: {key!r:.40} is not a count of processes (1 to 4096)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 65_536:
            raise InputError(f"{where}[{key}] must be a positive number of cores, got {value!r:.60}")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


_NUMERIC_FIELDS = ("min_memory_mb", "max_memory_mb", "storage_latency_s", "price_per_request",
                   "billing_granularity_s", "timeout_s", "base_memory_bytes", "overlap_slowdown",
                   "aggregate_bandwidth_bytes_s", "package_limit_bytes", "image_limit_bytes",
                   "ephemeral_storage_bytes", "cpu_speed_ratio", "poll_overhead_s", "host_cores")


@dataclass(frozen=True)
class Platform:
    """A target. ``tiers`` are the default choices a solver considers (FuncPipe's 8 memory
    sizes on Lambda); ``tier(memory_mb)`` gives any allowed configuration.

    ``scaling`` is the rule that turns a memory size into a tier on platforms with one
    memory knob; ``None`` means only the configurations in ``tiers`` exist (containers).
    ``cpu_speed_ratio``: one of the platform's vCPUs in units of one host thread.
    ``gpu_vcpu_equivalents``: training throughput of one GPU of each model in units of one
    vCPU, used only when a CPU host profile must be mapped to a GPU tier.
    ``measured_bandwidth``: per-tier bandwidth measured inside the target (a calibration
    file's), which wins over the scaling rule.
    ``poll_overhead_s``: the mean delay a consumer's polling ``wait`` adds after its key was
    written (None: not stated; the cost models then add none). ``host_cores``: on the
    local backend, the cores every worker and the store share (None elsewhere: a cloud
    function's CPU is its own). ``request_cpu``: on such a shared host, what a store request
    costs its CPU (None: not measured; no host bound is then predicted).
    """

    name: str
    kind: str                               # "serverless" | "container" | "local"
    tiers: tuple[Tier, ...]
    min_memory_mb: int
    max_memory_mb: int
    storage_latency_s: float                # t_lat: one round trip to the shared store
    price_per_request: float
    billing_granularity_s: float            # Gillis's D
    timeout_s: float | None
    base_memory_bytes: int                  # FuncPipe's s0: runtime + framework
    overlap_slowdown: float                 # FuncPipe's β ≥ 1
    aggregate_bandwidth_bytes_s: float | None = None   # e.g. OSS account cap
    direct_networking: bool = False         # workers talk to each other, not via storage
    package_limit_bytes: int | None = None
    image_limit_bytes: int | None = None
    ephemeral_storage_bytes: int | None = None
    sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    scaling: Scaling | None = None
    cpu_speed_ratio: float = 1.0
    gpu_vcpu_equivalents: Mapping[str, float] = field(default_factory=dict, hash=False)
    measured_bandwidth: Mapping[int, float] = field(default_factory=dict, hash=False)
    poll_overhead_s: float | None = None
    host_cores: int | None = None
    request_cpu: RequestCpu | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise InputError("a platform needs a non-empty name")
        if self.kind not in KINDS:
            raise InputError(f"platform {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.tiers:
            raise InputError(f"platform {self.name!r} lists no tiers; give at least one default configuration")
        if not 0 < self.min_memory_mb <= self.max_memory_mb:
            raise InputError(f"platform {self.name!r}: memory range {self.min_memory_mb}..{self.max_memory_mb} MB "
                             "is empty or not positive")
        outside = [t.memory_mb for t in self.tiers if not self.min_memory_mb <= t.memory_mb <= self.max_memory_mb]
        if outside:
            raise InputError(f"platform {self.name!r}: tiers {outside} MB lie outside its memory range "
                             f"{self.min_memory_mb}..{self.max_memory_mb} MB")
        if len({t.memory_mb for t in self.tiers}) != len(self.tiers):
            raise InputError(f"platform {self.name!r}: two tiers share a memory size; tiers are looked up by "
                             "memory, so give each a distinct one")
        if self.overlap_slowdown < 1:
            raise InputError(f"platform {self.name!r}: overlap_slowdown (FuncPipe's β) must be >= 1, "
                             f"got {self.overlap_slowdown}")
        if self.cpu_speed_ratio <= 0:
            raise InputError(f"platform {self.name!r}: cpu_speed_ratio must be positive, got {self.cpu_speed_ratio}")

    # -- tiers -----------------------------------------------------------------------------

    def tier(self, memory_mb: int) -> Tier:
        """The configuration of ``memory_mb``: any allowed size on platforms with a scaling
        rule, one of the listed configurations otherwise."""
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, numbers.Integral):
            raise InputError(f"{self.name}: a memory size is a whole number of MB, got {memory_mb!r}")
        memory_mb = int(memory_mb)
        if self.scaling is None:
            for tier in self.tiers:
                if tier.memory_mb == memory_mb:
                    return tier
            choices = "; ".join(tier.label() for tier in self.tiers)
            raise InputError(f"{self.name} has no {memory_mb} MB configuration; its configurations are: {choices}")
        if not self.min_memory_mb <= memory_mb <= self.max_memory_mb:
            raise InputError(f"{self.name} allows {self.min_memory_mb}-{self.max_memory_mb} MB per worker, "
                             f"got {memory_mb} MB; pick a size in that range")
        if memory_mb % self.scaling.memory_step_mb:
            raise InputError(f"{self.name} sizes memory in steps of {self.scaling.memory_step_mb} MB, got "
                             f"{memory_mb} MB; round to a multiple of {self.scaling.memory_step_mb}")
        tier = self.scaling.tier(memory_mb)
        if memory_mb in self.measured_bandwidth:
            tier = replace(tier, bandwidth_bytes_s=float(self.measured_bandwidth[memory_mb]))
        return tier

    @property
    def memory_choices(self) -> tuple[int, ...]:
        return tuple(tier.memory_mb for tier in self.tiers)

    # -- time and money --------------------------------------------------------------------

    def compute_seconds(self, host_seconds: float, host: HostInfo, tier: Tier) -> float:
        """Seconds a computation that took ``host_seconds`` on the profiling host takes on a
        worker of ``tier``. The model, and what it assumes:

        * CPU worker, CPU profile: the host ran with ``host.threads`` intra-op threads, and
          compute time is inversely proportional to the CPU share a computation gets, up to
          the number of threads it uses. A worker with ``v`` vCPUs runs it at
          ``min(v, threads) / threads × cpu_speed_ratio`` of the host's speed: below one
          thread per vCPU it is throttled (Lambda's 512 MB tier gets 0.29 of a vCPU), above
          it the extra vCPUs are idle because the stage keeps the profiled thread count.
          ``cpu_speed_ratio`` (one platform vCPU in host threads) is 1.0 on every built-in
          platform: an assumption, since no source compares a provider's vCPU with this
          host's. Linear scaling in threads makes fractional-vCPU predictions pessimistic
          when the host ran several threads (intra-op speed-up is sub-linear); profiling
          with one thread avoids that.
        * GPU worker, CPU profile: one GPU of model ``g`` does the work of
          ``gpu_vcpu_equivalents[g]`` vCPUs (whole-model training throughput; see the
          sources). Per-layer GPU times are far less regular than this; calibrate.
        * GPU worker, GPU profile: scaled by the ratio of the two GPUs' equivalents; a host
          GPU the catalog does not know raises :class:`InputError`.
        * CPU worker, GPU profile: no model; raises :class:`InputError`.

        A calibration file measured inside the target replaces all of this per layer and
        tier (``Problem.layer_seconds`` consults it first). FuncPipe's β is not applied
        here: it multiplies compute that overlaps communication, which the cost model knows.
        """
        if host_seconds < 0:
            raise InputError(f"host seconds must be non-negative, got {host_seconds}")
        if host.threads < 1:
            raise InputError(f"the host profile records {host.threads} threads; re-profile (threads >= 1)")
        host_rate = self._host_rate(host, tier)
        if tier.gpus:
            tier_rate = self._gpu_equivalents(tier.gpu_model, f"{self.name} tier {tier.label()}")
        else:
            if tier.vcpus <= 0:
                raise InputError(f"{self.name} tier {tier.memory_mb} MB has no CPU share; it cannot compute")
            tier_rate = min(tier.vcpus, host.threads) * self.cpu_speed_ratio
        return host_seconds * host_rate / tier_rate

    def _host_rate(self, host: HostInfo, tier: Tier) -> float:
        if host.device == "cpu":
            return float(host.threads)
        if not tier.gpus:
            raise InputError(f"the profile was measured on {host.gpu or 'a GPU'} but {self.name} tier "
                             f"{tier.memory_mb} MB is a CPU worker; there is no GPU-to-CPU model: profile on "
                             "CPU (device='cpu') or give a calibration file measured on the target")
        return self._gpu_equivalents(self._gpu_model_of(host.gpu), f"the profiling host's GPU {host.gpu!r}")

    def _gpu_model_of(self, name: str | None) -> str | None:
        if not name:
            return None
        matches = [model for model in self.gpu_vcpu_equivalents if model.lower() in name.lower()]
        return max(matches, key=len) if matches else None

    def _gpu_equivalents(self, model: str | None, what: str) -> float:
        if model is None or model not in self.gpu_vcpu_equivalents:
            known = ", ".join(sorted(self.gpu_vcpu_equivalents)) or "none"
            raise InputError(f"{what}: no speed figure for GPU model {model!r} on {self.name} (known: {known}); "
                             "give a calibration file measured on the target, or register a platform whose "
                             "gpu_vcpu_equivalents lists this GPU")
        return float(self.gpu_vcpu_equivalents[model])

    def billed_seconds(self, seconds: float) -> float:
        """Duration the provider bills: rounded up to the billing granularity (Gillis §IV-C)."""
        if seconds <= 0:
            return 0.0
        units = math.ceil(round(seconds / self.billing_granularity_s, 9))
        return units * self.billing_granularity_s

    def cost(self, seconds: float, tier: Tier, requests: int = 1) -> float:
        """Dollars for ``requests`` invocations of a ``tier`` worker that each ran ``seconds``."""
        return requests * (self.billed_seconds(seconds) * tier.price_per_s + self.price_per_request)

    # -- sources and printing --------------------------------------------------------------

    def numeric_fields(self) -> list[str]:
        """Every number this platform states, as the keys its ``sources`` must have."""
        keys = [name for name in _NUMERIC_FIELDS if getattr(self, name) is not None]
        keys += ["tier.memory_mb", "tier.vcpus", "tier.bandwidth_bytes_s", "tier.price_per_s"]
        if any(tier.gpus for tier in self.tiers):
            keys += ["tier.gpus", "tier.gpu_memory_mb"]
        if self.scaling is not None:
            keys += [f"scaling.{name}" for name, value in asdict(self.scaling).items()
                     if value is not None and name != "bandwidth_points"]
            keys.append("scaling.bandwidth_points")
        if self.gpu_vcpu_equivalents:
            keys.append("gpu_vcpu_equivalents")
        if self.measured_bandwidth:
            keys.append("measured_bandwidth")
        if self.request_cpu is not None:
            keys.append("request_cpu")
        return keys

    def missing_sources(self) -> list[str]:
        return [key for key in self.numeric_fields() if not str(self.sources.get(key, "")).strip()]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind, "tiers": [tier.to_json() for tier in self.tiers],
            **{name: getattr(self, name) for name in _NUMERIC_FIELDS},
            "direct_networking": self.direct_networking,
            "scaling": self.scaling.to_json() if self.scaling else None,
            "gpu_vcpu_equivalents": dict(self.gpu_vcpu_equivalents),
            "measured_bandwidth": {str(mb): bw for mb, bw in self.measured_bandwidth.items()},
            "request_cpu": self.request_cpu.to_json() if self.request_cpu is not None else None,
            "sources": dict(self.sources),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Platform:
        missing = [key for key in ("name", "kind", "tiers", "min_memory_mb", "max_memory_mb", "storage_latency_s",
                                   "price_per_request", "billing_granularity_s", "base_memory_bytes",
                                   "overlap_slowdown") if key not in data]
        if missing:
            raise InputError(f"platform description lacks {', '.join(missing)}")
        values = {"timeout_s": None, **{name: data[name] for name in _NUMERIC_FIELDS if name in data}}
        return cls(name=data["name"], kind=data["kind"], tiers=tuple(Tier.from_json(t) for t in data["tiers"]),
                   direct_networking=bool(data.get("direct_networking", False)),
                   scaling=Scaling.from_json(data["scaling"]) if data.get("scaling") else None,
                   gpu_vcpu_equivalents=dict(data.get("gpu_vcpu_equivalents", {})),
                   measured_bandwidth={int(mb): float(bw) for mb, bw in data.get("measured_bandwidth", {}).items()},
                   request_cpu=RequestCpu.from_json(data["request_cpu"]) if data.get("request_cpu") else None,
                   sources=dict(data.get("sources", {})), **values)

    def describe(self) -> str:
        """A short text card: the platform's facts, then its default tiers as a table."""
        lines = [f"{self.name} ({self.kind}): {self.min_memory_mb}-{self.max_memory_mb} MB per worker, "
                 f"storage latency {self.storage_latency_s * 1000:g} ms, "
                 f"${self.price_per_request * 1e6:g} per 1M requests, billed per {self.billing_granularity_s:g} s, "
                 f"timeout {'none' if self.timeout_s is None else f'{self.timeout_s:g} s'}, "
                 f"beta {self.overlap_slowdown:g}"
                 + (", direct networking" if self.direct_networking else "")
                 + ("" if self.aggregate_bandwidth_bytes_s is None
                    else f", aggregate cap {self.aggregate_bandwidth_bytes_s / MB_S:g} MB/s")]
        rows = [(tier.memory_mb, f"{tier.vcpus:.3g}", f"{tier.bandwidth_bytes_s / MB_S:.3g}",
                 f"{tier.price_per_hour:.4g}",
                 f"{tier.gpus}x {tier.gpu_model} ({tier.gpu_memory_mb} MB)" if tier.gpus else "-")
                for tier in self.tiers]
        lines.append(format_table(["memory MB", "vCPU", "MB/s", "$/hour", "gpu"], rows, numeric={0, 1, 2, 3},
                                  indent="  "))
        return "\n".join(lines)


# -- the built-in platforms ------------------------------------------------------------------

FUNCPIPE_TIERS_MB = (512, 1024, 2048, 3072, 4096, 6144, 8192, 10240)

LAMBDA_PRICE_PER_GB_S = 0.0000166667
LAMBDA_PRICE_PER_REQUEST = 0.20 / 1_000_000
# provisioned concurrency: each execution environment kept initialized is billed per GB-second
# for as long as it is configured, used or not (AWS_PRICING, "Provisioned Concurrency": $0.0000041667
# per GB-second, us-east-1, x86; AS_OF); requests it serves pay their duration on top
LAMBDA_PROVISIONED_PRICE_PER_GB_S = 0.0000041667
LAMBDA_MB_PER_VCPU = 1769
LAMBDA_TOP_BANDWIDTH = 70 * MB_S
# Bandwidth rises in proportion to memory up to 3008 MB, then stays at ~70 MB/s. See the
# "scaling.bandwidth_points" source below for why the knee sits at 3008 MB.
LAMBDA_BANDWIDTH_POINTS = ((0.0, 0.0), (3008.0, float(LAMBDA_TOP_BANDWIDTH)), (10240.0, float(LAMBDA_TOP_BANDWIDTH)))

LAMBDA_SOURCES = {
    "min_memory_mb": f"{AWS_MEMORY}: memory 128 MB to 10,240 MB in 1 MB increments",
    "max_memory_mb": f"{AWS_MEMORY}; {AWS_QUOTAS}: 'a single function can use up to 10,240 MB'; "
                     f"{GILLIS} footnote 4: the limit rose from 3 GB to 10 GB in December 2020",
    "storage_latency_s": f"{FUNCPIPE} §3.3: 'the measured t_lat is less than 40ms for AWS Lambda' "
                         "(S3 round trip; the upper bound is used)",
    "price_per_request": f"{AWS_PRICING}: $0.20 per 1M requests; {AS_OF}",
    "billing_granularity_s": f"{GILLIS} §IV-C: duration rounded up to the nearest 1 ms on AWS Lambda [10]; "
                             f"{AWS_PRICING}",
    "timeout_s": f"{AWS_QUOTAS}: 'Code can run for up to 15 minutes in a single invocation' (900 s); "
                 f"{SLSML}: 'Lambda is limited to 15 minutes'",
    "base_memory_bytes": MEASURED_RSS,
    "overlap_slowdown": f"assumption: 1.0 (no contention). {FUNCPIPE} App. B defines β >= 1 as the average "
                        "slowdown when computation overlaps communication and measures it in its profiler, but "
                        "publishes no value; a calibration file's overlap_slowdown replaces it",
    "package_limit_bytes": f"{AWS_QUOTAS}: deployment package 250 MB unzipped including layers (50 MB zipped "
                           f"for direct upload); {SLSML}: '50MB compressed, 250MB uncompressed'",
    "image_limit_bytes": f"{AWS_QUOTAS}: container image code package size 10 GB",
    "ephemeral_storage_bytes": f"{AWS_QUOTAS}: /tmp configurable from 512 MB (the default) to 10,240 MB; "
                               f"the maximum is recorded (above 512 MB it is billed extra). {SLSML} reports "
                               "the older fixed 512 MB",
    "cpu_speed_ratio": "assumption: 1.0, one Lambda vCPU = one host hardware thread; no source compares them",
    "tier.memory_mb": f"{FUNCPIPE} §5.1: the eight memory choices 512, 1024, 2048, 3072, 4096, 6144, 8192, "
                      "10240 MB are the default tiers; tier() accepts any size the platform allows",
    "tier.vcpus": f"{AWS_MEMORY}: 'At 1,769 MB, a function has the equivalent of one vCPU (one vCPU-second of "
                  f"credits per second)', CPU proportional to memory; {AWS_10GB_BLOG}: up to 6 vCPUs",
    "tier.bandwidth_bytes_s": "from scaling.bandwidth_points (below)",
    "tier.price_per_s": "memory in GiB x scaling.price_per_gb_s (Lambda bills GB-seconds with GB = 1024 MB)",
    "scaling.memory_step_mb": f"{AWS_MEMORY}: 1 MB increments",
    "scaling.mb_per_vcpu": f"{AWS_MEMORY}: 1,769 MB = one vCPU",
    "scaling.max_vcpus": f"{AWS_10GB_BLOG}: up to 6 vCPUs at 10,240 MB. The proportional share reaches only "
                         "10240/1769 = 5.79 vCPU at the top, so the cap never binds; 6 is the visible core count",
    "scaling.bandwidth_points": f"{FUNCPIPE} §1: 'the maximum bandwidth of an AWS Lambda function is only about "
                                "70 MB/s [28,57]' and App. D: HybridPS 'can fully utilize the bandwidth at about "
                                f"70MB/s'; §2: 'CPU and network bandwidth are allocated proportionally' to memory. "
                                "Assumption: proportional to memory up to 3008 MB (the largest Lambda when [28,57] "
                                "measured ~70 MB/s in 2018, per Gillis footnote 4), flat at 70 MB/s above. No "
                                "per-tier measurement is published; calibrate (FuncPipe measures W_j per tier)",
    "scaling.price_per_gb_s": f"{AWS_PRICING}: $0.0000166667 per GB-second; {AS_OF}. {HYDROZOA} §5.2 agrees: "
                              "'each worker provisioned with 10 GB of RAM costs $0.60 per hour'",
    "scaling.price_per_vcpu_s": "Lambda bills memory only; vCPU comes with it (AWS pricing page)",
    "scaling.min_vcpus": "no floor beyond the proportional share (128 MB gets 0.072 vCPU)",
    "scaling.vcpu_step": "Lambda's share is continuous (credits), so no rounding",
    "direct_networking": f"{FUNCPIPE} §1: functions 'lack the ability of direct inter-function communication'; "
                         "stages exchange tensors through S3",
}


@cache
def aws_lambda() -> Platform:
    scaling = Scaling(memory_step_mb=1, mb_per_vcpu=LAMBDA_MB_PER_VCPU, max_vcpus=6.0,
                      bandwidth_points=LAMBDA_BANDWIDTH_POINTS, price_per_gb_s=LAMBDA_PRICE_PER_GB_S)
    return Platform(
        name="aws-lambda", kind="serverless", tiers=tuple(scaling.tier(mb) for mb in FUNCPIPE_TIERS_MB),
        min_memory_mb=128, max_memory_mb=10240, storage_latency_s=0.040,
        price_per_request=LAMBDA_PRICE_PER_REQUEST, billing_granularity_s=0.001, timeout_s=900.0,
        base_memory_bytes=256 * MIB, overlap_slowdown=1.0, aggregate_bandwidth_bytes_s=None,
        direct_networking=False, package_limit_bytes=250 * MIB, image_limit_bytes=10 * GIB,
        ephemeral_storage_bytes=10240 * MIB, sources=dict(LAMBDA_SOURCES), scaling=scaling)


FC_CU_PRICE = 0.000020            # USD per CU, tier 1 (up to 100 million CU a month)
FC_CU_PER_VCPU_S = 1.0
FC_CU_PER_GB_S = 0.15
FC_CU_PER_INVOCATION = 75 / 10_000
ALIBABA_TIERS_MB = (*FUNCPIPE_TIERS_MB, 16384, 32768)
# Documented per-instance maximum bandwidth (performance-instance table), not a measurement.
ALIBABA_BANDWIDTH_POINTS = ((128.0, 1.0 * GBIT_S), (4096.0, 1.0 * GBIT_S), (8192.0, 1.5 * GBIT_S),
                            (16384.0, 2.5 * GBIT_S), (32768.0, 5.0 * GBIT_S))

ALIBABA_SOURCES = {
    "min_memory_mb": f"{FC_INSTANCES}: elastic instances 128 to 32768 MB, a multiple of 64",
    "max_memory_mb": f"{FUNCPIPE} §5.1: 'a maximum memory allocation of 32 Gbytes'; {FC_LIMITS}: memory 32 GB",
    "storage_latency_s": f"assumption: 40 ms, Lambda's figure ({FUNCPIPE} §3.3 measured t_lat on AWS only); "
                         "calibrate against OSS",
    "price_per_request": f"{FC_BILLING}: 75 CU per 10,000 invocations x USD 0.000020 per CU = USD 1.5e-7; {AS_OF}",
    "billing_granularity_s": "Alibaba Cloud Function Compute product page (alibabacloud.com/product/function-"
                             "compute): 'pay for the resources your code actually consumes to the nearest 100 "
                             "milliseconds' (may be finer on FC 3.0; unverified)",
    "timeout_s": f"{FC_LIMITS}: function execution duration 86,400 s",
    "base_memory_bytes": MEASURED_RSS,
    "overlap_slowdown": f"assumption: 1.0, as on aws-lambda ({FUNCPIPE} App. B gives no value)",
    "aggregate_bandwidth_bytes_s": f"{FUNCPIPE} §5.1: OSS 'puts a limit on the concurrent bandwidth, e.g. a total "
                                   "of 10Gb/s for a normal user' (10 Gbit/s = 1.25e9 bytes/s), shared by all "
                                   "workers",
    "package_limit_bytes": f"{FC_LIMITS}: code package (ZIP/JAR via console, developer tool or OSS) 500 MB",
    "image_limit_bytes": f"{FC_LIMITS}: image size before decompression 10 GB (CPU instances)",
    "ephemeral_storage_bytes": f"{FC_LIMITS}: temporary disk space 10 GB (512 MB by default, {FC_INSTANCES})",
    "cpu_speed_ratio": "assumption: 1.0, one FC vCPU = one host hardware thread",
    "tier.memory_mb": f"{FUNCPIPE} §5.1's eight sizes plus 16 and 32 GB, the sizes only Alibaba allows "
                      "(assumption: FuncPipe does not list its Alibaba choices)",
    "tier.vcpus": "from scaling.mb_per_vcpu (below)",
    "tier.bandwidth_bytes_s": "from scaling.bandwidth_points (below)",
    "tier.price_per_s": "USD 0.000020 per CU x (1 CU per vCPU-second x vCPUs + 0.15 CU per GB-second x GiB)",
    "scaling.memory_step_mb": f"{FC_INSTANCES}: memory 'must be a multiple of 64'",
    "scaling.mb_per_vcpu": f"assumption: 1 vCPU per 2 GB. FC 3.0 sets vCPU and memory separately with a vCPU:GB "
                           f"ratio from 1:1 to 1:4 ({FC_INSTANCES}); 1:2 is the middle, is the ratio of the "
                           "performance instances (2 vCPU/4 GB ... 16 vCPU/32 GB) and of the billing page's "
                           "example (0.25 vCPU with 512 MB)",
    "scaling.max_vcpus": f"{FC_INSTANCES}: vCPU 0.05 to 16",
    "scaling.min_vcpus": f"{FC_INSTANCES}: vCPU 0.05 to 16",
    "scaling.vcpu_step": f"{FC_INSTANCES}: vCPU 'must be a multiple of the 0.05'",
    "scaling.bandwidth_points": f"{FC_INSTANCES}: maximum bandwidth 1 / 1.5 / 2.5 / 5 Gbit/s for 4 / 8 / 16 / "
                                "32 GB performance instances, 1 Gbit/s for small elastic ones. These are "
                                "documented maxima, not measurements (FuncPipe reports no per-function figure "
                                "on Alibaba); the OSS account cap above usually binds first. Calibrate",
    "scaling.price_per_gb_s": f"{FC_BILLING}: 0.15 CU per GB-second x USD 0.000020 per CU (tier 1, first 100 "
                              f"million CU a month); {AS_OF}",
    "scaling.price_per_vcpu_s": f"{FC_BILLING}: 1 CU per active vCPU-second x USD 0.000020 per CU; {AS_OF}",
    "direct_networking": f"{FUNCPIPE} §5.1: workers communicate through OSS",
}


@cache
def alibaba_fc() -> Platform:
    scaling = Scaling(memory_step_mb=64, mb_per_vcpu=2048, max_vcpus=16.0, min_vcpus=0.05, vcpu_step=0.05,
                      bandwidth_points=ALIBABA_BANDWIDTH_POINTS, price_per_gb_s=FC_CU_PRICE * FC_CU_PER_GB_S,
                      price_per_vcpu_s=FC_CU_PRICE * FC_CU_PER_VCPU_S)
    return Platform(
        name="alibaba-fc", kind="serverless", tiers=tuple(scaling.tier(mb) for mb in ALIBABA_TIERS_MB),
        min_memory_mb=128, max_memory_mb=32768, storage_latency_s=0.040,
        price_per_request=FC_CU_PRICE * FC_CU_PER_INVOCATION, billing_granularity_s=0.1, timeout_s=86400.0,
        base_memory_bytes=256 * MIB, overlap_slowdown=1.0, aggregate_bandwidth_bytes_s=10 * GBIT_S,
        direct_networking=False, package_limit_bytes=500 * MIB, image_limit_bytes=10 * GIB,
        ephemeral_storage_bytes=10 * GIB, sources=dict(ALIBABA_SOURCES), scaling=scaling)


# Azure Container Instances, per hour (Hydrozoa Table 3, GPU-container rates).
ACI_VCPU_HOUR = 0.03165
ACI_GB_HOUR = 0.00425
ACI_GPU_HOUR = {"K80": 0.36, "V100": 2.8548}
# (gpu model, vCPUs, memory GB, GPU memory MB): the container configurations offered.
ACI_CONFIGS = (("K80", 4, 6, 12 * 1024), ("V100", 6, 16, 16 * 1024))
# Training throughput of one GPU in vCPU units (see the "gpu_vcpu_equivalents" source).
GPU_VCPU_EQUIVALENTS = {"K80": 115.0, "V100": 460.0}


def _aci_tier(gpu: str, vcpus: int, memory_gb: int, gpu_memory_mb: int) -> Tier:
    per_hour = vcpus * ACI_VCPU_HOUR + memory_gb * ACI_GB_HOUR + ACI_GPU_HOUR[gpu]
    return Tier(memory_gb * 1024, float(vcpus), float(GBIT_S), per_hour / 3600, gpus=1, gpu_model=gpu,
                gpu_memory_mb=gpu_memory_mb)


GPU_CONTAINER_SOURCES = {
    "min_memory_mb": "the smallest configuration listed (6 GB, K80)",
    "max_memory_mb": "the largest configuration listed (16 GB, V100)",
    "storage_latency_s": "assumption: 1 ms for one message between two containers in a region; Hydrozoa gives no "
                         "figure. Calibrate",
    "price_per_request": f"{HYDROZOA} §3.1: ACI charges for GPU, CPU and memory 'on a per second basis'; no "
                         "per-request fee",
    "billing_granularity_s": f"{HYDROZOA} §3.1: per-second billing",
    "base_memory_bytes": "assumption: 1 GiB of host memory for Python, torch and the CUDA libraries and context "
                         "(the CPU-only runtime measures 227 MB; CUDA adds several hundred MB); not measured",
    "overlap_slowdown": f"assumption: 1.0 ({FUNCPIPE} App. B gives no value)",
    "cpu_speed_ratio": "assumption: 1.0, one ACI vCPU = one host hardware thread",
    "tier.memory_mb": f"K80: {HYDROZOA} §5.3, 'a K80, 4 VCPUs, and 6 GB of RAM per worker'. V100: assumption, "
                      "6 vCPU and 16 GB (host memory equal to the V100's 16 GB); Hydrozoa does not state its V100 "
                      "container size",
    "tier.vcpus": f"K80: {HYDROZOA} §5.2-5.3, 4 vCPUs; V100: assumption, 6 vCPUs",
    "tier.gpus": "one GPU per worker: a stage runs on one device",
    "tier.gpu_memory_mb": "NVIDIA data sheets: a Tesla K80 board is two GPUs with 12 GB each (ACI's K80 unit is "
                          "one of them); Tesla V100 16 GB (the NC6s v3 part of Hydrozoa Table 6). Assumption that "
                          "ACI's SKUs are these parts",
    "tier.bandwidth_bytes_s": "assumption: 1 Gbit/s between containers; neither Hydrozoa nor ACI publishes a "
                              "per-container figure. Calibrate",
    "tier.price_per_s": f"{HYDROZOA} Table 3, GPU container, per hour: vCPU $0.03165, GB $0.00425, K80 $0.36, "
                        "V100 $2.8548 (US East, 2021); divided by 3600. Check: 4 vCPU + 6 GB + K80 = $0.512/h, "
                        "the figure of §5.3. The ACI GPU SKUs are legacy; verify current availability and rates",
    "gpu_vcpu_equivalents": f"K80 = 115: {HYDROZOA} §5.2, one K80 trains 1.8x (ResNet-34) and 2.5x (AlexNet) "
                            "the throughput of 16 workers with 4 vCPUs each, whose scaling is near-linear, so one "
                            "K80 ~ 1.8 x 64 = 115 vCPUs (the smaller figure). V100 = 4 x K80 = 460: assumption "
                            f"from {HYDROZOA} App. B.1, which pits 4 V100 against 16 K80 clusters. Whole-model "
                            "throughput, not per-layer; calibrate",
    "direct_networking": f"{HYDROZOA} §3.1: 'containers can communicate with each other directly through public "
                         "IP addresses'",
}


@cache
def gpu_container() -> Platform:
    tiers = tuple(_aci_tier(*config) for config in ACI_CONFIGS)
    return Platform(
        name="gpu-container", kind="container", tiers=tiers,
        min_memory_mb=min(t.memory_mb for t in tiers), max_memory_mb=max(t.memory_mb for t in tiers),
        storage_latency_s=0.001, price_per_request=0.0, billing_granularity_s=1.0, timeout_s=None,
        base_memory_bytes=1 * GIB, overlap_slowdown=1.0, aggregate_bandwidth_bytes_s=None,
        direct_networking=True, sources=dict(GPU_CONTAINER_SOURCES), scaling=None,
        gpu_vcpu_equivalents=dict(GPU_VCPU_EQUIVALENTS))


def _local_sources(cpus: int) -> dict[str, str]:
    lambda_says = "as aws-lambda, so local runs are Lambda in miniature: "
    sources = {key: lambda_says + text for key, text in LAMBDA_SOURCES.items()}
    sources.update({
        "storage_latency_s": "assumption: 2 ms for one round trip to a store on 127.0.0.1 (DESIGN.md: local S3 "
                             "or Redis servers); replace with what the local backend measures",
        "price_per_request": lambda_says + "predicted dollars are what the plan would cost on Lambda. "
                             + LAMBDA_SOURCES["price_per_request"],
        "scaling.price_per_gb_s": lambda_says + "predicted dollars are what the plan would cost on Lambda. "
                                  + LAMBDA_SOURCES["scaling.price_per_gb_s"],
        "scaling.host_vcpu_cap": f"os.cpu_count() = {cpus} on this host: a local stage cannot get more CPU "
                                 "than the host has",
        "tier.vcpus": lambda_says + "the tier's Lambda share, capped at os.cpu_count(). The local backend must "
                      "throttle CPU to match (it caps memory and bandwidth); otherwise measured compute is the "
                      "host's",
        "tier.bandwidth_bytes_s": lambda_says + "the token-bucket rate the local backend throttles each stage "
                                  "to. " + LAMBDA_SOURCES["scaling.bandwidth_points"],
        "direct_networking": "the local backend passes tensors through a local store, as Lambda does through S3",
        "poll_overhead_s": "assumption: half of Store.wait's largest back-off (5 ms between polls, runtime/store.py); "
                           "flatpack calibrate measures it",
        "host_cores": "len(os.sched_getaffinity(0)) on this host: every local worker and the S3 server share "
                      "these cores",
    })
    for unbounded in ("timeout_s", "package_limit_bytes", "image_limit_bytes", "ephemeral_storage_bytes"):
        sources.pop(unbounded)
    return sources


def host_cores() -> int:
    """Cores this process may run on (the local backend's workers and store share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


@cache
def local() -> Platform:
    cpus = os.cpu_count() or 1
    lam = aws_lambda()
    assert lam.scaling is not None  # the Lambda catalog entry scales CPU with memory
    scaling = replace(lam.scaling, host_vcpu_cap=float(cpus))
    return Platform(
        name="local", kind="local", tiers=tuple(scaling.tier(t.memory_mb) for t in lam.tiers),
        min_memory_mb=lam.min_memory_mb, max_memory_mb=lam.max_memory_mb, storage_latency_s=0.002,
        price_per_request=lam.price_per_request, billing_granularity_s=lam.billing_granularity_s, timeout_s=None,
        base_memory_bytes=lam.base_memory_bytes, overlap_slowdown=lam.overlap_slowdown,
        aggregate_bandwidth_bytes_s=None, direct_networking=False, sources=_local_sources(cpus), scaling=scaling,
        poll_overhead_s=0.0025, host_cores=host_cores())


# -- ray: a cluster's nodes -----------------------------------------------------------------
#
# A Ray cluster is the user's own machines; what a function of it costs is what its share of a
# node costs. The default is the price of renting that share by the second: AWS Fargate's
# on-demand rates (us-east-1, Linux/x86), per vCPU-hour and per GB-hour. An on-prem cluster
# sets its own (RayCluster's prices; FLATPACK_RAY_PRICE_PER_VCPU_S / _PER_GB_S, read by
# flatpack.backends.ray; --price-per-vcpu-s / --price-per-gb-s).
FARGATE_PRICING = ("AWS Fargate pricing, https://aws.amazon.com/fargate/pricing/ (us-east-1, Linux/x86, on-demand: "
                   "$0.04048 per vCPU-hour, $0.004445 per GB-hour)")
RAY_PRICE_PER_VCPU_S = 0.04048 / 3600
RAY_PRICE_PER_GB_S = 0.004445 / 3600


@dataclass(frozen=True)
class RayNode:
    """What one alive node of a Ray cluster offers tasks: its ``CPU`` and ``memory`` resources
    (Ray's logical resources: the scheduler's labels, not a quota)."""

    cpus: float
    memory_bytes: int


@dataclass(frozen=True)
class RayCluster:
    """A Ray cluster as the planner sees it: its nodes (read by ``flatpack.backends.ray``
    from ``ray.nodes()``), the price of a vCPU-second and a GB-second on it, and where the
    figures come from."""

    nodes: tuple[RayNode, ...]
    price_per_vcpu_s: float = RAY_PRICE_PER_VCPU_S
    price_per_gb_s: float = RAY_PRICE_PER_GB_S
    source: str = "assumption: no cluster was read"
    price_source: str = f"default: {FARGATE_PRICING}"

    def __post_init__(self) -> None:
        if not self.nodes:
            raise InputError("a Ray cluster needs at least one alive node with CPUs; start one (ray start --head)")
        for name in ("price_per_vcpu_s", "price_per_gb_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise InputError(f"the Ray cluster's {name} must be a non-negative number of dollars, got {value!r}")

    @property
    def total_cpus(self) -> float:
        return sum(node.cpus for node in self.nodes)

    @property
    def total_memory_bytes(self) -> int:
        return sum(node.memory_bytes for node in self.nodes)

    @property
    def largest_cpus(self) -> float:
        return max(node.cpus for node in self.nodes)

    @property
    def largest_memory_mb(self) -> int:
        return max(node.memory_bytes for node in self.nodes) // MIB


def host_memory_bytes() -> int:
    """This host's physical memory (the one-node cluster assumed when no cluster was read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):   # not POSIX
        return 8 * GIB


_ray_cluster: RayCluster | None = None


def use_ray_cluster(cluster: RayCluster | None) -> None:
    """Plans for ``target="ray"`` describe ``cluster`` from now on (None: this host as a
    one-node cluster); ``flatpack.backends.ray.connect`` calls it with the cluster it read."""
    global _ray_cluster
    _ray_cluster = cluster


def ray_cluster() -> RayCluster:
    """The cluster plans for ``ray`` are made for: the one read last, else this host."""
    if _ray_cluster is not None:
        return _ray_cluster
    return RayCluster((RayNode(float(host_cores()), host_memory_bytes()),),
                      source="assumption: no Ray cluster was read in this process, so this host as a one-node "
                             "cluster (its cores and physical memory); connect first (flatpack.backends.ray.connect, "
                             "--address) to plan for the cluster's real nodes")


def _ray_sources(cluster: RayCluster) -> dict[str, str]:
    sources = _local_sources(host_cores())
    as_local = "as local (Lambda in miniature), so that a plan's tiers mean the same on local and on Ray: "
    sources.update({
        "min_memory_mb": as_local + sources["min_memory_mb"],
        "max_memory_mb": f"the largest node's memory resource ({cluster.source}): a function runs on one node",
        "storage_latency_s": "assumption: 2 ms, as local, for a round trip to the S3 store the nodes share (the "
                             "local SeaweedFS on the driver, or the user's endpoint); flatpack calibrate --target "
                             "ray measures it",
        "price_per_request": "a Ray task has no per-request fee",
        "billing_granularity_s": "assumption: a cluster's cost accrues continuously; 1 ms, no rounding to speak of",
        "scaling.host_vcpu_cap": f"the largest node's CPU resource ({cluster.source}): a function runs on one node",
        "scaling.max_vcpus": as_local + sources["scaling.max_vcpus"],
        "scaling.price_per_gb_s": cluster.price_source,
        "scaling.price_per_vcpu_s": cluster.price_source,
        "tier.vcpus": as_local + "memory / 1,769 MB, capped at the largest node's CPUs. The Ray task asks for "
                      "this many CPUs (num_cpus) and the tier's memory in bytes (memory); Ray's resources are "
                      "labels, so the worker holds itself to them as on local",
        "tier.price_per_s": "vCPUs x scaling.price_per_vcpu_s + memory in GiB x scaling.price_per_gb_s",
        "tier.bandwidth_bytes_s": as_local + "the token-bucket rate each function throttles itself to. "
                                  + LAMBDA_SOURCES["scaling.bandwidth_points"],
        "direct_networking": "functions pass tensors through the S3 store every node reaches, as on local",
    })
    sources.pop("host_cores")
    return sources


def ray() -> Platform:
    """The Ray cluster plans are made for (:func:`ray_cluster`) as a platform: local's tier rule
    (vCPU and bandwidth in proportion to memory), bounded by the largest node's CPUs and
    memory, priced at the cluster's rates. Not cached: ``use_ray_cluster`` changes it."""
    cluster = ray_cluster()
    lam = aws_lambda()
    assert lam.scaling is not None  # the Lambda catalog entry scales CPU with memory
    max_memory_mb = min(cluster.largest_memory_mb, lam.max_memory_mb)
    if max_memory_mb < lam.min_memory_mb:
        raise InputError(f"the Ray cluster's largest node offers {max_memory_mb} MB of memory; a function needs at "
                         f"least {lam.min_memory_mb} MB. Give the nodes more (ray start --memory)")
    scaling = replace(lam.scaling, host_vcpu_cap=cluster.largest_cpus, price_per_gb_s=cluster.price_per_gb_s,
                      price_per_vcpu_s=cluster.price_per_vcpu_s)
    tiers = tuple(scaling.tier(mb) for mb in FUNCPIPE_TIERS_MB if mb <= max_memory_mb) or (scaling.tier(max_memory_mb),)
    return Platform(
        name="ray", kind="local", tiers=tiers, min_memory_mb=lam.min_memory_mb, max_memory_mb=max_memory_mb,
        storage_latency_s=0.002, price_per_request=0.0, billing_granularity_s=0.001, timeout_s=None,
        base_memory_bytes=lam.base_memory_bytes, overlap_slowdown=lam.overlap_slowdown,
        aggregate_bandwidth_bytes_s=None, direct_networking=False, sources=_ray_sources(cluster), scaling=scaling,
        poll_overhead_s=0.0025)


# -- the registry ----------------------------------------------------------------------------

BUILTIN_PLATFORMS = {
    "local": "flatpack.platform.catalog:local",
    "aws-lambda": "flatpack.platform.catalog:aws_lambda",
    "alibaba-fc": "flatpack.platform.catalog:alibaba_fc",
    "gpu-container": "flatpack.platform.catalog:gpu_container",
    "ray": "flatpack.platform.catalog:ray",
}

PLATFORMS: Registry[Platform] = Registry("platform", InputError, BUILTIN_PLATFORMS)


def get_platform(name: str) -> Platform:
    """The platform called ``name``; :class:`InputError` listing the known names otherwise."""
    if not isinstance(name, str):
        raise InputError(f"a platform is named by a string, got {type(name).__name__}; known platforms: "
                         f"{', '.join(PLATFORMS.names())}")
    return PLATFORMS.factory(name)()


def register_platform(platform: Platform) -> None:
    """Adds a user's platform under ``platform.name``; a name already taken is refused."""
    if not isinstance(platform, Platform):
        raise InputError(f"register_platform expects a Platform, got {type(platform).__name__}")
    PLATFORMS.register(platform.name, lambda: platform)


def platform_names() -> list[str]:
    return PLATFORMS.names()


def describe_platforms(names: list[str] | None = None) -> str:
    """The catalog as text, one card per platform (for the command line)."""
    return "\n\n".join(get_platform(name).describe() for name in (names or PLATFORMS.names()))


# -- base images -----------------------------------------------------------------------------
#
# Every image flatpack generates starts FROM a digest, never a bare tag: a tag moves (a rebuilt
# base silently changes what runs), a digest names one manifest. No registry can be reached where
# flatpack is developed, so each digest below was read from a public repository that pins it
# (Renovate keeps those pins current), with the date it was published there: an old digest is an
# image without the OS fixes published since. Refresh with
# ``docker buildx imagetools inspect <name>`` and pass ``--base-image <name>@sha256:<digest>``.

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class BaseImage:
    """A base image pinned by digest, with where and when the digest was read."""

    name: str                  # repository:tag, for people (Docker uses the digest)
    digest: str                # sha256:<64 hex>, the multi-platform index's digest
    observed: str              # YYYY-MM-DD: when the source recorded it
    source: str
    user: str                  # the unprivileged uid:gid the image runs as

    def __post_init__(self) -> None:
        if not _DIGEST.match(self.digest):
            raise InputError(f"base image {self.name}: {self.digest!r} is not a sha256 digest (sha256:<64 hex>)")
        if ":" not in self.name.rsplit("/", 1)[-1] or "@" in self.name:
            raise InputError(f"base image {self.name!r} must be repository:tag (the digest goes in digest)")
        if self.user.split(":")[0] in ("0", "root", ""):
            raise InputError(f"base image {self.name}: the image must run as a non-root user, not {self.user!r}")

    @property
    def reference(self) -> str:
        return f"{self.name}@{self.digest}"


_USER = "10001:10001"      # no account needed in /etc/passwd: a numeric uid:gid of no one else's
BASE_IMAGES: dict[str, BaseImage] = {
    "aws-lambda": BaseImage(
        "public.ecr.aws/lambda/python:3.12",
        "sha256:92c88c1adc374b073b07b12bd4045497af7da68230d47c2b330423115c5850dc", "2024-12-03",
        "github.com/gkwa/itsfergus Dockerfile, commit 4a8b96fc (Renovate: 'Pin public.ecr.aws/lambda/python "
        "Docker tag to 92c88c1', 2024-12-03)", _USER),
    "alibaba-fc": BaseImage(
        "python:3.12.3-slim-bookworm",
        "sha256:541d45d3d675fb8197f534525a671e2f8d66c882b89491f9dda271f4f94dcd06", "2024-04-12",
        "github.com/nalabelle/build images/digests.Dockerfile, commit b709b6a5 (Renovate: 'update all "
        "non-major dependencies, including digests', 2024-04-12)", _USER),
    "gpu-container": BaseImage(
        "python:3.11.9-slim-bookworm",
        "sha256:dad770592ab3582ab2dabcf0e18a863df9d86bd9d23efcfa614110ce49ac20e4", "2024-04-12",
        "github.com/nalabelle/build images/digests.Dockerfile, commit b709b6a5 (Renovate: 'update all "
        "non-major dependencies, including digests', 2024-04-12)", _USER),
}


def base_image(target: str, override: str | None = None) -> BaseImage:
    """The pinned base image of ``target``'s images; ``override`` is ``name:tag@sha256:<digest>``
    (a tag alone is refused: it says which image, not which build of it)."""
    if target not in BASE_IMAGES:
        raise InputError(f"no base image recorded for target {target!r}; known: {', '.join(BASE_IMAGES)}")
    recorded = BASE_IMAGES[target]
    if override is None:
        return recorded
    name, _, digest = override.partition("@")
    if not digest:
        raise InputError(
            f"the base image {override!r} is a tag, not a digest: a tag can point at a different image tomorrow. "
            f"Find its digest with `docker buildx imagetools inspect {override}` (the 'Digest:' line) and pass "
            f"{override}@sha256:<digest>")
    return BaseImage(name, digest, "given", "given on the command line (--base-image)", recorded.user)
