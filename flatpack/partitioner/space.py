"""The choices a solver may make for a problem — memory tiers, replica degrees, micro-batch
counts and (for fork-join inference) worker counts — read in one place so that every
solver searches the same space and their answers can be compared, brute force included.

``Problem.options`` may narrow or widen each set:

``memory_mb``       tiers to consider (default: the platform's tiers; FuncPipe's 8 on Lambda)
``replicas``        data-parallel degrees d (default FuncPipe's {1, 2, 4, 8, 16}, at most M)
``micro_batches``   micro-batch counts M (default: the workload's M only)
``max_workers``     the most workers one fork-join group forks (default 8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from flatpack.errors import InputError, PlanError
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.workload import check_divides

DEFAULT_REPLICAS = (1, 2, 4, 8, 16)
DEFAULT_MAX_WORKERS = 8


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _positive_ints(value: Any, what: str) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else tuple(value)
    if not items or any(not isinstance(item, int) or isinstance(item, bool) or item < 1 for item in items):
        raise InputError(f"option {what} must be positive integers, got {value!r}")
    return tuple(sorted(set(items)))


@dataclass(frozen=True)
class SearchSpace:
    memory_mb: tuple[int, ...]
    replicas: tuple[int, ...]
    micro_batches: tuple[int, ...]
    max_workers: int

    @classmethod
    def of(cls, problem: Problem) -> SearchSpace:
        options = problem.options
        platform = problem.platform
        memory = _positive_ints(_given(options.memory_mb, platform.memory_choices), "memory_mb")
        for size in memory:
            platform.tier(size)  # raises, naming the allowed sizes, when the platform has no such tier
        workload = problem.workload
        if workload.mode == "infer":
            micro_batches: tuple[int, ...] = (workload.micro_batch_count,)
        else:
            micro_batches = _positive_ints(_given(options.micro_batches, workload.micro_batches), "micro_batches")
            for count in micro_batches:
                check_divides(workload.batch, count)
        replicas = _positive_ints(_given(options.replicas, DEFAULT_REPLICAS), "replicas")
        usable = tuple(d for d in replicas if d <= max(micro_batches))
        if workload.mode == "train" and not usable:
            raise PlanError(f"every replica degree in {list(replicas)} exceeds the {max(micro_batches)} micro-batches "
                            "of an iteration, so some replicas would idle; allow replicas=1 or more micro-batches")
        max_workers = int(_given(options.max_workers, DEFAULT_MAX_WORKERS))
        if max_workers < 0:
            raise InputError(f"option max_workers must be >= 0, got {max_workers}")
        return cls(memory, usable or (1,), micro_batches, max_workers)

    def replicas_for(self, micro_batches: int) -> tuple[int, ...]:
        """Degrees d that leave no replica idle at M = ``micro_batches``."""
        return tuple(d for d in self.replicas if d <= micro_batches)

    def configurations(self) -> Iterable[tuple[int, int]]:
        """(M, d) pairs in the space."""
        for count in self.micro_batches:
            for degree in self.replicas_for(count):
                yield count, degree
