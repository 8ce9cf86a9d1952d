"""Bad input gets an error that names the cause and the fix, before anything is written."""

from __future__ import annotations

import json

import pytest
import torch

import flatpack
from flatpack.errors import ArtifactError, InputError, PlanError
from flatpack.stage.integrity import INDEX_FILE, Index
from tests.models import MLP


def test_not_a_module():
    with pytest.raises(InputError, match="expects a torch.nn.Module, got function"):
        # the wrong type on purpose: the error must name what was given
        flatpack.compile(lambda x: x, (torch.randn(2),))  # pyright: ignore[reportArgumentType]


def test_wrong_number_of_inputs():
    with pytest.raises(InputError, match=r"do not match forward\(x\)"):
        flatpack.compile(MLP(), (torch.randn(2, 8), torch.randn(2, 8)))


def test_wrong_shape_of_inputs():
    with pytest.raises(InputError, match=r"failed on the example inputs.*forward takes \(x\)"):
        flatpack.compile(MLP(width=8), (torch.randn(2, 5),))


def test_unknown_target_and_option():
    with pytest.raises(InputError, match="unknown target 'aws'"):
        flatpack.compile(MLP(), (torch.randn(2, 8),), target="aws")
    with pytest.raises(InputError, match="unknown option"):
        flatpack.compile(MLP(), (torch.randn(2, 8),), stagse=2)


def test_more_stages_than_layers_leaves_no_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(PlanError, match="cannot cut a chain of 4 layers into 9 stages"):
        flatpack.compile(MLP(depth=4), (torch.randn(2, 8),), stages=9, out_dir=out)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_foreign_out_dir_is_refused_and_untouched(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not written by flatpack"):
        flatpack.compile(MLP(), (torch.randn(2, 8),), out_dir=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_previous_flatpack_output_is_replaced(tmp_path):
    out = tmp_path / "out"
    flatpack.compile(MLP(), (torch.randn(2, 8),), stages=3, out_dir=out)
    flatpack.compile(MLP(), (torch.randn(2, 8),), stages=2, out_dir=out)
    assert sorted(p.name for p in out.iterdir()) == ["flatpack.index.json", "flatpack.json", "plan.json", "stage_000",
                                                     "stage_001"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("victim", ["weights.safetensors", "stage.py"])
def test_tampered_artifact_is_detected(tmp_path, victim):
    out = tmp_path / "out"
    flatpack.compile(MLP(), (torch.randn(2, 8),), stages=2, out_dir=out)
    path = out / "stage_001" / victim
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=rf"stage_001/{victim} has sha256 .* but flatpack.index.json records "
                                            ".* modified or corrupted"):
        flatpack.load(out)


def test_missing_and_foreign_manifests(tmp_path):
    with pytest.raises(ArtifactError, match="not a flatpack output directory"):
        flatpack.load(tmp_path)
    out = tmp_path / "out"
    flatpack.compile(MLP(), (torch.randn(2, 8),), stages=2, out_dir=out)
    manifest = out / "stage_000" / "manifest.json"
    manifest.write_text(json.dumps({"kind": "something-else"}))
    with pytest.raises(ArtifactError, match="stage_000/manifest.json has .* bytes but flatpack.index.json records"):
        flatpack.load(out)
    # past the index (rewritten to match), the manifest's own checks still refuse it
    files = {path.relative_to(out).as_posix(): path.read_bytes() for path in out.rglob("*")
             if path.is_file() and path.name != INDEX_FILE}
    (out / INDEX_FILE).write_bytes(Index.build(files).raw)
    with pytest.raises(ArtifactError, match="not a flatpack stage manifest"):
        flatpack.load(out)


def test_calling_the_staged_model_with_other_structure_is_an_input_error():
    staged = flatpack.compile(MLP(), (torch.randn(2, 8),), stages=2).as_module()
    with pytest.raises(InputError, match="do not match forward"):
        staged(torch.randn(2, 8), torch.randn(2, 8))
