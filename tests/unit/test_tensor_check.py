"""The one tensor-input check (flatpack/stage/tensor_check.py) that compiled models, train()
batches, --data sources and stage workers share."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.errors import InputError
from flatpack.stage.tensor_check import TensorSpec, check_tensor

FIX = "Do the fix."


def test_free_dimensions_may_differ_and_fixed_ones_are_named():
    spec = TensorSpec.from_json({"shape": [2, 16, 8], "dtype": "float32", "dynamic": [0, 1]})
    check_tensor("hidden", torch.zeros(5, 32, 8), spec, fix=FIX)
    with pytest.raises(InputError, match=r"^stage 1: input 'hidden' has shape \(5, 32, 4\), but the model was "
                                         r"compiled for \(2, 16, 8\) \(dimensions 0, 1 may differ\): dim 2 must be "
                                         r"8, got 4\. Do the fix\.$"):
        check_tensor("hidden", torch.zeros(5, 32, 4), spec, where="stage 1: ", fix=FIX)


def test_without_known_free_dimensions_only_the_rank_and_dtype_are_fixed():
    spec = TensorSpec.from_json({"shape": [2, 16], "dtype": "int64"})
    check_tensor(0, torch.zeros(7, 3, dtype=torch.long), spec, fix=FIX)
    with pytest.raises(InputError, match=r"input 0 has shape \(7,\), 1 dimensions, but .* 2: \(2, 16\)"):
        check_tensor(0, torch.zeros(7, dtype=torch.long), spec, fix=FIX)
    with pytest.raises(InputError, match=r"input 0 has dtype int32, but the model was compiled for int64"):
        check_tensor(0, torch.zeros(7, 3, dtype=torch.int32), spec, fix=FIX)
    # the same kind of dtype is admitted where asked (data, before the model is compiled on it)
    check_tensor(0, torch.zeros(7, 3, dtype=torch.int32), spec, fix=FIX, exact_dtype=False)
    with pytest.raises(InputError, match=r"input 0 has dtype float64.*float32.*astype\('float32'\)"):
        check_tensor(0, torch.zeros(7, 3, dtype=torch.float64), TensorSpec.of(torch.zeros(2, 3)), fix=FIX,
                     exact_dtype=False)


@pytest.mark.parametrize("value, words", [(None, "is missing"), ([1, 2], "must be a float32 tensor .* got list")])
def test_a_missing_or_non_tensor_input_is_named(value, words):
    with pytest.raises(InputError, match=rf"input 'x' {words}.*Do the fix"):
        check_tensor("x", value, TensorSpec((2, 3), "float32", (0,)), fix=FIX)


def test_stage_manifests_record_the_dimensions_export_left_free():
    pytest.importorskip("transformers")
    from flatpack.examples import bert

    model, inputs = bert()
    compiled = flatpack.compile(model, inputs, stages=2)
    assert compiled.frontend == "export"
    entries = [entry for artifact in compiled.artifacts for entry in artifact.manifest.inputs if entry.is_tensor]
    assert entries and all(entry.dynamic is not None for entry in entries)
    first = {entry.name: entry for entry in compiled.artifacts[0].manifest.inputs}
    assert first["input_ids"].dynamic == (0, 1)      # batch and sequence length
    hidden = [entry for entry in compiled.artifacts[1].manifest.inputs if len(entry.shape) == 3]
    # the width is fixed
    assert hidden and all(entry.dynamic is not None and 2 not in entry.dynamic for entry in hidden)


def test_a_stage_checks_its_tensor_inputs_from_its_manifest():
    from flatpack.stage.manifest import Manifest, ValueEntry
    from flatpack.stage.tensor_check import check_stage_inputs, stage_input_specs

    inputs = (ValueEntry("hidden", "tensor", 2048, (4, 16, 8), "float32", dynamic=(0, 1)),
              ValueEntry("size", "scalar", 8, python_type="int"))
    manifest = Manifest(1, 2, (3, 3), ("l3",), "export", True, True, (), inputs, (), (), "test")
    specs = stage_input_specs(manifest)
    assert set(specs) == {"hidden"}           # scalars cross boundaries unchecked
    check_stage_inputs(specs, [("hidden", torch.zeros(2, 7, 8)), ("size", 7)], where="stage 1: ")
    with pytest.raises(InputError, match=r"^stage 1: input 'hidden' has shape \(2, 7, 3\).*dim 2 must be 8, got 3\. "
                                         r"Every batch must have the shapes"):
        check_stage_inputs(specs, [("hidden", torch.zeros(2, 7, 3))], where="stage 1: ")
