"""A run's training state moved onto new cuts (``flatpack run --replan``, ``backends.replan``).

A stage checkpoint (``training.checkpoint_bytes``) keys its weights and accumulated
gradients by the parameter's original name, but its optimizer state by the parameter's
position in the stage, and its parameter groups by the optimizer's packed order. Those
positions mean nothing to a stage cut elsewhere, so :func:`gather` reads every stage's
checkpoint of one iteration into a :class:`TrainingState` keyed by name alone (weights and
buffers, each parameter's optimizer entries and group settings, accumulated gradients, and
what every stage holds alike: the optimizer steps, which place the learning-rate schedule,
the accumulation count and the loss scaler's state), and :func:`stage_checkpoint` writes it
back as the checkpoint of a stage of the new cuts: the bytes that stage's trainer would have
written had it trained those iterations itself, which its first invocation loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from flatpack.errors import RunFailure
from flatpack.runtime.optim import OptimizerSpec, packed_positions
from flatpack.runtime.training import checkpoint_bytes
from flatpack.stage import wire
from flatpack.stage.manifest import Manifest

# what every stage's checkpoint of one iteration holds alike (the steps drive the schedule,
# the count the gradient accumulation; the loss scale is agreed over every stage)
COMMON = ("iteration", "steps", "accumulated", "optimizer_class", "loss_scale")


@dataclass
class TrainingState:
    """The whole model's training state after ``iteration``, every entry by original name."""

    iteration: int
    weights: dict[str, torch.Tensor]                  # parameters and buffers
    optimizer: dict[str, dict[str, Any]]              # trainable parameter -> its optimizer state entries
    group_settings: dict[str, dict[str, Any]]         # trainable parameter -> its parameter group's settings
    accumulated: dict[str, torch.Tensor]              # gradients accumulated since the last step
    steps: int
    accumulated_count: int
    optimizer_class: str
    loss_scale: dict[str, Any] | None


def trainable_names(manifest: Manifest) -> list[str]:
    """The stage's trainable parameters in manifest order: the order its trainer hands them to
    the optimizer (``training.stage_tensors``), which checkpoint positions count in."""
    return [entry.name for entry in manifest.parameters if entry.trainable]


def _optimizer_over(spec: OptimizerSpec, weights: dict[str, torch.Tensor],
                    names: Sequence[str]) -> tuple[torch.optim.Optimizer, dict[str, nn.Parameter]]:
    """The optimizer a stage training ``names`` builds (its groups depend on the parameters'
    dimensions: ``OptimizerSpec.param_groups``), over parameters holding ``weights``."""
    params = {name: nn.Parameter(weights[name].detach().clone()) for name in names}
    return spec.build(params.values()), params


def gather(checkpoints: Sequence[bytes], manifests: Sequence[Manifest], spec: OptimizerSpec) -> TrainingState:
    """One iteration's checkpoints of every stage (``checkpoints[s]`` of the stage
    ``manifests[s]`` describes) as one :class:`TrainingState`. A tied parameter several stages
    hold is read from the first (every holder steps it alike). Refuses checkpoints that are
    not of one iteration and one run: they would make a state no run ever had."""
    if len(checkpoints) != len(manifests):
        raise RunFailure(f"{len(checkpoints)} stage checkpoints for {len(manifests)} stages: a plan switch needs "
                         "every stage's checkpoint of the same iteration")
    weights: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    settings: dict[str, dict[str, Any]] = {}
    accumulated: dict[str, torch.Tensor] = {}
    common: dict[str, Any] | None = None
    for index, (raw, manifest) in enumerate(zip(checkpoints, manifests)):
        tensors, meta = wire.loads(raw)
        found = {key: meta.get(key) for key in COMMON}
        if common is None:
            common = found
        elif found != common:
            differing = ", ".join(f"{key} {common[key]!r} (stage 0) vs {found[key]!r} (stage {index})"
                                  for key in COMMON if found[key] != common[key])
            raise RunFailure(f"the stage checkpoints to move onto the new plan disagree: {differing}. They are not "
                             "one consistent iteration of the run; resume it from its last consistent checkpoint")
        stage_weights = {key[2:]: tensor for key, tensor in tensors.items() if key.startswith("w/")}
        for name, tensor in stage_weights.items():
            weights.setdefault(name, tensor)
        for key, tensor in tensors.items():
            if key.startswith("a/"):
                accumulated.setdefault(key[2:], tensor)
        names = trainable_names(manifest)
        optimizer, params = _optimizer_over(spec, stage_weights, names)
        packed = packed_positions(optimizer, list(params.values()))
        group_of = {packed_index: group for group in meta["param_groups"] for packed_index in group["params"]}
        by_position: dict[int, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("o/"):
                _, position, entry = key.split("/", 2)
                by_position.setdefault(int(position), {})[entry] = value
        for position, scalars in meta["scalars"].items():
            by_position.setdefault(int(position), {}).update(scalars)
        for position, name in enumerate(names):
            if name in entries:
                continue
            entries[name] = by_position.get(position, {})
            group = group_of.get(packed[position], {})
            settings[name] = {key: value for key, value in group.items() if key != "params"}
    assert common is not None
    return TrainingState(int(common["iteration"]), weights, entries, settings, accumulated, int(common["steps"] or 0),
                         int(common["accumulated"] or 0), str(common["optimizer_class"]), common["loss_scale"])


def stage_checkpoint(state: TrainingState, manifest: Manifest, spec: OptimizerSpec) -> bytes:
    """The checkpoint of the stage ``manifest`` describes, after ``state.iteration``, in the
    format its trainer writes and loads (``training.checkpoint_bytes``). Refuses a state that
    lacks one of the stage's weights (the plans would not be of one model)."""
    names = [entry.name for entry in manifest.parameters]
    missing = [name for name in names if name not in state.weights]
    if missing:
        raise RunFailure(f"the new plan's stage {manifest.stage} holds {', '.join(missing[:5])}, which no stage "
                         "checkpoint of the old plan has: the two plans are not of the same model")
    trainable = trainable_names(manifest)
    optimizer, params = _optimizer_over(spec, state.weights, trainable)
    if type(optimizer).__name__ != state.optimizer_class:
        raise RunFailure(f"the run's checkpoints hold {state.optimizer_class} state but its optimizer is "
                         f"{type(optimizer).__name__}; a plan switch moves the state of the optimizer that wrote it")
    for name, param in params.items():
        optimizer.state[param] = dict(state.optimizer.get(name, {}))
    for group in optimizer.param_groups:
        if group["params"]:
            # a group's settings as the group of its first parameter had them (the learning rate
            # the schedule reached, weight decay): parameters grouped alike share them
            first = next(name for name, param in params.items() if param is group["params"][0])
            group.update(state.group_settings.get(first, {}))
    tensors = {name: params[name] if name in params else state.weights[name] for name in names}
    return checkpoint_bytes(state.iteration, tensors, params, optimizer,
                            {name: grad for name, grad in state.accumulated.items() if name in params},
                            state.steps, state.accumulated_count, state.loss_scale)
