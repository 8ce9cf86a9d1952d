"""The model zoo: every model builds small and trains a step, full sizes match the known counts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import torch

import flatpack
from flatpack.errors import InputError
from flatpack.zoo import ZOO, build, zoo_names
from tests.helpers import assert_equivalent

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HF_MODELS = {"bert-large", "gpt2"}

# torchvision's parameter counts for the same architectures (1000 classes).
TORCHVISION_PARAMS = {
    "vgg11": 132_863_336, "vgg16": 138_357_544, "vgg19": 143_667_240, "alexnet": 61_100_840,
    "resnet34": 21_797_672, "resnet50": 25_557_032, "resnet101": 44_549_160, "resnet152": 60_192_808,
    "wrn50-2": 68_883_240,
}


def _output_tensors(output: torch.Tensor | Mapping[str, Any]) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    return [value for value in output.values() if isinstance(value, torch.Tensor)]  # a HF ModelOutput


def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HF_MODELS else n
                                  for n in zoo_names()])
def test_tiny_model_runs_forward_and_backward(name):
    model, inputs = build(name, "tiny", batch=2)
    outputs = _output_tensors(model(*inputs))
    assert all(out.shape[0] == 2 and torch.isfinite(out).all() for out in outputs)
    # Every output enters the loss, so BERT's pooler gets a gradient too.
    sum((out.float().square().mean() for out in outputs), torch.zeros(())).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_builds_are_seeded_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    (first, x1), (second, x2) = build("resnet34"), build("resnet34")
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(x1[0], x2[0])
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))


@pytest.mark.parametrize("name,count", sorted(TORCHVISION_PARAMS.items()))
def test_full_size_matches_torchvision_parameter_count(name, count):
    with torch.device("meta"):
        model, inputs = build(name, "full")
    assert _params(model) == count
    assert inputs[0].shape == (1, *ZOO[name].input_shape)


def test_full_size_wide_and_recurrent_models_grow_as_the_papers_say():
    with torch.device("meta"):
        counts = {name: _params(build(name, "full")[0])
                  for name in ("resnet34", "wrn34-3", "rnn-3", "rnn-9", "amoebanet-d18", "amoebanet-d36")}
    # Widening every stage k-fold multiplies the convolutions' weights by about k^2.
    assert 8.5 < counts["wrn34-3"] / counts["resnet34"] < 9
    # Gillis: 2K-unit LSTM layers, up to 9 of them fit a 1.4 GB function.
    assert counts["rnn-3"] == 3 * 4 * 2048 * (2 * 2048 + 2)
    assert counts["rnn-9"] * 4 < 1.4e9
    # FuncPipe Table 1 (MiB): AmoebaNet-D18 476, D36 900; within 3%.
    assert counts["amoebanet-d18"] * 4 / 2 ** 20 == pytest.approx(476, rel=0.03)
    assert counts["amoebanet-d36"] * 4 / 2 ** 20 == pytest.approx(900, rel=0.03)


@pytest.mark.slow
def test_importing_the_zoo_does_not_import_transformers():
    code = "import sys, flatpack.zoo; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_paper_figures_name_their_source():
    for entry in ZOO.values():
        for figure in entry.paper:
            assert figure.source.split(" ")[0] in {"FuncPipe", "Gillis",
                                                   "Hydrozoa"}
            assert figure.table and figure.paper_name
    assert ZOO["resnet101"].paper[-1].activation_mib_per_sample == 198


@pytest.mark.parametrize("name,size,batch", [("resnet-9000", "tiny", 1), ("vgg16", "huge", 1),
                                             ("vgg16", "tiny", 0), ("vgg16", "tiny", True)])
def test_unknown_name_size_or_bad_batch_is_an_input_error_listing_the_choices(name, size, batch):
    with pytest.raises(InputError) as info:
        build(name, size, batch)
    message = str(info.value)
    if name not in ZOO:
        assert "vgg16" in message and "amoebanet-d18" in message
    elif size != "tiny":
        assert "tiny" in message and "full" in message


@pytest.mark.parametrize("name", [
    "resnet50",
    "amoebanet-d18",
    pytest.param("rnn-3", marks=pytest.mark.filterwarnings(
        "ignore:The tensor attributes .*_flat_weights")),  # nn.LSTM re-assigns them under torch.export
])
def test_tiny_model_compiles_into_two_equivalent_stages(name):
    model, inputs = build(name, "tiny", batch=2)
    compiled = assert_equivalent(model, inputs, stages=2, passes=ZOO[name].passes)
    assert compiled is not None and len(compiled.plan.stages) == 2


def test_amoebanet_keeps_a_cut_between_cells():
    """Two tensors cross between AmoebaNet cells; its pipeline keeps those cuts."""
    model, inputs = build("amoebanet-d18", "tiny", batch=2)
    default = flatpack.compile(model, inputs, stages=1)
    cells = flatpack.compile(model, inputs, stages=1, passes=ZOO["amoebanet-d18"].passes)
    assert cells.plan.num_layers >= 3 * default.plan.num_layers


@pytest.mark.filterwarnings("ignore:The tensor attributes .*_flat_weights")
@pytest.mark.parametrize("batch", [1, 2])
def test_stacked_lstms_stay_one_layer_each(batch):
    """Regression: the zero initial states (built from the batch size alone) and the unused
    final-state projections once glued every LSTM of RNN-k into one layer."""
    model, inputs = build("rnn-3", "tiny", batch=batch)
    compiled = assert_equivalent(model, inputs, stages=3)
    assert compiled is not None and compiled.plan.num_layers == 3


def test_no_model_name_is_defined_twice_across_the_examples_and_the_zoo():
    from flatpack import models
    from flatpack.examples import EXAMPLES

    assert not set(EXAMPLES) & set(ZOO)
    assert sorted(models.model_names()) == sorted([*EXAMPLES, *ZOO])
    gpt2, hf_gpt2 = models.find("gpt2"), models.find("hf-gpt2")
    assert gpt2 is not None and gpt2.origin == models.ZOO
    assert hf_gpt2 is not None and hf_gpt2.origin == models.EXAMPLE
    # a second definition of a registered name is refused, naming it
    with pytest.raises(InputError, match="'gpt2' is already registered"):
        models.MODELS.register("gpt2", lambda: hf_gpt2)
    with pytest.raises(InputError, match="'tiny-resnet' is already registered"):
        models.register_builtins(models.MODELS)


def test_the_cli_model_argument_resolves_through_the_one_registry():
    from flatpack import cli, models

    model, inputs = cli.load_factory("mlp")
    mlp = models.find("mlp")
    assert mlp is not None
    reference, reference_inputs = mlp.build()
    assert type(model) is type(reference)
    torch.testing.assert_close(model(*inputs), reference(*reference_inputs))
    model, inputs = cli.load_factory("alexnet")          # a zoo name, at the tiny size
    assert isinstance(inputs, tuple) and inputs[0].shape == build("alexnet", "tiny")[1][0].shape
    with pytest.raises(InputError, match="did you mean alexnet"):
        cli.load_factory("alexnett")
