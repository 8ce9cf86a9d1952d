"""Recomputation and bf16 on the local backend (issue 22, items 3 and 4), on a conv net
(BatchNorm, dropout) and a small transformer (attention, LayerNorm, dropout): a stage that
recomputes its activations trains to the same weights and gradients as one that keeps
them, dropout included (and under bf16); a bf16 run equals single-process autocast with the same
micro-batches within the tolerance ``verdict.BF16_RTOL`` justifies, with float32 master
weights and optimizer state and half the bytes on the wire."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.runtime.reference import train_single_process
from flatpack.verdict import BF16_RTOL, compare_training, pipeline_optimizer_state

pytestmark = pytest.mark.slow

BATCH = 12
MICRO_BATCHES = 4
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


class ConvNet(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(dropout)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn1(self.conv1(x))))
        h = torch.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean(dim=(2, 3)))


class Transformer(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32, dropout=dropout, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


MODELS = {"conv": (ConvNet, (BATCH, 3, 8, 8)), "transformer": (Transformer, (BATCH, 5, 6))}


def make(name: str, dropout: float = 0.0) -> tuple[nn.Module, list]:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory(dropout)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(*shape, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(2)]
    return model, data


def compiled_with(model: nn.Module, data: list, recompute: tuple[bool, bool]) -> flatpack.Compiled:
    base = flatpack.compile(model, (data[0][0],), stages=2)
    plan = dataclasses.replace(base.plan, micro_batches=MICRO_BATCHES, stages=tuple(
        dataclasses.replace(stage, recompute=flag) for stage, flag in zip(base.plan.stages, recompute)))
    return flatpack.compile(model, (data[0][0],), plan=plan)


def train(s3_server, compiled, data, iterations: int, **options):
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=iterations, optimizer=SGD, **options)
        return result, pipeline_optimizer_state(deployment, compiled)


@pytest.mark.parametrize(("name", "precision"), [("conv", "fp32"), ("transformer", "fp32"), ("transformer", "bf16")])
def test_recomputing_stages_train_as_stages_that_keep_their_activations_with_dropout(s3_server, name, precision):
    model, data = make(name, dropout=0.2)
    kept, kept_state = train(s3_server, compiled_with(model, data, (False, False)), data, 2, schedule="1f1b",
                             precision=precision)
    again_plan = compiled_with(model, data, (True, True))
    assert [stage.recompute for stage in again_plan.plan.stages] == [True, True]
    again, again_state = train(s3_server, again_plan, data, 2, schedule="1f1b", precision=precision)
    # the recomputed forward draws the micro-batch's dropout masks again from the same seed
    # and runs the same kernels, and BatchNorm's running statistics move once: equal to the bit
    for key, expected in kept.parameters.items():
        torch.testing.assert_close(again.parameters[key], expected, rtol=0, atol=0, msg=key)
    for key, entries in kept_state.items():
        torch.testing.assert_close(again_state[key]["momentum_buffer"], entries["momentum_buffer"], rtol=0, atol=0,
                                   msg=key)
    assert again.losses == kept.losses


@pytest.mark.parametrize("name", ["conv", "transformer"])
def test_a_recomputing_run_equals_single_process_training(s3_server, name):
    model, data = make(name)
    result, _ = train(s3_server, compiled_with(model, data, (True, False)), data, 2)
    reference, losses = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES)
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(result.parameters[key], expected, rtol=1e-4, atol=1e-5, msg=key)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("name", ["conv", "transformer"])
def test_bf16_equals_single_process_autocast_with_float32_master_weights(s3_server, name):
    model, data = make(name)
    compiled = compiled_with(model, data, (False, False))
    fp32, _ = train(s3_server, compiled, data, 1)
    bf16, bf16_state = train(s3_server, compiled, data, 1, precision="bf16")
    reference_state: dict = {}
    reference, losses = train_single_process(model, data, 1, optimizer=SGD, micro_batches=MICRO_BATCHES,
                                             optimizer_state=reference_state, precision="bf16")
    initial = model.state_dict()
    checks, note = compare_training(reference, bf16.parameters, reference_state, bf16_state, SGD, 1, "bf16",
                                    initial)
    assert not note and all(check.passed for check in checks), "\n".join(check.line() for check in checks)
    assert bf16.losses == pytest.approx(losses, rel=BF16_RTOL)
    # master weights and optimizer state stay float32
    assert all(tensor.dtype == torch.float32 for key, tensor in bf16.parameters.items()
               if tensor.is_floating_point())
    assert all(entries["momentum_buffer"].dtype == torch.float32 for entries in bf16_state.values())
    # the tolerance tells autocast from float32: the float32 run's gradients are not within it
    fp32_state: dict = {}
    fp32_reference, _ = train_single_process(model, data, 1, optimizer=SGD, micro_batches=MICRO_BATCHES,
                                             optimizer_state=fp32_state)
    if name == "transformer":
        checks, _ = compare_training(reference, fp32_reference.state_dict(), reference_state, fp32_state, SGD, 1,
                                     "bf16", initial)
        assert not all(check.passed for check in checks)
    # boundary tensors on the wire in bfloat16: each activation stage 0 uploads has half the
    # bytes of the float32 run's (the safetensors header aside)
    def activation_bytes(result) -> list[int]:
        return [event.nbytes for event in result.events
                if event.kind == "upload" and event.stage == 0 and event.micro_batch is not None]

    for half, full in zip(activation_bytes(bf16), activation_bytes(fp32)):
        assert half < 0.6 * full


def test_bf16_on_gpu_container_ranks_equals_single_process_autocast():
    """The GPU-container runtime (here gloo ranks on the CPU; the same code autocasts on CUDA)."""
    from flatpack.backends import gpu_container

    model, data = make("transformer")
    compiled = compiled_with(model, data, (False, False))
    with gpu_container.deploy(compiled, backend="gloo") as deployment:
        result = deployment.train(data, iterations=1, optimizer=SGD, precision="bf16")
    reference, losses = train_single_process(model, data, 1, optimizer=SGD, micro_batches=MICRO_BATCHES,
                                             precision="bf16")
    parameters = {name: tensor.cpu() for name, tensor in result.parameters.items()}
    checks, note = compare_training(reference, parameters, {}, {}, SGD, 1, "bf16", model.state_dict())
    assert not note and all(check.passed for check in checks), "\n".join(check.line() for check in checks)
    assert result.losses == pytest.approx(losses, rel=BF16_RTOL)


def test_gpu_container_ranks_refuse_a_plan_that_recomputes():
    from flatpack.backends import gpu_container
    from flatpack.errors import InputError

    model, data = make("conv")
    with pytest.raises(InputError, match=r"stages \[1\] recompute their activations.*--recompute never"):
        gpu_container.build_run(compiled_with(model, data, (False, True)), iterations=1, batch=BATCH, backend="gloo")


def test_flatpack_run_with_bf16_and_recompute_auto_trains_and_passes_its_verdict(tmp_path, capsys):
    import json

    from flatpack.cli import main

    out = tmp_path / "run"
    assert main(["run", "mlp", "--precision", "bf16", "--recompute", "auto", "--stages", "2", "--optimizer", "sgd",
                 "--iterations", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "equivalence with single-process training: passed" in printed
    assert "bf16: boundary rounding" in printed and "max|w - w0|" in printed
    stages = json.loads((out / "compiled" / "plan.json").read_text())["stages"]
    assert len(stages) == 2 and all("recompute" in stage for stage in stages)
    record = json.loads((out / "run.json").read_text())
    assert record["train_options"]["precision"] == "bf16"     # flatpack resume trains the same way
