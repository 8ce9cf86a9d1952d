"""Shared check: the staged model computes exactly what the original computes."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import flatpack
from flatpack.ir.graph import LayerGraph
from flatpack.verify import check_equivalence


def layer_graph(compiled: flatpack.Compiled) -> LayerGraph:
    """The layer graph of a model compiled in this process (``flatpack.load`` keeps none)."""
    assert compiled.graph is not None, "a loaded Compiled has no layer graph: compile the model here"
    return compiled.graph


def assert_equivalent(model: nn.Module, inputs: Any, compiled: flatpack.Compiled | None = None,
                      staged: flatpack.StagedModule | None = None, **compile_kwargs: Any) -> flatpack.Compiled | None:
    """Stage weights are the original's; outputs and input and parameter gradients are equal."""
    reference = copy.deepcopy(model)
    if staged is None:
        compiled = compiled or flatpack.compile(model, inputs, **compile_kwargs)
        staged = compiled.as_module()
    originals = dict(reference.named_parameters(remove_duplicate=False)) | dict(
        reference.named_buffers(remove_duplicate=False))
    for name, tensor in staged.named_original_parameters():
        if name in originals:
            assert torch.equal(tensor.detach(), originals[name].detach()), f"stage weight {name} differs"
    check_equivalence(reference, staged, inputs).assert_close()
    return compiled
