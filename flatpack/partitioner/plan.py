"""Plans: which layers each stage runs, on which memory tier, with how many replicas, and
how many micro-batches an iteration is cut into, and (``Provenance``) what they were made
for: the graph, the target, the workload, the calibration and the flatpack that made them.

Plain data with a JSON round-trip and a schema version, comparable and hashable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from flatpack.errors import PlanError
from flatpack.safeio import MiB, expect_mapping, load_json, parse_json
from flatpack.version import PLAN_SCHEMA_VERSION, __version__

if TYPE_CHECKING:
    from flatpack.partitioner.workload import Workload


# What a plan may ask for, checked wherever a plan is read or built (check_against): far above
# any real plan, low enough that a hostile plan cannot ask for 100,000 functions or a NaN tier.
MAX_REPLICAS = 1_024            # data-parallel replicas of one stage
MAX_MEMORY_MB = 1_048_576       # a memory tier of 1 TiB
MAX_MICRO_BATCHES = 65_536
MAX_LAYERS = 1_000_000
PLAN_FILE_LIMIT = 64 * MiB      # a plan's predictions may carry a front; never this much
STAGE_FIELDS = ("start", "end", "memory_mb", "replicas", "recompute", "split")


def _whole(value: Any, what: str, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high]``: a whole finite number (numpy's too), never a
    bool, NaN, infinity or string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PlanError(f"{what} must be a whole number, not {type(value).__name__} {value!r:.60}")
    if isinstance(value, numbers.Integral):
        # compared as an int: float() of a 400-digit one would overflow
        if not low <= int(value) <= high:
            raise PlanError(f"{what} is {int(value)!r:.40}; it must be at least {low:,} and at most {high:,}")
        return int(value)
    number = float(value)
    if not math.isfinite(number) or not number.is_integer():
        raise PlanError(f"{what} must be a whole number, not {value!r}")
    if not low <= number <= high:
        raise PlanError(f"{what} is {value!r}; it must be at least {low:,} and at most {high:,}")
    return int(number)


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
        workload, digest = data.get("workload"), data.get("calibration_digest")
        if workload is not None and not isinstance(workload, dict):
            raise PlanError(f"malformed plan JSON: provenance.workload must be an object or null, not "
                            f"{type(workload).__name__}")
        if digest is not None and not isinstance(digest, str):
            raise PlanError(f"malformed plan JSON: provenance.calibration_digest must be a string or null, not "
                            f"{type(digest).__name__}")
        return cls(data["graph_hash"], data["target"], workload, digest, str(data.get("flatpack_version", "")))

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
        """Raises PlanError unless the stages tile layers 0..num_layers-1 in order, each with a
        whole number of replicas (1 to :data:`MAX_REPLICAS`), a whole memory tier in MB (1 to
        :data:`MAX_MEMORY_MB`) or none, and the plan's micro-batches (1 to
        :data:`MAX_MICRO_BATCHES`) or none: NaN, infinities, booleans and huge values too."""
        _whole(self.num_layers, "the plan's num_layers", 1, MAX_LAYERS)
        if self.num_layers != num_layers:
            raise PlanError(f"the plan was made for a chain of {self.num_layers} layers, this chain has "
                            f"{num_layers}; re-plan after running the same passes")
        if not self.stages:
            raise PlanError("a plan needs at least one stage")
        expected = 0
        for index, stage in enumerate(self.stages):
            _whole(stage.start, f"stage {index}'s start", 0, MAX_LAYERS)
            _whole(stage.end, f"stage {index}'s end", 0, MAX_LAYERS)
            _whole(stage.replicas, f"stage {index}'s replicas", 1, MAX_REPLICAS)
            if stage.memory_mb is not None:
                _whole(stage.memory_mb, f"stage {index}'s memory_mb", 1, MAX_MEMORY_MB)
            if not isinstance(stage.recompute, bool):
                raise PlanError(f"stage {index}'s recompute must be true or false, not {stage.recompute!r:.60}")
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
        if self.micro_batches is not None:
            _whole(self.micro_batches, "the plan's micro_batches (it needs at least 1 micro-batch)", 1,
                   MAX_MICRO_BATCHES)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(stage.replicas for stage in self.stages)

    @property
    def workers(self) -> int:
        """The functions the plan runs at once: every stage's replicas."""
        return sum(self.replicas)

    def micro_batches_for(self, workload: Workload | None, explicit: int | None = None) -> int:
        """M when this plan runs: ``explicit`` (a train() call's ``micro_batches``), else the
        plan's own (a solver that chose it), else the workload's, else 1 (a plan made without
        a workload). The one place M is resolved: the backends, the job and the verdict call it."""
        return explicit or self.micro_batches or (workload.micro_batches if workload else None) or 1

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
    def from_json(cls, data: Any, where: str = "plan JSON") -> Plan:
        """The plan ``data`` describes, every field typed and bounded (:meth:`check_against`):
        a PlanError naming ``where`` and the field, never a TypeError or a NaN tier."""
        data = expect_mapping(data, what=where, error=PlanError)
        version = data.get("schema_version")
        if version != PLAN_SCHEMA_VERSION or isinstance(version, bool):
            raise PlanError(f"{where}: plan schema {version!r:.40} is not {PLAN_SCHEMA_VERSION}; "
                            "re-plan with this flatpack version")
        stages = data.get("stages")
        if not isinstance(stages, list) or not stages or len(stages) > MAX_LAYERS:
            raise PlanError(f"{where}: stages must be a non-empty list of stage objects")
        solver, predictions = data.get("solver", "manual"), data.get("predictions", {})
        if not isinstance(solver, str) or len(solver) > 256:
            raise PlanError(f"{where}: solver must be a name (a string of at most 256 characters)")
        if not isinstance(predictions, dict):
            raise PlanError(f"{where}: predictions must be an object, not {type(predictions).__name__}")
        if "num_layers" not in data:
            raise PlanError(f"{where} has no num_layers; it is written by flatpack plan or flatpack compile")
        built = []
        for index, stage in enumerate(stages):
            stage = expect_mapping(stage, what=f"{where}: stages[{index}]", error=PlanError)
            unknown = sorted(set(stage) - set(STAGE_FIELDS))
            missing = [name for name in ("start", "end") if name not in stage]
            if unknown or missing:
                raise PlanError(f"{where}: stages[{index}] has {'unknown fields ' + repr(unknown) if unknown else ''}"
                                f"{' and ' if unknown and missing else ''}"
                                f"{'no ' + ' or '.join(missing) if missing else ''}; a stage has "
                                f"{', '.join(STAGE_FIELDS)}")
            split = stage.get("split")
            if split is not None and not isinstance(split, str):
                raise PlanError(f"{where}: stages[{index}].split must be a string or null")
            built.append(StagePlan(stage["start"], stage["end"], stage.get("memory_mb"), stage.get("replicas", 1),
                                   recompute=stage.get("recompute", False), split=split))
        plan = cls(tuple(built), data["num_layers"], solver, predictions, micro_batches=data.get("micro_batches"),
                   provenance=Provenance.from_json(data["provenance"]) if data.get("provenance") is not None else None)
        try:
            plan.check_against(_whole(plan.num_layers, f"{where}: num_layers", 1, MAX_LAYERS))
        except PlanError as err:
            raise PlanError(f"{where}: {err}") from None
        return plan

    @classmethod
    def loads(cls, text: str | bytes, where: str = "plan JSON") -> Plan:
        """A plan from JSON text: strict JSON (no NaN, no duplicate keys, bounded depth)."""
        return cls.from_json(parse_json(text, what=where, error=PlanError), where)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """A plan file (``flatpack plan --out``), read with the bounded reader."""
        return cls.from_json(load_json(path, limit=PLAN_FILE_LIMIT, what=str(path), error=PlanError), str(path))


def _stage_json(stage: StagePlan) -> dict:
    """A stage as JSON; ``split`` only where a fork-join plan set it."""
    data = asdict(stage)
    if data["split"] is None:
        del data["split"]
    return data
