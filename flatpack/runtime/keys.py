"""Store keys: every object a run writes is named by run, iteration, stage, replica,
micro-batch and kind, under the run's own prefix, so that a run lists only its own prefix
(never a whole bucket) and a restarted worker finds exactly what it needs.

Layout (``<run>`` is the run id)::

    <run>/artifacts/stage_NNN/<file>                  stage artifacts (source, weights, manifest)
    <run>/spec/g<first>                               the settings of the segment starting at iteration <first>
    <run>/marker/i<iter>/s<stage>/r<replica>/<phase>  a worker reached a phase (straggler watch)
    <run>/data/i<iter>/m<mb>                          a micro-batch's inputs
    <run>/data/i<iter>/t<mb>                          a micro-batch's targets (read by the last stage)
    <run>/act/i<iter>/s<stage>/m<mb>                  a stage's outputs for a micro-batch
    <run>/grad/i<iter>/s<stage>/m<mb>                 gradients for a stage's inputs
    <run>/sync/i<iter>/s<stage>/r<replica>/c<chunk>   scatter-reduce: a replica's gradient chunk
    <run>/reduced/i<iter>/s<stage>/c<chunk>           scatter-reduce: a summed chunk
    <run>/norm/i<iter>/s<stage>                       a stage's squared gradient norm (global-norm clipping)
    <run>/{sync,reduced,shared,norm}/i<iter>q<pos>/...  the same for a round of an asynchronous
                                                      schedule whose first micro-batch is <pos> of <iter>
    <run>/ckpt/s<stage>/i<iter>                       stage state after iteration <iter>
    <run>/timeline/s<stage>/r<replica>/i<iter>/a<attempt>   task start and end times
    <run>/status/s<stage>/r<replica>/i<start>/a<attempt>  a worker's final status (ok, oom, error, transient)
    <run>/progress/i<iter>/s<stage>/r<replica>        a worker finished an iteration: its loss and end time
    <run>/calls/i<first>                              one train() call: its first iteration, length, initial checkpoint
    <run>/infer/<request>/...                         fork-join inference partitions
    <run>/profile/inputs                              in-target profiling: the model's example inputs
    <run>/profile/spec/m<MB>                          in-target profiling: a tier's ProfileSpec
    <run>/profile/result/m<MB>                        in-target profiling: a tier's TierResult
    <run>/profile/probe/m<MB>                         in-target profiling: a tier's bandwidth probe
    <run>/calibrate/<kind>/m<MB>[/<n>]                target calibration: a tier's spec, result, probe objects

Iterations, stages, replicas, micro-batches and memory sizes are zero-padded so that a
prefix listing returns them in order.

Iteration numbers are never reused within a run: a second ``train()`` call, or one that
resumes a failed call, takes the numbers after every number an earlier call used, so no
call can read another's tensors, progress or status records (it starts from a checkpoint
named by its call record instead).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flatpack.stage.artifact import stage_dirname


# the kinds of key each iteration writes and none needs once a checkpoint covers it
INTERMEDIATE_KINDS = ("data", "act", "grad", "sync", "reduced", "shared", "norm", "marker")
# a per-iteration key's iteration part (_slot): i<iteration>, or i<iteration>q<position> for a round
_SLOT = re.compile(r"i(\d+)(?:q\d+)?")


def _n(value: int) -> str:
    return f"{value:06d}"


@dataclass(frozen=True)
class Round:
    """One round of an asynchronous schedule (PipeDream's 1F1B-RR): a stage's replicas reduce
    the gradients of a round of micro-batches, not an iteration's. Its keys name the iteration
    of its first micro-batch and that micro-batch's position in it, so that the invoker's
    garbage collection (:meth:`RunKeys.iteration_of`) frees them once a checkpoint covers the
    iteration, as it frees an iteration's (keyed by the position in the run's sequence of
    micro-batches instead, they outlived every checkpoint and a long run's store grew by
    twice a stage's gradient per round)."""

    iteration: int
    position: int

    @classmethod
    def of(cls, sequence: int, micro_batches: int) -> Round:
        """The round whose first micro-batch is number ``sequence`` of the run's sequence."""
        iteration, position = divmod(sequence, micro_batches)
        return cls(iteration, position)


def _slot(iteration: int | Round) -> str:
    """A per-iteration key's iteration part: ``i<iter>``, or ``i<iter>q<pos>`` for a round."""
    if isinstance(iteration, Round):
        return f"i{_n(iteration.iteration)}q{_n(iteration.position)}"
    return f"i{_n(iteration)}"


@dataclass(frozen=True)
class RunKeys:
    """Key builder for one run."""

    run: str

    def __post_init__(self) -> None:
        if not self.run or "/" in self.run or self.run.strip() != self.run:
            raise ValueError(f"a run id must be a non-empty name without '/' or surrounding spaces, got {self.run!r}")

    @property
    def prefix(self) -> str:
        return f"{self.run}/"

    def artifact(self, stage: int, filename: str) -> str:
        return f"{self.artifacts(stage)}{filename}"

    def artifact_index(self) -> str:
        """The artifact's index (``flatpack.index.json``); workers check it against their digest."""
        return f"{self.run}/artifacts/flatpack.index.json"

    def artifacts(self, stage: int) -> str:
        return f"{self.run}/artifacts/{stage_dirname(stage)}/"

    def spec(self, first_iteration: int) -> str:
        """The settings of the segment (fixed replica degrees) that starts at ``first_iteration``."""
        return f"{self.run}/spec/g{_n(first_iteration)}"

    def inference_spec(self) -> str:
        return f"{self.run}/spec/inference"

    def marker(self, iteration: int, stage: int, replica: int, phase: str) -> str:
        return f"{self.run}/marker/i{_n(iteration)}/s{_n(stage)}/r{_n(replica)}/{phase}"

    def markers(self, iteration: int) -> str:
        return f"{self.run}/marker/i{_n(iteration)}/"

    def data(self, iteration: int, micro_batch: int) -> str:
        return f"{self.run}/data/i{_n(iteration)}/m{_n(micro_batch)}"

    def target(self, iteration: int, micro_batch: int) -> str:
        return f"{self.run}/data/i{_n(iteration)}/t{_n(micro_batch)}"

    def activation(self, iteration: int, stage: int, micro_batch: int) -> str:
        return f"{self.run}/act/i{_n(iteration)}/s{_n(stage)}/m{_n(micro_batch)}"

    def gradient(self, iteration: int, stage: int, micro_batch: int) -> str:
        return f"{self.run}/grad/i{_n(iteration)}/s{_n(stage)}/m{_n(micro_batch)}"

    def sync_chunk(self, iteration: int | Round, stage: int, replica: int, chunk: int) -> str:
        return f"{self.run}/sync/{_slot(iteration)}/s{_n(stage)}/r{_n(replica)}/c{_n(chunk)}"

    def reduced_chunk(self, iteration: int | Round, stage: int, chunk: int) -> str:
        return f"{self.run}/reduced/{_slot(iteration)}/s{_n(stage)}/c{_n(chunk)}"

    def shared_gradient(self, iteration: int | Round, stage: int, name: str) -> str:
        return f"{self.run}/shared/{_slot(iteration)}/s{_n(stage)}/{name}"

    def grad_norm(self, iteration: int | Round, stage: int) -> str:
        return f"{self.run}/norm/{_slot(iteration)}/s{_n(stage)}"

    def checkpoint(self, stage: int, iteration: int) -> str:
        return f"{self.run}/ckpt/s{_n(stage)}/i{_n(iteration)}"

    def timeline(self, stage: int, replica: int, iteration: int, attempt: int) -> str:
        return f"{self.run}/timeline/s{_n(stage)}/r{_n(replica)}/i{_n(iteration)}/a{_n(attempt)}"

    def timelines(self) -> str:
        return f"{self.run}/timeline/"

    def status(self, stage: int, replica: int, attempt: int, start_iteration: int = 0) -> str:
        """A worker's final status; the start iteration is in the key because attempts count
        from 0 again in every call (a call's first launch is attempt 0)."""
        return f"{self.run}/status/s{_n(stage)}/r{_n(replica)}/i{_n(start_iteration)}/a{_n(attempt)}"

    def checkpoints(self, stage: int) -> str:
        return f"{self.run}/ckpt/s{_n(stage)}/"

    def call(self, first_iteration: int) -> str:
        return f"{self.run}/calls/i{_n(first_iteration)}"

    def calls(self) -> str:
        return f"{self.run}/calls/"

    def progress(self, iteration: int, stage: int, replica: int) -> str:
        return f"{self.run}/progress/i{_n(iteration)}/s{_n(stage)}/r{_n(replica)}"

    def progresses(self) -> str:
        return f"{self.run}/progress/"

    def progresses_of(self, iteration: int) -> str:
        return f"{self.run}/progress/i{_n(iteration)}/"

    def intermediate_prefixes(self) -> list[str]:
        """One prefix per kind of per-iteration key (data, activations, gradients, the
        synchronization's chunks, markers...): what the invoker deletes once a checkpoint
        covers the iteration. Each key under them is ``<prefix>i<iteration>/...``
        (:meth:`iteration_of`)."""
        return [f"{self.run}/{kind}/" for kind in INTERMEDIATE_KINDS]

    def iteration_of(self, key: str) -> int | None:
        """The iteration of a key under :meth:`intermediate_prefixes` (a round's: that of its
        first micro-batch, :class:`Round`); None for any other key."""
        parts = key.split("/")
        if len(parts) < 4 or parts[0] != self.run or parts[1] not in INTERMEDIATE_KINDS:
            return None
        found = _SLOT.fullmatch(parts[2])
        return int(found.group(1)) if found else None

    def infer(self, request: str, group: int, partition: int, kind: str) -> str:
        return f"{self.run}/infer/{request}/g{_n(group)}/p{_n(partition)}/{kind}"

    def profile(self, kind: str, memory_mb: int | None = None) -> str:
        """In-target profiling: the ``memory_mb`` tier's ``spec``, ``result`` or bandwidth
        ``probe``, or (no tier) the ``inputs`` every tier's function reads."""
        if kind == "inputs" and memory_mb is None:
            return f"{self.run}/profile/inputs"
        if kind in ("spec", "result", "probe") and memory_mb is not None:
            return f"{self.run}/profile/{kind}/m{_n(memory_mb)}"
        raise ValueError(f"no profile key {kind!r} for memory size {memory_mb!r}: spec, result and probe are a "
                         "tier's (give its memory size), inputs are every tier's (give none)")

    def calibrate(self, kind: str, memory_mb: int, invocation: int | None = None) -> str:
        """Target calibration (``flatpack calibrate``): the ``memory_mb`` tier's ``spec``,
        the ``result`` of its ``invocation`` (0 cold, 1 warm), or a ``probe`` object."""
        if kind not in ("spec", "result", "probe"):
            raise ValueError(f"no calibrate key {kind!r}: spec, result and probe are a tier's")
        suffix = "" if invocation is None else f"/{_n(invocation)}"
        return f"{self.run}/calibrate/{kind}/m{_n(memory_mb)}{suffix}"
