"""Train and eval mode follow the staged module, as they follow the original.

A model is compiled in one mode; its staged module (``Compiled.as_module()`` and the
artifacts read back by ``flatpack.load``) is switched with ``.train()`` / ``.eval()`` and
compared with the original switched the same way. Dropout draws from the global RNG in the
same order in the stages as in the original (one process, same ops in graph order), so
train-mode outputs are compared under the same seed, exactly.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flatpack
from flatpack.compiler import StagedModule
from flatpack.ir.trace import ModeWarning


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean((2, 3)))


class DropoutMLP(nn.Module):
    """nn.Dropout modules and a functional dropout that reads ``self.training``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(torch.relu(self.fc1(x)))
        x = F.dropout(torch.relu(self.fc2(x)), 0.5, self.training)
        return self.fc3(x)


class DropPath(nn.Module):
    """timm-style stochastic depth: a Python branch on ``self.training``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(0.8)
        return x * keep / 0.8


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop_path = DropPath()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x + self.drop_path(torch.relu(self.fc(x))))


def _staged(model: nn.Module, inputs, tmp_path, how: str, **kwargs) -> StagedModule:
    compiled = flatpack.compile(model, inputs, **kwargs)
    if how == "as_module":
        return compiled.as_module()
    return flatpack.load(compiled.save(tmp_path / "out")).as_module()


def _call(module: nn.Module, inputs, seed: int = 7):
    torch.manual_seed(seed)
    out = module(**inputs) if isinstance(inputs, dict) else module(inputs)
    return getattr(out, "logits", out)


def _check_mode(original: nn.Module, staged: nn.Module, inputs, training: bool) -> None:
    original.train(training)
    staged.train(training)
    assert staged.training is training
    torch.testing.assert_close(_call(staged, inputs), _call(original, inputs), rtol=0, atol=0)


def _check_running_stats(original: nn.Module, staged: StagedModule) -> None:
    buffers = dict(original.named_buffers())
    checked = 0
    for name, tensor in staged.named_original_parameters():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")) and name in buffers:
            torch.testing.assert_close(tensor, buffers[name], rtol=0, atol=0, msg=f"{name} differs")
            checked += 1
    assert checked, "no running statistics were compared"


@pytest.mark.parametrize("how", ["as_module", "load"])
@pytest.mark.parametrize("compiled_training", [True, False], ids=["compiled-train", "compiled-eval"])
def test_conv_batchnorm_switches_mode_and_tracks_running_stats(how, compiled_training, tmp_path):
    torch.manual_seed(0)
    model = ConvBN().train(compiled_training)
    x = torch.randn(4, 3, 8, 8)
    staged = _staged(model, x, tmp_path, how, stages=2)
    assert staged.training is compiled_training, "a staged module starts in the mode it was compiled in"
    original = copy.deepcopy(model)
    # the other mode first, then back: eval must use the running statistics, train must
    # normalize with the batch's and update the running statistics exactly as the original
    for training in (not compiled_training, compiled_training, True, False):
        _check_mode(original, staged, x, training)
        _check_running_stats(original, staged)


@pytest.mark.parametrize("how", ["as_module", "load"])
@pytest.mark.parametrize("compiled_training", [True, False], ids=["compiled-train", "compiled-eval"])
def test_dropout_mlp_switches_mode(how, compiled_training, tmp_path):
    torch.manual_seed(0)
    model = DropoutMLP().train(compiled_training)
    x = torch.randn(8, 16)
    staged = _staged(model, x, tmp_path, how, stages=2)
    original = copy.deepcopy(model)
    for training in (not compiled_training, compiled_training):
        _check_mode(original, staged, x, training)
    staged.train()
    assert not torch.equal(_call(staged, x, seed=1), _call(staged, x, seed=2)), "train mode drops out"
    staged.eval()
    assert torch.equal(_call(staged, x, seed=1), _call(staged, x, seed=2)), "eval mode is deterministic"


def test_emitted_stage_reads_self_training(tmp_path):
    model = DropoutMLP().train()
    compiled = flatpack.compile(model, torch.randn(8, 16), stages=1)
    source = compiled.artifacts[0].source
    assert "training = self.training" in source
    assert "training = True" not in source and "training = False" not in source
    assert [line for line in source.splitlines() if line.startswith(("import ", "from "))] == ["import torch"]
    assert compiled.artifacts[0].manifest.training is True
    assert compiled.artifacts[0].manifest.mode_fixed == ()


def test_branch_on_training_is_reported_and_documented_in_the_manifest(tmp_path):
    torch.manual_seed(0)
    model = Residual().train()
    x = torch.randn(4, 16)
    with pytest.warns(ModeWarning, match=r"drop_path.*DropPath"):
        compiled = flatpack.compile(model, x, stages=2)
    assert any("drop_path" in entry for entry in compiled.info.mode_fixed or ())
    assert all(any("drop_path" in entry for entry in artifact.manifest.mode_fixed)
               for artifact in compiled.artifacts)
    staged = compiled.as_module()
    with pytest.warns(ModeWarning, match="drop_path"):
        staged.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        staged.train()  # back to the compiled mode: nothing to warn about
        flatpack.compile(DropoutMLP().train(), torch.randn(8, 16), stages=2)  # all switchable: no warning


# HuggingFace models -------------------------------------------------------------------------

def _t5():
    from flatpack.examples import _transformers

    tf = _transformers()
    torch.manual_seed(0)
    config = tf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, use_cache=False)
    ids = torch.randint(0, 128, (2, 8))
    return tf.T5ForConditionalGeneration(config).eval(), {"input_ids": ids, "decoder_input_ids": ids}


def _bart():
    from flatpack.examples import _transformers

    tf = _transformers()
    torch.manual_seed(0)
    config = tf.BartConfig(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                           decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False)
    ids = torch.randint(3, 128, (2, 8))
    return tf.BartForConditionalGeneration(config).eval(), {"input_ids": ids, "decoder_input_ids": ids}


def _factory(name: str):
    from flatpack import examples

    return {"bert": examples.bert, "resnet": examples.hf_resnet, "t5": _t5, "bart": _bart}[name]


@pytest.mark.slow
@pytest.mark.parametrize("name,compiled_training", [
    ("bert", True), ("bert", False), ("resnet", True), ("resnet", False), ("t5", True), ("bart", True),
])
def test_hf_models_switch_mode(name, compiled_training, tmp_path):
    pytest.importorskip("transformers")
    model, inputs = _factory(name)()
    model.train(compiled_training)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeWarning)
        compiled = flatpack.compile(model, inputs, stages=3)
    assert compiled.frontend == "export"
    original = copy.deepcopy(model)
    for staged in (compiled.as_module(), flatpack.load(compiled.save(tmp_path / "out")).as_module()):
        reference = copy.deepcopy(original)
        for training in (not compiled_training, compiled_training):
            _check_mode(reference, staged, inputs, training)
        if name == "resnet":
            _check_running_stats(reference, staged)


class TwinBN(nn.Module):
    """One BatchNorm called twice, on a dict input (so torch.export traces it): the two
    step-counter increments are chained in the exported graph."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_a = nn.Conv2d(3, 4, 3, 1, 1, bias=False)
        self.conv_b = nn.Conv2d(3, 4, 1, 1, 0, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, batch: dict) -> torch.Tensor:
        x = batch["x"]
        return torch.relu(self.bn(self.conv_a(x)) + self.bn(self.conv_b(x)))


@pytest.mark.parametrize("compiled_training", [True, False], ids=["compiled-train", "compiled-eval"])
def test_batchnorm_called_twice_switches_mode_on_the_export_path(compiled_training, tmp_path):
    torch.manual_seed(0)
    model = TwinBN().train(compiled_training)
    inputs = ({"x": torch.randn(4, 3, 6, 6)},)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeWarning)
        compiled = flatpack.compile(model, inputs, stages=1)
    assert compiled.frontend == "export"
    staged, original = compiled.as_module(), copy.deepcopy(model)
    for training in (not compiled_training, compiled_training, not compiled_training):
        original.train(training)
        staged.train(training)
        torch.testing.assert_close(staged(*inputs), original(*inputs), rtol=0, atol=0)
        _check_running_stats(original, staged)


@pytest.mark.slow
def test_loaded_stage_switches_mode_in_a_fresh_interpreter(tmp_path):
    """The emitted mode switch needs nothing beyond torch and flatpack's loader."""
    import subprocess
    import sys
    from pathlib import Path

    torch.manual_seed(0)
    model = ConvBN().train()
    x = torch.randn(4, 3, 8, 8)
    out = flatpack.compile(model, x, stages=1).save(tmp_path / "out")
    torch.save({"x": x}, tmp_path / "x.pt")
    model.eval()
    expected = model(x)
    child = (
        "import sys, torch\n"
        "from flatpack.codegen import load_stage\n"
        f"stage = load_stage({str(out / 'stage_000')!r})\n"
        "assert stage.training\n"
        f"x = torch.load({str(tmp_path / 'x.pt')!r})['x']\n"
        f"torch.save(stage.eval()(x)[0], {str(tmp_path / 'y.pt')!r})\n"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", child], check=True, cwd=tmp_path,
                   env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    torch.testing.assert_close(torch.load(tmp_path / "y.pt"), expected, rtol=0, atol=0)


def test_batchnorm_traced_in_eval_mode_keeps_its_shared_statistics_in_one_layer():
    """Switched to train mode, both calls of one BatchNorm update its running statistics in
    order: the chain of an eval-mode trace keeps them in one layer, as a train-mode trace does,
    so no two stages hold diverging copies of the statistics."""
    model = TwinBN().eval()
    compiled = flatpack.compile(model, ({"x": torch.randn(4, 3, 6, 6)},), stages=1, passes=[])
    layer_of = {node: index for index, layer in enumerate(compiled.chain["layers"]) for node in layer["nodes"]}
    assert layer_of["batch_norm"] == layer_of["batch_norm_1"]
