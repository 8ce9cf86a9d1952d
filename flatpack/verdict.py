"""Is a pipelined run what single-process training computes? The verdict ``flatpack run`` and
``flatpack demo`` print: the reference (single-process training of the original module with
the same micro-batching), the tolerances that follow from the optimizer, and the checks."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flatpack import schedules
from flatpack.analysis.reference import call, first_output, train_async_single_process, train_single_process
from flatpack.backends.functions import checkpoint_tensors, workload_of
from flatpack.job_options import JobOptions
from flatpack.runtime.optim import OptimizerSpec
from flatpack.weights import with_aliases


# -- the verdict: is the pipelined run what single-process training computes? ---------------
#
# "Equivalent" means: the run's final weights, buffers and optimizer state are those of
# single-process training of the original module with the SAME micro-batching (gradient
# accumulation over the micro-batches the runtime cuts, each loss scaled by b/B, one step per
# iteration; BatchNorm normalizes each micro-batch with its own statistics and a stage's
# reported running statistics are replica 0's, updated by its micro-batches in order), up to
# the rounding of summing the same gradients in another order (micro-batches accumulated per
# replica, then reduced across replicas). The tolerances follow from the optimizer:
#
# * gradients, compared tightly through the optimizer state (SGD's momentum buffer, Adam's
#   exp_avg and exp_avg_sq: weighted sums of every step's gradients and their squares),
#   per tensor relative to its largest element: |Δ| <= tol * max|ref|. After ONE step both
#   runs took their gradients at the same weights, so only float32 summation order differs
#   (a few ulps of the summands; measured 2.7e-7 on zoo resnet50, M = 4): tol = 1e-4
#   (STATE_RTOL_FIRST). After more steps the gradients are taken at weights that legitimately
#   differ (by up to the Adam bound below; BatchNorm over 4-sample micro-batches then moves
#   them by 1.2e-3 relative after 3 Adam steps, measured): tol = 1e-2 (STATE_RTOL), an
#   empirical margin, not a derived bound. Either still catches a real gradient error: a
#   dropped or doubled micro-batch, a missing b/B scale or a stale weight changes them by
#   O(1/M) >= 0.1 for the M <= 8 of these runs. (A first-step check of a longer run would
#   need the iteration-0 checkpoint, which the runtime deletes once a later one exists.)
# * weights under SGD (linear in the gradients): |Δ| <= SGD_ATOL + SGD_RTOL * |w|, as
#   torch.allclose.
# * weights under Adam: its step divides by sqrt(v), so a gradient element near zero whose
#   rounding differs can move the step by up to its full size; no relative bound on the
#   gradients carries over to the weights. What does: Adam's step is bounded per element.
#   With bias correction, m̂_t = Σ w_i g_i and v̂_t = Σ u_i g_i², and Cauchy-Schwarz gives
#   |m̂_t| / sqrt(v̂_t) <= c_t = sqrt(Σ_i w_i² / u_i)
#     = sqrt((1-β1)²(1-β2^t) / ((1-β1^t)²(1-β2)) · Σ_{k<t} (β1²/β2)^k)
#   (c_1 = 1, c_t ~ 1 for the first steps with the default betas; eps and L2 weight decay
#   only shrink or re-enter through g). Two runs from the same weights therefore differ after
#   T steps by at most 2·lr·Σ_t c_t per element: the bound the weights are held to. It is
#   rigorous but loose, which is why the gradients are compared tightly as well.
# * buffers (BatchNorm running statistics, counters): functions of activations at those
#   weights: floating ones as the weights under SGD (Adam: the state tolerance relative to
#   each tensor's largest element), integer ones exactly.
#
# * ``--precision bf16`` and ``fp16``: the reference is single-process autocast with the same
#   micro-batches, computing as the stages do (``train_single_process(pipeline=compiled,
#   threads=1)``): through the compiled stages, with every float32 tensor one stage hands
#   another rounded to the wire dtype (forward, and backward for its gradient, as the workers
#   send them), fp16's loss scaled and the step skipped as torch.amp.GradScaler does, and
#   torch's intra-op threads those of the workers (one). The threads matter: a 16-bit GEMM
#   rounds its float32 sums to 16 bits, and how a CPU kernel splits a sum across threads
#   moves some of them across a rounding boundary. The earlier reference (the original module,
#   the process's threads, a 1.6e-2 bound) was 5.6e-3 of the update away after one step and
#   4-5 % after four to eight, so correct runs were reported FAILED; so computed, the run is
#   the reference bit for bit (measured: 8 steps, a conv net and a transformer, sync and 1F1B,
#   1 and 2 replicas per stage, SGD and Adam; tests/integration/test_precision_knobs.py).
#   What can still differ is what differs in float32, the order in which the same gradients
#   are summed (replicas, tied weights, accumulation), and its 16-bit consequence: weights
#   δ apart can flip the 16-bit rounding of an activation element, which then moves by up to
#   2^-8 (bf16; fp16 2^-11) of its value, but only with probability about δ / 2^-8, so a
#   gradient, a sum over many such elements, moves by about δ again: the roundings make the
#   float32 difference sparser, not larger, and it does not compound faster with the steps.
#   The float32 tolerances therefore hold at any step count (one step: 1e-4, summation order
#   only; more: 1e-2), and under SGD, whose weights move linearly in the gradients, the
#   weights may also differ by that gradient tolerance of how far training moved each tensor
#   (max|w - w0|). They still catch what matters: the same run without autocast is 3.7e-2
#   from the autocast reference after one step, a dropped micro-batch O(1/M)
#   (tests/integration/test_precision_knobs.py holds a dropped one to FAILED).
#
# Dropout (and any random draw in train mode): the run keeps it on, and the reference runs the
# compiled stages with each stage's forward seeded as the workers seed it (per batch of the run's
# data, stage and micro-batch: ``reference.StageSeeds``), so it draws the run's masks and is held to the same
# bounds (tests/integration/test_dropout_verdict.py). A run that re-planned changed its stages'
# seeds mid-run and is not checked.

STATE_RTOL_FIRST, STATE_RTOL = 1e-4, 1e-2
ZERO_FLOOR = 1e-3
SGD_RTOL, SGD_ATOL = 1e-4, 1e-5
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def adam_step_bound(betas: tuple[float, float], step: int) -> float:
    """c_t: the largest |m̂_t| / sqrt(v̂_t) any gradients can give at step ``step`` (>= 1)."""
    beta1, beta2 = betas
    ratio = sum((beta1 * beta1 / beta2) ** k for k in range(step))
    return math.sqrt((1 - beta1) ** 2 * (1 - beta2 ** step) / ((1 - beta1 ** step) ** 2 * (1 - beta2)) * ratio)


def adam_weight_bound(lr: float | list[float], betas: tuple[float, float], iterations: int) -> float:
    """The most two Adam runs from the same weights can differ per element after
    ``iterations`` steps, whatever their gradients: 2·Σ lr_t·c_t (plus float slack); ``lr``
    one rate, or each step's under a schedule."""
    rates = lr if isinstance(lr, list) else [lr] * iterations
    return 2 * sum(rate * adam_step_bound(betas, t) for t, rate in enumerate(rates[:iterations], 1)) + 1e-6


@dataclass(frozen=True)
class Check:
    what: str          # "weights", "gradients (optimizer state)", "buffers"
    worst: float       # the largest |Δ| (for relative checks: |Δ| / max|ref| of the tensor)
    bound: str         # the bound, in words
    passed: bool
    where: str = ""    # the tensor with the worst |Δ| (or the first that failed)

    def line(self) -> str:
        where = f" at {self.where}" if self.where else ""
        return (f"  {'ok    ' if self.passed else 'FAILED'} {self.what}: max {self.worst:.3g}{where} "
                f"(bound {self.bound})")


@dataclass
class Verdict:
    equivalent: bool | None       # None: not checkable (the reason is in ``note``)
    stages: int
    replicas: tuple[int, ...]
    micro_batches: int
    iterations: int
    optimizer: str
    checks: list[Check] = field(default_factory=list)
    dropouts: int = 0             # nn.Dropout modules with p > 0 (the run trains with them on)
    seeded: bool = False          # the reference drew the run's random numbers (``StageSeeds``)
    note: str = ""

    @property
    def max_weight_diff(self) -> float | None:
        weights = [check.worst for check in self.checks if check.what == "weights"]
        return max(weights) if weights else None

    def coverage(self) -> str:
        cut = ("" if self.stages > 1 else
               "; 1 stage: no pipeline cut was exercised, only the micro-batching and the replicas")
        return (f"{self.stages} stage{'s' * (self.stages != 1)}, replicas {','.join(map(str, self.replicas))}, "
                f"{self.micro_batches} micro-batch{'es' * (self.micro_batches != 1)}, {self.iterations} "
                f"iteration{'s' * (self.iterations != 1)}, {self.optimizer}{cut}")

    def describe(self) -> str:
        return "\n".join([self._head(), *(check.line() for check in self.checks), f"  {self._draws()}"])

    def _draws(self) -> str:
        """What the check says of the model's random draws (dropout)."""
        what = (f"dropout on (p > 0 in {self.dropouts} module{'s' * (self.dropouts != 1)})" if self.dropouts
                else "random draws in train mode" if self.seeded else "no random draws in train mode (no dropout)")
        if not self.seeded:
            return what
        return (f"{what}: the reference ran the compiled stages seeded as the workers seed them (per batch of "
                "the run's data, stage and micro-batch), so it drew the run's masks")

    def _head(self) -> str:
        if self.equivalent is None:
            head = f"equivalence with single-process training: NOT CHECKED ({self.coverage()}): {self.note}"
        elif self.equivalent:
            head = (f"equivalence with single-process training: passed: equivalent ({self.coverage()}) to "
                    "single-process training with the same micro-batches")
        else:
            head = (f"equivalence with single-process training: FAILED: not equivalent ({self.coverage()})"
                    + (f": {self.note}" if self.note else ""))
        return head


@dataclass
class _Worst:
    """One check's running result over its tensors: the largest difference, whether every
    tensor passed, and where: the worst tensor that failed, else the worst one."""

    worst: float = 0.0
    where: str = ""
    passed: bool = True
    count: int = 0

    def add(self, where: str, worst: float, passed: bool) -> None:
        if (self.passed and not passed) or (passed == self.passed and worst > self.worst):
            self.where = where
        self.worst = max(self.worst, worst)
        self.passed = self.passed and passed
        self.count += 1

    def check(self, what: str, bound: str) -> Check:
        return Check(what, self.worst, bound, self.passed, self.where)


@dataclass(frozen=True)
class _Tolerances:
    """The bounds one comparison holds the run to (see the tolerances above), and their words."""

    steps: int                  # the optimizer's steps
    adam_bound: float | None    # Adam-like: the bound on each weight element; SGD: None
    state_rtol: float
    precision: str
    initial: dict[str, torch.Tensor] | None

    @classmethod
    def of(cls, spec: OptimizerSpec, iterations: int, precision: str,
           initial: dict[str, torch.Tensor] | None) -> _Tolerances:
        steps = iterations // spec.accumulate
        adam_bound = adam_weight_bound(spec.learning_rates(steps), spec.betas, steps) if spec.is_adam_like else None
        if precision != "fp32" and adam_bound is None and initial is None:
            raise ValueError(f"a {precision} run under SGD is compared through its updates: pass the initial state")
        return cls(steps, adam_bound, STATE_RTOL_FIRST if steps <= 1 else STATE_RTOL, precision, initial)

    @property
    def sixteen_bits(self) -> bool:
        return self.precision != "fp32"

    def sgd_bound(self, name: str, expected: torch.Tensor) -> torch.Tensor:
        """SGD moves weights linearly in the gradients, so a 16-bit run's gradient tolerance
        carries over to its weights relative to the size of the update, not of the weight
        (a bias that starts at zero would otherwise have no room at all)."""
        bound = SGD_ATOL + SGD_RTOL * expected.abs()
        if self.sixteen_bits:
            assert self.initial is not None  # refused in of(): a 16-bit run under SGD needs it
            bound = bound + self.state_rtol * float((expected - self.initial[name].double()).abs().max())
        return bound

    def weight_passed(self, name: str, diff: torch.Tensor, expected: torch.Tensor) -> bool:
        if self.adam_bound is not None:
            return bool((diff <= self.adam_bound).all())
        return bool((diff <= self.sgd_bound(name, expected.double())).all())

    def buffer_passed(self, name: str, diff: torch.Tensor, expected: torch.Tensor) -> bool:
        if not expected.is_floating_point():
            return bool((diff == 0).all())
        if self.adam_bound is not None:
            return bool((diff <= self.state_rtol * float(expected.double().abs().max()) + SGD_ATOL).all())
        return bool((diff <= self.sgd_bound(name, expected.double())).all())

    def weight_bound(self) -> str:
        if self.adam_bound is not None:
            return f"2·lr·Σc_t = {self.adam_bound:.3g}, Adam's step bound over {self.steps} steps"
        return f"{SGD_ATOL:g} + {SGD_RTOL:g}·|w|" + (f" + {self.state_rtol:g}·max|w - w0|" if self.sixteen_bits else "")

    def gradient_bound(self) -> str:
        return (f"{self.state_rtol:g}" + (" (one step: summation order only)" if self.steps <= 1 else
                                          f" (after {self.steps} steps at drifting weights)")
                + (f"; {self.precision} against the reference computed as the stages compute"
                   if self.sixteen_bits else ""))

    def buffer_bound(self) -> str:
        if self.adam_bound is not None:
            return f"{self.state_rtol:g}·max|ref| + {SGD_ATOL:g}; integers exact"
        return (f"{SGD_ATOL:g} + {SGD_RTOL:g}·|b|" + (f" + {self.state_rtol:g}·max|b - b0|" if self.sixteen_bits
                                                      else "") + "; integers exact")


def _compare_tensors(reference: nn.Module, parameters: dict[str, torch.Tensor], tolerances: _Tolerances,
                     missing: list[str]) -> tuple[_Worst, _Worst | None]:
    """The run's weights and buffers against the reference's (buffers None: it has none);
    appends to ``missing`` what the run lacks or holds in another shape."""
    trainable = {id(p) for p in reference.parameters() if p.requires_grad}
    weights, buffers = _Worst(), _Worst()
    state = reference.state_dict(keep_vars=True)
    for name, expected in state.items():
        got = parameters.get(name)
        if got is None:
            missing.append(name)
            continue
        expected = expected.detach()
        if got.shape != expected.shape:
            missing.append(f"{name} (shape {tuple(got.shape)}, expected {tuple(expected.shape)})")
            continue
        if not expected.numel():
            continue
        diff = (got.double() - expected.double()).abs()
        if id(state[name]) in trainable:
            weights.add(name, float(diff.max()), tolerances.weight_passed(name, diff, expected))
        else:
            buffers.add(name, float(diff.max()), tolerances.buffer_passed(name, diff, expected))
    return weights, buffers if any(id(t) not in trainable for t in state.values()) else None


def _largest_by_key(reference_state: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """The largest element of each kind of optimizer tensor (``exp_avg``, ...) over all parameters."""
    largest: dict[str, float] = {}
    for entries in reference_state.values():
        for key, expected in entries.items():
            if expected.numel():
                largest[key] = max(largest.get(key, 0.0), float(expected.double().abs().max()))
    return largest


def _compare_state(reference_state: dict[str, dict[str, torch.Tensor]],
                   pipelined_state: dict[str, dict[str, torch.Tensor]], state_rtol: float,
                   missing: list[str]) -> _Worst:
    """The run's optimizer tensors against the reference's, |Δ|/max|ref| per tensor; appends
    to ``missing`` those the run lacks."""
    # a tensor whose gradient is zero in exact arithmetic (attention's key bias: softmax
    # ignores a shift) holds only rounding noise; its scale is floored at ZERO_FLOOR of the
    # largest tensor's of the same kind, the size that noise is relative to
    largest = _largest_by_key(reference_state)
    gradients = _Worst()
    for name, entries in reference_state.items():
        for key, expected in entries.items():
            if key not in STATE_KEYS:
                continue
            got = pipelined_state.get(name, {}).get(key)
            if got is None:
                missing.append(f"{key} of {name}")
                continue
            scale = max(float(expected.double().abs().max()) if expected.numel() else 0.0,
                        ZERO_FLOOR * largest.get(key, 0.0))
            worst = float((got.double() - expected.double()).abs().max()) / scale if scale else (
                float(got.double().abs().max()) if got.numel() else 0.0)
            gradients.add(f"{key} of {name}", worst, worst <= state_rtol)
    return gradients


def compare_training(reference: nn.Module, parameters: dict[str, torch.Tensor],
                     reference_state: dict[str, dict[str, torch.Tensor]],
                     pipelined_state: dict[str, dict[str, torch.Tensor]], optimizer: Any,
                     iterations: int, precision: str = "fp32",
                     initial: dict[str, torch.Tensor] | None = None) -> tuple[list[Check], str]:
    """The checks above of a run's final ``parameters`` and optimizer state against the
    reference's; returns them and a note naming what is missing, if anything. A bf16 run
    under SGD needs the ``initial`` state: its weights are held to the gradient tolerance of how
    far training moved each tensor."""
    tolerances = _Tolerances.of(OptimizerSpec.of(optimizer), iterations, precision, initial)
    missing: list[str] = []
    weights, buffers = _compare_tensors(reference, parameters, tolerances, missing)
    gradients = _compare_state(reference_state, pipelined_state, tolerances.state_rtol, missing)
    checks = [weights.check("weights", tolerances.weight_bound())]
    if gradients.count:
        checks.append(gradients.check("gradients (optimizer state, |Δ|/max|ref| per tensor)",
                                      tolerances.gradient_bound()))
    if buffers is not None:
        checks.append(buffers.check("buffers", tolerances.buffer_bound()))
    note = f"missing from the run: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else ""
    return checks, note


def draws_random(model: nn.Module, example: Any) -> bool:
    """Whether a train-mode forward of ``model`` (a copy) depends on the random seed."""
    outputs = []
    for seed in (1, 2):
        probe = copy.deepcopy(model).train()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                outputs.append(first_output(call(probe, example)))
            except Exception:  # noqa: BLE001 - a model that cannot run this probe is trained anyway
                return False
    return not torch.equal(outputs[0], outputs[1])


def fixed_buffers_of(compiled: Any) -> Any:
    """For micro-batch m, the buffers the run's reported weights never saw m update: those of
    stages with d replicas where m mod d != 0 (a stage reports replica 0's buffers)."""
    by_stage = []
    for artifact, stage in zip(compiled.artifacts, compiled.plan.stages):
        names = {alias for entry in artifact.manifest.parameters if entry.kind == "buffer"
                 for alias in (entry.aliases or (entry.name,))}
        by_stage.append((stage.replicas, names))
    return lambda m: {name for replicas, names in by_stage if m % replicas for name in names}


def parameter_stages(compiled: Any) -> dict[str, int]:
    """Each parameter's stage by every name it has (the stages' manifests): which stage's
    weight versions it follows in the asynchronous schedule's simulation."""
    return {alias: artifact.index for artifact in compiled.artifacts for entry in artifact.manifest.parameters
            for alias in entry.all_names}


def pipeline_optimizer_state(deployment: Any, compiled: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Each trainable parameter's optimizer tensors in the last checkpoint every stage took,
    by every name the parameter has (stage optimizers index them in manifest order)."""
    iteration = deployment.consistent_checkpoint()
    found: dict[str, dict[str, torch.Tensor]] = {}
    if iteration is None:
        return found
    for index, artifact in enumerate(compiled.artifacts):
        tensors = checkpoint_tensors(deployment.store, deployment.keys, index, iteration)
        trainable = [entry for entry in artifact.manifest.parameters if entry.trainable]
        for position, entry in enumerate(trainable):
            entries = {key.rsplit("/", 1)[1]: tensor for key, tensor in tensors.items()
                       if key.startswith(f"o/{position}/")}
            for alias in entry.all_names:
                found.setdefault(alias, entries)
    return found


def verdict(initial: nn.Module, compiled: Any, batches: list, options: JobOptions, loss: str,
            parameters: dict[str, torch.Tensor], pipelined_state: dict[str, dict[str, torch.Tensor]], *,
            dropouts: int, example: Any, replanned: bool = False) -> Verdict:
    """Trains the reference from the run's initial weights with the run's micro-batches and
    checks the run against it (see the tolerances above). A model that draws random numbers
    in train mode (dropout) is compared with the compiled stages seeded as the workers seed
    them (``reference.StageSeeds``); ``replanned``: the run switched plans, so its stages and
    their seeds changed mid-run, and such a model cannot be checked."""
    run_iterations = options.batches.iterations
    if run_iterations is None:
        raise ValueError("the verdict needs the run's iterations: pass the JobOptions training_data resolved")
    stages = compiled.plan.stages
    # the run's M as the backend resolved it (the plan's, else its workload's: --micro-batches)
    micro_batches = compiled.plan.micro_batches_for(workload_of(compiled))
    optimizer = options.optimizer_spec()
    found = Verdict(None, len(stages), tuple(stage.replicas for stage in stages), micro_batches,
                    run_iterations, optimizer.describe(), dropouts=dropouts)
    draws = draws_random(initial, example)
    if draws and replanned:
        found.note = ("the model draws random numbers in train mode (dropout) and the run re-planned: the stages, "
                      "and the seeds each draws with, changed mid-run, which the reference does not follow; run "
                      "without --replan, or with dropout p = 0, to check equivalence")
        return found
    found.seeded = draws

    # a tied weight is checkpointed under one name; the reference's state_dict has each
    parameters = with_aliases(compiled, parameters)
    reference_state: dict[str, dict[str, torch.Tensor]] = {}
    # under bf16/fp16 the reference computes as the stages do (see the tolerances above): it
    # rounds what crosses the plan's cuts, with the workers' one intra-op thread
    # with random draws it runs the stages, seeded as the workers seed them, to draw the run's masks
    sixteen_bits = options.train.precision != "fp32"
    pipeline = compiled if sixteen_bits or found.seeded else None
    threads = 1 if sixteen_bits else None
    schedule = schedules.get(options.train.schedule)
    if not schedule.flush:
        # the simulation of the asynchronous schedule: `flatpack run --eval-every N` trains in
        # calls of N iterations, and the pipeline drains at the end of each
        reference, _ = train_async_single_process(
            initial, batches, run_iterations, schedule=schedule, stage_of=parameter_stages(compiled),
            stages=len(stages), micro_batches=micro_batches, optimizer=optimizer, loss=loss,
            vertical_sync=options.train.vertical_sync, call_iterations=options.evaluation.eval_every or None,
            optimizer_state=reference_state, precision=options.train.precision, pipeline=pipeline, threads=threads,
            seeded=found.seeded, replicas=tuple(stage.replicas for stage in stages),
            fixed_buffers=fixed_buffers_of(compiled))
    else:
        reference, _ = train_single_process(initial, batches, run_iterations, loss=loss, optimizer=optimizer,
                                            micro_batches=micro_batches, fixed_buffers=fixed_buffers_of(compiled),
                                            optimizer_state=reference_state, precision=options.train.precision,
                                            pipeline=pipeline, threads=threads, seeded=found.seeded)
    # the bounds grow with the optimizer's steps: one per round under an asynchronous schedule
    iterations = run_iterations * max(schedule.optimizer_steps(micro_batches, stage.replicas) for stage in stages)
    found.checks, found.note = compare_training(reference, parameters, reference_state, pipelined_state,
                                                optimizer, iterations, options.train.precision,
                                                initial.state_dict())
    found.equivalent = not found.note and all(check.passed for check in found.checks)
    return found
