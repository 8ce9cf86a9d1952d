"""Fork-join inference with Gillis's channel split through the local backend's functions:
the outputs equal the model's for p ∈ {2, 3, 4}, one-sample requests included; the split
each group runs is the one its plan says; a request too small for a batch split is refused
before any function starts."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.backends import local
from flatpack.errors import InputError, PlanError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.forkjoin import ForkJoinSpec
from tests.models import ConvBlocks, TinyTransformer


def deploy(s3_server, compiled):
    return local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env())


def served_spec(deployment) -> ForkJoinSpec:
    return ForkJoinSpec.loads(deployment.store.get(deployment.keys.inference_spec()))


def test_conv_model_channel_split_over_2_3_and_4_partitions_equals_the_model(s3_server):
    """c1 → batch norm → ReLU → c2 over 4 partitions (c2's input channels follow c1's
    filters: partial sums, added by the master), the pooled head over 3, one-sample and
    three-sample requests."""
    torch.manual_seed(0)
    model = ConvBlocks().eval()
    stages = (StagePlan(0, 1, None, 4, split="channel"), StagePlan(2, 4, None, 3, split="channel"))
    compiled = flatpack.compile(model, (torch.randn(2, 3, 6, 6),), plan=Plan(stages, 5))
    with deploy(s3_server, compiled) as deployment:
        for batch in (1, 3):
            x = torch.randn(batch, 3, 6, 6)
            with torch.no_grad():
                torch.testing.assert_close(deployment.infer(x), model(x))
        spec = served_spec(deployment)
    # what ran is what the plan says: the split, the partitions, and the master's joins
    assert [(group.split, group.partitions) for group in spec.groups] == [("channel", 4), ("channel", 3)]
    assert "sum" in spec.groups[0].joins and spec.groups[1].joins == ("cat:1",)


def test_transformer_mixes_channel_and_batch_splits_as_its_plan_says(s3_server):
    """The second block's MLP (up, GELU, down, residual) split by channel over 2 (the down
    projection's input features follow up's: partial sums), the head split by batch, the
    rest on the master. (The exported attention has the example's batch in its reshapes, so
    it runs whole.)"""
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    stages = (StagePlan(0, 5), StagePlan(6, 6, None, 2, split="channel"), StagePlan(7, 7, None, 2, split="batch"))
    compiled = flatpack.compile(model, (torch.randn(2, 5, 8),), plan=Plan(stages, 8))
    with deploy(s3_server, compiled) as deployment:
        for batch in (2, 3):
            x = torch.randn(batch, 5, 8)
            with torch.no_grad():
                torch.testing.assert_close(deployment.infer(x), model(x))
        spec = served_spec(deployment)
        with pytest.raises(InputError, match=r"group 2 \(layers 7\.\.7\) splits the request's batch over 2 partitions, "
                                             r"but this request has 1 sample"):
            deployment.infer(torch.randn(1, 5, 8))
    assert [(group.split, group.workers) for group in spec.groups if group.workers] == [("channel", 2), ("batch", 2)]
    assert spec.groups[0].workers == 0 and spec.groups[0].on_master
    assert spec.groups[1].joins == ("sum",)


def test_a_request_too_small_for_a_batch_split_is_refused_before_any_function_starts(s3_server):
    torch.manual_seed(0)
    model = ConvBlocks().eval()
    compiled = flatpack.compile(model, (torch.randn(2, 3, 6, 6),),
                                plan=Plan((StagePlan(0, 1, None, 2, split="batch"), StagePlan(2, 4)), 5))
    with deploy(s3_server, compiled) as deployment:
        with pytest.raises(InputError, match=r"over 2 partitions, but this request has 1 sample.*split='channel'"):
            deployment.infer(torch.randn(1, 3, 6, 6))
        assert not deployment.workers


def test_a_channel_split_the_group_cannot_take_is_refused_naming_the_op_before_any_function_starts(s3_server):
    """The whole conv model as one group: the ReLU after c2's partial sums cannot be cut."""
    torch.manual_seed(0)
    model = ConvBlocks().eval()
    compiled = flatpack.compile(model, (torch.randn(2, 3, 6, 6),),
                                plan=Plan((StagePlan(0, 4, None, 2, split="channel"),), 5))
    with deploy(s3_server, compiled) as deployment:
        with pytest.raises(PlanError, match=r"group 0 \(layers 0\.\.4\): op relu_1 \(relu\) is not linear, so it "
                                            r"cannot take a partial sum"):
            deployment.infer(torch.randn(1, 3, 6, 6))
        assert not deployment.workers
