"""PipeDream's weight stashing (thesis Ch. 5): the weight versions a stage keeps for its
in-flight micro-batches under an asynchronous schedule (``flatpack.schedules``, e.g.
``1f1b-async``).

Under an asynchronous schedule every micro-batch is one of PipeDream's minibatches: each
stage steps its optimizer after every backward, and the pipeline never flushes between
iterations (only at the end of a call). The schedule says which version the forward of the
call's g-th micro-batch uses (``Schedule.weight_version``: under 1F1B, stage s of S with d
replicas has taken ``floor((g - (S - s - 1)) / d)`` steps by then, one per round of d
micro-batches); weight stashing keeps that version until the micro-batch's backward, which
computes its gradient on the same weights. The gradients of a round wait in
:class:`RoundGradients` until the round is complete on the replica and reduced over the
stage's replicas; the step is applied when a forward first asks for its version. Vertical
sync makes every stage use the version the first stage used, so a micro-batch sees one
consistent model across stages.
"""

from __future__ import annotations

from typing import Mapping

import torch


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

    def release(self, version: int) -> None:
        """A micro-batch's backward is done with ``version``."""
        self.users[version] -= 1

    def prune(self, keep_from: int) -> None:
        """Drops every version no in-flight micro-batch holds that is older than ``keep_from``
        (the oldest a later forward may still ask for: the live one)."""
        for held in list(self.versions):
            if self.users.get(held, 0) == 0 and held < keep_from:
                self.versions.pop(held)
                self.users.pop(held, None)

    def held(self) -> int:
        """Versions kept now (weight stashing's memory is this many copies of the stage's weights)."""
        return len(self.versions)


class RoundGradients:
    """A replica's gradients of each round not yet reduced: round -> the sum of its
    micro-batches' gradients on this replica, added in the order their backwards ran (the
    call's sequence order), and how many it holds."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, torch.Tensor | None]] = {}
        self.counts: dict[int, int] = {}

    def add(self, round_index: int, grads: Mapping[str, torch.Tensor | None]) -> int:
        """Adds one micro-batch's gradients to its round; returns how many the round holds."""
        held = self.sums.get(round_index)
        if held is None:
            self.sums[round_index] = {name: None if grad is None else grad.detach().clone()
                                      for name, grad in grads.items()}
        else:
            for name, grad in grads.items():
                if grad is not None:
                    total = held.get(name)
                    held[name] = grad.detach().clone() if total is None else total + grad
        self.counts[round_index] = self.counts.get(round_index, 0) + 1
        return self.counts[round_index]

    def pop(self, round_index: int) -> dict[str, torch.Tensor]:
        """The round's summed gradients (none: no micro-batch of it ran here), forgotten here."""
        self.counts.pop(round_index, None)
        return {name: grad for name, grad in self.sums.pop(round_index, {}).items() if grad is not None}
