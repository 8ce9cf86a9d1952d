"""PipeDream's asynchronous 1F1B with weight stashing (issue 22, item 6) on local functions:
each micro-batch's backward computes on exactly the weights its forward used (versions
recorded in process), and a run's weights equal the single-process simulation of the same
asynchronous schedule (``train_async_single_process``), with and without vertical sync, on a
conv model and a transformer, across calls, under a replay, and refused where it does not
combine, before any function starts."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.codegen.artifact import build_module
from flatpack.errors import InputError
from flatpack.runtime import wire
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.lanes import Lanes
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.reference import train_async_single_process, train_single_process
from flatpack.runtime.spec import Role, RunSpec, split_value, stage_specs
from flatpack.runtime.stashing import forward_version
from flatpack.runtime.store import FileStore
from flatpack.runtime.timeline import Recorder
from flatpack.runtime.training import TARGET, StageTrainer, pack_values
from tests.integration.test_training_knobs import assert_same_parameters, compiled_with, conv_case, transformer_case

pytestmark = pytest.mark.slow

ADAM = OptimizerSpec("adam", lr=0.02)


def stage_of(compiled: flatpack.Compiled) -> dict[str, int]:
    """Each parameter's stage, by original name (the stages' manifests)."""
    return {entry["name"]: artifact.index for artifact in compiled.artifacts for entry in artifact.manifest["parameters"]}


@pytest.mark.parametrize(("case", "stages", "vertical_sync"), [
    (conv_case, 2, False),
    (transformer_case, 3, False),
    (transformer_case, 3, True),
])
def test_async_run_equals_the_single_process_simulation_of_the_same_schedule(s3_server, case, stages, vertical_sync):
    model, data = case()
    compiled = compiled_with(model, data[0][0], [1] * stages, micro_batches=4)
    assert len(compiled.plan.stages) == stages
    simulated, losses = train_async_single_process(model, data, 6, stage_of=stage_of(compiled), stages=stages,
                                                   micro_batches=4, optimizer=ADAM, vertical_sync=vertical_sync)
    # the schedule matters: flushed training on the same batches ends elsewhere
    flushed, _ = train_single_process(model, data, 6, optimizer=ADAM, micro_batches=4)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(simulated.parameters(), flushed.parameters()))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=6, optimizer=ADAM, schedule="1f1b-async",
                                  vertical_sync=vertical_sync)
    assert_same_parameters(result, simulated)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
