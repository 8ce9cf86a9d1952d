"""A line in the micro-batch size, ``per_sample * batch + fixed``: how the profiler fits the
times and sizes it measures over several batch sizes (FuncPipe §4), and how the profile data
(``ir.profile``), the in-target profiler (``measure``, ``runtime.profile_function``) and the
calibrations store them. Plain Python, no torch: the solvers read these lines."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Linear:
    """``per_sample * batch + fixed``; both terms are clamped to be non-negative."""

    per_sample: float
    fixed: float = 0.0

    def at(self, batch: float) -> float:
        return self.per_sample * batch + self.fixed

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.per_sample + other.per_sample, self.fixed + other.fixed)

    def scaled(self, factor: float) -> Linear:
        return Linear(self.per_sample * factor, self.fixed * factor)

    @classmethod
    def fit(cls, batches: Sequence[float], values: Sequence[float]) -> Linear:
        """Least-squares line through ``(batch, value)``; a single point gives a line through
        the origin. Negative terms (noise on a near-constant cost) are clamped to zero and the
        other term refitted, so the fit never predicts a negative time or size."""
        if len(batches) != len(values) or not batches:
            raise ValueError("fit needs as many values as batch sizes, and at least one")
        if len(set(batches)) == 1:
            return cls(max(sum(values) / len(values) / batches[0], 0.0), 0.0)
        count = len(batches)
        mean_batch = sum(batches) / count
        mean_value = sum(values) / count
        spread = sum((batch - mean_batch) ** 2 for batch in batches)
        slope = sum((batch - mean_batch) * (value - mean_value) for batch, value in zip(batches, values)) / spread
        intercept = mean_value - slope * mean_batch
        if slope < 0:
            return cls(0.0, max(mean_value, 0.0))
        if intercept < 0:
            through_origin = sum(b * v for b, v in zip(batches, values)) / sum(b * b for b in batches)
            return cls(max(through_origin, 0.0), 0.0)
        return cls(slope, intercept)

    def to_json(self) -> list[float]:
        return [self.per_sample, self.fixed]

    @classmethod
    def from_json(cls, data: Sequence[float]) -> Linear:
        per_sample, fixed = data
        return cls(float(per_sample), float(fixed))
