"""The equivalence verdict of flatpack run: the reference trains with the run's micro-batches,
tolerances follow from the optimizer, and a planted bug fails."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import flatpack
from flatpack.analysis.reference import train_single_process
from flatpack.errors import InputError
from flatpack.verdict import Verdict, adam_step_bound, adam_weight_bound, compare_training
from tests.unit.narrowing import problem_of


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def _batches(count: int = 2) -> list:
    generator = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 6, generator=generator),), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(count)]


def _train(optimizer: str, micro_batches: int = 4):
    state: dict = {}
    trained, _ = train_single_process(_model(), _batches(), 2, optimizer=optimizer, loss="cross_entropy",
                                      micro_batches=micro_batches, optimizer_state=state)
    return trained, state


def test_reference_accumulates_the_micro_batches_with_their_own_batch_statistics():
    model, batches = _model(), _batches(1)
    manual = copy.deepcopy(model).train()
    opt = torch.optim.SGD(manual.parameters(), lr=0.01, momentum=0.9)
    inputs, target = batches[0]
    for piece, part in zip(torch.tensor_split(inputs[0], 4), torch.tensor_split(target, 4)):
        (nn.functional.cross_entropy(manual(piece), part) * (len(part) / 8)).backward()
    opt.step()
    trained, _ = train_single_process(model, batches, 1, optimizer="sgd", micro_batches=4)
    full, _ = train_single_process(model, batches, 1, optimizer="sgd", micro_batches=1)
    for name, tensor in manual.state_dict().items():
        assert torch.allclose(trained.state_dict()[name].float(), tensor.float(), atol=1e-7), name
    # BatchNorm over micro-batches is not BatchNorm over the whole batch: the old reference differs
    assert not torch.allclose(full.state_dict()["1.running_mean"], manual.state_dict()["1.running_mean"])


def test_fixed_buffers_keep_the_running_statistics_of_micro_batches_another_replica_ran():
    model, batches = _model(), _batches(1)
    trained, _ = train_single_process(model, batches, 1, optimizer="sgd", micro_batches=4,
                                      fixed_buffers=lambda m: {"1.running_mean", "1.running_var",
                                                               "1.num_batches_tracked"} if m % 2 else set())
    assert int(trained.state_dict()["1.num_batches_tracked"]) == 2


def test_identical_runs_are_equivalent_and_a_planted_bug_fails():
    for optimizer in ("sgd", "adam"):
        reference, reference_state = _train(optimizer)
        run, run_state = _train(optimizer)
        parameters = {name: tensor.clone() for name, tensor in run.state_dict().items()}
        checks, note = compare_training(reference, parameters, reference_state, run_state, optimizer, 2)
        assert not note and all(check.passed for check in checks), [c.line() for c in checks]
        # one weight moved by 1.0: far outside Adam's step bound (2·lr·Σc_t ≈ 0.04)
        planted = dict(parameters)
        planted["3.weight"] = planted["3.weight"].clone()
        planted["3.weight"][0, 0] += 1.0
        checks, _ = compare_training(reference, planted, reference_state, run_state, optimizer, 2)
        failed = [check for check in checks if not check.passed]
        assert [check.what for check in failed] == ["weights"] and failed[0].where == "3.weight"
        # gradients off by a dropped micro-batch (3/4 of them): the optimizer state check fails
        wrong = {name: {key: value * 0.75 for key, value in entries.items()} for name, entries in run_state.items()}
        checks, _ = compare_training(reference, parameters, reference_state, wrong, optimizer, 2)
        assert any(not check.passed and check.what.startswith("gradients") for check in checks)


def test_a_missing_parameter_is_not_equivalent():
    reference, state = _train("sgd")
    parameters = {name: tensor for name, tensor in reference.state_dict().items() if name != "0.bias"}
    _, note = compare_training(reference, parameters, state, state, "sgd", 2)
    assert "0.bias" in note


def test_adam_bound_is_one_step_of_lr_at_the_first_step_and_grows_with_the_steps():
    assert abs(adam_step_bound((0.9, 0.999), 1) - 1.0) < 1e-12
    # the bound holds for any gradients: check it against Adam on adversarial sequences
    torch.manual_seed(0)
    for _ in range(20):
        param = nn.Parameter(torch.zeros(64))
        opt = torch.optim.Adam([param], lr=0.1)
        for step in range(1, 6):
            before = param.detach().clone()
            param.grad = torch.randn(64) * torch.logspace(-6, 3, 64)[torch.randperm(64)]
            opt.step()
            assert float((param.detach() - before).abs().max()) <= 0.1 * adam_step_bound((0.9, 0.999), step) + 1e-7
    assert adam_weight_bound(0.01, (0.9, 0.999), 3) > adam_weight_bound(0.01, (0.9, 0.999), 1)


def test_the_verdict_names_what_it_covered():
    one = Verdict(True, 1, (2,), 4, 3, "adam")
    assert "no pipeline cut was exercised" in one.describe()
    two = Verdict(True, 2, (1, 2), 4, 3, "adam", dropouts=3, seeded=True)
    text = two.describe()
    assert "equivalent (2 stages, replicas 1,2, 4 micro-batches, 3 iterations, adam)" in text
    assert "dropout on (p > 0 in 3 modules): the reference ran the compiled stages seeded" in text
    assert "no random draws in train mode" in one.describe()
    assert "equivalent" not in Verdict(None, 2, (1, 1), 4, 3, "sgd", note="random").describe().replace(
        "equivalence", "")
    assert "FAILED: not equivalent" in Verdict(False, 2, (1, 1), 4, 3, "sgd").describe()


def test_balanced_plans_get_memory_tiers_before_costing():
    import flatpack
    from flatpack.examples import mlp
    from flatpack.profiler import ProfileOptions
    from flatpack.partitioner.solvers.wrappers import solver_for
    from flatpack.partitioner.cost import funcpipe
    from flatpack.partitioner.workload import Workload

    model, example = mlp()
    compiled = flatpack.compile(model, example, target="local", solver=solver_for("balanced"),
                                workload=Workload("train", batch=16, micro_batches=4),
                                profile=ProfileOptions(batch_sizes=(2, 4), repeats=1))
    assert all(stage.memory_mb for stage in compiled.plan.stages)
    assert funcpipe.iteration(problem_of(compiled), compiled.plan).iteration_s > 0


def test_the_seeded_reference_draws_the_same_masks_every_time_and_others_than_the_unseeded_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4))
    compiled = flatpack.compile(model, (torch.randn(8, 8),), stages=2)
    data = [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(2)]
    state_before = torch.random.get_rng_state()
    first, losses = train_single_process(model, data, 2, micro_batches=2, pipeline=compiled, seeded=True)
    again, losses_again = train_single_process(model, data, 2, micro_batches=2, pipeline=compiled, seeded=True)
    assert torch.equal(torch.random.get_rng_state(), state_before)     # the caller's generator untouched
    assert losses == losses_again
    for (name, value), other in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.equal(value, other), name
    _, unseeded = train_single_process(model, data, 2, micro_batches=2, pipeline=compiled)
    assert unseeded != losses        # the seeds decide the masks: a reference without them draws others


def test_seeding_needs_the_compiled_stages():
    with pytest.raises(InputError, match="pass the compiled model as pipeline"):
        train_single_process(nn.Linear(2, 2), [(torch.randn(2, 2), torch.randn(2, 2))], 1, loss="mse", seeded=True)
