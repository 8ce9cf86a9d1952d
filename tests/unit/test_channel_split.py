"""Gillis's channel split (``stage/channels.py``, ``ir/channels.py``, ``runtime/channel_split.py``): every group the
planner can split by channel, run as p partitions in this process and joined as the master
joins them, gives the model's outputs; the planner's table and the runtime's analysis agree
on which groups split; and too many partitions are refused, naming the layer."""

from __future__ import annotations

import functools
from typing import cast

import pytest
import torch

import flatpack
from flatpack.errors import PlanError
from flatpack.ir.channels import ChannelGroup
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.partitioner.workload import Workload
from flatpack.runtime import channel_split
from flatpack.stage.channels import channel_ranges
from tests.models import ConvBlocks, TinyTransformer
from tests.unit.narrowing import graph_of, problem_of

PARTS = (2, 3, 4)
SERVE = Workload("infer", batch=2, micro_batches=1)
CASES = {
    "conv": (ConvBlocks, lambda batch: torch.randn(batch, 3, 6, 6)),
    "transformer": (TinyTransformer, lambda batch: torch.randn(batch, 5, 8)),
}


@functools.cache
def model_of(case):
    torch.manual_seed(0)
    return CASES[case][0]().eval()


def sample(case, batch):
    return CASES[case][1](batch)


@functools.cache
def compiled_as(case, ranges=None):
    """The model compiled with these stages, or as one stage with the planner's channel
    table (cached: the transformer's export takes seconds)."""
    model = model_of(case)
    example = (sample(case, 2),)
    if ranges is None:
        return flatpack.compile(model, example, stages=1, workload=SERVE)
    layers = len(graph_of(compiled_as(case)).layers)
    return flatpack.compile(model, example, plan=Plan.from_ranges(list(ranges), layers))


def channel_table(case) -> dict[tuple[int, int], ChannelGroup]:
    """The planner's channel table of the model compiled as one stage for serving."""
    table = problem_of(compiled_as(case)).channel_groups
    assert table is not None, "a serving workload's problem has a channel table"
    return table


def covering_plans(case):
    """Plans whose stages, together, are every group the planner's table can split, with
    single layers between them: few compiles for all the groups."""
    table = channel_table(case)
    layers = len(graph_of(compiled_as(case)).layers)
    remaining, plans = sorted(table), []
    while remaining:
        chosen, position = [], 0
        for start, end in remaining:
            if start >= position:
                chosen.append((start, end))
                position = end + 1
        remaining = [group for group in remaining if group not in chosen]
        ranges = sorted(chosen + [(i, i) for i in range(layers) if not any(a <= i <= b for a, b in chosen)])
        plans.append((tuple(ranges), chosen))
    return plans


def run_split(compiled, stage, partitions, x):
    """The stages run in order in this process, stage ``stage`` as its channel
    ``partitions``, whose outputs are joined as the master joins them."""
    env = dict(zip(compiled.info.input_names, compiled.input_leaves(x)))
    for index, module in enumerate(compiled.stage_modules()):
        module.eval()
        manifest = module.flatpack_manifest
        inputs = [env[name] for name in manifest.input_names]
        names = manifest.output_names
        with torch.no_grad():
            if index != stage:
                env.update(zip(names, module(*inputs)))
                continue
            results = [dict(zip(names, partition(*inputs))) for partition in partitions]
        joins = partitions[0].flatpack_joins
        sent = [{name: result[name] for name in channel_split.needed_outputs(names, joins, k)}
                for k, result in enumerate(results)]
        env.update(channel_split.join_outputs(sent, names, joins))
    (output,) = compiled.info.output_names
    return env[output]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_channel_split_equals_the_model(case):
    model = model_of(case)
    table = channel_table(case)
    assert table, "the model has groups a channel split cuts"
    covered = set()
    for ranges, groups in covering_plans(case):
        compiled = compiled_as(case, ranges)
        for group in groups:
            stage = ranges.index(group)
            for parts in PARTS:
                if parts > table[group].max_partitions:
                    continue
                module = compiled.stage_modules()[stage]
                partitions = [channel_split.partition_module(module, parts, k) for k in range(parts)]
                for batch in (1, 3):
                    x = sample(case, batch)
                    with torch.no_grad():
                        expected = model(x)
                    torch.testing.assert_close(run_split(compiled, stage, partitions, x), expected)
                covered.add(parts)
    assert covered == set(PARTS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_planner_table_and_the_runtime_analysis_agree_on_which_groups_split(case):
    """The planner's table comes from the compiler's graph, the runtime's analysis from the
    stage module: on every stage compiled here (the groups that split, the single layers
    between them, the whole model) the same groups split, limited by the same layer."""
    table = channel_table(case)
    layers = len(graph_of(compiled_as(case)).layers)
    checked = 0
    for ranges in [ranges for ranges, _ in covering_plans(case)] + [((0, layers - 1),)]:
        compiled = compiled_as(case, ranges)
        for stage, group in enumerate(ranges):
            try:
                _, analysis = channel_split.analyse_stage(compiled.stage_modules()[stage])
                runtime = min(analysis.anchors, key=lambda anchor: anchor[1]) if analysis.anchors else None
            except PlanError:
                runtime = None
            planned = (table[group].limiting_layer, table[group].max_partitions) if group in table else None
            assert planned == runtime, group
            checked += 1
    assert checked > len(table)


SINGLE_LAYERS = ((0, 0), (1, 1), (2, 2), (3, 3), (4, 4))


def test_partitions_hold_their_slice_of_the_weights():
    module = compiled_as("conv", SINGLE_LAYERS).stage_modules()[0]      # c1: 8 filters, then batch norm
    for parts in PARTS:
        pieces = [channel_split.partition_module(module, parts, k) for k in range(parts)]
        sizes = [cast(torch.Tensor, piece.c1_weight).shape[0] for piece in pieces]
        assert sizes == [length for _, length in channel_ranges(8, parts)] and sum(sizes) == 8
        # batch norm's per-channel weights follow the conv's filters
        assert [cast(torch.Tensor, piece.bn_running_mean).shape[0] for piece in pieces] == sizes


def test_more_partitions_than_channels_is_refused_naming_the_layer():
    module = compiled_as("conv", SINGLE_LAYERS).stage_modules()[1]      # c2: 6 filters
    with pytest.raises(PlanError, match=r"layer c2 has 6 output channels, fewer than the 7 partitions.*at most 6"):
        channel_split.partition_module(module, 7, 0)
    # and at compile time, from the plan's stage, before anything runs
    stages = (StagePlan(0, 0), StagePlan(1, 1, None, 7, split="channel"), StagePlan(2, 4))
    with pytest.raises(PlanError, match=r"layers 1\.\.1 .*layer c2 has 6 output channels, fewer than the 7 partitions"):
        flatpack.compile(model_of("conv"), (sample("conv", 2),), plan=Plan(stages, 5), workload=SERVE)
