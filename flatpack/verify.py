"""Does a staged model compute what the original computes? Outputs, input and parameter gradients.

Used by ``flatpack demo`` and by the tests. Gradients are taken with ``torch.autograd.grad``
against one random cotangent per output, so neither model's ``.grad`` fields are touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

OUTPUT = "output"
INPUT_GRAD = "input gradient"
PARAM_GRAD = "parameter gradient"


@dataclass
class Comparison:
    kind: str  # OUTPUT, INPUT_GRAD or PARAM_GRAD
    name: str
    expected: torch.Tensor
    actual: torch.Tensor

    @property
    def max_abs_diff(self) -> float:
        if self.expected.numel() == 0:
            return 0.0
        return (self.expected.double() - self.actual.double()).abs().max().item()


@dataclass
class EquivalenceReport:
    comparisons: list[Comparison] = field(default_factory=list)

    def max_abs_diff(self, kind: str) -> float:
        return max((c.max_abs_diff for c in self.comparisons if c.kind == kind), default=0.0)

    def assert_close(self, **tolerances: Any) -> None:
        """Raises AssertionError naming the first output or gradient that differs."""
        for comparison in self.comparisons:
            torch.testing.assert_close(comparison.actual, comparison.expected, **tolerances,
                                       msg=lambda m, c=comparison: f"{c.kind} {c.name}: {m}")


def _call(module: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return module(**inputs)
    if isinstance(inputs, torch.Tensor):
        return module(inputs)
    return module(*inputs)


def _fresh_inputs(inputs: Any) -> Any:
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), inputs)


def _tensors(value: Any) -> list[tuple[str, torch.Tensor]]:
    flat, _ = pytree.tree_flatten_with_path(dict(value) if isinstance(value, dict) else value)
    return [(pytree.keystr(path) or "[0]", leaf) for path, leaf in flat if isinstance(leaf, torch.Tensor)]


def check_equivalence(model: nn.Module, staged: nn.Module, inputs: Any, seed: int = 0) -> EquivalenceReport:
    """Runs both models on copies of ``inputs`` and pairs up outputs and gradients.

    ``staged`` is ``Compiled.as_module()`` (or anything with ``tensor(original_name)``).
    Every name of a tied parameter is compared, so a tie the stages lost shows up.
    """
    report = EquivalenceReport()
    expected_inputs, actual_inputs = _fresh_inputs(inputs), _fresh_inputs(inputs)
    expected_outputs = _tensors(_call(model, expected_inputs))
    actual_outputs = _tensors(_call(staged, actual_inputs))
    if [name for name, _ in expected_outputs] != [name for name, _ in actual_outputs]:
        raise AssertionError(f"outputs differ in structure: {[n for n, _ in expected_outputs]} vs "
                             f"{[n for n, _ in actual_outputs]}")
    for (name, expected), (_, actual) in zip(expected_outputs, actual_outputs):
        report.comparisons.append(Comparison(OUTPUT, name, expected.detach(), actual.detach()))

    differentiable = [(e, a) for (_, e), (_, a) in zip(expected_outputs, actual_outputs)
                      if e.requires_grad and a.requires_grad]
    if not differentiable:
        return report
    generator = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(e.shape, generator=generator, dtype=e.dtype) if e.is_floating_point()
                  else torch.zeros_like(e) for e, _ in differentiable]

    named_params = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    expected_targets = [t for t in pytree.tree_leaves(expected_inputs) if isinstance(t, torch.Tensor)
                        and t.requires_grad]
    actual_targets = [t for t in pytree.tree_leaves(actual_inputs) if isinstance(t, torch.Tensor)
                      and t.requires_grad]
    held = {name: staged_tensor for name, _ in named_params
            if (staged_tensor := _held_tensor(staged, name)) is not None}
    unique_params = list({id(p): p for _, p in named_params}.values())
    staged_params = list({id(tensor): tensor for tensor in held.values()}.values())
    expected_grads = torch.autograd.grad([e for e, _ in differentiable], expected_targets + unique_params,
                                         cotangents, allow_unused=True)
    actual_grads = torch.autograd.grad([a for _, a in differentiable], actual_targets + staged_params,
                                       cotangents, allow_unused=True)
    expected_by_id = dict(zip(map(id, expected_targets + unique_params), expected_grads))
    actual_by_id = dict(zip(map(id, actual_targets + staged_params), actual_grads))

    def grad_or_zeros(grads: dict, tensor: torch.Tensor) -> torch.Tensor:
        grad = grads[id(tensor)]
        return torch.zeros_like(tensor) if grad is None else grad

    for index, (expected, actual) in enumerate(zip(expected_targets, actual_targets)):
        report.comparisons.append(Comparison(INPUT_GRAD, f"input {index}", grad_or_zeros(expected_by_id, expected),
                                             grad_or_zeros(actual_by_id, actual)))
    for name, param in named_params:
        # a parameter no stage holds is one the graph never reads: its gradient must be zero
        actual = grad_or_zeros(actual_by_id, held[name]) if name in held else torch.zeros_like(param)
        report.comparisons.append(Comparison(PARAM_GRAD, name, grad_or_zeros(expected_by_id, param), actual))
    return report


def _held_tensor(staged: Any, name: str) -> torch.Tensor | None:
    try:
        return staged.tensor(name)
    except KeyError:
        return None
