"""``analysis.restage``: a training state read from one plan's stage checkpoints, written for
other cuts and read back, is the same state, entry by entry and by parameter name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatpack
from flatpack.analysis.restage import TrainingState, gather, stage_checkpoint
from flatpack.errors import RunFailure
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec
from flatpack.runtime.training import checkpoint_bytes, stage_tensors

SPEC = OptimizerSpec("adamw", 0.01, {"weight_decay": 0.1}, no_decay_bias_norm=True,
                     schedule=ScheduleSpec("step", {"step_size": 1, "gamma": 0.5}), accumulate=2)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def compiled_for(cuts: list[int]) -> flatpack.Compiled:
    torch.manual_seed(0)
    model, example = Small(), (torch.randn(2, 4),)
    layers = flatpack.compile(model, example, stages=1).plan.num_layers
    plan = Plan(tuple(StagePlan(start, end) for start, end in Plan.from_cuts(cuts, layers).ranges), layers)
    return flatpack.compile(model, example, plan=plan)


def trained_checkpoints(compiled: flatpack.Compiled, iteration: int) -> list[bytes]:
    """Each stage's checkpoint after two real AdamW steps on random gradients (the group split
    by dimensions differs per stage), with a gradient accumulated since."""
    generator = torch.Generator().manual_seed(3)
    checkpoints = []
    for module in compiled.stage_modules():
        state, trainable = stage_tensors(module)
        optimizer = SPEC.build(trainable.values())
        schedule = SPEC.build_schedule(optimizer)
        for _ in range(2):
            for param in trainable.values():
                param.grad = torch.randn(param.shape, generator=generator)
            optimizer.step()
            if schedule is not None:
                schedule.step()
        accumulated = {name: torch.randn(param.shape, generator=generator) for name, param in trainable.items()}
        checkpoints.append(checkpoint_bytes(iteration, state, trainable, optimizer, accumulated, 2, 1, None))
    return checkpoints


def manifests(compiled: flatpack.Compiled) -> list:
    return [artifact.manifest for artifact in compiled.artifacts]


def assert_same_state(found: TrainingState, expected: TrainingState) -> None:
    assert (found.iteration, found.steps, found.accumulated_count, found.optimizer_class, found.loss_scale) == (
        expected.iteration, expected.steps, expected.accumulated_count, expected.optimizer_class, expected.loss_scale)
    assert found.weights.keys() == expected.weights.keys()
    for name, tensor in expected.weights.items():
        assert torch.equal(found.weights[name], tensor), name
    assert found.optimizer.keys() == expected.optimizer.keys()
    for name, entries in expected.optimizer.items():
        assert found.optimizer[name].keys() == entries.keys(), name
        for key, value in entries.items():
            assert torch.equal(torch.as_tensor(found.optimizer[name][key]), torch.as_tensor(value)), (name, key)
    assert found.group_settings == expected.group_settings
    assert found.accumulated.keys() == expected.accumulated.keys()
    for name, grad in expected.accumulated.items():
        assert torch.equal(found.accumulated[name], grad), name


def test_a_state_moved_onto_other_cuts_reads_back_the_same():
    two, three = compiled_for([1]), compiled_for([0, 1])
    assert len(two.plan.stages) == 2 and len(three.plan.stages) == 3
    state = gather(trained_checkpoints(two, 5), manifests(two), SPEC)
    assert state.steps == 2 and state.iteration == 5
    # the learning rate the schedule reached and the no-decay group's settings travel by name
    assert {settings["weight_decay"] for settings in state.group_settings.values()} == {0.0, 0.1}
    assert {settings["lr"] for settings in state.group_settings.values()} == {0.0025}
    moved = [stage_checkpoint(state, manifest, SPEC) for manifest in manifests(three)]
    assert_same_state(gather(moved, manifests(three), SPEC), state)


def test_checkpoints_of_different_iterations_are_refused():
    two = compiled_for([1])
    first, second = trained_checkpoints(two, 5)[0], trained_checkpoints(two, 6)[1]
    with pytest.raises(RunFailure, match="iteration 5 .stage 0. vs 6 .stage 1."):
        gather([first, second], manifests(two), SPEC)


def test_a_state_without_a_stage_weight_is_refused():
    two = compiled_for([1])
    state = gather(trained_checkpoints(two, 5), manifests(two), SPEC)
    del state.weights["a.weight"]
    with pytest.raises(RunFailure, match="a.weight"):
        stage_checkpoint(state, manifests(two)[0], SPEC)
