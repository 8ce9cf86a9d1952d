"""The practitioner's training knobs on pipelined local functions (issue 22, items 1, 2, 5):
an optimizer and schedule named as data (AdamW, weight decay off for biases and norms, a
cosine schedule after a warm-up), global-norm gradient clipping across stages, gradient
accumulation and evaluation through the inference path. Each is held to single-process
training with the same micro-batching (``train_single_process`` applies the same knobs the
way torch does in one process), on a conv model and a transformer, and under a replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import flatpack
from flatpack.analysis.reference import call, train_single_process
from flatpack.backends import local
from flatpack.evaluation import evaluate
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec

pytestmark = pytest.mark.slow

BATCH = 8


class ConvNet(nn.Module):
    """Convolutions with BatchNorm (1-d weights the no-decay group takes) and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)   # BatchNorm follows: a bias would only hold noise
        self.norm1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x)))
        h = torch.relu(self.conv2(h)) + h
        return self.head(h.mean(dim=(2, 3)))


class TinyTransformer(nn.Module):
    """Token embedding, two pre-norm encoder layers (LayerNorm, attention, MLP), a classifier."""

    def __init__(self, vocab: int = 32, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h).mean(dim=1))


def conv_case() -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 3, 6, 6, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(6)]
    return ConvNet(), data


def transformer_case() -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    data = [(torch.randint(0, 32, (BATCH, 6), generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(6)]
    return TinyTransformer(), data


def compiled_with(model: nn.Module, example: torch.Tensor, replicas: list[int],
                  micro_batches: int) -> flatpack.Compiled:
    base = flatpack.compile(model, (example,), stages=len(replicas))
    plan = Plan(tuple(StagePlan(stage.start, stage.end, None, degree)
                      for stage, degree in zip(base.plan.stages, replicas)), base.plan.num_layers,
                micro_batches=micro_batches)
    return flatpack.compile(model, (example,), plan=plan)


# clip at a norm the gradients exceed, so that clipping changes the result (checked below)
KNOBS = OptimizerSpec("adamw", lr=0.02, options={"weight_decay": 0.1, "betas": (0.9, 0.95)},
                      no_decay_bias_norm=True, schedule=ScheduleSpec("cosine", {"T_max": 2}, warmup=1),
                      clip_grad_norm=0.05, accumulate=2)


def assert_same_parameters(result: local.TrainResult, reference: nn.Module) -> None:
    for name, expected in reference.state_dict().items():
        assert name in result.parameters, f"{name} missing from the run's checkpoints"
        if name.endswith("in_proj_bias"):
            # attention's key bias has a zero gradient in exact arithmetic (softmax ignores a
            # shift), so Adam turns rounding noise into full steps there (verdict.py); the
            # query and value biases are compared
            width = expected.numel() // 3
            expected, got = torch.cat([expected[:width], expected[2 * width:]]), torch.cat(
                [result.parameters[name][:width], result.parameters[name][2 * width:]])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=name)
            continue
        torch.testing.assert_close(result.parameters[name], expected, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("case", "replicas", "schedule"), [
    (conv_case, [1, 1], "sync"),
    (transformer_case, [2, 2], "1f1b"),
])
def test_named_optimizer_schedule_clipping_and_accumulation_equal_single_process(s3_server, case, replicas,
                                                                                  schedule):
    model, data = case()
    compiled = compiled_with(model, data[0][0], replicas, micro_batches=4)
    assert len(compiled.plan.stages) == 2
    reference, losses = train_single_process(model, data, 6, optimizer=KNOBS, micro_batches=4)
    unclipped, _ = train_single_process(model, data, 6, optimizer=dataclasses.replace(KNOBS, clip_grad_norm=None),
                                        micro_batches=4)
    # the knobs matter: without clipping the same run ends elsewhere
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(reference.parameters(), unclipped.parameters()))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=6, optimizer=KNOBS, schedule=schedule)
        evaluated = evaluate(deployment.infer, data[:2], "cross_entropy", iteration=6)
    assert_same_parameters(result, reference)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    expected = evaluate(lambda inputs: call(reference.eval(), inputs), data[:2], "cross_entropy", iteration=6)
    assert evaluated.samples == expected.samples == 2 * BATCH
    assert evaluated.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-5)
    assert evaluated.accuracy == pytest.approx(expected.accuracy)


def test_a_lost_stage_mid_accumulation_replays_to_the_same_weights(s3_server):
    """Killed after its backward in the second iteration of an accumulation (iteration 3),
    stage 1 replica 1 restarts from the checkpoint after iteration 2 (checkpoint_every=1),
    which holds iteration 2's accumulated gradients and the schedule's position; it replays
    iteration 3, the clipping reduction included, to the weights of the uninterrupted run."""
    model, data = transformer_case()
    compiled = compiled_with(model, data[0][0], [2, 2], micro_batches=4)
    # 4 iterations: two accumulated steps, the kill in the second half of the second
    reference, _ = train_single_process(model, data, 4, optimizer=KNOBS, micro_batches=4)
    kill = {"stage": 1, "replica": 1, "iteration": 3, "at": "backward", "action": "kill"}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data[:4], iterations=4, optimizer=KNOBS, faults=[kill])
    assert [(r.worker, r.iteration) for r in result.restarts if r.reason == "lost"] == [("s1r1", 3)]
    assert_same_parameters(result, reference)


def test_a_second_call_continues_the_schedule_and_the_accumulation(s3_server):
    """Three calls of 3, 1 and 2 iterations (an accumulation split between calls) train as one
    call of 6: the schedule's steps and the accumulated gradients travel in the checkpoints."""
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    reference, _ = train_single_process(model, data, 6, optimizer=KNOBS, micro_batches=2)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        offset = 0
        for length in (3, 1, 2):
            result = deployment.train(data[offset:offset + length], iterations=length, optimizer=KNOBS,
                                      batch_offset=offset)
            offset += length
    assert_same_parameters(result, reference)


def test_flatpack_run_trains_with_the_knobs_and_reports_held_out_loss_and_accuracy(tmp_path, capsys):
    """The command line end to end: --eval-fraction holds out whole shards, --eval-every
    trains in calls of N iterations with the held-out loss and accuracy after each (progress
    line and report), and the verdict holds the run to the reference with the same knobs."""
    from safetensors.torch import save_file

    from flatpack.cli import main

    shards = tmp_path / "shards"
    shards.mkdir()
    generator = torch.Generator().manual_seed(4)
    for index in range(4):
        save_file({"x": torch.randn(8, 64, generator=generator),
                   "target": torch.randint(0, 10, (8,), generator=generator)},
                  str(shards / f"part-{index}.safetensors"))
    # evaluations after 3 and 6 iterations: the second call begins mid-accumulation
    code = main(["run", "mlp", "--data", str(shards), "--eval-fraction", "0.25", "--eval-every", "3", "--batch", "8",
                 "--micro-batches", "2", "--replicas", "1", "--stages", "2", "--epochs", "2", "--optimizer", "adamw",
                 "--optimizer-args", "lr=3e-3,weight_decay=0.01", "--no-decay-bias-norm", "--schedule-lr", "cosine",
                 "--warmup", "1", "--clip-grad-norm", "0.5", "--accumulate", "2", "--out", str(tmp_path / "run")])
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out
    # 3 training shards x 8 rows / batch 8 x 2 epochs = 6 iterations; the 4th shard is held out
    # (what the run narrates goes to the flatpack logger, on stderr)
    assert "3 batches of 8 per epoch, 6 iterations" in captured.err
    for iteration in (3, 6):
        assert f"evaluation after {iteration} iterations on 8 held-out samples: loss" in out
    # the progress line (stderr) carries the last evaluation
    assert "eval loss" in captured.err and "acc" in captured.err
    assert "held-out evaluation (through the inference path): iter 3: loss" in out
    assert "equivalence with single-process training: passed" in out
    assert "AdamW(lr=0.003, weight_decay=0.01), no decay on biases and norms, cosine schedule after 1 warm-up" in out


def test_an_evaluated_run_stopped_mid_call_resumes_every_remaining_call_to_the_same_weights(tmp_path, capsys):
    """`flatpack run --eval-every 2` trains as calls of 2 iterations; stopped by SIGTERM in
    its second call, `flatpack resume` finishes that call and trains the iterations of the
    calls it had not begun, ending with the uninterrupted run's weights bit for bit (the
    schedule's steps and the accumulation travel in the checkpoints)."""
    import json

    from flatpack.cli import main
    from tests.helpers import assert_same_weights, flatpack_process, stop_with_sigterm, wait_for_output

    arguments = ["run", "mlp", "--batch", "8", "--micro-batches", "2", "--iterations", "6", "--replicas", "1",
                 "--stages", "2", "--checkpoint-every", "1", "--no-verify", "--eval-every", "2",
                 "--optimizer", "adamw", "--schedule-lr", "cosine", "--warmup", "1", "--clip-grad-norm", "0.5",
                 "--accumulate", "2"]
    assert main([*arguments, "--out", str(tmp_path / "whole")]) == 0
    stopped, log_path = tmp_path / "stopped", tmp_path / "stopped.log"
    with flatpack_process([*arguments, "--out", str(stopped)], log_path) as runner:
        wait_for_output(runner, log_path, "iter 3/6")
        stop_with_sigterm(runner)
    assert "evaluation after 2 iterations" in log_path.read_text(errors="replace")
    capsys.readouterr()
    assert main(["resume", str(stopped)]) == 0
    assert "training the run's last 2 iterations" in capsys.readouterr().err   # the logger's narration
    assert json.loads((stopped / "run.json").read_text())["state"] == "done"
    assert_same_weights(tmp_path / "whole" / "trained.safetensors", stopped / "trained.safetensors")


class TiedNet(nn.Module):
    """An embedding whose weight is also the output layer's (a language model's tied head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))).mean(dim=1))


def test_a_tied_weight_on_two_stages_counts_once_in_the_global_norm(s3_server):
    """The tied weight lives on both stages, each holding the summed gradient; counted twice,
    the global norm would be too large and the clipped step too small."""
    torch.manual_seed(0)
    model = TiedNet()
    generator = torch.Generator().manual_seed(6)
    data = [(torch.randint(0, 32, (BATCH, 5), generator=generator), torch.randint(0, 32, (BATCH,), generator=generator))
            for _ in range(3)]
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    holders = {entry.name for artifact in compiled.artifacts for entry in artifact.manifest.parameters
               if entry.shared_with}
    assert holders, "the tied weight is held by both stages"
    spec = OptimizerSpec("sgd", lr=0.5, clip_grad_norm=0.05)
    reference, _ = train_single_process(model, data, 3, optimizer=spec, micro_batches=2)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=3, optimizer=spec)
    # the run checkpoints a tied weight once; the reference's state_dict names it twice
    from flatpack.weights import with_aliases

    assert_same_parameters(dataclasses.replace(result, parameters=with_aliases(compiled, result.parameters)),
                           reference)


def test_gpu_container_ranks_apply_the_knobs_as_single_process():
    """The gpu-container runtime (gloo ranks on 127.0.0.1, 3 stages x (2, 1, 2) replicas, a
    weight tied between the first two stages): AdamW with the no-decay group, a cosine
    schedule after a warm-up, clipping through one float64 all-reduce, and accumulation with
    the replicas reducing once per step."""
    from flatpack.backends import gpu_container
    from tests.integration.test_gpu_container import assert_matches_reference, batches as skip_batches
    from tests.integration.test_gpu_container import compiled_with as gpu_compiled
    from tests.integration.test_gpu_container import make_model as skip_model

    data = skip_batches(4)
    spec = dataclasses.replace(KNOBS, schedule=ScheduleSpec("cosine", {"T_max": 1}, warmup=1))
    reference, losses = train_single_process(skip_model(), data, 4, optimizer=spec, micro_batches=4)
    unclipped, _ = train_single_process(skip_model(), data, 4, optimizer=dataclasses.replace(spec, clip_grad_norm=None),
                                        micro_batches=4)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(reference.parameters(), unclipped.parameters()))
    with gpu_container.deploy(gpu_compiled((2, 1, 2), micro_batches=4), backend="gloo") as deployment:
        result = deployment.train(data, iterations=4, optimizer=spec)
    assert_matches_reference(result, reference, losses)


def test_a_call_with_another_optimizer_continues_the_weights_with_a_fresh_state(s3_server):
    """A second call may change the optimizer: AdamW's checkpoint (two parameter groups)
    gives SGD its weights, not its state; and its lr is the call's own."""
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    first = OptimizerSpec("adamw", lr=0.02, no_decay_bias_norm=True, options={"weight_decay": 0.1})
    second = OptimizerSpec("sgd", lr=0.05)
    after_first, _ = train_single_process(model, data[:2], 2, optimizer=first, micro_batches=2)
    reference, _ = train_single_process(after_first, data[2:4], 2, optimizer=second, micro_batches=2)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        deployment.train(data[:2], iterations=2, optimizer=first)
        result = deployment.train(data[2:4], iterations=2, optimizer=second)
    assert_same_parameters(result, reference)


def test_a_huggingface_transformer_trains_with_adamw_cosine_warmup_clipping_and_bf16(tmp_path, capsys):
    """The README's training-knobs command on the HuggingFace BERT example (synthetic batches
    here instead of shards): AdamW without decay on biases and norms, a cosine schedule after
    a warm-up, global-norm clipping and bf16 train, report the held-out loss, and equal the
    single-process autocast reference computed as the stages compute."""
    from flatpack.cli import main

    code = main(["run", "bert", "--eval-every", "2", "--batch", "8", "--micro-batches", "2", "--stages", "2",
                 "--replicas", "1", "--iterations", "4", "--optimizer", "adamw", "--optimizer-args",
                 "lr=3e-4,weight_decay=0.01", "--no-decay-bias-norm", "--schedule-lr", "cosine", "--warmup", "1",
                 "--clip-grad-norm", "1.0", "--precision", "bf16", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out evaluation (through the inference path): iter 2: loss" in out
    assert "equivalence with single-process training: passed" in out
    assert "AdamW(lr=0.0003, weight_decay=0.01), no decay on biases and norms, cosine schedule after 1 warm-up" in out
