"""Pipelined training on the local backend: every stage replica is its own process and the
processes share nothing but the real local S3 server (the ``s3_server`` fixture). The
parameters after N iterations must equal single-process training on the same batches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import flatpack
from flatpack.analysis.reference import train_single_process
from flatpack.backends import functions, local
from flatpack.errors import FunctionOutOfMemory
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.elastic import doubling

pytestmark = pytest.mark.slow

BATCH = 12


class Net(nn.Module):
    """Linear layers with a residual branch and a carried side value (the mask), so that
    boundaries carry several tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        skip = h
        for index, layer in enumerate(self.hidden):
            h = torch.tanh(layer(h))
            if index == 1:
                h = h + skip
        return self.out(h)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(count)]


def compiled_with(model: nn.Module, stages: list[tuple[int, int]], replicas: list[int], micro_batches: int,
                  memory_mb: int | None = None) -> flatpack.Compiled:
    base = flatpack.compile(model, (torch.randn(BATCH, 8),), stages=len(stages))
    layers = base.plan.num_layers
    ranges = _fit_ranges(stages, layers)
    plan = Plan(tuple(StagePlan(start, end, memory_mb, d) for (start, end), d in zip(ranges, replicas)), layers,
                micro_batches=micro_batches)
    return flatpack.compile(model, (torch.randn(BATCH, 8),), plan=plan)


def _fit_ranges(stages: list[tuple[int, int]], layers: int) -> list[tuple[int, int]]:
    """Stage ranges given as fractions of the chain (start, end in 0..100)."""
    cuts = sorted({min(layers - 2, max(0, round(end / 100 * layers) - 1)) for _, end in stages[:-1]})
    return Plan.from_cuts(cuts, layers).ranges


def assert_same_parameters(result: local.TrainResult, reference: nn.Module) -> None:
    for name, expected in reference.state_dict().items():
        assert name in result.parameters, f"{name} missing from the run's checkpoints"
        torch.testing.assert_close(result.parameters[name], expected, rtol=1e-4, atol=1e-5, msg=name)


def run_and_compare(s3_server, compiled, data, iterations, optimizer, **options) -> local.TrainResult:
    model = make_model()
    reference, losses = train_single_process(model, data, iterations, optimizer=optimizer)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=iterations, optimizer=optimizer, **options)
    assert_same_parameters(result, reference)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    return result


# 2 stages of one replica each with SGD and momentum, sync: test_recovery.py trains that plan against
# the same single-process reference (parameters and losses), a stage replayed on the way
@pytest.mark.parametrize(("stages", "replicas", "micro_batches", "optimizer", "schedule"), [
    ([(0, 34), (34, 67), (67, 100)], [2, 2, 2], 4, {"name": "adam", "lr": 0.01}, "sync"),
    ([(0, 50), (50, 100)], [3, 3], 6, {"name": "sgd", "lr": 0.1, "momentum": 0.9}, "1f1b"),
    ([(0, 50), (50, 100)], [3, 3], 3, {"name": "adam", "lr": 0.01}, "sync"),
    ([(0, 34), (34, 67), (67, 100)], [1, 2, 3], 6, {"name": "adam", "lr": 0.01}, "1f1b"),
])
def test_pipelined_training_equals_single_process(s3_server, stages, replicas, micro_batches, optimizer, schedule):
    compiled = compiled_with(make_model(), stages, replicas, micro_batches)
    result = run_and_compare(s3_server, compiled, batches(3), 3, optimizer, schedule=schedule,
                             sync="pipelined" if replicas[0] != 3 else "lambdaml")
    kinds = {event.kind for event in result.events}
    assert {"forward", "backward", "upload", "download", "update"} <= kinds
    if max(replicas) > 1:
        assert "sync" in kinds


def test_killed_worker_resumes_from_checkpoint(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [2, 2], 4)
    kill = {"stage": 1, "replica": 1, "iteration": 2, "at": "backward", "action": "kill"}
    result = run_and_compare(s3_server, compiled, batches(4), 4, {"name": "sgd", "lr": 0.1, "momentum": 0.9},
                             faults=[kill])
    lost = [restart for restart in result.restarts if restart.reason == "lost"]
    assert [(r.worker, r.iteration) for r in lost] == [("s1r1", 2)]


def test_function_reinvokes_itself_near_its_time_limit(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2)
    slow = [{"stage": s, "replica": 0, "iteration": 0, "at": "start", "action": "sleep", "seconds": 2.5}
            for s in (0, 1)]
    result = run_and_compare(s3_server, compiled, batches(3), 3, "adam", time_limit_s=2.0, faults=slow)
    assert any(restart.reason == "time limit" for restart in result.restarts)


def test_straggler_is_relaunched_and_reported(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [2, 2], 4)
    sleepy = {"stage": 0, "replica": 1, "iteration": 1, "at": "forward", "action": "sleep", "seconds": 60}
    result = run_and_compare(s3_server, compiled, batches(3), 3, "sgd", faults=[sleepy], straggler_ratio=3.0)
    stragglers = [restart for restart in result.restarts if restart.reason == "straggler"]
    assert [(r.worker, r.iteration) for r in stragglers] == [("s0r1", 1)]
    assert "s0r1 straggled in iteration 1" in stragglers[0].describe()


def test_elastic_scaling_changes_degrees_between_epochs(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 4)
    # one iteration per epoch: each epoch still starts new functions at the new degrees and
    # hands them the weights and Adam state of the last one
    result = run_and_compare(s3_server, compiled, batches(3), 3, "adam", elastic=doubling(max_replicas=3),
                             epoch_iterations=1)
    assert result.degrees == [(1, 1), (2, 2), (3, 3)]


def test_function_over_its_memory_tier_fails_with_stage_and_excess(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2, memory_mb=1024)
    ballast = {"stage": 1, "replica": 0, "iteration": 0, "at": "forward", "action": "allocate", "bytes": 1200 << 20}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(FunctionOutOfMemory) as caught:
            deployment.train(batches(2), iterations=2, faults=[ballast])
    error = caught.value
    assert (error.stage, error.replica) == (1, 0)
    assert error.limit_bytes == 1024 << 20 and error.over_bytes > 100 << 20
    assert "stage 1 replica 0 ran out of memory" in str(error) and "MB over" in str(error)
    # the suggestion is one of the platform's tiers, holding the measured peak with headroom
    suggested = functions.memory_suggestion_mb(error.peak_bytes, functions.platform_tiers_mb(compiled))
    assert suggested in functions.platform_tiers_mb(compiled) and suggested << 20 >= error.peak_bytes
    assert f"--memory {suggested}" in str(error)


def test_fork_join_inference_equals_the_model(s3_server):
    model = make_model().eval()
    base = flatpack.compile(model, (torch.randn(BATCH, 8),), stages=3)
    plan = dataclasses.replace(base.plan, stages=tuple(
        dataclasses.replace(stage, replicas=r) for stage, r in zip(base.plan.stages, (1, 3, 2))))
    compiled = flatpack.compile(model, (torch.randn(BATCH, 8),), plan=plan)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        for seed in range(3):
            x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(deployment.infer(x), model(x))
        assert deployment.last_latency_s is not None


class ReturnsItsLoss(nn.Module):
    """A model that returns its own scalar loss (as HuggingFace models given labels do)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).pow(2).mean()


def test_a_model_that_returns_its_own_scalar_loss_trains_as_in_one_process(s3_server):
    torch.manual_seed(0)
    model = ReturnsItsLoss()
    base = flatpack.compile(model, (torch.randn(BATCH, 8),), stages=2)
    plan = dataclasses.replace(base.plan, micro_batches=4, stages=tuple(
        dataclasses.replace(stage, replicas=2) for stage in base.plan.stages))
    compiled = flatpack.compile(model, (torch.randn(BATCH, 8),), plan=plan)
    data = [(x, None) for x, _ in batches(2)]
    optimizer = {"name": "sgd", "lr": 0.1}
    reference, losses = train_single_process(model, data, 2, optimizer=optimizer, loss="output")
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=2, optimizer=optimizer, loss="output")
    assert_same_parameters(result, reference)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-6)
