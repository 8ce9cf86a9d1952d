"""check_equivalence notices what differs: an output, a parameter's gradient, a lost tie."""

from __future__ import annotations

import pytest
import torch

import flatpack
from flatpack.verify import INPUT_GRAD, OUTPUT, PARAM_GRAD, check_equivalence
from tests.models import MLP


def staged_mlp():
    torch.manual_seed(0)
    model = MLP(depth=3)
    return model, flatpack.compile(model, (torch.randn(2, 8),), stages=3).as_module()


def test_equal_models_compare_equal_everywhere():
    model, staged = staged_mlp()
    report = check_equivalence(model, staged, (torch.randn(4, 8),))
    assert {c.kind for c in report.comparisons} == {OUTPUT, INPUT_GRAD, PARAM_GRAD}
    assert len([c for c in report.comparisons if c.kind == PARAM_GRAD]) == 6
    report.assert_close()
    assert model.layers[0].weight.grad is None, "the check leaves .grad alone"


def test_a_changed_weight_is_reported_by_name():
    model, staged = staged_mlp()
    with torch.no_grad():
        staged.tensor("layers.2.weight").mul_(1.5)
    report = check_equivalence(model, staged, (torch.randn(4, 8),))
    assert report.max_abs_diff(OUTPUT) > 0
    with pytest.raises(AssertionError, match="output"):
        report.assert_close()
    by_name = {c.name: c for c in report.comparisons if c.kind == PARAM_GRAD}
    assert by_name["layers.2.weight"].max_abs_diff > 0 or by_name["layers.1.weight"].max_abs_diff > 0
