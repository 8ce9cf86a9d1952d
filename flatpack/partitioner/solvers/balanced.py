"""balanced: cut the chain into K stages with the most even parameter bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from flatpack.errors import PlanError
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.table import plural

DEFAULT_STAGES = 2


@dataclass(frozen=True)
class Balanced:
    """Exact min–max split: minimizes the largest stage's parameter bytes, then the bytes
    crossing the cuts, by dynamic programming over (layers, stages) — O(K·n²).

    The placeholder solver until the cost-model solvers land, and kept by name afterwards:
    a quick way to get K stages of similar weight without a profile. ``Problem.stages``
    defaults to 2.
    """

    name: ClassVar[str] = "balanced"

    def __call__(self, problem: Problem) -> Plan:
        count = len(problem.chain)
        stages = DEFAULT_STAGES if problem.stages is None else problem.stages
        if not isinstance(stages, int) or stages < 1:
            raise PlanError(f"stages must be a positive integer, got {stages!r}")
        if stages > count:
            raise PlanError(
                f"cannot cut a chain of {plural(count, 'layer')} into {plural(stages, 'stage')}. Ask for at most "
                f"{plural(count, 'stage')}, or keep more layers by dropping merge-branches/coarsen from "
                "the pass pipeline (passes=\"fuse-elementwise\")."
            )
        prefix = [0]
        for layer in problem.chain:
            prefix.append(prefix[-1] + layer.param_bytes)
        infinity = (float("inf"), float("inf"))
        # best[k][i]: (max stage bytes, cut bytes) for layers[:i] in k stages
        best = [[infinity] * (count + 1) for _ in range(stages + 1)]
        choice = [[0] * (count + 1) for _ in range(stages + 1)]
        best[0][0] = (0, 0)
        for k in range(1, stages + 1):
            for i in range(k, count - (stages - k) + 1):
                for j in range(k - 1, i):
                    previous = best[k - 1][j]
                    if previous == infinity:
                        continue
                    cut_bytes = problem.chain[j - 1].boundary_bytes if j > 0 else 0
                    candidate = (max(previous[0], prefix[i] - prefix[j]), previous[1] + cut_bytes)
                    if candidate < best[k][i]:
                        best[k][i] = candidate
                        choice[k][i] = j
        ranges = []
        end = count
        for k in range(stages, 0, -1):
            start = choice[k][end]
            ranges.append((start, end - 1))
            end = start
        plan = Plan.from_ranges(ranges[::-1], count, self.name)
        max_bytes, cut_bytes = best[stages][count]
        return Plan(plan.stages, count, self.name,
                    {"max_stage_param_bytes": int(max_bytes), "cut_boundary_bytes": int(cut_bytes)})
