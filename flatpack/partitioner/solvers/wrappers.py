"""Solvers built on other solvers, as ``flatpack run``, ``plan`` and ``deploy`` use them:
:class:`WithTiers` (a memory tier for every stage a cutting solver left without one),
:class:`FixedCuts` (the cuts the user names: ``--stages N`` or ``--split-points``) and
:class:`FastestOnFront` (the fastest plan on dp's Pareto front, ``--pick fastest``).
:func:`solver_for` is the solver a training run compiles with."""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from dataclasses import dataclass
from typing import Any, Sequence, cast

from flatpack.errors import InputError
from flatpack.partitioner.cost.funcpipe import with_tiers
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.solvers import PICKS, available_solvers, get_solver
from flatpack.partitioner.solvers.base import CostSolver
from flatpack.table import plural

__all__ = ["PICKS", "FastestOnFront", "FixedCuts", "WithTiers", "check_split_points", "dp", "run_solver", "solver_for",
           "split_layer"]


def solver_for(name: Any) -> Any:
    """The solver ``flatpack run`` compiles with: the named one, and for a solver that only
    cuts (``balanced`` leaves every stage without a memory tier) the smallest tier that fits
    each stage, so the cost model can predict the run (:func:`funcpipe.with_tiers`). An
    unknown name is refused with the close matches."""
    if isinstance(name, str):
        base = name.split("{", 1)[0].strip()
        names = list(available_solvers())
        if base not in names:
            close = difflib.get_close_matches(base, names, n=2, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise InputError(f"unknown solver {base!r}; {hint}the solvers are: {', '.join(names)}")
    return WithTiers(get_solver(name))


@dataclass(frozen=True)
class WithTiers:
    """A solver whose plans get a memory tier for every stage left without one."""

    solver: Any

    @property
    def name(self) -> str:
        return getattr(self.solver, "name", str(self.solver))

    def __call__(self, problem: Any) -> Any:
        return with_tiers(problem, self.solver(problem))


@dataclass(frozen=True)
class FixedCuts:
    """A solver that cuts where the user says: before each module in ``split_points`` (as
    torch.distributed.pipelining's ``SplitPoint.BEGINNING`` does), or into ``stages`` stages
    of balanced parameter bytes. Every stage ``replicas`` replicas (``--stages 2 --replicas 2``:
    2 × 2); :class:`WithTiers` gives each the smallest memory tier that fits."""

    split_points: tuple[str, ...] = ()
    stages: int | None = None
    replicas: int = 1
    stage_replicas: tuple[int, ...] = ()      # each stage's own degree, in stage order (``--stage-replicas``)

    @classmethod
    def of(cls, split_points: Sequence[str], stages: int | None, degrees: Sequence[int] | int | None,
           stage_replicas: Sequence[int] = ()) -> FixedCuts:
        """The user's cuts, every stage the one degree ``--replicas`` names (else one replica:
        a list of degrees is the solver's choice, and no solver runs), or each its own degree
        of ``stage_replicas``."""
        if isinstance(degrees, int):
            degrees = (degrees,)
        return cls(tuple(split_points), stages, degrees[0] if degrees is not None and len(degrees) == 1 else 1,
                   tuple(stage_replicas))

    @property
    def name(self) -> str:
        return f"split-points {','.join(self.split_points)}" if self.split_points else plural(self.stages or 0, "stage")

    def __call__(self, problem: Any) -> Any:
        plan = self._cut(problem)
        degrees = self.stage_replicas or (self.replicas,) * len(plan.stages)
        if len(degrees) != len(plan.stages):
            raise InputError(f"--stage-replicas {','.join(map(str, degrees))} names {len(degrees)} degrees, but the "
                             f"cuts make {len(plan.stages)} stages (the model has too few layers for more); give one "
                             "degree per stage")
        if all(degree == 1 for degree in degrees):
            return plan
        return dataclasses.replace(plan, stages=tuple(dataclasses.replace(stage, replicas=degree)
                                                      for stage, degree in zip(plan.stages, degrees)))

    def _cut(self, problem: Any) -> Plan:
        if not self.split_points:
            return get_solver("balanced")(dataclasses.replace(problem, stages=self.stages))
        starts = [split_layer(problem.chain, point) for point in self.split_points]
        if sorted(set(starts)) != starts or 0 in starts:
            raise InputError(f"--split-points {','.join(self.split_points)} cut at layers {starts}: they must name "
                             "modules in the order the model runs them, none of them the first layer, each in a "
                             "different layer (see flatpack inspect MODEL for the layers)")
        bounds = [0, *starts, len(problem.chain)]
        return Plan.from_ranges([(begin, end - 1) for begin, end in itertools.pairwise(bounds)], len(problem.chain),
                                "split-points")


def split_layer(chain: Any, module: str) -> int:
    """The index of the first layer of ``chain`` that runs module ``module`` (a layer is named
    ``module.path:op``): the stage that begins there."""
    names = [layer.name.split(":", 1)[0] for layer in chain]
    for index, name in enumerate(names):
        if name == module or name.startswith(module + "."):
            return index
    close = difflib.get_close_matches(module, sorted(set(names)), n=3, cutoff=0.5)
    hint = f"; layers begin at {', '.join(close)}" if close else ""
    raise InputError(f"--split-points: no layer begins at module {module!r} after the passes{hint}. A split point "
                     "must start a layer: see the layer names with flatpack inspect MODEL, or keep more layers with "
                     "--passes fuse-elementwise")


def check_split_points(model: Any, points: Sequence[str]) -> None:
    """Refuses split points that name no module of ``model`` (a torch ``nn.Module``), with the
    close matches."""
    modules = dict(model.named_modules())
    for point in points:
        if point not in modules:
            close = difflib.get_close_matches(point, list(modules), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise InputError(f"--split-points: {type(model).__name__} has no module {point!r}; {hint}name modules as "
                             "model.named_modules() does, e.g. bert.encoder.layer.2")


def dp() -> CostSolver:
    """dp, the exact cost-model solver, whose front the job reports and picks from."""
    return cast(CostSolver, get_solver("dp"))  # the registry's "dp" is solvers.dp.Dp, a CostSolver


@dataclass(frozen=True)
class FastestOnFront:
    """A solver: the fastest plan on dp's Pareto front."""

    name: str = "dp-fastest"

    def __call__(self, problem: Any) -> Any:
        return dp().front(problem).plans[0]


def run_solver(pick: str, solver: Any, stages: int | None, split_points: tuple[str, ...],
               replicas: Sequence[int] = (1,), stage_replicas: Sequence[int] = ()) -> Any:
    """The solver a training run compiles with: fixed cuts (``stages`` or ``split_points``;
    every stage the one degree of ``replicas`` when it names one, else one replica), else the
    fastest plan on dp's front (``pick`` "fastest"), else ``solver`` with tiers."""
    if stages or split_points:
        return WithTiers(FixedCuts.of(split_points, stages, replicas, stage_replicas))
    return FastestOnFront() if pick == "fastest" else solver_for(solver)
