"""Calibration: per-layer seconds measured inside the target, which override the catalog's
host-to-tier compute model (FuncPipe's profiler runs every layer on every memory tier in the
cloud, FuncPipe §4 and App. B).

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

Seconds are :class:`~flatpack.ir.profile.Linear` lines ``per_sample * micro_batch + fixed``.
A tier that is not in the file falls back to the platform model: :meth:`Calibration.seconds`
answers exact tiers only and never interpolates between them, because compute time is not
linear in memory (the vCPU share saturates at the thread count) and a guess between two
measurements would look measured while being a model.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from flatpack.errors import InputError
from flatpack.ir.profile import Linear

if TYPE_CHECKING:
    from flatpack.backends.catalog import Platform

FORMAT = "flatpack-calibration"
SCHEMA_VERSION = 1


def _number(value: Any, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"calibration file: {where} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise InputError(f"calibration file: {where} must be {'positive' if positive else 'non-negative'}, "
                         f"got {value!r}")
    return float(value)


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


@dataclass(frozen=True)
class TierCalibration:
    """What was measured on one memory tier: per-layer forward and backward lines and,
    optionally, the worker's bandwidth."""

    forward_s: tuple[Linear, ...]
    backward_s: tuple[Linear, ...]
    bandwidth_bytes_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"forward_s": [line.to_json() for line in self.forward_s],
                                "backward_s": [line.to_json() for line in self.backward_s]}
        if self.bandwidth_bytes_s is not None:
            data["bandwidth_bytes_s"] = self.bandwidth_bytes_s
        return data


@dataclass(frozen=True)
class Calibration:
    """Seconds measured inside ``platform`` for the chain ``layer_names`` of the graph
    ``graph_hash``, per memory tier (MB)."""

    platform: str
    layer_names: tuple[str, ...]
    tiers: Mapping[int, TierCalibration] = field(hash=False)
    graph_hash: str | None = None
    storage_latency_s: float | None = None
    overlap_slowdown: float | None = None
    provenance: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.platform:
            raise InputError("a calibration names the platform it was measured on")
        if not self.layer_names:
            raise InputError("a calibration covers at least one layer")
        if not self.tiers:
            raise InputError("a calibration holds at least one memory tier")
        for memory_mb, tier in self.tiers.items():
            for kind in ("forward_s", "backward_s"):
                if len(getattr(tier, kind)) != len(self.layer_names):
                    raise InputError(f"calibration: tier {memory_mb} MB has {len(getattr(tier, kind))} {kind} "
                                     f"lines for {len(self.layer_names)} layers")
        if self.overlap_slowdown is not None and self.overlap_slowdown < 1:
            raise InputError(f"calibration: overlap_slowdown (beta) must be >= 1, got {self.overlap_slowdown}")

    @property
    def tiers_mb(self) -> tuple[int, ...]:
        return tuple(sorted(self.tiers))

    # -- use -------------------------------------------------------------------------------

    def check_against(self, layer_names: Sequence[str], graph_hash: str | None,
                      platform: str | None = None) -> None:
        """Refuses a calibration measured for another graph or platform. ``graph_hash`` or
        ``platform`` given as ``None`` is not checked."""
        rerun = "re-run calibration on this graph (after the same passes) on the target"
        if platform is not None and platform != self.platform:
            raise InputError(f"the calibration file was measured on {self.platform!r} but the target is "
                             f"{platform!r}; calibrate on {platform!r} or compile for {self.platform!r}")
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
        ``memory_mb`` tier, or ``None`` when that tier was not calibrated (the caller then
        uses the platform's model). Exact tiers only: no interpolation between tiers."""
        if not 0 <= layer_index < len(self.layer_names):
            raise InputError(f"layer index {layer_index} is outside the calibrated chain of "
                             f"{len(self.layer_names)} layers")
        tier = self.tiers.get(memory_mb)
        if tier is None:
            return None
        return tier.forward_s[layer_index].at(micro_batch), tier.backward_s[layer_index].at(micro_batch)

    def apply(self, platform: "Platform") -> "Platform":
        """``platform`` with this file's measured bandwidth, storage latency and β in place
        of the catalog's, each source noting that it was measured."""
        self.check_against(self.layer_names, None, platform.name)
        bandwidth = {mb: tier.bandwidth_bytes_s for mb, tier in self.tiers.items() if tier.bandwidth_bytes_s}
        note = "measured inside the target by calibration" + (f" ({self.provenance.get('measured')})"
                                                               if self.provenance.get("measured") else "")
        sources = dict(platform.sources)
        changes: dict[str, Any] = {}
        if bandwidth:
            changes["measured_bandwidth"] = {**platform.measured_bandwidth, **bandwidth}
            changes["tiers"] = tuple(replace(t, bandwidth_bytes_s=bandwidth[t.memory_mb])
                                     if t.memory_mb in bandwidth else t for t in platform.tiers)
            sources["measured_bandwidth"] = f"tiers {sorted(bandwidth)} MB: {note}"
        for name in ("storage_latency_s", "overlap_slowdown"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
                sources[name] = note
        return replace(platform, sources=sources, **changes)

    # -- files -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": FORMAT, "schema_version": SCHEMA_VERSION, "platform": self.platform,
            "graph_hash": self.graph_hash, "layers": list(self.layer_names),
            "tiers": {str(mb): self.tiers[mb].to_json() for mb in self.tiers_mb},
        }
        for name in ("storage_latency_s", "overlap_slowdown"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        if self.provenance:
            data["provenance"] = dict(self.provenance)
        return data

    @classmethod
    def from_json(cls, data: Any) -> "Calibration":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputError(f"not a flatpack calibration file: expected a JSON object with \"format\": "
                             f"\"{FORMAT}\"")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InputError(f"calibration file schema version {version!r} is not supported; this flatpack "
                             f"reads version {SCHEMA_VERSION}: re-run calibration with this flatpack")
        missing = [key for key in ("platform", "layers", "tiers") if key not in data]
        if missing:
            raise InputError(f"calibration file lacks {', '.join(missing)}")
        layers = data["layers"]
        if not isinstance(layers, list) or not all(isinstance(name, str) for name in layers):
            raise InputError("calibration file: \"layers\" must be a list of layer names")
        graph_hash = data.get("graph_hash")
        if graph_hash is not None and not isinstance(graph_hash, str):
            raise InputError(f"calibration file: \"graph_hash\" must be a string or null, got {graph_hash!r}")
        if not isinstance(data["tiers"], dict):
            raise InputError("calibration file: \"tiers\" must map memory sizes in MB to measurements")
        tiers = {}
        for key, tier in data["tiers"].items():
            if not str(key).isdigit() or int(key) <= 0:
                raise InputError(f"calibration file: tier key {key!r} is not a memory size in MB")
            if not isinstance(tier, dict):
                raise InputError(f"calibration file: tier {key} MB must be an object with forward_s and backward_s")
            where = f"tiers[{key}]"
            bandwidth = tier.get("bandwidth_bytes_s")
            tiers[int(key)] = TierCalibration(
                _lines(tier.get("forward_s"), len(layers), f"{where}.forward_s"),
                _lines(tier.get("backward_s"), len(layers), f"{where}.backward_s"),
                None if bandwidth is None else _number(bandwidth, f"{where}.bandwidth_bytes_s", positive=True))
        optional = {name: _number(data[name], name) for name in ("storage_latency_s", "overlap_slowdown")
                    if data.get(name) is not None}
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise InputError("calibration file: \"provenance\" must be an object of strings")
        return cls(platform=str(data["platform"]), layer_names=tuple(layers), tiers=tiers, graph_hash=graph_hash,
                   provenance={str(k): str(v) for k, v in provenance.items()}, **optional)

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(temporary, path)     # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as error:
            raise InputError(f"cannot read calibration file {path}: {error.strerror or error}") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"calibration file {path} is not valid JSON ({error.msg} at line {error.lineno})") \
                from error
        return cls.from_json(data)
