"""Shared checks: the staged model must compute exactly what the original computes."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

import flatpack


def _leaves(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _clone_inputs(inputs: Any) -> Any:
    return pytree.tree_map(
        lambda t: t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t,
        inputs,
    )


def _call(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, torch.Tensor):
        return module(inputs)
    return module(*inputs)


def _as_plain(value: Any) -> Any:
    """ModelOutput and other dict subclasses compare as plain dicts of their tensors."""
    return pytree.tree_map(lambda x: x, dict(value) if isinstance(value, dict) else value)


def assert_equivalent(model: nn.Module, inputs: Any, compiled: flatpack.Compiled | None = None,
                      staged: nn.Module | None = None, **compile_kwargs: Any) -> flatpack.Compiled | None:
    """Outputs, input gradients and parameter gradients of staged == original; weights are the original's."""
    reference = copy.deepcopy(model)
    if staged is None:
        compiled = compiled or flatpack.compile(model, inputs, **compile_kwargs)
        staged = compiled.as_module()
    for name, tensor in staged.named_original_parameters():
        original = dict(reference.named_parameters(remove_duplicate=False)) | dict(
            reference.named_buffers(remove_duplicate=False))
        if name in original:
            assert torch.equal(tensor.detach(), original[name].detach()), f"stage weight {name} differs"

    reference_inputs, staged_inputs = _clone_inputs(inputs), _clone_inputs(inputs)
    expected = _call(reference, reference_inputs)
    actual = _call(staged, staged_inputs)
    assert type(actual) is type(expected) or isinstance(expected, dict)
    torch.testing.assert_close(_as_plain(actual), _as_plain(expected))

    expected_leaves = [t for t in _leaves(_as_plain(expected)) if t.requires_grad]
    actual_leaves = [t for t in _leaves(_as_plain(actual)) if t.requires_grad]
    assert len(expected_leaves) == len(actual_leaves)
    if expected_leaves:
        torch.manual_seed(1)
        weights = [torch.randn_like(t) for t in expected_leaves]
        sum((t * w).sum() for t, w in zip(expected_leaves, weights)).backward()
        sum((t * w).sum() for t, w in zip(actual_leaves, weights)).backward()
        for (name, param) in reference.named_parameters(remove_duplicate=False):
            got = staged.tensor(name).grad
            if param.grad is None:
                assert got is None or not got.any(), f"{name}: staged has a gradient, original none"
            else:
                torch.testing.assert_close(got, param.grad, msg=lambda m: f"gradient of {name}: {m}")
        for ref_in, staged_in in zip(_leaves(reference_inputs), _leaves(staged_inputs)):
            if ref_in.grad is not None:
                torch.testing.assert_close(staged_in.grad, ref_in.grad)
    return compiled
