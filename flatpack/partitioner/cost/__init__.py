"""Cost models: pure functions of (profiled chain, plan, platform, workload) that return a
breakdown, not only a total, and a ``to_json()`` for ``Plan.predictions``.

* :mod:`.funcpipe` — FuncPipe's storage-based training pipeline (FuncPipe
  §3.4, App. B), and :func:`check_layers_fit`, the "a layer is larger than any tier" check;
* :mod:`.gillis` — Gillis's fork-join inference (Gillis §IV);
* :mod:`.hydrozoa` — Hydrozoa's A×B hybrid parallelism (Hydrozoa §3.3–3.4, App. A);
* :mod:`.pipedream` — PipeDream's slowest-stage model with replicated stages
  (the PipeDream dissertation §5.3.1);
* :mod:`.collectives` — the synchronization formulas they share.

Every model reads compute time through ``Problem.layer_seconds``, so a calibration measured
on the target applies to all of them.
"""

from flatpack.partitioner.cost import funcpipe, gillis, hydrozoa, pipedream
from flatpack.partitioner.cost.collectives import (ring_allreduce_seconds, scatter_reduce_coefficients,
                                                   scatter_reduce_seconds)
from flatpack.partitioner.cost.common import MemoryNeed
from flatpack.partitioner.cost.funcpipe import PipelineCost, check_layers_fit
from flatpack.partitioner.cost.gillis import CommDelay, ForkJoinCost, ForkJoinPlan, Group, billed_seconds
from flatpack.partitioner.cost.hydrozoa import HybridCost
from flatpack.partitioner.cost.pipedream import PipeDreamCost

__all__ = [
    "CommDelay", "ForkJoinCost", "ForkJoinPlan", "Group", "HybridCost", "MemoryNeed", "PipeDreamCost",
    "PipelineCost", "billed_seconds", "check_layers_fit", "funcpipe", "gillis", "hydrozoa", "pipedream",
    "ring_allreduce_seconds", "scatter_reduce_coefficients", "scatter_reduce_seconds",
]
