"""Recomputation and mixed precision on the local backend and on gpu-container ranks (issue 22,
items 3 and 4), on a conv net (BatchNorm, dropout) and a small transformer (attention,
LayerNorm, dropout): a stage that recomputes its activations trains to the same weights as
one that keeps them, dropout included; a bf16 run over eight steps is single-process autocast
computed as the stages compute (``train_single_process(pipeline=compiled, threads=1)``: the
tensors crossing the cuts rounded, the workers' one intra-op thread) bit for bit, which the
verdict's float32 tolerances then hold while still failing a dropped micro-batch; an fp16 run
is ``torch.amp.GradScaler`` training, the skipped step after an overflow and the scale's
updates included, on every stage alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flatpack
from flatpack.analysis.reference import torch_threads, train_single_process
from flatpack.backends import local
from flatpack.stage import wire
from flatpack.stage.artifact import stage_manifest
from flatpack.verdict import compare_training, pipeline_optimizer_state

pytestmark = pytest.mark.slow

BATCH = 12
MICRO_BATCHES = 4
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
ADAM = {"name": "adam", "lr": 1e-3}
THREADS = 1      # the local functions' intra-op threads; a 16-bit reference computes with as many


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


class ResidualMLP(nn.Module):
    """Residual sums of the float32 input and bfloat16 linears stay float32 under autocast, so
    whatever a cut here carries is rounded on the wire (the transformer's and the conv net's
    cuts already carry bfloat16)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc in self.fcs:
            x = x + torch.relu(fc(x))
        return self.head(x)


class SkewedNet(nn.Module):
    """A convolution, then a head with small weights on large inputs: the head's weight
    gradient is 4096 times what the same net's would be, and nothing else's changes, so at a
    loss scale between the two only the last stage's gradients overflow float16."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(8, 5)
        with torch.no_grad():
            self.head.weight.div_(4096)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.conv(x)).mean(dim=(2, 3)))
        return self.head(h * 4096)


MODELS = {"conv": (ConvNet, (BATCH, 3, 8, 8)), "transformer": (Transformer, (BATCH, 5, 6)),
          "residual": (ResidualMLP, (BATCH, 6)), "skewed": (SkewedNet, (BATCH, 3, 8, 8))}


def make(name: str, dropout: float = 0.0, iterations: int = 2) -> tuple[nn.Module, list]:
    factory, shape = MODELS[name]
    torch.manual_seed(0)
    model = factory(dropout)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(*shape, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(iterations)]
    return model, data


def compiled_with(model: nn.Module, data: list, recompute: tuple[bool, bool]) -> flatpack.Compiled:
    base = flatpack.compile(model, (data[0][0],), stages=2)
    plan = dataclasses.replace(base.plan, micro_batches=MICRO_BATCHES, stages=tuple(
        dataclasses.replace(stage, recompute=flag) for stage, flag in zip(base.plan.stages, recompute)))
    return flatpack.compile(model, (data[0][0],), plan=plan)


def loss_scales(deployment, compiled) -> list[dict]:
    """Each stage's loss scaler (scale, clean steps) in the last checkpoint every stage took."""
    iteration = deployment.consistent_checkpoint()
    return [wire.loads(deployment.store.wait(deployment.keys.checkpoint(stage, iteration), 60))[1]["loss_scale"]
            for stage in range(len(compiled.artifacts))]


def train(s3_server, compiled, data, iterations: int, optimizer=SGD, **options):
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=iterations, optimizer=optimizer, **options)
        return result, pipeline_optimizer_state(deployment, compiled)


def assert_identical(parameters: dict[str, torch.Tensor], reference: nn.Module) -> None:
    for name, expected in reference.state_dict().items():
        torch.testing.assert_close(parameters[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("name", "precision"), [("conv", "fp32"), ("transformer", "bf16")])
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


def test_a_recomputing_run_equals_single_process_training(s3_server):
    model, data = make("conv")
    result, _ = train(s3_server, compiled_with(model, data, (True, False)), data, 2)
    reference, losses = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES)
    for key, expected in reference.state_dict().items():
        torch.testing.assert_close(result.parameters[key], expected, rtol=1e-4, atol=1e-5, msg=key)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)


STEPS = 8


@pytest.mark.parametrize(("name", "schedule", "optimizer"), [("conv", "sync", SGD), ("transformer", "1f1b", ADAM)])
def test_bf16_over_eight_steps_is_autocast_computed_as_the_stages_compute(s3_server, name, schedule, optimizer):
    """Eight steps: the verdict's checks pass at their float32 bounds, with the gradients (the
    optimizer state) within 1e-5 of the reference's, a hundredth of even the one-step bound
    (the sync schedule sums a micro-batch's gradients in another order: a few float32 ulps
    that do not grow); a run without autocast and a dropped micro-batch both fail them; the
    master weights and state stay float32, and each activation crosses the cut in half the
    bytes of float32."""
    model, data = make(name, iterations=STEPS)
    compiled = compiled_with(model, data, (False, False))
    run, run_state = train(s3_server, compiled, data, STEPS, optimizer, schedule=schedule, precision="bf16")
    reference_state: dict = {}
    reference, losses = train_single_process(model, data, STEPS, optimizer=optimizer, micro_batches=MICRO_BATCHES,
                                             optimizer_state=reference_state, precision="bf16", pipeline=compiled,
                                             threads=THREADS)
    initial = model.state_dict()
    checks, note = compare_training(reference, run.parameters, reference_state, run_state, optimizer, STEPS, "bf16",
                                    initial)
    report = "\n".join(check.line() for check in checks)
    assert not note and all(check.passed for check in checks), report
    assert next(check for check in checks if check.what.startswith("gradients")).worst <= 1e-5, report
    assert run.losses == pytest.approx(losses, rel=1e-6)
    assert all(tensor.dtype == torch.float32 for tensor in run.parameters.values() if tensor.is_floating_point())
    assert all(tensor.dtype == torch.float32 for entries in run_state.values() for tensor in entries.values())
    # what the bounds still catch: the same training without autocast, and one micro-batch of
    # four dropped (the first three micro-batches of each batch, their losses scaled by 1/3)
    for precision, dropped in (("fp32", False), ("bf16", True)):
        batches = [(x[:9], y[:9]) for x, y in data] if dropped else data
        wrong_state: dict = {}
        wrong_reference, _ = train_single_process(model, batches, STEPS, optimizer=optimizer,
                                                  micro_batches=3 if dropped else MICRO_BATCHES,
                                                  optimizer_state=wrong_state, threads=THREADS,
                                                  precision=precision, pipeline=compiled)
        checks, _ = compare_training(reference, wrong_reference.state_dict(), reference_state, wrong_state,
                                     optimizer, STEPS, "bf16", initial)
        assert not all(check.passed for check in checks), f"precision={precision} dropped={dropped}"
    # the wire: stage 0's activations in bfloat16, half of what they are in float32
    stage0 = compiled.stage_modules()[0]
    names = compiled.artifacts[1].manifest.input_names
    outputs = dict(zip(stage_manifest(stage0).output_names,
                       stage0(data[0][0][:BATCH // MICRO_BATCHES])))
    float32_bytes = sum(value.numel() * 4 for key, value in outputs.items()
                        if key in names and isinstance(value, torch.Tensor) and value.is_floating_point())
    uploads = [event.nbytes for event in run.events
               if event.kind == "upload" and event.stage == 0 and event.micro_batch is not None]
    assert uploads and all(nbytes < 0.5 * float32_bytes + 1024 for nbytes in uploads)   # + the safetensors header


def test_a_cut_carrying_float32_is_rounded_on_the_wire_in_the_reference_too(s3_server):
    """The residual stream stays float32 under autocast, so the cut rounds it to bfloat16:
    the reference computed through the stages with that rounding is the run bit for bit,
    the original module under autocast (no rounding at the cut) is not."""
    model, data = make("residual")
    compiled = compiled_with(model, data, (False, False))
    assert any(entry.dtype == "float32" for entry in compiled.artifacts[1].manifest.inputs
               if entry.name not in compiled.info.input_names)
    run, _ = train(s3_server, compiled, data, 2, precision="bf16")
    rounded, _ = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES, precision="bf16",
                                      pipeline=compiled, threads=THREADS)
    assert_identical(run.parameters, rounded)
    unrounded, _ = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES,
                                        precision="bf16", threads=THREADS)
    assert any(not torch.equal(run.parameters[key], value) for key, value in unrounded.state_dict().items())


GROWING = {"init_scale": 2.0 ** 12, "growth_interval": 2}     # the scale doubles every second clean step


def test_fp16_is_grad_scaler_training_with_the_same_scale_on_every_stage(s3_server):
    """Six steps of fp16 with a scale that grows: the weights, Adam's moments and the losses
    are those of single-process GradScaler training computed as the stages compute, and every
    stage's scaler ends where GradScaler's does."""
    model, data = make("transformer", iterations=6)
    compiled = compiled_with(model, data, (False, False))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        run = deployment.train(data, iterations=6, optimizer=ADAM, schedule="1f1b", precision="fp16",
                               loss_scaling=GROWING)
        run_state = pipeline_optimizer_state(deployment, compiled)
        scales = loss_scales(deployment, compiled)
    reference_state: dict = {}
    scaler: dict = {}
    reference, losses = train_single_process(model, data, 6, optimizer=ADAM, micro_batches=MICRO_BATCHES,
                                             optimizer_state=reference_state, precision="fp16", pipeline=compiled,
                                             threads=THREADS, loss_scaling=GROWING, scaler_state=scaler)
    assert scaler["scale"] > GROWING["init_scale"]       # it grew: the updates were exercised
    assert scales == [scaler] * 2
    assert_identical(run.parameters, reference)
    for key, entries in reference_state.items():
        for entry, expected in entries.items():
            torch.testing.assert_close(run_state[key][entry], expected, rtol=0, atol=0,
                                       msg=lambda text, entry=entry, key=key: f"{entry} of {key}: {text}")
    assert run.losses == losses
    assert all(tensor.dtype == torch.float32 for tensor in run.parameters.values() if tensor.is_floating_point())


def finite_gradients(compiled: flatpack.Compiled, batch: tuple, scale: float) -> list[bool]:
    """Per stage, whether one iteration's gradients of ``batch`` at loss scale ``scale`` are
    all finite under fp16, computed in process as the stages compute them."""
    staged = compiled.as_module()
    staged.wire_precision = "fp16"
    rows = BATCH // MICRO_BATCHES
    with torch_threads(THREADS):
        for m in range(MICRO_BATCHES):
            piece, target = batch[0][m * rows:(m + 1) * rows], batch[1][m * rows:(m + 1) * rows]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(staged(piece), target) * (rows / BATCH)
            (loss * scale).backward()
    return [all(bool(torch.isfinite(p.grad).all()) for p in stage.parameters() if p.grad is not None)
            for stage in staged.stages]


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage(s3_server):
    """At the smallest power-of-two loss scale where the first iteration overflows float16 on
    one stage and not on the other (found in process: the skewed net's last stage), one
    reduction tells every stage, so neither steps and each halves its scale; a second call
    resumes the scale from the checkpoints and trains on as GradScaler does in one process."""
    model, data = make("skewed", iterations=3)
    compiled = compiled_with(model, data, (False, False))
    scales = [2.0 ** power for power in range(8, 25)]
    found = {scale: finite_gradients(compiled, data[0], scale) for scale in scales}
    scale = next((scale for scale in scales if len(set(found[scale])) == 2), None)
    assert scale is not None, f"no scale overflows one stage alone: {found}"
    overflowing = {"init_scale": scale}
    initial = {name: tensor.detach().clone() for name, tensor in model.named_parameters()}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        skipped = deployment.train(data[:1], iterations=1, optimizer=SGD, precision="fp16", loss_scaling=overflowing)
        assert loss_scales(deployment, compiled) == [{"scale": scale / 2, "growth_tracker": 0}] * 2
        for name, expected in initial.items():
            assert torch.equal(skipped.parameters[name], expected), f"{name} stepped though a stage overflowed"
        run = deployment.train(data[1:], iterations=2, optimizer=SGD, precision="fp16", loss_scaling=overflowing,
                               batch_offset=1)
        stage_scales = loss_scales(deployment, compiled)
    scaler: dict = {}
    reference, _ = train_single_process(model, data, 3, optimizer=SGD, micro_batches=MICRO_BATCHES, precision="fp16",
                                        pipeline=compiled, threads=THREADS, loss_scaling=overflowing,
                                        scaler_state=scaler)
    assert scaler["scale"] < scale               # the reference skipped its first step too
    assert stage_scales == [scaler] * 2
    assert_identical(run.parameters, reference)
    assert any(not torch.equal(run.parameters[name], value) for name, value in initial.items())


def test_fp16_with_the_asynchronous_schedule_is_refused_before_any_function_starts(s3_server):
    from flatpack.errors import InputError

    model, data = make("conv")
    compiled = compiled_with(model, data, (False, False))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match=r"--precision fp16 skips a step.*use --precision bf16"):
            deployment.train(data, iterations=1, optimizer=SGD, schedule="1f1b-async", precision="fp16")
        assert not deployment.workers
    with pytest.raises(InputError, match=r"init_scale must be a positive, finite number, got -1"):
        deployment.train(data, iterations=1, optimizer=SGD, precision="fp16", loss_scaling={"init_scale": -1})
    with pytest.raises(InputError, match=r"loss_scaling has no setting scale; the settings are init_scale"):
        train_single_process(model, data, 1, precision="fp16", loss_scaling={"scale": 2.0})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_gpu_container_ranks_equal_single_process_autocast(precision):
    """The GPU-container runtime (here gloo ranks on the CPU with one thread each; the same code
    autocasts on CUDA): the run is the reference computed as the stages compute, fp16's loss
    scaling included."""
    from flatpack.backends import gpu_container

    model, data = make("transformer")
    compiled = compiled_with(model, data, (False, False))
    with gpu_container.deploy(compiled, backend="gloo") as deployment:
        result = deployment.train(data, iterations=2, optimizer=SGD, precision=precision, threads=THREADS,
                                  loss_scaling=GROWING)
    reference, losses = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES,
                                             precision=precision, pipeline=compiled, threads=THREADS,
                                             loss_scaling=GROWING)
    assert_identical({name: tensor.cpu() for name, tensor in result.parameters.items()}, reference)
    assert result.losses == pytest.approx(losses, rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: autocast on CUDA ranks")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_on_cuda_ranks_follows_the_cpu_reference(precision):
    """The same ranks autocasting on CUDA: other kernels than the CPU reference's round
    elsewhere, so no bitwise claim; the losses follow the reference's within 2e-2 over two
    iterations and the master weights stay float32."""
    from flatpack.backends import gpu_container

    model, data = make("transformer")
    compiled = compiled_with(model, data, (False, False))
    with gpu_container.deploy(compiled, backend="gloo", device="cuda") as deployment:
        result = deployment.train(data, iterations=2, optimizer=SGD, precision=precision)
    _, losses = train_single_process(model, data, 2, optimizer=SGD, micro_batches=MICRO_BATCHES, precision=precision,
                                     pipeline=compiled, threads=THREADS)
    assert result.losses == pytest.approx(losses, rel=2e-2)
    assert all(tensor.dtype == torch.float32 for tensor in result.parameters.values() if tensor.is_floating_point())


def test_gpu_container_ranks_recompute_as_the_plan_says_with_dropout():
    """A plan whose stages recompute runs on the ranks (``training.stage_backward``, the
    functions' own code): with dropout, the weights equal those of ranks that keep their
    activations, to the bit (the recomputed forward draws the micro-batch's masks again)."""
    from flatpack.backends import gpu_container

    model, data = make("conv", dropout=0.2)
    results = []
    for recompute in ((False, False), (True, True)):
        compiled = compiled_with(model, data, recompute)
        run = gpu_container.build_run(compiled, iterations=1, batch=BATCH, backend="gloo")
        assert [stage.recompute for stage in run.spec.stages] == list(recompute)
        with gpu_container.deploy(compiled, backend="gloo") as deployment:
            results.append(deployment.train(data, iterations=2, optimizer=SGD, schedule="1f1b", threads=THREADS))
    kept, again = results
    for key, expected in kept.parameters.items():
        torch.testing.assert_close(again.parameters[key], expected, rtol=0, atol=0, msg=key)
    assert again.losses == kept.losses


def test_flatpack_run_with_bf16_and_recompute_auto_trains_and_passes_its_verdict(tmp_path, capsys):
    import json

    from flatpack.cli import main

    out = tmp_path / "run"
    assert main(["run", "mlp", "--precision", "bf16", "--recompute", "auto", "--stages", "2", "--optimizer", "sgd",
                 "--iterations", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "equivalence with single-process training: passed" in printed
    assert "bf16 against the reference computed as the stages compute" in printed and "max|w - w0|" in printed
    stages = json.loads((out / "compiled" / "plan.json").read_text())["stages"]
    assert len(stages) == 2 and all("recompute" in stage for stage in stages)
    record = json.loads((out / "run.json").read_text())
    assert record["train_options"]["precision"] == "bf16"     # flatpack resume trains the same way
