"""The plan re-chosen when the observed load moves the batch sizes (Gillis §IV-C, for the
batches the batcher really forms).

A plan is solved for one batch size: Gillis's latency model prices a fork-join group at that
size, and the cheapest plan within the SLO at 4 samples is not the one at 64 (more samples
make a larger tier or a split group pay; fewer make them waste). The served model was planned
for its example's batch; under load the batcher forms other sizes. :class:`PlanChooser`
tracks them (the last ``SIZES_KEPT`` batches) and every ``LOOK_EVERY`` batches takes their
``QUANTILE`` (the size the plan must serve within the SLO for nearly every batch). When that
has moved by ``MOVE_FACTOR`` or more from the size the current plan was chosen for, it solves
again with ``replan_solver`` (``solvers.dp`` by default: exact, Gillis's model for inference)
for a batch of that size within the batch's share of the SLO, h·S/2 (``serve.batcher``: two
batch times fit the headroom). A plan with other stages, tiers or splits replaces the served
one through the blue/green path of a version switch (``Service.switch_to``: no request is
dropped), and the log says why: the current plan misses the batch budget at the new size
("needed to meet the SLO"), or the new one is cheaper per batch within it.

Re-choosing needs what ``flatpack.compile`` made in this process (the layer chain and the
Problem, ``compiler.with_plan``): a model given by name or as an ``nn.Module``. An artifact
directory carries only its stages; it is served with the plan it was compiled with.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

from flatpack import logs
from flatpack.compiler import Compiled, with_plan
from flatpack.errors import PlanError
from flatpack.partitioner.cost import gillis
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.solvers import get_solver
from flatpack.partitioner.workload import Workload
from flatpack.serve.batcher import HEADROOM

LOG = logs.get("serve")
SIZES_KEPT = 64         # the batches the distribution is read from
LOOK_EVERY = 32         # batches between two looks (a solve costs a fraction of a second)
QUANTILE = 0.9          # the batch size a plan must serve: nearly every batch is at most this
MOVE_FACTOR = 2.0       # a re-choice when the size moved at least this much either way


@dataclass(frozen=True)
class Replan:
    """A plan to switch to: the compiled model cut by it, the batch size it was chosen for, why."""

    compiled: Compiled
    batch: int
    reason: str


def stages_of(plan: Plan) -> tuple:
    """What makes two plans run differently: each stage's layers, tier, replicas and split."""
    return tuple((stage.start, stage.end, stage.memory_mb, stage.replicas, stage.split) for stage in plan.stages)


def can_replan(compiled: Compiled) -> bool:
    """Whether ``compiled`` can be cut again here (it was compiled in this process)."""
    return compiled.graph is not None and compiled.problem is not None


class PlanChooser:
    """Tracks the batch sizes served under ``compiled``'s plan and solves again when they move."""

    def __init__(self, compiled: Compiled, slo_s: float, solver: Any) -> None:
        self.compiled = compiled
        self.budget_s = HEADROOM * slo_s / 2        # one batch's share of the SLO (serve.batcher)
        self._solver = get_solver(solver)
        workload = compiled.plan.provenance.workload if compiled.plan.provenance is not None else None
        self.chosen_for: int | None = int(workload["batch"]) if workload else None
        self._sizes: deque[int] = deque(maxlen=SIZES_KEPT)
        self._since_look = 0

    def observe(self, samples: int) -> int | None:
        """Records a batch; returns the batch size to re-choose the plan for when the sizes
        moved (every ``LOOK_EVERY`` batches at most), else None."""
        self._sizes.append(samples)
        self._since_look += 1
        if self._since_look < LOOK_EVERY:
            return None
        self._since_look = 0
        ordered = sorted(self._sizes)
        size = ordered[min(len(ordered) - 1, int(QUANTILE * len(ordered)))]
        if self.chosen_for is not None and 1 / MOVE_FACTOR < size / self.chosen_for < MOVE_FACTOR:
            return None
        return size

    def choose(self, batch: int) -> Replan | None:
        """The plan for batches of ``batch`` samples within the batch budget, when it differs
        from the served one (else None, and the served plan counts as chosen for ``batch``)."""
        assert self.compiled.problem is not None    # can_replan was checked before a chooser was made
        problem = dataclasses.replace(self.compiled.problem,
                                      workload=Workload(mode="infer", batch=batch, slo_s=self.budget_s))
        plan = self._solver(problem)
        previous = self.chosen_for
        self.chosen_for = batch
        if stages_of(plan) == stages_of(self.compiled.plan):
            LOG.info("batches moved to %d samples (the plan was chosen for %s); the same plan is still the one "
                     "to serve", batch, previous)
            return None
        reason = self._reason(problem, plan, batch, previous)
        candidate = with_plan(self.compiled, dataclasses.replace(plan, provenance=self.compiled.plan.provenance))
        return Replan(candidate, batch, reason)

    def adopt(self, replan: Replan) -> None:
        """The switch to ``replan`` went through: its plan is the served one from now on."""
        self.compiled = replan.compiled
        self.chosen_for = replan.batch

    def _reason(self, problem: Any, plan: Plan, batch: int, previous: int | None) -> str:
        moved = f"the batches moved to {batch} samples (the plan was chosen for {previous})"
        try:
            current = gillis.latency(problem, self.compiled.plan)
            chosen = gillis.latency(problem, plan)
        except PlanError:       # compiled without a profile: Gillis has nothing to price
            return f"{moved}; the solver chose another plan for them"
        if not current.fits or current.latency_s > self.budget_s:
            return (f"{moved}: the served plan takes {current.latency_s * 1e3:.1f} ms per batch, over the "
                    f"{self.budget_s * 1e3:.1f} ms budget; another plan is needed to meet the SLO "
                    f"({chosen.latency_s * 1e3:.1f} ms)")
        return (f"{moved}: another plan is cheaper within the SLO (${chosen.dollars_per_request:.3g} per batch "
                f"instead of ${current.dollars_per_request:.3g}, {chosen.latency_s * 1e3:.1f} ms within the "
                f"{self.budget_s * 1e3:.1f} ms budget)")
