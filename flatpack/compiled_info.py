"""A compiled artifact's ``flatpack.json`` as typed data (``Compiled.info``): parsed and
validated once, where ``flatpack.load`` reads the verified file, written back by
``Compiled.save`` in the same JSON, and read by attribute everywhere else.

It holds what the stages alone do not say: what the model was compiled for and how (target,
frontend, passes, the trace's notes and mode), how a call's arguments map to the stages' flat
inputs and how their flat outputs become the model's nested ones (signature, structures, names,
the example's tensor specs), the original ``state_dict`` keys, the stage directories, the
layer chain's JSON (``LayerGraph.to_json``) and its profile. The plan is saved in the same
file under ``"plan"`` but is the :class:`~flatpack.partitioner.plan.Plan`'s own JSON, parsed
by ``Plan.from_json``.

Keys recorded only by later versions of the same schema (``training``, ``mode_fixed``,
``input_specs``, ``state_dict_keys``) are None when absent and are left out again on save, so
a directory saved by an earlier flatpack loads and saves back unchanged.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from typing import Any, Mapping

from flatpack.errors import ArtifactError
from flatpack.ir import structure
from flatpack.ir.profile import ChainProfile
from flatpack.ir.trace import Signature
from flatpack.stage.json_fields import Invalid, ints, required, strings
from flatpack.stage.tensor_check import TensorSpec
from flatpack.version import COMPILED_SCHEMA_VERSION

COMPILED_KIND = "flatpack-compiled"
# the kinds of parameter a signature may record (inspect.Parameter.POSITIONAL_ONLY, ...)
_PARAMETER_KINDS = frozenset(type(inspect.Parameter.POSITIONAL_ONLY).__members__)
# the keys a document may lack: recorded only by later versions of the schema, or only with a profile
_OPTIONAL_KEYS = ("training", "mode_fixed", "input_specs", "state_dict_keys", "profile")


@dataclass(frozen=True, kw_only=True)
class CompiledInfo:
    """What ``flatpack.json`` records besides the plan (schema
    :data:`~flatpack.version.COMPILED_SCHEMA_VERSION`)."""

    flatpack_version: str
    torch_version: str
    target: str                                   # the platform the plan is for
    frontend: str                                 # "fx" or "export"
    trace_notes: tuple[str, ...]                  # what tracing had to do (a re-trace, use_cache=False...)
    training: bool | None = None                  # the mode the model was compiled in
    mode_fixed: tuple[str, ...] | None = None     # what keeps that mode's behaviour after .train()/.eval()
    model_class: str                              # "module.Qual.Name" of the compiled model
    passes: tuple[str, ...]                       # the pass pipeline, as pipeline strings
    signature: Signature                          # model.forward's parameters
    input_structure: dict[str, Any]               # ir.structure JSON of the call's arguments
    output_structure: dict[str, Any]              # ir.structure JSON of the model's outputs
    input_names: tuple[str, ...]                  # the flat inputs, in the graph's placeholder order
    input_specs: tuple[TensorSpec, ...] | None = None   # per tensor input: the example's shape, dtype, free dims
    output_names: tuple[str, ...]                 # the flat outputs the output structure indexes
    state_dict_keys: tuple[str, ...] | None = None      # every key model.load_state_dict expects
    stages: tuple[str, ...]                       # the stage directories (stage_000, ...)
    chain: dict[str, Any]                         # the layer chain (LayerGraph.to_json)
    profile: ChainProfile | None = None           # the per-layer profile, when compiled with one

    def to_json(self) -> dict[str, Any]:
        """The document ``flatpack.json`` holds (without the plan), key for key as
        :meth:`parse` reads it."""
        document: dict[str, Any] = {
            "kind": COMPILED_KIND, "schema_version": COMPILED_SCHEMA_VERSION,
            "flatpack_version": self.flatpack_version, "torch_version": self.torch_version, "target": self.target,
            "frontend": self.frontend, "trace_notes": list(self.trace_notes), "training": self.training,
            "mode_fixed": _list_or_none(self.mode_fixed), "model_class": self.model_class,
            "passes": list(self.passes), "signature": self.signature.to_json(),
            "input_structure": self.input_structure, "output_structure": self.output_structure,
            "input_names": list(self.input_names),
            "input_specs": None if self.input_specs is None else [spec.to_json() for spec in self.input_specs],
            "output_names": list(self.output_names), "state_dict_keys": _list_or_none(self.state_dict_keys),
            "stages": list(self.stages), "chain": self.chain,
            "profile": None if self.profile is None else {**self.profile.to_json(),
                                                          "cache_hit": self.profile.cache_hit},
        }
        # a key not recorded (by an earlier flatpack, or a compile without a profile) stays unrecorded
        return {key: value for key, value in document.items() if value is not None or key not in _OPTIONAL_KEYS}

    def dumps(self, plan: Mapping[str, Any]) -> bytes:
        """``flatpack.json``'s bytes: this document with the plan's JSON last."""
        return (json.dumps({**self.to_json(), "plan": dict(plan)}, indent=2) + "\n").encode()

    @classmethod
    def parse(cls, document: Any, where: str) -> CompiledInfo:
        """Validates ``flatpack.json``'s parsed JSON read from ``where`` (its ``"plan"`` is left
        to ``Plan.from_json``); an ArtifactError names the file and the key that is missing or
        ill-typed, never a KeyError later, in whatever reads the field."""
        if not isinstance(document, dict) or document.get("kind") != COMPILED_KIND \
                or document.get("schema_version") != COMPILED_SCHEMA_VERSION:
            raise ArtifactError(f"{where} is not a flatpack output of schema {COMPILED_SCHEMA_VERSION}; recompile")
        for key in ("output_structure", "input_structure"):
            if key not in document:
                raise ArtifactError(f"{where} has no {key}; the output is corrupted, recompile")
            # the closed vocabulary, before anything rebuilds a value from it (tests/security)
            structure.check(document[key], f"{where} ({key})")
        try:
            return cls._from_json(document, where)
        except Invalid as err:
            raise ArtifactError(f"{err}: the output is corrupted, recompile the model") from None

    @classmethod
    def _from_json(cls, data: dict[str, Any], where: str) -> CompiledInfo:
        def strings_at(key: str) -> tuple[str, ...]:
            return strings(required(data, key, list, where), f"{where}'s {key!r}")

        def optional_strings_at(key: str) -> tuple[str, ...] | None:
            return strings_at(key) if key in data else None

        training = required(data, "training", bool, where) if "training" in data else None
        input_specs = (tuple(_tensor_spec(entry, f"{where}'s 'input_specs' entry {position}")
                             for position, entry in enumerate(required(data, "input_specs", list, where)))
                       if "input_specs" in data else None)
        profile = _profile(required(data, "profile", dict, where), f"{where}'s 'profile'") \
            if "profile" in data else None
        return cls(
            flatpack_version=required(data, "flatpack_version", str, where),
            torch_version=required(data, "torch_version", str, where),
            target=required(data, "target", str, where), frontend=required(data, "frontend", str, where),
            trace_notes=strings_at("trace_notes"), training=training, mode_fixed=optional_strings_at("mode_fixed"),
            model_class=required(data, "model_class", str, where), passes=strings_at("passes"),
            signature=_signature(required(data, "signature", list, where), f"{where}'s 'signature'"),
            input_structure=required(data, "input_structure", dict, where),
            output_structure=required(data, "output_structure", dict, where),
            input_names=strings_at("input_names"), input_specs=input_specs, output_names=strings_at("output_names"),
            state_dict_keys=optional_strings_at("state_dict_keys"), stages=strings_at("stages"),
            chain=required(data, "chain", dict, where), profile=profile,
        )


def _list_or_none(values: tuple[str, ...] | None) -> list[str] | None:
    return None if values is None else list(values)


def _signature(entries: list[Any], where: str) -> Signature:
    """``[[name, kind, has_default], ...]`` with ``kind`` one of inspect's parameter kinds."""
    parameters = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and entry[1] in _PARAMETER_KINDS and isinstance(entry[2], bool)):
            raise Invalid(f"{where} has the entry {entry!r}, not [name, parameter kind "
                          f"({', '.join(sorted(_PARAMETER_KINDS))}), has a default (true or false)]")
        parameters.append((entry[0], entry[1], entry[2]))
    return Signature(parameters)


def _tensor_spec(entry: Any, where: str) -> TensorSpec:
    if not isinstance(entry, dict):
        raise Invalid(f"{where} is {entry!r}, not an object")
    if "dynamic" not in entry:
        raise Invalid(f"{where} has no 'dynamic'")
    dynamic = entry["dynamic"]
    return TensorSpec(ints(required(entry, "shape", list, where), f"{where}'s 'shape'"),
                      required(entry, "dtype", str, where),
                      None if dynamic is None else ints(dynamic, f"{where}'s 'dynamic'"))


def _profile(data: dict[str, Any], where: str) -> ChainProfile:
    cache_hit = required(data, "cache_hit", bool, where) if "cache_hit" in data else False
    try:
        return ChainProfile.from_json(data, cache_hit=cache_hit)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise Invalid(f"{where} is malformed ({type(err).__name__}: {err})") from None
