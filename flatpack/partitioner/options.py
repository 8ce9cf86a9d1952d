"""``Problem.options`` as typed data: the search space, the objective and the cost models'
knobs a caller may set, each a named field, so that a misspelt option is refused where it is
given instead of being ignored by every solver.

Values are kept as given (a tier may be ``2048`` or ``[1024, 2048]``); the module that uses an
option checks its value (``partitioner/space.py`` the search space, ``cost/registry.py`` the cost
model and its typed options, ``solvers/base.py`` ``weights``, ``solvers/hydrozoa_planner.py``
``cluster_size``).
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any, Mapping

from flatpack.errors import InputError


@dataclass(frozen=True)
class ProblemOptions:
    """What a caller may set besides the workload (None: the default the user of the option picks)."""

    memory_mb: Any = None          # tiers to consider (space.py; default: the platform's)
    replicas: Any = None           # data-parallel degrees d (space.py; default FuncPipe's {1, 2, 4, 8, 16})
    micro_batches: Any = None      # micro-batch counts M (space.py; default: the workload's M only)
    max_workers: Any = None        # the most workers one fork-join group forks (space.py; default 8)
    weights: Any = None            # (α₁, α₂): minimize α₁·cost + α₂·time (solvers/base.py)
    cost_model: str | None = None  # "hydrozoa" or "pipedream" for GPU-container training (cost/registry.py)
    hydrozoa_alpha: float | None = None   # Hydrozoa's α and β (cost/hydrozoa.py sync_overheads; None: the
    hydrozoa_beta: float | None = None    # calibration's fit, else 0)
    comm_delay: Any = None         # measured EMG parameters of Gillis's delay model (cost/registry.py GillisModel)
    cluster_size: Any = None       # Hydrozoa Alg. 1's desired workers (solvers/hydrozoa_planner.py)
    threads: int = 1               # compute threads per function (cost/funcpipe.py)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def of(cls, given: ProblemOptions | Mapping[str, Any] | None, caller: str = "Problem") -> ProblemOptions:
        """The options ``given`` as keywords; an unknown name is refused naming the closest known one."""
        if given is None:
            return cls()
        if isinstance(given, ProblemOptions):
            return given
        if not isinstance(given, Mapping):
            raise InputError(f"{caller}'s options must be keyword options, got {type(given).__name__}")
        known = cls.names()
        unknown = sorted(set(given) - set(known))
        if unknown:
            hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, 1))
                     else repr(name) for name in unknown]
            raise InputError(f"unknown option(s) {', '.join(hints)} for {caller} (known: {', '.join(sorted(known))})")
        return cls(**given)

    def given(self) -> dict[str, Any]:
        """The options set to something other than their default, by name (for reports and JSON)."""
        defaults = ProblemOptions()
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) != getattr(defaults, name)}

    def with_changes(self, **changes: Any) -> ProblemOptions:
        """These options with ``changes``, checked like :meth:`of`."""
        return ProblemOptions.of({**self.given(), **changes})
