"""Plans: which layers each stage runs, on which memory tier, with how many replicas, and
how many micro-batches an iteration is cut into, and (``Provenance``) what they were made
for: the graph, the target, the workload, the calibration and the flatpack that made them.

Plain data with a JSON round-trip and a schema version, comparable and hashable.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from flatpack.errors import PlanError
from flatpack.version import PLAN_SCHEMA_VERSION, __version__

if TYPE_CHECKING:
    from flatpack.partitioner.workload import Workload


class PlanReuseWarning(UserWarning):
    """A plan reused, with ``force``, for something other than what it was made for."""


@dataclass(frozen=True)
class Provenance:
    """What a plan was made for: the graph (``profiler.graph_hash``), the target, the
    workload (mode, batch, micro-batches, optimizer, sync; None when compiled without one),
    the calibration file's digest (None: the catalog's models) and flatpack's version. A
    plan's predictions hold for exactly these."""

    graph_hash: str
    target: str
    workload: dict[str, Any] | None = field(default=None, hash=False)
    calibration_digest: str | None = None
    flatpack_version: str = __version__

    def differences(self, other: Provenance) -> list[str]:
        """What differs from ``other`` (what the plan is now used for), one phrase each."""
        found = []
        for name, what in (("graph_hash", "graph"), ("target", "target"), ("workload", "workload"),
                           ("calibration_digest", "calibration"), ("flatpack_version", "flatpack version")):
            made, used = getattr(self, name), getattr(other, name)
            if made != used:
                found.append(f"{what}: made for {made!r}, used for {used!r}")
        return found

    def check(self, current: Provenance, force: bool = False) -> None:
        """Refuses (``PlanError``) a plan made for something other than ``current``; with
        ``force``, warns (:class:`PlanReuseWarning`) and lets it through."""
        differences = self.differences(current)
        if not differences:
            return
        message = ("the plan was made for something else, so its predictions and memory checks do not hold here: "
                   + "; ".join(differences)
                   + ". Re-plan for this model, target, workload and calibration (flatpack plan), or pass --force "
                     "(force=True) to use it anyway")
        if not force:
            raise PlanError(message)
        warnings.warn(message, PlanReuseWarning, stacklevel=3)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Provenance:
        if not isinstance(data, dict) or not isinstance(data.get("graph_hash"), str) \
                or not isinstance(data.get("target"), str):
            raise PlanError("malformed plan JSON: \"provenance\" must hold at least graph_hash and target strings")
        return cls(data["graph_hash"], data["target"], data.get("workload"), data.get("calibration_digest"),
                   str(data.get("flatpack_version", "")))

# how a fork-join inference group divides its work over its partitions (``StagePlan.split``)
FORK_JOIN_SPLITS = ("channel", "batch")


@dataclass(frozen=True)
class StagePlan:
    """Layers ``start..end`` (inclusive) of the chain; ``memory_mb`` and ``replicas`` are the
    tier and data-parallel degree the cost-model solvers choose (None / 1 for the solvers
    that only cut, such as ``balanced``). ``recompute``: the stage keeps no activations
    between a micro-batch's forward and its backward and runs the forward again in the
    backward (less memory, one more forward; ``cost.common.memory_need``).
    ``split`` says how a fork-join inference group
    with replicas > 1 divides its work (``FORK_JOIN_SPLITS``, Gillis §II-C): ``"channel"``
    (each worker keeps a slice of the filters) or ``"batch"`` (each worker keeps all the
    weights and a slice of the request's samples); None: ``cost/gillis.py`` picks."""

    start: int
    end: int
    memory_mb: int | None = None
    replicas: int = 1
    # keyword-only: positional calls name the tier and replicas, never these two
    recompute: bool = field(default=False, kw_only=True)
    split: str | None = field(default=None, kw_only=True)

    @property
    def num_layers(self) -> int:
        return self.end - self.start + 1


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]
    num_layers: int
    solver: str = "manual"
    predictions: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    schema_version: int = PLAN_SCHEMA_VERSION
    # FuncPipe's M when the solver chose it; None: the workload's micro_batches
    micro_batches: int | None = None
    # what the plan was made for (compile records it); None: a plan written by hand or by an
    # older flatpack, which nothing can be checked against
    provenance: Provenance | None = field(default=None, compare=False, hash=False)

    @classmethod
    def from_ranges(cls, ranges: list[tuple[int, int]], num_layers: int, solver: str = "manual") -> Plan:
        plan = cls(tuple(StagePlan(start, end) for start, end in ranges), num_layers, solver)
        plan.check_against(num_layers)
        return plan

    @classmethod
    def from_cuts(cls, cuts: list[int], num_layers: int, solver: str = "manual") -> Plan:
        """``cuts`` are the layer indices after which a new stage starts."""
        points = sorted(set(cuts))
        starts = [0, *(cut + 1 for cut in points)]
        ends = [*points, num_layers - 1]
        return cls.from_ranges(list(zip(starts, ends)), num_layers, solver)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(stage.start, stage.end) for stage in self.stages]

    @property
    def cuts(self) -> list[int]:
        return [stage.end for stage in self.stages[:-1]]

    def check_against(self, num_layers: int) -> None:
        """Raises PlanError unless the stages tile layers 0..num_layers-1 in order."""
        if self.num_layers != num_layers:
            raise PlanError(f"the plan was made for a chain of {self.num_layers} layers, this chain has "
                            f"{num_layers}; re-plan after running the same passes")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.start != expected or stage.end < stage.start:
                raise PlanError(f"stage {index} covers layers {stage.start}..{stage.end}; stages must "
                                f"cover the chain in order without gaps, and this one must start at {expected}")
            if stage.replicas < 1:
                raise PlanError(f"stage {index} has {stage.replicas} replicas; it needs at least 1")
            if stage.split is not None and stage.split not in FORK_JOIN_SPLITS:
                raise PlanError(f"stage {index} has split {stage.split!r}; a fork-join group splits by "
                                f"{' or '.join(FORK_JOIN_SPLITS)}, or leave it out to let the cost model pick")
            if stage.memory_mb is not None and stage.memory_mb <= 0:
                raise PlanError(f"stage {index} has {stage.memory_mb} MB of memory; give a positive tier")
            expected = stage.end + 1
        if expected != num_layers:
            raise PlanError(f"the stages end at layer {expected - 1} but the chain has {num_layers} layers")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise PlanError(f"a plan needs at least 1 micro-batch, got {self.micro_batches}")

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(stage.replicas for stage in self.stages)

    def micro_batches_for(self, workload: Workload | None) -> int:
        """M when this plan runs: the plan's own (a solver that chose it), else the workload's,
        else 1 (a plan made without a workload)."""
        return self.micro_batches or (workload.micro_batches if workload else None) or 1

    @property
    def memory_mb(self) -> tuple[int | None, ...]:
        return tuple(stage.memory_mb for stage in self.stages)

    def with_predictions(self, **predictions: Any) -> Plan:
        """The same plan with ``predictions`` merged into its predictions."""
        return dataclasses.replace(self, predictions={**self.predictions, **predictions})

    def to_json(self) -> dict:
        data = {"schema_version": self.schema_version, "solver": self.solver, "num_layers": self.num_layers,
                "stages": [_stage_json(stage) for stage in self.stages], "micro_batches": self.micro_batches,
                "predictions": self.predictions}
        if self.provenance is not None:
            data["provenance"] = self.provenance.to_json()
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, data: dict) -> Plan:
        if data.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise PlanError(f"plan schema {data.get('schema_version')} is not {PLAN_SCHEMA_VERSION}; "
                            "re-plan with this flatpack version")
        try:
            stages = tuple(StagePlan(**stage) for stage in data["stages"])
            provenance = Provenance.from_json(data["provenance"]) if data.get("provenance") is not None else None
            plan = cls(stages, int(data["num_layers"]), data.get("solver", "manual"), data.get("predictions", {}),
                       micro_batches=data.get("micro_batches"), provenance=provenance)
        except (KeyError, TypeError) as err:
            raise PlanError(f"malformed plan JSON: {err}") from None
        plan.check_against(plan.num_layers)
        return plan

    @classmethod
    def loads(cls, text: str) -> Plan:
        return cls.from_json(json.loads(text))


def _stage_json(stage: StagePlan) -> dict:
    """A stage as JSON; ``split`` only where a fork-join plan set it."""
    data = asdict(stage)
    if data["split"] is None:
        del data["split"]
    return data
