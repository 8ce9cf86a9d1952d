"""What a solver sees: the chain as plain numbers, the platform and the workload — never
torch objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flatpack.errors import PlanError
from flatpack.ir import meta
from flatpack.ir.channels import group_table
from flatpack.ir.profile import ChainProfile, HostInfo, LayerProfile, Linear
from flatpack.partitioner.options import ProblemOptions
from flatpack.partitioner.workload import Workload
from flatpack.platform.catalog import get_platform

if TYPE_CHECKING:
    from flatpack.platform.calibration import Calibration
    from flatpack.platform.catalog import Platform, Tier
    from flatpack.ir.channels import ChannelGroup
    from flatpack.ir.graph import LayerGraph


@dataclass(frozen=True)
class ChainLayer:
    name: str
    param_bytes: int
    flops: int
    boundary_bytes: int  # bytes crossing the boundary after this layer, at the example batch
    profile: LayerProfile | None = None


@dataclass(frozen=True)
class Problem:
    """The chain, where it runs (``platform``) and what it must do (``workload``).

    ``host`` says where the profiles were measured; ``calibration``, when given, holds
    seconds measured inside the target and overrides the host-to-tier model.
    """

    chain: tuple[ChainLayer, ...]
    platform: Platform
    workload: Workload = field(default_factory=Workload)
    host: HostInfo | None = None
    calibration: Calibration | None = None
    stages: int | None = None
    # a mapping is accepted and checked (ProblemOptions.of): a misspelt option is refused here
    options: ProblemOptions = field(default_factory=ProblemOptions)
    input_bytes: Linear | None = None   # the model's inputs per micro-batch, when profiled
    # Gillis's channel split of each group start..end that has one (``ir/channels.py``),
    # analysed for inference workloads; None: not analysed (a hand-made chain), and the
    # Gillis model takes every group as channel-splittable with all its weights split
    channel_groups: dict[tuple[int, int], ChannelGroup] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", ProblemOptions.of(self.options))

    @classmethod
    def from_graph(cls, graph: LayerGraph, stages: int | None = None, target: str = "local",
                   workload: Workload | None = None, profile: ChainProfile | None = None,
                   calibration: Calibration | None = None, **options: Any) -> Problem:
        if profile is not None and len(profile.layers) != len(graph.layers):
            raise PlanError(f"the profile has {len(profile.layers)} layers but the chain has {len(graph.layers)}; "
                            "profile the graph after running the passes")
        chain = tuple(
            ChainLayer(layer.name, layer.meta[meta.PARAM_BYTES], layer.meta[meta.LAYER_FLOPS],
                       graph.boundary(index).nbytes, profile.layers[index] if profile else None)
            for index, layer in enumerate(graph.layers)
        )
        platform = get_platform(target)
        if calibration is not None:
            calibration.check_against([layer.name for layer in chain], profile.graph_hash if profile else None,
                                      platform.name)
            platform = calibration.apply(platform)
        workload = workload or Workload()
        channel_groups = group_table(graph) if workload.mode == "infer" else None
        return cls(chain, platform, workload, profile.host if profile else None,
                   calibration, stages, ProblemOptions.of(options), profile.input_bytes if profile else None,
                   channel_groups)

    @classmethod
    def from_saved(cls, chain: dict[str, Any], profile: ChainProfile, target: str, workload: Workload | None = None,
                   calibration: Calibration | None = None, **options: Any) -> Problem:
        """The problem of a saved artifact (``Compiled.load``, which keeps no graph): its
        chain's JSON (``Compiled.info.chain``) and its profile, as :meth:`from_graph` builds it."""
        layers = chain.get("layers") if isinstance(chain, dict) else None
        if not isinstance(layers, list) or len(layers) != len(profile.layers):
            raise PlanError(f"the saved chain has {len(layers) if isinstance(layers, list) else 'no'} layers but its "
                            f"profile {len(profile.layers)}; recompile the artifact with a profile")
        built = tuple(ChainLayer(layer["name"], int(layer["param_bytes"]), int(layer["flops"]),
                                 int(layer["boundary"]["bytes"]), measured)
                      for layer, measured in zip(layers, profile.layers))
        platform = get_platform(target)
        if calibration is not None:
            calibration.check_against([layer.name for layer in built], profile.graph_hash, platform.name)
            platform = calibration.apply(platform)
        return cls(built, platform, workload or Workload(), profile.host, calibration, None,
                   ProblemOptions.of(options), profile.input_bytes)

    @property
    def profiled(self) -> bool:
        return all(layer.profile is not None for layer in self.chain)

    def layer_profile(self, index: int) -> LayerProfile:
        profile = self.chain[index].profile
        if profile is None:
            raise PlanError(f"layer {index} ({self.chain[index].name}) has no profile; cost models need a "
                            "profiled chain: compile with profile=True or run flatpack.profiler.profile_graph")
        return profile

    def boundary_bytes(self, index: int, micro_batch: float) -> float:
        """Bytes crossing the boundary after layer ``index`` for one micro-batch (FuncPipe's
        o_i; the gradient sent back across it has the same size). ``index`` -1 is the
        model's input. A bf16 workload's boundaries travel in bfloat16
        (``runtime.precision.for_wire``): half the profiled float32 bytes. (Integer tensors
        crossing a boundary, such as an attention mask, keep their size; the profile does not
        separate them, so for those this under-counts.)"""
        if index == -1:
            if self.input_bytes is None:
                raise PlanError("the problem has no profile of the model's inputs; build it with Problem.from_graph "
                                "from a profiled graph")
            return self.input_bytes.at(micro_batch)
        return self.layer_profile(index).output_bytes.at(micro_batch) * self.workload.boundary_scale

    def layer_seconds(self, index: int, tier: Tier, micro_batch: float) -> tuple[float, float]:
        """Forward and backward seconds of layer ``index`` for one micro-batch on ``tier``:
        the calibration's figure when it has one, else the host profile mapped through the
        platform's compute model."""
        if self.calibration is not None:
            calibrated = self.calibration.seconds(index, tier.memory_mb, micro_batch)
            if calibrated is not None:
                return calibrated
        profile = self.layer_profile(index)
        return (self._on_tier(profile.forward_s.at(micro_batch), tier),
                self._on_tier(profile.backward_s.at(micro_batch), tier))

    def layer_inference_seconds(self, index: int, tier: Tier, batch: float) -> float:
        """Seconds of layer ``index``'s forward when serving (no autograd graph) a batch on
        ``tier``. A calibration's forward line, when it has the tier, is taken as measured
        for serving too (the runtime's calibration runs forwards without gradients)."""
        if self.calibration is not None:
            calibrated = self.calibration.seconds(index, tier.memory_mb, batch)
            if calibrated is not None:
                return calibrated[0]
        return self._on_tier(self.layer_profile(index).inference_line().at(batch), tier)

    def _on_tier(self, host_seconds: float, tier: Tier) -> float:
        """Host seconds on ``tier``: times the speed ratio ``flatpack calibrate`` measured on
        the tier when the calibration has one for this profile's thread count (a CPU
        profile), else through the platform's compute model."""
        if self.host is None:
            raise PlanError("the problem has profiles but no host record; build it with Problem.from_graph")
        if self.calibration is not None and self.host.device == "cpu":
            ratio = self.calibration.speed_ratio(tier.memory_mb, self.host.threads)
            if ratio is not None:
                return host_seconds * ratio
        return self.platform.compute_seconds(host_seconds, self.host, tier)
