"""Quantities several layers use are defined once and every layer asks the same place: the
stage directory name, the size units and the batch rules."""

from __future__ import annotations

import torch

from flatpack import units
from flatpack.backends import images
from flatpack.platform import catalog
from flatpack.batching import batch_rows, has_batch_dimension
from flatpack.stage.artifact import stage_dirname
from flatpack.partitioner.cost import common
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.workload import Workload
from flatpack.runtime import distributed, forkjoin, worker
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.spec import split_value


def test_every_layer_names_a_stage_directory_alike():
    assert stage_dirname(7) == "stage_007"
    assert RunKeys("run").artifacts(7) == f"run/artifacts/{stage_dirname(7)}/"
    assert RunKeys("run").artifact(7, "stage.py") == f"run/artifacts/{stage_dirname(7)}/stage.py"
    assert distributed.stage_path("ctx", 7).name == stage_dirname(7)
    assert distributed.parameters_file("out", 7).stem == stage_dirname(7)


def test_the_size_units_are_one_set():
    assert units.MIB == 2**20 and units.GIB == 2**30 and units.MB_S == 10**6
    for module in (catalog, images, worker, common):
        assert module.MIB is units.MIB, module.__name__


def test_the_batch_rule_decides_what_is_cut():
    batch = torch.arange(12.0).reshape(6, 2)
    mask = torch.ones(5)            # no batch dimension: the same for every piece
    assert has_batch_dimension(batch, 6) and not has_batch_dimension(mask, 6)
    assert not has_batch_dimension(torch.tensor(6.0), 6) and not has_batch_dimension(6, 6)
    assert batch_rows([mask.sum(), 3, batch]) == 6 and batch_rows([3, "x"]) is None
    pieces = split_value(batch, 6, 3)
    assert [piece.shape[0] for piece in pieces] == [2, 2, 2] and split_value(mask, 6, 3) == [mask] * 3
    parts = forkjoin.split_batch({"x": batch, "m": mask}, 3)
    assert all(part["m"] is mask for part in parts)
    joined = forkjoin.join_batch(parts, [2, 2, 2])
    assert torch.equal(joined["x"], batch) and joined["m"] is mask


def test_a_plan_runs_its_own_micro_batches_else_the_workload_s():
    plan = Plan.from_ranges([(0, 1), (2, 3)], 4, "test")
    assert plan.micro_batches_for(Workload("train", batch=8)) == 4     # the workload's default M
    assert plan.micro_batches_for(None) == 1
    chosen = Plan(plan.stages, plan.num_layers, micro_batches=2)
    assert chosen.micro_batches_for(Workload("train", batch=8)) == 2
