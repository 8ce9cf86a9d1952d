"""The stage manifest as typed data (flatpack/stage/manifest.py): what emit writes parses back to
the same value, the module built from it carries it, and a malformed manifest is refused where
the artifact is read, naming the field, before any stage code runs."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import flatpack
from flatpack.errors import ArtifactError
from flatpack.stage.artifact import MANIFEST_FILE, SOURCE_FILE, WEIGHTS_FILE, parse_stage, serialize, stage_manifest
from flatpack.stage.manifest import STAGE_KIND, Manifest, ParameterEntry, ValueEntry
from flatpack.stage.tensor_check import stage_input_specs
from flatpack.version import STAGE_SCHEMA_VERSION


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.embed(x)))) * self.scale


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Tied().eval()


@pytest.fixture(scope="module")
def compiled(model):
    return flatpack.compile(model, torch.randn(4, 8), stages=2)


def test_a_manifest_round_trips_through_its_json(compiled):
    for artifact in compiled.artifacts:
        files = serialize(artifact)
        parsed = Manifest.parse(files[MANIFEST_FILE], "here")
        assert parsed == Manifest.parse(parsed.dumps(), "again")
        assert {name for name in parsed.files} == {SOURCE_FILE, WEIGHTS_FILE}
        assert parsed.to_json()["kind"] == STAGE_KIND and parsed.to_json()["schema_version"] == STAGE_SCHEMA_VERSION
        # everything but the file hashes (added when serialized) is what emit made
        assert parsed.to_json() | {"files": None} == artifact.manifest.to_json() | {"files": None}


def test_the_manifest_says_what_crosses_and_what_is_tied(compiled):
    first, second = (artifact.manifest for artifact in compiled.artifacts)
    assert first.input_names == compiled.info.input_names
    assert set(second.input_names) <= set(first.output_names) | set(first.input_names)
    assert second.output_names == compiled.info.output_names
    assert all(isinstance(entry, ValueEntry) and entry.is_tensor for entry in first.inputs)
    tied = [entry for artifact in compiled.artifacts for entry in artifact.manifest.parameters
            if "head.weight" in entry.all_names]
    assert tied and all(isinstance(entry, ParameterEntry) and entry.shared_with for entry in tied)
    assert stage_input_specs(first)[first.input_names[0]].shape == (4, 8)


def test_a_built_stage_module_carries_its_manifest_and_computes_the_model(model, compiled):
    modules = compiled.stage_modules()
    assert [stage_manifest(module) for module in modules] == [artifact.manifest for artifact in compiled.artifacts]
    with pytest.raises(TypeError, match="not a flatpack stage module"):
        stage_manifest(nn.Linear(2, 2))
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled.as_module()(x), model(x))


def _with(files: dict[str, bytes], change) -> dict[str, bytes]:
    data = json.loads(files[MANIFEST_FILE])
    change(data)
    return {**files, MANIFEST_FILE: json.dumps(data).encode()}


@pytest.mark.parametrize("change, named", [
    (lambda data: data.pop("layers"), "has no 'layers'"),
    (lambda data: data.update(stage="1"), "'stage' is '1', not an integer"),
    (lambda data: data.update(training=1), "'training' is 1, not true or false"),
    (lambda data: data.update(layers=[0, 1, 2]), "not [first, last]"),
    (lambda data: data["inputs"][0].pop("shape"), "input 0 (x) has no 'shape'"),
    (lambda data: data["parameters"][0].update(kind="weight"), "not one of parameter, frozen, buffer, constant"),
    (lambda data: data.update(inputs={}), "'inputs' is {}, not a list"),
])
def test_a_malformed_manifest_is_refused_naming_the_field(compiled, change, named):
    files = _with(serialize(compiled.artifacts[0]), change)
    with pytest.raises(ArtifactError, match="malformed") as refused:
        parse_stage(files, "out/stage_000")
    assert named in str(refused.value) and "out/stage_000/manifest.json" in str(refused.value)


@pytest.mark.parametrize("change, named", [
    (lambda data: data.update(kind="something-else"), "not a flatpack stage manifest"),
    (lambda data: data.update(schema_version=STAGE_SCHEMA_VERSION + 1), "recompile with this version"),
])
def test_a_manifest_of_another_kind_or_schema_is_refused(compiled, change, named):
    with pytest.raises(ArtifactError, match=named):
        parse_stage(_with(serialize(compiled.artifacts[0]), change), "out/stage_000")


def test_a_manifest_that_is_not_json_is_refused():
    with pytest.raises(ArtifactError, match="is not valid JSON"):
        Manifest.parse(b"{", "out/stage_000/manifest.json")
