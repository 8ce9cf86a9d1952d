"""``Compiled.info``: flatpack.json as typed data, parsed once at load and written back on
save byte for byte; a missing or ill-typed key is refused naming the key and the file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import flatpack
from flatpack.cli import main
from flatpack.compiled_info import CompiledInfo
from flatpack.compiler import COMPILED_FILE
from flatpack.errors import ArtifactError
from flatpack.ir.profile import ProfileWarning
from flatpack.profiler import ProfileOptions
from flatpack.stage.integrity import INDEX_FILE
from flatpack.stage.tensor_check import TensorSpec
from tests.security.conftest import rewrite_index

# keys a document saved by an earlier flatpack of the same schema may lack
LATER_KEYS = ("training", "mode_fixed", "input_specs", "state_dict_keys")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> flatpack.Compiled:
    """Compiled with a profile, so that every key flatpack.json can hold is there."""
    cache = tmp_path_factory.mktemp("profile-cache")
    with warnings.catch_warnings():
        # a model this small times the same at every batch size: flat slopes, which do not matter here
        warnings.simplefilter("ignore", ProfileWarning)
        return flatpack.compile(make_model(), (torch.randn(4, 8),), stages=2,
                                profile=ProfileOptions(cache_dir=str(cache), repeats=1, warmup=0,
                                                       batch_sizes=(1, 2, 4), progress=False))


def saved_json(out: Path) -> dict:
    return json.loads((out / COMPILED_FILE).read_text())


def resave(out: Path, compiled_json: dict) -> None:
    """Writes ``compiled_json`` as flatpack.json, as compile writes it, with a matching index."""
    (out / COMPILED_FILE).write_text(json.dumps(compiled_json, indent=2) + "\n")
    rewrite_index(out)


def test_a_saved_directory_loads_to_equal_info_and_saves_back_byte_for_byte(profiled, tmp_path):
    out = profiled.save(tmp_path / "out")
    loaded = flatpack.load(out, digest=profiled.digest)
    assert loaded.info == profiled.info
    assert loaded.info.profile is not None and loaded.profile == profiled.profile
    assert loaded.files()[COMPILED_FILE] == (out / COMPILED_FILE).read_bytes()
    again = loaded.save(tmp_path / "again")
    assert (again / INDEX_FILE).read_bytes() == (out / INDEX_FILE).read_bytes()
    assert flatpack.load(again, digest=profiled.digest).info == profiled.info


def test_the_info_holds_what_compile_recorded(profiled):
    info = profiled.info
    assert info.target == profiled.target == "local" and info.frontend == profiled.frontend
    assert info.stages == ("stage_000", "stage_001") and info.training is True
    assert info.input_names == profiled.artifacts[0].manifest.input_names
    assert info.output_names == profiled.artifacts[-1].manifest.output_names
    assert info.input_specs == (TensorSpec((4, 8), "float32", None),)   # fx: the frontend cannot tell
    assert info.state_dict_keys == tuple(make_model().state_dict())
    assert info.model_class == "torch.nn.modules.container.Sequential"


def test_a_document_from_an_earlier_flatpack_loads_and_saves_back_unchanged(profiled, tmp_path):
    out = profiled.save(tmp_path / "out")
    earlier = {key: value for key, value in saved_json(out).items() if key not in (*LATER_KEYS, "profile")}
    resave(out, earlier)
    loaded = flatpack.load(out)
    assert all(getattr(loaded.info, key) is None for key in (*LATER_KEYS, "profile"))
    assert loaded.files()[COMPILED_FILE] == (out / COMPILED_FILE).read_bytes()
    x = torch.randn(3, 8)
    torch.testing.assert_close(loaded.as_module()(x), profiled.as_module()(x))
    # without a recorded mode, the staged model starts in its first stage's (the mode it was traced in)
    assert loaded.as_module().training is True


@pytest.mark.parametrize("key", ["flatpack_version", "torch_version", "target", "frontend", "trace_notes",
                                 "model_class", "passes", "signature", "input_names", "output_names", "stages",
                                 "chain"])
def test_a_missing_key_is_refused_naming_the_key_and_the_file(profiled, tmp_path, key):
    out = profiled.save(tmp_path / "out")
    compiled_json = saved_json(out)
    del compiled_json[key]
    resave(out, compiled_json)
    with pytest.raises(ArtifactError) as caught:
        flatpack.load(out)
    message = str(caught.value)
    assert f"has no {key!r}" in message and str(out / COMPILED_FILE) in message and "recompile" in message


@pytest.mark.parametrize(("key", "value", "named"), [
    ("target", 3, "'target' is 3, not a string"),
    ("input_names", ["x", 1], "'input_names' is ['x', 1], not a list of strings"),
    ("training", "yes", "'training' is 'yes', not true or false"),
    ("state_dict_keys", {"0.weight": 1}, "'state_dict_keys' is {'0.weight': 1}, not a list"),
    ("chain", [], "'chain' is [], not an object"),
    ("signature", [["input", "EVAL", False]], "'signature' has the entry ['input', 'EVAL', False]"),
    ("input_specs", [{"shape": [4, "8"], "dtype": "float32", "dynamic": None}],
     "'input_specs' entry 0's 'shape' is [4, '8'], not a list of integers"),
    ("input_specs", [{"shape": [4, 8], "dtype": "float32"}], "'input_specs' entry 0 has no 'dynamic'"),
    ("profile", {"layers": []}, "'profile' is malformed (KeyError: 'host')"),
])
def test_an_ill_typed_key_is_refused_naming_the_key_and_the_file(profiled, tmp_path, key, value, named):
    out = profiled.save(tmp_path / "out")
    compiled_json = saved_json(out)
    compiled_json[key] = value
    resave(out, compiled_json)
    with pytest.raises(ArtifactError) as caught:
        flatpack.load(out)
    message = str(caught.value)
    assert named in message and str(out / COMPILED_FILE) in message


def test_the_typed_parse_runs_only_after_the_index_is_verified(profiled, tmp_path):
    """An ill-typed flatpack.json whose index was not rewritten fails on its sha256, as before."""
    out = profiled.save(tmp_path / "out")
    compiled_json = saved_json(out)
    del compiled_json["input_names"]
    (out / COMPILED_FILE).write_text(json.dumps(compiled_json, indent=2) + "\n")
    with pytest.raises(ArtifactError, match="sha256|bytes") as caught:
        flatpack.load(out)
    assert "input_names" not in str(caught.value)


def test_flatpack_check_refuses_what_load_refuses(profiled, tmp_path, capsys):
    out = profiled.save(tmp_path / "out")
    assert main(["check", str(out)]) == 0
    compiled_json = saved_json(out)
    del compiled_json["output_names"]
    resave(out, compiled_json)
    assert main(["check", str(out)]) == 2
    assert "has no 'output_names'" in capsys.readouterr().err


def test_parse_refuses_a_document_of_another_kind_or_schema():
    with pytest.raises(ArtifactError, match="not a flatpack output of schema"):
        CompiledInfo.parse({"kind": "flatpack-stage", "schema_version": 1}, "x/flatpack.json")
    with pytest.raises(ArtifactError, match="not a flatpack output of schema"):
        CompiledInfo.parse([], "x/flatpack.json")
