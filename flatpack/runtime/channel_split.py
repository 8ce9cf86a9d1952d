"""Runs one partition of a channel-split group (Gillis §II-C Fig. 2b; the rules are in
``stage/channels.py``): the stage module traced, its split weights cut to the partition's
channels, and the master's join of the partitions' outputs."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.passes.shape_prop import ShapeProp

from flatpack.stage.artifact import stage_manifest
from flatpack.stage.channels import PARTIAL, ChannelAnalysis, NotChannelSplittable, Sliced, analyse, channel_ranges

JOIN_SUM = "sum"
JOIN_WHOLE = "whole"
JOIN_CAT = "cat:"


def analyse_stage(module: torch.nn.Module, where: str = "the group") -> tuple[torch.fx.GraphModule, ChannelAnalysis]:
    """The stage module traced, with shapes from a run on zero inputs of its manifest's
    example shapes, and its channel split."""
    manifest = stage_manifest(module)
    traced = torch.fx.symbolic_trace(module)
    example = []
    for entry in manifest.inputs:
        if not entry.is_tensor:
            raise NotChannelSplittable(f"{where}: input {entry.name} is a {entry.kind}, not a tensor; "
                                       "only tensor inputs can be broadcast to channel partitions")
        example.append(torch.zeros(entry.shape, dtype=getattr(torch, entry.dtype)))
    with torch.no_grad():
        ShapeProp(traced).propagate(*example)

    def shape_of(node: torch.fx.Node) -> tuple[int, ...] | None:
        meta = node.meta.get("tensor_meta")
        return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None

    def param_bytes(node: torch.fx.Node) -> int:
        tensor = getattr(traced, str(node.target))
        return tensor.numel() * tensor.element_size()

    names = {entry.attr: entry.name for entry in manifest.parameters}
    return traced, analyse(traced.graph.nodes, shape_of, param_bytes, where,
                           lambda node: names.get(str(node.target), str(node.target)))


def joins(analysis: ChannelAnalysis) -> tuple[str, ...]:
    """How the master joins each output: ``cat:<dim>``, ``sum`` or ``whole``."""
    return tuple(f"{JOIN_CAT}{state.dim}" if isinstance(state, Sliced) else JOIN_SUM if state == PARTIAL
                 else JOIN_WHOLE for state in analysis.outputs)


def partition_module(module: torch.nn.Module, parts: int, index: int, where: str = "the group") -> torch.nn.Module:
    """Partition ``index`` of ``parts`` of the stage ``module``: its split weights cut to the
    partition's channels (copies: the full tensors are released), partial sums' biases and
    whole addends on partition 0 only, whole operands of sliced ops narrowed to match."""
    if not 0 <= index < parts:
        raise ValueError(f"partition {index} is not in 0..{parts - 1}")
    traced, analysis = analyse_stage(module, where)
    analysis.check_partitions(parts, where)
    for name, (axis, channels) in analysis.sliced_params.items():
        start, length = channel_ranges(channels, parts)[index]
        full = getattr(traced, name)
        piece = full.detach().narrow(axis, start, length).clone()
        delattr(traced, name)
        traced.register_buffer(name, piece)
    graph = traced.graph
    for node in list(graph.nodes):
        if index and node.name in analysis.bias_on_first:
            if len(node.args) > 2:
                node.update_arg(2, None)
            else:
                node.update_kwarg("bias", None)
        for (name, argument), (axis, sliced) in analysis.narrowed.items():
            if name != node.name:
                continue
            start, length = channel_ranges(sliced.channels, parts)[index]
            with graph.inserting_before(node):
                narrowed = graph.call_function(torch.narrow, (node.args[argument], axis, start, length))
            node.update_arg(argument, narrowed)
        if index and node.name in analysis.whole_on_first:
            node.replace_all_uses_with(node.args[analysis.whole_on_first[node.name]])
            graph.erase_node(node)
    graph.lint()
    traced.recompile()
    # torch's stub types Module.__setattr__ for tensors and modules; any value is allowed at run time
    traced.flatpack_joins = joins(analysis)  # pyright: ignore[reportArgumentType]
    return traced.eval()


def join_outputs(parts: list[dict[str, Any]], names: tuple[str, ...], how: tuple[str, ...]) -> dict[str, Any]:
    """The group's outputs from its partitions' (in partition order)."""
    joined = {}
    for name, join in zip(names, how):
        if join == JOIN_WHOLE:
            joined[name] = parts[0][name]
        elif join == JOIN_SUM:
            joined[name] = torch.stack([part[name] for part in parts]).sum(0)
        else:
            joined[name] = torch.cat([part[name] for part in parts], dim=int(join[len(JOIN_CAT):]))
    return joined


def needed_outputs(names: tuple[str, ...], how: tuple[str, ...], index: int) -> tuple[str, ...]:
    """The outputs partition ``index`` sends: every one but the whole ones, which only
    partition 0 sends (they are the same on every partition)."""
    return tuple(name for name, join in zip(names, how) if index == 0 or join != JOIN_WHOLE)

