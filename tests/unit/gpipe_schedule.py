"""A toy schedule, the whole of it: what adding a flush-type schedule to flatpack takes is
this class and its registration (``test_schedules.py`` registers it, and names it in
``FLATPACK_SCHEDULES`` for the workers, which are processes of their own).

GPipe's order as ``torch.distributed.pipelining.ScheduleGPipe`` runs it: every forward,
then every backward in the same (not the reversed) micro-batch order. Its gradients are
sync's, summed in another order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

from flatpack.schedules import Action, Computation, Schedule


@dataclass(frozen=True)
class GPipe(Schedule):
    name: ClassVar[str] = "gpipe"
    description: ClassVar[str] = "GPipe: all forwards, then all backwards in micro-batch order"

    def actions(self, stage: int, stages: int, owned: Sequence[int]) -> list[Action]:
        return ([Action(stage, Computation.FORWARD, m) for m in owned]
                + [Action(stage, Computation.BACKWARD, m) for m in owned])

    def iteration_s(self, pipeline_bound_s: float, simulated_s: Callable[[], float]) -> float:
        return simulated_s()
