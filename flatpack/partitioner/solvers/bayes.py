"""bayes: Bayesian optimization over a plan's joint configuration — CherryPick's method
(Alipourfard et al., NSDI '17: a Gaussian-process surrogate of a configuration's cost, and
expected improvement to pick the next configuration to try). It is the black-box baseline of
both papers the cost models come from: Gillis's "BO" (Gillis §V-C, "the
same design as Cherrypick ... expected improvement"), and FuncPipe's "Bayes"
(FuncPipe §5.1 and App. D: partition and resources optimized jointly, each
configuration priced by the performance model, 100 iterations — this solver's default
budget; FuncPipe notes it "fails to find a feasible configuration for over half of our
training tasks with 20 iterations"). It sees the cost model only through
:func:`~flatpack.partitioner.objective.evaluate`, one plan at a time, so its answer is the
best plan among the ``evaluations`` it priced, not an optimum.

Encoding. One fixed-length vector per plan, the same for every trial (the GP needs one input
space), built from :class:`~flatpack.partitioner.solvers.sampled.DecisionSpace`:

* ``cut{i}`` ∈ {0, 1} for i < L−1: a stage ends after layer i;
* ``tier{i}``, one per layer *slot* (one ``tier`` under Gillis, where every function has the
  same memory): the index into the sorted tiers. A stage takes the slot of its first layer,
  so moving one cut changes the tier of one stage only, not of every stage after it;
* ``degree{i}`` per slot under PipeDream and Gillis, one ``degree`` otherwise: the index into
  every degree any M allows. At the chosen M the degree is clamped to the largest allowed
  (d ≤ M), a repair rather than a rejection: those vectors are not plans to learn from;
* ``micro``: the index into the micro-batch counts M that allow some degree.

Indices are integer parameters, which the GP treats as ordered: more memory is faster and
dearer, a higher degree index is a larger degree, so neighbouring values behave alike.
Decisions with one choice are left out of the vector. Distinct vectors can make the same plan
(the tier of a slot inside a stage is ignored); :class:`Incumbent` prices each plan once but
counts every evaluation against the budget.

Goal and constraints. The GP models the log of what is minimized — α₁·cost + α₂·time for a
weighted goal, dollars for an SLO goal — since both span orders of magnitude across plans.
Infeasibility is handled as optuna intends, with constraint values per trial
(``Trial.set_constraint``; optuna 5 deprecates ``GPSampler(constraints_func=...)`` in its
favour): ``memory`` is 1 for a plan that overflows a function's memory and 0 otherwise, and
for an SLO goal ``slo`` = log(time / SLO), feasible at ≤ 0. GPSampler then fits one GP per
constraint and maximizes log constrained expected improvement (logEI + log P(feasible),
Gardner et al. ICML '14), so an infeasible plan still teaches the surrogate its objective and
where the constraints bite, instead of being a penalty value that would distort the GP. The
plan returned is always the best fitting, SLO-meeting plan priced (:class:`Incumbent`), never
a guess of the surrogate.

Backend: optuna's GPSampler, chosen by measurement against a BoTorch loop on the same
encoding, start and budget (SingleTaskGP per outcome, LogConstrainedExpectedImprovement,
optimize_acqf_mixed_alternating; the table is in ``benchmarks/bayes_backends.py``). At 30
evaluations, 2 seeds, median gap to the exact optimum on the 14-layer chains: optuna 2.2 %
against 23 % (training, weights), 120 % against 580 % (training, SLO), 8 % against 35 %
(inference, weights), 74 % against 43 % (inference, SLO: BoTorch's one win). On the 4-layer
chains neither is ahead (BoTorch met a tight SLO in 3 of 4 runs, optuna in 2). Optuna took
2–16 s a solve, BoTorch 29–108 s (its GP refit each step dominates); in about BoTorch's time
at 30, optuna prices 100 plans, which brought the 14-layer gaps to 1.6 %, 90 %, 3 % and
54 %. And BoTorch would add gpytorch, linear_operator and scikit-learn to the dependencies.

Bounds: at most ``evaluations`` plans priced, and no new trial starts after ``time_limit_s``
(a trial in progress finishes). With the same ``seed`` the same plan comes back, as long as
the evaluation budget, not the time limit, ends the search.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, Iterator, Mapping, Sequence

import optuna

from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.problem import Problem
from flatpack.partitioner.solvers.base import CostSolver, Goal
from flatpack.partitioner.solvers.sampled import DecisionSpace, Incumbent, one_thread, positive

TINY = 1e-300  # keeps log() finite for a zero cost or time


@dataclass(frozen=True)
class Encoding:
    """The fixed-length vector of one plan's decisions (see the module docstring)."""

    space: DecisionSpace

    def dimensions(self) -> dict[str, int]:
        """Each decision's name and number of choices; one with a single choice is no
        dimension of the GP and is left out."""
        space = self.space
        dims = {f"cut{i}": 2 for i in range(space.num_layers - 1)}
        dims.update({name: len(space.memory_mb) for name in self._slots("tier", space.tier_per_stage)})
        dims.update({name: len(space.all_degrees) for name in self._slots("degree", space.degree_per_stage)})
        dims["micro"] = len(space.micro_batches)
        return {name: choices for name, choices in dims.items() if choices > 1}

    def plan(self, values: Mapping[str, int], solver: str) -> Plan:
        """The plan of one vector: ``values`` maps each dimension to its choice's index
        (a dimension left out has one choice, index 0)."""
        space = self.space
        cuts = [bool(values.get(f"cut{i}", 0)) for i in range(space.num_layers - 1)]
        starts = [0, *(i + 1 for i, cut in enumerate(cuts) if cut)]
        micro_batches = space.micro_batches[values.get("micro", 0)]
        allowed = space.degrees_for(micro_batches)

        def per_stage(names: list[str]) -> list[int]:
            # a stage takes the slot of its first layer; a shared decision has one slot
            return [values.get(names[start] if len(names) > 1 else names[0], 0) for start in starts]

        tiers = [space.memory_mb[i] for i in per_stage(self._slots("tier", space.tier_per_stage))]
        degrees = [allowed[min(i, len(allowed) - 1)]  # the repair: d ≤ M
                   for i in per_stage(self._slots("degree", space.degree_per_stage))]
        return space.plan(cuts, tiers, degrees, micro_batches, solver)

    def _slots(self, what: str, per_slot: bool) -> list[str]:
        return [f"{what}{i}" for i in range(self.space.num_layers)] if per_slot else [what]


@dataclass(frozen=True)
class Bayes(CostSolver):
    """GP-surrogate Bayesian optimization (optuna's GPSampler); see the module docstring.

    ``evaluations``: plans priced at most (FuncPipe's BO baseline used 100); ``time_limit_s``:
    no trial starts after it (a front shares it among its goals);
    ``startup``: random plans before the GP proposes any (CherryPick starts from a few);
    ``seed``: seeds the random start and the acquisition search.
    """

    name: ClassVar[str] = "bayes"
    exact: ClassVar[bool] = False
    evaluations: int = 100
    time_limit_s: float = 60.0
    startup: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for what in ("evaluations", "startup"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"bayes {what} must be a positive integer, got {value!r}")
        if not isinstance(self.time_limit_s, (int, float)) or isinstance(self.time_limit_s, bool):
            raise InputError(f"bayes time_limit_s must be a number of seconds, got {self.time_limit_s!r}")
        positive(self.time_limit_s, "time_limit_s", "bayes")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise InputError(f"bayes seed must be an integer, got {self.seed!r}")

    def solve_all(self, problem: Problem, goals: Sequence[Goal]) -> list[Plan | None]:
        """Each goal with the full ``evaluations`` and an even share of ``time_limit_s``, as
        ``rl`` shares its time over a front."""
        share = dataclasses.replace(self, time_limit_s=self.time_limit_s / len(goals))
        return [share.solve(problem, goal) for goal in goals]

    def solve(self, problem: Problem, goal: Goal) -> Plan | None:
        encoding = Encoding(DecisionSpace.of(problem))
        dimensions = encoding.dimensions()
        incumbent = Incumbent(problem, goal, self.name)

        def objective(trial: optuna.Trial) -> float:
            values = {name: trial.suggest_int(name, 0, choices - 1) for name, choices in dimensions.items()}
            evaluation = incumbent.price(encoding.plan(values, self.name))
            trial.set_constraint("memory", 0.0 if evaluation.fits else 1.0)
            if goal.slo_s is None:
                return math.log(max(evaluation.objective(goal.weights), TINY))
            trial.set_constraint("slo", math.log(max(evaluation.time_s, TINY) / max(goal.slo_s, TINY)))
            return math.log(max(evaluation.dollars, TINY))

        with _optuna_session():
            sampler = optuna.samplers.GPSampler(seed=self.seed, n_startup_trials=self.startup,
                                                deterministic_objective=True, warn_independent_sampling=False)
            study = optuna.create_study(direction="minimize", sampler=sampler)
            study.optimize(objective, n_trials=self.evaluations, timeout=self.time_limit_s)
        return incumbent.result(backend=f"optuna {optuna.__version__} GPSampler (log constrained EI)",
                                evaluations=incumbent.samples, evaluation_budget=self.evaluations,
                                startup=self.startup, seed=self.seed)


@contextmanager
def _optuna_session() -> Iterator[None]:
    """One solve's settings, restored afterwards so that the caller's stay as they were:
    optuna's per-trial INFO lines and experimental warnings silenced, and torch on one thread
    (:func:`~flatpack.partitioner.solvers.sampled.one_thread`)."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.WARNING)
    try:
        with one_thread(), warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)
