"""PipeDream's asynchronous 1F1B (thesis Ch. 5, "1F1B" and "weight stashing"): the order of
a stage's compute tasks over a whole call, which weight version each micro-batch uses, and
the stash of versions a stage keeps for its in-flight micro-batches.

Under ``schedule="1f1b-async"`` every micro-batch is one of PipeDream's minibatches: each
stage steps its optimizer after every backward, and the pipeline never flushes between
iterations (only at the end of a call). Stage s of S keeps ``w = S - s - 1`` forwards in
flight before its first backward, so before the forward of micro-batch g (numbered across
the call's iterations) it has taken ``g - w`` steps: that is the version the forward uses.
Weight stashing keeps that version until the micro-batch's backward, which computes its
gradient on the same weights. Vertical sync makes every stage use the version the first
stage used, ``g - (S - 1)``, so a micro-batch sees one consistent model across stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class AsyncTask:
    """One compute task of the asynchronous schedule: "F" or "B" of micro-batch
    ``micro_batch`` of ``iteration``, the ``sequence``-th micro-batch of the call."""

    kind: str
    iteration: int
    micro_batch: int
    sequence: int


def warmup_forwards(stage: int, stages: int) -> int:
    """Forwards stage ``stage`` runs before its first backward: PipeDream's NOAM - 1 for one
    replica per stage, S - s - 1 (the last stage alternates from the start)."""
    return stages - stage - 1


def forward_version(sequence: int, stage: int, stages: int, vertical_sync: bool) -> int:
    """The optimizer steps (since the call began) a stage has taken when it runs the forward
    of the call's ``sequence``-th micro-batch, or under vertical sync those of the first
    stage: the weight version the micro-batch's forward and backward use on this stage."""
    lag = warmup_forwards(0 if vertical_sync else stage, stages)
    return max(0, sequence - lag)


def async_chunks(first_iteration: int, end_iteration: int, micro_batches: int, stage: int,
                 stages: int) -> list[list[AsyncTask]]:
    """The stage's compute tasks over iterations ``first_iteration``..``end_iteration - 1``
    as one 1F1B sequence without a flush, cut into one list per iteration: iteration i's
    list runs from the forward of its first micro-batch to the task before the next
    iteration's first forward, and the last also drains the pipeline's backwards."""
    total = (end_iteration - first_iteration) * micro_batches
    warmup = min(warmup_forwards(stage, stages), total)

    def task(kind: str, sequence: int) -> AsyncTask:
        return AsyncTask(kind, first_iteration + sequence // micro_batches, sequence % micro_batches, sequence)

    order = [task("F", g) for g in range(warmup)]
    for g in range(warmup, total):
        order += [task("F", g), task("B", g - warmup)]
    order += [task("B", g) for g in range(total - warmup, total)]
    chunks: list[list[AsyncTask]] = [[] for _ in range(end_iteration - first_iteration)]
    current = 0
    for item in order:
        if item.kind == "F":
            current = item.sequence // micro_batches
        chunks[current].append(item)
    return chunks


class WeightStash:
    """The weight versions a stage's in-flight micro-batches (and, under vertical sync, its
    next forwards) need: version -> the trainable parameters' values after that many steps.

    The newest version is the live parameters' storage itself until the optimizer is about
    to change them (:meth:`before_step`): then, if a micro-batch still holds it, the live
    parameters move to a copy and the stash keeps the old storage. A stage so holds as many
    copies of its weights as versions are in use, PipeDream's count (S - s on stage s; the
    ``pipedream`` cost model's ``weight_versions``), never one more for the live weights.
    Without this, an in-place step would silently change the weights a saved autograd graph
    computes its gradient with (``x.data`` has its own version counter, so autograd would
    not notice)."""

    def __init__(self, parameters: Mapping[str, torch.Tensor]) -> None:
        self.parameters = parameters
        self.versions: dict[int, dict[str, torch.Tensor]] = {}
        self.users: dict[int, int] = {}     # version -> in-flight micro-batches holding it

    def snapshot(self, version: int) -> None:
        """Keeps the live parameters as ``version`` (the stage's current one), sharing their
        storage until :meth:`before_step`."""
        if version not in self.versions:
            self.versions[version] = {name: param.data for name, param in self.parameters.items()}

    def before_step(self, version: int) -> None:
        """The optimizer is about to update the live parameters, now ``version``: if that
        version is stashed, the live parameters continue on a copy and the stash keeps what
        its micro-batches computed with."""
        if version in self.versions:
            for param in self.parameters.values():
                param.data = param.data.clone()

    def acquire(self, version: int) -> dict[str, torch.Tensor]:
        """The weights of ``version`` for one micro-batch's forward, as fresh leaf tensors
        that share the stash's storage: each micro-batch's gradient lands on its own leaves,
        so two in-flight micro-batches of one version never add into each other's."""
        if version not in self.versions:
            raise RuntimeError(f"weight version {version} is not stashed (stashed: {sorted(self.versions)}); "
                               "this is a bug in the asynchronous schedule")
        self.users[version] = self.users.get(version, 0) + 1
        return {name: tensor.detach().requires_grad_(self.parameters[name].requires_grad)
                for name, tensor in self.versions[version].items()}

    def release(self, version: int, keep_from: int) -> None:
        """A micro-batch's backward is done with ``version``: drops every version no
        in-flight micro-batch holds that is older than ``keep_from`` (the oldest a later
        forward may still ask for)."""
        self.users[version] -= 1
        for held in list(self.versions):
            if self.users.get(held, 0) == 0 and held < keep_from:
                self.versions.pop(held)
                self.users.pop(held, None)

    def held(self) -> int:
        """Versions kept now (weight stashing's memory is this many copies of the stage's weights)."""
        return len(self.versions)
