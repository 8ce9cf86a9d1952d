"""Regression tests for the flatpack bugs that the property tests found (see BUGS.md).

One minimal reproduction per bug, asserting the behaviour flatpack has had since the fixes
in 52997f4. The property tests generate these constructs too. These tests keep each case
small and named.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import flatpack

Pair = collections.namedtuple("Pair", ["logits", "hidden"])


def every_layer_a_stage(model, example, passes=""):
    graph = flatpack.compile(model, example, passes=passes, stages=1).graph
    assert graph is not None  # compiled in this process
    count = len(graph.layers)
    plan = flatpack.Plan.from_cuts(list(range(count - 1)), count)
    return flatpack.compile(model, example, passes=passes, plan=plan)


class DictAndList(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        h = self.lin(x)
        return {"out": h, "list": [h * 2]}


def test_output_container_types():
    x = torch.randn(1, 3)
    out = flatpack.compile(DictAndList(), x, stages=1).as_module()(x)
    assert type(out) is dict
    assert type(out["list"]) is list


class Counter(nn.Module):
    calls: torch.Tensor  # a buffer, declared so that it reads as a tensor

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x)


def test_compile_leaves_a_train_model_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).train()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    flatpack.compile(model, torch.randn(4, 3), stages=1)
    changed = [name for name, t in model.state_dict().items() if not torch.equal(t, before[name])]
    assert not changed, f"compile changed {changed}"


class ScalesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        x.mul_(2.0)
        return self.lin(x)


def test_compile_leaves_the_example_inputs_alone():
    x = torch.ones(1, 3)
    flatpack.compile(ScalesInput(), x, stages=1)
    assert torch.equal(x, torch.ones(1, 3))


def test_compile_leaves_an_eval_model_alone():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    flatpack.compile(model, torch.randn(4, 3), stages=1)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


def test_buffer_update_in_forward_is_staged():
    model = Counter()
    x = torch.randn(2, 3)
    staged = flatpack.compile(model, x, stages=1).as_module()
    model(x)
    staged(x)
    assert torch.equal(staged.tensor("calls"), model.calls)


def test_cumulative_batchnorm_is_refused_clearly():
    """momentum=None averages with 1/num_batches_tracked, a Python float neither tracer can
    follow: refused with advice, not staged with a frozen factor."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=None)).train()
    with pytest.raises(flatpack.TraceError, match=r"momentum=None"):
        flatpack.compile(model, torch.randn(4, 3), stages=1)


class ReturnsNamedTuple(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return Pair(self.lin(x), x)


class ReturnsNamedTupleFromDict(ReturnsNamedTuple):
    def forward(self, batch):
        return Pair(self.lin(batch["x"]), batch["x"])


def test_namedtuple_output_fx():
    x = torch.randn(2, 3)
    out = flatpack.compile(ReturnsNamedTuple(), x, stages=1).as_module()(x)
    assert type(out) is Pair


def test_namedtuple_output_export():
    x = torch.randn(2, 3)
    out = flatpack.compile(ReturnsNamedTupleFromDict(), ({"x": x},), stages=1).as_module()({"x": x})
    assert type(out) is Pair


class SnapshotThenWrite(nn.Module):
    state: torch.Tensor  # a buffer, declared so that it reads as a tensor

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(3))
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, batch):
        snapshot = self.state * 1.0  # reads the buffer alone: a free value, recomputed by each stage
        self.state.add_(1.0)
        return self.b(self.a(batch["x"])) + snapshot


def test_free_value_read_before_buffer_write():
    torch.manual_seed(0)
    model = SnapshotThenWrite()
    x = torch.randn(2, 3)
    staged = every_layer_a_stage(model, ({"x": x},)).as_module()
    torch.testing.assert_close(staged({"x": x}), model({"x": x}))


class SharedNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        a = self.a(x)
        b = self.b(x)
        yb = self.bn(b)  # updates the running statistics with b first ...
        ya = self.bn(a)  # ... then with a
        return ya + yb


def test_shared_batchnorm_update_order():
    torch.manual_seed(0)
    model = SharedNorm().train()
    x = torch.randn(4, 3)
    staged = every_layer_a_stage(model, x, passes="fuse-elementwise").as_module().train()
    torch.testing.assert_close(staged(x), model(x))
    torch.testing.assert_close(staged.tensor("bn.running_mean"), model.bn.running_mean)


class HiddenParameterRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x):
        gain = dict(self.named_parameters())["gain"]  # fx sees a tensor, not an attribute read
        return self.lin(x) * (gain * 2)


def test_parameter_read_outside_fx_keeps_its_gradient():
    model = HiddenParameterRead()
    x = torch.ones(1, 3)
    staged = flatpack.compile(model, x, stages=1).as_module()
    model(x).sum().backward()
    staged(x).sum().backward()
    torch.testing.assert_close(staged.tensor("gain").grad, model.gain.grad)


class Identity(nn.Module):
    def forward(self, x):
        return x


def test_identity_model_is_refused_clearly():
    with pytest.raises(flatpack.InputError, match="computes nothing"):
        flatpack.compile(Identity(), torch.ones(2), stages=1)
