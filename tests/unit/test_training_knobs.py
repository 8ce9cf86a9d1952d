"""The training knobs as plain data (issue 22, items 1, 2, 5), without processes: any
``torch.optim`` optimizer and schedule by name, refused before launch with the valid names
and options; no weight decay on biases and norms as torch's two groups; a schedule restored
from a step count; global-norm clipping through a store equal to ``clip_grad_norm_``;
accumulation as a larger batch; the cost model's optimizer state; the run options. The
pipelined equivalence tests are tests/integration/test_training_knobs.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from flatpack import cli
from flatpack.analysis.reference import train_single_process
from flatpack.errors import InputError
from flatpack.evaluation import evaluate
from flatpack.job import JobOptions
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.workload import Workload
from flatpack.runtime import clipping
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec, packed_positions, parse_options
from flatpack.runtime.store import FileStore


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def data(count: int, rows: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(rows, 6, generator=generator), torch.randint(0, 3, (rows,), generator=generator))
            for _ in range(count)]


# -- optimizers and schedules by name -------------------------------------------------------------

@pytest.mark.parametrize(("name", "cls"), [("adamw", torch.optim.AdamW), ("AdamW", torch.optim.AdamW),
                                           ("rmsprop", torch.optim.RMSprop), ("nadam", torch.optim.NAdam),
                                           ("adagrad", torch.optim.Adagrad)])
def test_any_torch_optimizer_is_built_by_name_with_its_options(name, cls):
    spec = OptimizerSpec(name, lr=3e-4, options={"weight_decay": 0.01})
    optimizer = spec.build(small_model().parameters())
    assert type(optimizer) is cls
    assert optimizer.param_groups[0]["lr"] == 3e-4 and optimizer.param_groups[0]["weight_decay"] == 0.01
    # plain data on the wire: the JSON round trip is the same spec
    import json

    assert OptimizerSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


def test_sgd_keeps_momentum_09_unless_told_and_flat_options_are_options():
    assert OptimizerSpec("sgd").build(small_model().parameters()).param_groups[0]["momentum"] == 0.9
    plain = OptimizerSpec.of({"name": "sgd", "lr": 0.1, "momentum": 0})
    assert plain.options == {"momentum": 0} and plain.build(small_model().parameters()).param_groups[0]["momentum"] == 0


@pytest.mark.parametrize(("make", "words"), [
    (lambda: OptimizerSpec("lamb"), r"'lamb' is not known.*the optimizers are: adadelta.*adamw.*sgd"),
    (lambda: OptimizerSpec.of({"name": "adamw", "weight_dacay": 0.1}),
     r"'weight_dacay' \(did you mean 'weight_decay'\?\).*its options are: lr, betas, eps, weight_decay"),
    (lambda: OptimizerSpec("adam", options={"betas": (1.5, 0.9)}), "refused its options.*beta"),
    (lambda: OptimizerSpec("lbfgs"), "cannot step as a pipeline steps it.*closure"),
    (lambda: OptimizerSpec("adam", lr=-1), "learning rate must be positive"),
    (lambda: OptimizerSpec("adam", clip_grad_norm=0), "--clip-grad-norm must be a positive"),
    (lambda: OptimizerSpec("adam", accumulate=0), "--accumulate must be a number of iterations >= 1"),
    (lambda: ScheduleSpec("cosin"), r"schedule 'cosin' is not known; did you mean 'cosine'\?.*the schedules are"),
    (lambda: ScheduleSpec("reducelronplateau"), "cannot be named: it steps on a validation metric"),
    (lambda: ScheduleSpec("lambdalr"), "cannot be named: it takes a Python function"),
    (lambda: ScheduleSpec("cosine", warmup=-2), "--warmup must be a number of steps >= 0"),
    (lambda: OptimizerSpec("adam", schedule=ScheduleSpec("step", {"step_sise": 3})),
     r"'step_sise' \(did you mean 'step_size'\?\) is not known; its options are: step_size, gamma"),
])
def test_bad_names_and_options_are_refused_with_the_valid_ones(make, words):
    with pytest.raises(InputError, match=words):
        make()


def test_options_parse_as_python_literals():
    assert parse_options("lr=3e-4, betas=(0.9,0.95),amsgrad=True,anneal_strategy=cos", "--optimizer-args") == {
        "lr": 3e-4, "betas": (0.9, 0.95), "amsgrad": True, "anneal_strategy": "cos"}
    assert parse_options("", "--optimizer-args") == {}
    with pytest.raises(InputError, match="--optimizer-args: 'weight_decay' is not KEY=VALUE"):
        parse_options("lr=1,weight_decay", "--optimizer-args")


def test_no_decay_bias_norm_is_torchs_two_groups():
    """Biases and LayerNorm weights (fewer than 2 dims) go without weight decay, exactly as
    two hand-made torch groups; the checkpoint keys state by the parameter's own position."""
    spec = OptimizerSpec("adamw", lr=0.05, options={"weight_decay": 0.5}, no_decay_bias_norm=True)
    ours, theirs = small_model(), small_model()
    mine = spec.build(ours.parameters())
    params = list(theirs.parameters())
    torch_groups = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                                      {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                     lr=0.05, weight_decay=0.5)
    for model, optimizer in ((ours, mine), (theirs, torch_groups)):
        for inputs, target in data(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), target).backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert [group["weight_decay"] for group in mine.param_groups] == [0.5, 0.0]
    # the decay group comes first, so the state's packed order is not the parameters' order
    positions = packed_positions(mine, list(ours.parameters()))
    assert positions == [0, 2, 3, 4, 1, 5]     # weights 0 and 4 first, then the biases and norms


def test_a_schedule_restored_from_its_step_count_continues_bit_identically():
    spec = OptimizerSpec("adamw", lr=0.1, schedule=ScheduleSpec("cosine", warmup=3).with_length(12))
    rates = spec.learning_rates(12)
    assert rates[0] == pytest.approx(0.1 / 4) and rates[2] == pytest.approx(0.3 / 4) and rates[3] == pytest.approx(0.1)
    assert rates[4:] == sorted(rates[4:], reverse=True) and rates[-1] < 0.01
    probe = nn.Parameter(torch.zeros(2))
    optimizer = spec.build([probe])
    scheduler = spec.build_schedule(optimizer)
    assert scheduler is not None
    for _ in range(5):
        probe.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    saved = copy.deepcopy(optimizer.state_dict())
    restored_optimizer = spec.build([nn.Parameter(torch.zeros(2))])
    restored_optimizer.load_state_dict(saved)
    restored = spec.restore_schedule(restored_optimizer, 5)
    assert restored is not None
    for step in range(5, 12):
        assert restored_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] == rates[step]
        for opt, sched in ((optimizer, scheduler), (restored_optimizer, restored)):
            opt.step()
            sched.step()


# -- global-norm clipping -----------------------------------------------------------------------

def test_global_norm_through_the_store_equals_clip_grad_norm(tmp_path):
    """Three 'stages' each holding some parameters publish their squared norms; each derives
    the same global norm and scales its own gradients: what clip_grad_norm_ does to all."""
    model, whole = small_model(), small_model()
    inputs, target = data(1)[0]
    for each in (model, whole):
        nn.functional.cross_entropy(each(inputs), target).backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.1)
    params = list(model.parameters())
    stages = [params[:2], params[2:4], params[4:]]
    store, keys = FileStore(tmp_path), RunKeys("run")
    own = [clipping.squared_norm(p.grad for p in group) for group in stages]
    for index in range(3):       # replica 0 of every stage publishes
        store.put(keys.grad_norm(7, index), __import__("struct").pack("<d", own[index]))
    norms = [clipping.global_norm(store, keys, 7, index, 3, 1, own[index], timeout_s=5) for index in range(3)]
    assert float(expected_norm) > 0.1          # the limit binds
    assert norms[0] == norms[1] == norms[2]
    assert norms[0] == pytest.approx(float(expected_norm), rel=1e-6)
    for index, group in enumerate(stages):
        clipping.scale_gradients(group, clipping.clip_coefficient(norms[index], 0.1))
    for mine, theirs in zip(model.parameters(), whole.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-9)
    # below the limit nothing changes, as in torch
    assert clipping.clip_coefficient(0.05, 0.1) == 1.0
    assert keys.iteration_of(keys.grad_norm(7, 0)) == 7     # the invoker deletes it once iteration 7 is covered


# -- accumulation and evaluation ------------------------------------------------------------------

def test_accumulating_k_batches_is_training_on_their_union():
    """--accumulate 2 over batches of 8 equals one step per batch of 16 (a mean loss, no
    BatchNorm): the effective batch is K times larger."""
    model = small_model()
    small = data(4)
    union = [(torch.cat([small[i][0], small[i + 1][0]]), torch.cat([small[i][1], small[i + 1][1]]))
             for i in (0, 2)]
    spec = OptimizerSpec("sgd", lr=0.5, options={"momentum": 0.9}, clip_grad_norm=0.3)
    accumulated, losses = train_single_process(model, small, 4, optimizer=dataclasses.replace(spec, accumulate=2),
                                               micro_batches=2)
    large, _ = train_single_process(model, union, 2, optimizer=spec, micro_batches=4)
    for a, b in zip(accumulated.parameters(), large.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert len(losses) == 4     # each batch's own mean loss


def test_evaluation_is_the_mean_loss_and_accuracy_over_samples():
    model = small_model().eval()
    batches = data(2) + data(1, rows=4)
    found = evaluate(model, batches, "cross_entropy", iteration=5)
    inputs = torch.cat([b[0] for b in batches])
    target = torch.cat([b[1] for b in batches])
    with torch.no_grad():
        output = model(inputs)
    assert found.samples == 20 and found.iteration == 5
    assert found.loss == pytest.approx(float(nn.functional.cross_entropy(output, target)), rel=1e-6)
    assert found.accuracy == pytest.approx(float((output.argmax(-1) == target).float().mean()))
    assert "eval loss" in found.short() and "acc" in found.short()
    assert evaluate(model, [(b[0], b[0][:, :3]) for b in batches], "mse", iteration=5).accuracy is None


# -- the cost model -------------------------------------------------------------------------------

def test_optimizer_state_bytes_follow_the_optimizer_chosen():
    assert OptimizerSpec("adamw").state_factor() == 2.0
    assert OptimizerSpec("sgd").state_factor() == 1.0                       # momentum 0.9
    assert OptimizerSpec("sgd", options={"momentum": 0}).state_factor() == 0.0
    assert OptimizerSpec("adagrad").state_factor() == 1.0
    from tests.unit.test_cost_models import MIB, TWO_STAGES, problem

    for factor in (0.0, 1.0, 2.0):
        work = Workload("train", batch=8, micro_batches=4, optimizer="sgd", optimizer_state_factor=factor)
        cost = funcpipe.iteration(problem(work), TWO_STAGES)
        assert cost.stages[0].memory.optimizer == int(factor * 150 * MIB)     # layers 0-1: 150 MiB trainable
    with pytest.raises(InputError, match="optimizer_state_factor must be >= 0"):
        Workload("train", batch=8, micro_batches=4, optimizer_state_factor=-1.0)


# -- the run options ------------------------------------------------------------------------------

def test_job_options_make_the_spec_with_the_schedule_running_to_the_end():
    options = JobOptions.of(optimizer="adamw", optimizer_args={"lr": 3e-4, "weight_decay": 0.01}, schedule_lr="cosine",
                         warmup=2, clip_grad_norm=1.0, accumulate=2, iterations=20, no_decay_bias_norm=True)
    options.check()
    spec = options.optimizer_spec()
    assert spec == OptimizerSpec("adamw", 3e-4, {"weight_decay": 0.01}, True,
                                 ScheduleSpec("cosine", {"T_max": 8}, 2), 1.0, 2)
    schedule = JobOptions.of(warmup=3, iterations=10).optimizer_spec().schedule
    assert schedule is not None and schedule.name == "constant"
    whole = OptimizerSpec("adamw", clip_grad_norm=1.0)
    assert JobOptions.of(optimizer=whole).optimizer_spec() is whole
    with pytest.raises(InputError, match="holds warmup, clip_grad_norm itself"):
        JobOptions.of(optimizer=whole, warmup=2, clip_grad_norm=0.5).optimizer_spec()


@pytest.mark.parametrize("args, words", [
    (["--optimizer", "lamb"], "'lamb' is not known"),
    (["--optimizer", "adamw", "--optimizer-args", "lr=1e-3,weight_dacay=0.1"], "did you mean 'weight_decay'"),
    (["--optimizer-args", "lr"], "--optimizer-args: 'lr' is not KEY=VALUE"),
    (["--schedule-lr", "plateau"], "schedule 'plateau' is not known"),
    (["--schedule-args", "gamma=0.5"], "--schedule-args apply to --schedule-lr NAME"),
    (["--schedule-lr", "cosine", "--warmup", "4", "--iterations", "4"], "--warmup 4 is not shorter than"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a positive"),
    (["--accumulate", "0"], "--accumulate must be a number of iterations >= 1"),
    (["--accumulate", "3", "--iterations", "4"], "--iterations 4 is not a multiple of --accumulate 3"),
    (["--eval-every", "-1"], "--eval-every must be"),
    (["--eval-fraction", "0.2", "--eval-every", "2"], "--eval-fraction holds out a share of --data"),
    (["--eval-data", "held/"], "--eval-data and --eval-fraction apply to --eval-every N"),
    (["--eval-every", "2", "--eval-fraction", "1.5"], "--eval-fraction must be in"),
])
def test_bad_knobs_exit_2_before_the_model_is_built(args, words, capsys, monkeypatch, tmp_path):
    def never(*_a, **_k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "load_factory", never)
    code = cli.main(["run", "mlp", "--out", str(tmp_path / "out"), *args])
    error = capsys.readouterr().err
    assert code == 2 and words in error, error


# -- held-out data ---------------------------------------------------------------------------------

def shard_directory(root, count: int, target=lambda g: torch.randint(0, 10, (8,), generator=g)):
    from safetensors.torch import save_file

    root.mkdir()
    generator = torch.Generator().manual_seed(5)
    for index in range(count):
        save_file({"x": torch.randn(8, 64, generator=generator), "target": target(generator)},
                  str(root / f"part-{index}.safetensors"))
    return root


def test_eval_fraction_holds_out_whole_shards_and_the_record_keeps_the_split(tmp_path):
    from flatpack.data import ShardDirectory, ShardSource, source_from_json, split_shards

    source = ShardDirectory(shard_directory(tmp_path / "shards", 4))
    training, held = split_shards(source, 0.25)
    assert training.names() == ["part-0.safetensors", "part-1.safetensors", "part-2.safetensors"]
    assert held.names() == ["part-3.safetensors"] and "held out: 1 of its shards" in held.describe()
    record = training.to_json()
    assert record is not None, "the training side of a split is recorded by name"
    again = source_from_json(record)
    assert isinstance(again, ShardSource)
    assert again.names() == training.names() and again.describe() == training.describe()
    with pytest.raises(InputError, match="leaving none to train on"):
        split_shards(ShardDirectory(shard_directory(tmp_path / "one", 1)), 0.5)


def test_held_out_data_scored_with_another_loss_is_refused_before_launch(tmp_path):
    from flatpack.examples import mlp
    from flatpack.job import evaluation_batches

    model, example = mlp()
    held = shard_directory(tmp_path / "held", 1, target=lambda g: torch.randn(8, 10, generator=g))
    options = JobOptions.of(batch=8, eval_every=2, eval_data=str(held))
    with pytest.raises(InputError, match="would be scored with mse but the run trains with cross_entropy"):
        evaluation_batches(model, example, options, "cross_entropy")
    good = shard_directory(tmp_path / "good", 2)
    assert len(evaluation_batches(model, example, options.with_changes(eval_data=str(good)),
                                  "cross_entropy")) == 2


def test_a_record_of_the_old_sgd_or_adam_spec_still_loads():
    old = {"name": "adam", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    assert OptimizerSpec.from_json(old) == OptimizerSpec("adam", 0.01, {"betas": [0.9, 0.999], "eps": 1e-8,
                                                                         "weight_decay": 0.0})
    sgd = OptimizerSpec.from_json({**old, "name": "sgd"})
    assert sgd.options == {"momentum": 0.9, "weight_decay": 0.0}
