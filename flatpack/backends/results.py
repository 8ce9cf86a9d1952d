"""What a training call returns, on every backend (:class:`TrainResult`), and the restarts
it made on the way (:class:`Restart`). Its own module so that the backend protocol and every
backend name it without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from flatpack.runtime import timeline


@dataclass
class Restart:
    worker: str
    iteration: int
    # "lost" (killed), "straggler", "time limit", "transient" (a store fault outlasted its retries)
    reason: str
    attempt: int
    behind_s: float = 0.0  # straggler: how far behind its peers when relaunched
    cost_s: float = 0.0    # seconds the iteration took beyond the peers' pace because of it

    def describe(self) -> str:
        if self.reason == "straggler":
            return (f"{self.worker} straggled in iteration {self.iteration}: {self.behind_s:.2f} s behind its peers, "
                    f"relaunched from the last checkpoint (attempt {self.attempt}); it cost {self.cost_s:.2f} s")
        if self.reason == "time limit":
            return f"{self.worker} checkpointed near its time limit and was invoked again at iteration {self.iteration}"
        if self.reason == "transient":
            return (f"{self.worker} gave up on a transient fault and was restarted at iteration {self.iteration} "
                    f"from the last checkpoint (attempt {self.attempt})")
        return (f"{self.worker} was lost and restarted at iteration {self.iteration} from the last checkpoint "
                f"(attempt {self.attempt})")


@dataclass
class TrainResult:
    parameters: dict[str, torch.Tensor]   # original parameter and buffer names -> final values
    losses: list[float]                   # mean loss over the global batch, per iteration
    events: list[timeline.Event]
    restarts: list[Restart]
    degrees: list[tuple[int, ...]]        # replica degrees of each segment (elasticity)
    wall_s: float
    samples: int
    dollars: float                        # functions' memory x seconds at the platform's price
    peak_bytes: dict[str, int] = field(default_factory=dict)
    switches: list[Any] = field(default_factory=list)   # backends.replan.PlanSwitch, each plan switch in order
    # backends.elastic_policy.ElasticDecision, each epoch boundary of an elastic policy's run
    decisions: list[Any] = field(default_factory=list)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def merge_results(results: Sequence[TrainResult]) -> TrainResult:
    """Consecutive ``train()`` calls as one result: the last call's parameters, the calls'
    losses, events, restarts and segments in order, their time, samples and dollars summed,
    each function's highest peak."""
    peaks: dict[str, int] = {}
    for result in results:
        for worker, peak in result.peak_bytes.items():
            peaks[worker] = max(peaks.get(worker, 0), peak)
    return TrainResult(parameters=results[-1].parameters, losses=[loss for r in results for loss in r.losses],
                       events=[event for r in results for event in r.events],
                       restarts=[restart for r in results for restart in r.restarts],
                       degrees=[degrees for r in results for degrees in r.degrees],
                       wall_s=sum(r.wall_s for r in results), samples=sum(r.samples for r in results),
                       dollars=sum(r.dollars for r in results), peak_bytes=peaks,
                       switches=[switch for r in results for switch in r.switches],
                       decisions=[decision for r in results for decision in r.decisions])
