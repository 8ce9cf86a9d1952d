"""A stage's ``manifest.json`` as typed data: parsed and validated once, where the artifact is
read (:func:`flatpack.stage.artifact.parse_stage`), and read by attribute everywhere else.

The manifest is a stage's I/O contract: the values that enter and leave it (name, kind,
shape, dtype, the dimensions a dynamic batch leaves free), its weights (canonical name,
attribute, kind, the stages a tied weight is shared with), the layers it holds, the mode it
was traced in, and the hashes of its other files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import flatpack.safeio as safeio
from flatpack.errors import ArtifactError
from flatpack.stage.json_fields import Invalid as _Invalid
from flatpack.stage.json_fields import ints as _ints
from flatpack.stage.json_fields import required as _field
from flatpack.stage.json_fields import strings as _strings
from flatpack.version import STAGE_SCHEMA_VERSION

STAGE_KIND = "flatpack-stage"
TENSOR = "tensor"
PARAMETER_KINDS = ("parameter", "frozen", "buffer", "constant")


def _named(data: Any, where: str) -> tuple[str, str, str]:
    """An entry's ``name`` and ``kind``, and where it is named by its name from then on."""
    if not isinstance(data, dict):
        raise _Invalid(f"{where} is {data!r}, not an object")
    name = _field(data, "name", str, where)
    where = f"{where} ({name})"
    return name, _field(data, "kind", str, where), where


@dataclass(frozen=True)
class ValueEntry:
    """A value that enters or leaves the stage: a tensor (``shape``, ``dtype``, and ``dynamic``,
    the dimensions a dynamic batch leaves free, where the frontend knows them) or a Python
    value (``python_type``)."""

    name: str
    kind: str
    nbytes: int
    shape: tuple[int, ...] = ()
    dtype: str = ""
    python_type: str = ""
    dynamic: tuple[int, ...] | None = None

    @property
    def is_tensor(self) -> bool:
        return self.kind == TENSOR

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": self.kind, "bytes": self.nbytes}
        if self.is_tensor:
            out.update(shape=list(self.shape), dtype=self.dtype)
        else:
            out["type"] = self.python_type
        if self.dynamic is not None:
            out["dynamic"] = list(self.dynamic)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str) -> ValueEntry:
        name, kind, where = _named(data, where)
        nbytes = _field(data, "bytes", int, where)
        dynamic = _ints(data["dynamic"], f"{where}'s 'dynamic'") if data.get("dynamic") is not None else None
        if kind != TENSOR:
            return cls(name, kind, nbytes, python_type=str(data.get("type", "")), dynamic=dynamic)
        return cls(name, kind, nbytes, _ints(_field(data, "shape", list, where), f"{where}'s 'shape'"),
                   _field(data, "dtype", str, where), dynamic=dynamic)


@dataclass(frozen=True)
class ParameterEntry:
    """A weight the stage carries: its canonical ``name`` in the model, the ``attr`` the stage
    module holds it under, its ``kind`` (trainable ``parameter``, ``frozen``, ``buffer`` or
    ``constant``), every name the model gives it (``aliases``) and the other stages holding a
    copy of a tied weight (``shared_with``)."""

    name: str
    attr: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...]
    shared_with: tuple[int, ...] = ()

    @property
    def trainable(self) -> bool:
        return self.kind == "parameter"

    @property
    def all_names(self) -> tuple[str, ...]:
        """The canonical name, then the other names the model gives the weight."""
        return (self.name, *(alias for alias in self.aliases if alias != self.name))

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "attr": self.attr, "kind": self.kind, "shape": list(self.shape),
                "dtype": self.dtype, "aliases": list(self.aliases), "shared_with": list(self.shared_with)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> ParameterEntry:
        name, kind, where = _named(data, where)
        if kind not in PARAMETER_KINDS:
            raise _Invalid(f"{where}'s kind is {kind!r}, not one of {', '.join(PARAMETER_KINDS)}")
        return cls(name, _field(data, "attr", str, where), kind,
                   _ints(_field(data, "shape", list, where), f"{where}'s 'shape'"), _field(data, "dtype", str, where),
                   _strings(data.get("aliases", [name]), f"{where}'s 'aliases'"),
                   _ints(data.get("shared_with", []), f"{where}'s 'shared_with'"))


@dataclass(frozen=True)
class FileHash:
    sha256: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.nbytes}

    @classmethod
    def from_json(cls, data: Any, where: str) -> FileHash:
        if not isinstance(data, dict):
            raise _Invalid(f"{where} is {data!r}, not an object")
        return cls(_field(data, "sha256", str, where), _field(data, "bytes", int, where))


@dataclass(frozen=True)
class Manifest:
    """One stage's manifest (schema :data:`~flatpack.version.STAGE_SCHEMA_VERSION`)."""

    stage: int
    num_stages: int
    layers: tuple[int, int]            # the first and last layer of the chain the stage holds
    layer_names: tuple[str, ...]
    frontend: str                      # "fx" or "export"
    dynamic_batch: bool
    training: bool                     # the mode it was traced in, which the stage starts in
    mode_fixed: tuple[str, ...]        # what keeps that mode's behaviour after .train()/.eval()
    inputs: tuple[ValueEntry, ...]
    outputs: tuple[ValueEntry, ...]
    parameters: tuple[ParameterEntry, ...]
    flatpack_version: str
    files: Mapping[str, FileHash] = field(default_factory=dict)   # filled when the stage is serialized

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(entry.name for entry in self.outputs)

    def attributes(self) -> dict[str, str]:
        """Canonical parameter name -> the attribute the stage module holds it under."""
        return {entry.name: entry.attr for entry in self.parameters}

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": STAGE_KIND, "schema_version": STAGE_SCHEMA_VERSION, "flatpack_version": self.flatpack_version,
            "stage": self.stage, "num_stages": self.num_stages, "layers": list(self.layers),
            "layer_names": list(self.layer_names), "frontend": self.frontend, "dynamic_batch": self.dynamic_batch,
            "training": self.training, "mode_fixed": list(self.mode_fixed),
            "inputs": [entry.to_json() for entry in self.inputs],
            "outputs": [entry.to_json() for entry in self.outputs],
            "parameters": [entry.to_json() for entry in self.parameters],
            **({"files": {name: entry.to_json() for name, entry in self.files.items()}} if self.files else {}),
        }

    def dumps(self) -> bytes:
        return (json.dumps(self.to_json(), indent=2) + "\n").encode()

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Manifest:
        """Parses and validates ``manifest.json`` read from ``where``; an ArtifactError names
        what is wrong (never a KeyError later, in whatever reads the field)."""
        # strict, bounded JSON: a manifest nested 200,000 deep is an ArtifactError, not a RecursionError
        data = safeio.parse_json(raw, what=where, error=ArtifactError)
        if not isinstance(data, dict) or data.get("kind") != STAGE_KIND:
            kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
            raise ArtifactError(f"{where} is not a flatpack stage manifest (kind={kind!r})")
        if data.get("schema_version") != STAGE_SCHEMA_VERSION:
            raise ArtifactError(f"{where} uses stage schema {data.get('schema_version')}, this flatpack reads "
                                f"schema {STAGE_SCHEMA_VERSION}; recompile with this version")
        try:
            return cls._from_json(data, where)
        except _Invalid as err:
            raise ArtifactError(f"{err}: the manifest is malformed; recompile the model") from None

    @classmethod
    def _from_json(cls, data: dict[str, Any], where: str) -> Manifest:
        layers = _ints(_field(data, "layers", list, where), f"{where}'s 'layers'")
        if len(layers) != 2:
            raise _Invalid(f"{where}'s 'layers' is {list(layers)}, not [first, last]")
        files = _field(data, "files", dict, where) if "files" in data else {}
        return cls(
            stage=_field(data, "stage", int, where), num_stages=_field(data, "num_stages", int, where),
            layers=(layers[0], layers[1]),
            layer_names=_strings(_field(data, "layer_names", list, where), f"{where}'s 'layer_names'"),
            frontend=_field(data, "frontend", str, where), dynamic_batch=_field(data, "dynamic_batch", bool, where),
            training=_field(data, "training", bool, where),
            mode_fixed=_strings(_field(data, "mode_fixed", list, where), f"{where}'s 'mode_fixed'"),
            inputs=tuple(ValueEntry.from_json(entry, f"{where} input {position}")
                         for position, entry in enumerate(_field(data, "inputs", list, where))),
            outputs=tuple(ValueEntry.from_json(entry, f"{where} output {position}")
                          for position, entry in enumerate(_field(data, "outputs", list, where))),
            parameters=tuple(ParameterEntry.from_json(entry, f"{where} parameter {position}")
                             for position, entry in enumerate(_field(data, "parameters", list, where))),
            flatpack_version=_field(data, "flatpack_version", str, where),
            files={name: FileHash.from_json(entry, f"{where} file {name}") for name, entry in files.items()},
        )
