"""The main job: compile a model for a target, show the plan front, deploy it, train a few
pipelined iterations, print predicted versus measured, check equivalence with single-process
training and leave the plots. ``flatpack run`` and ``flatpack demo`` call :func:`run_training`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import io
import itertools
import math
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TextIO, cast

import torch
from torch import nn

import flatpack
from flatpack import logs
from flatpack.analysis import chrome_trace, gantt, report
from flatpack.analysis.reference import call, first_output, torch_threads
from flatpack.analysis.refit import EVENTS_FILE
from flatpack.backends import local
from flatpack.backends.batch_checks import NON_FINITE
from flatpack.backends.functions import merge_results
from flatpack.backends.replan import DEFAULT_THRESHOLD, SKIP_FIRST, PlanSwitch, ReplanPolicy
from flatpack.data import (Batches, batches_from_record, check_against_example, first_batch_rows, make_batches,
                           parse_source, split_shards)
from flatpack.errors import FlatpackError, InputError, RunFailure
from flatpack.evaluation import evaluate
from flatpack.partitioner import report as plan_report
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.funcpipe import with_tiers
from flatpack.partitioner.plan import Plan
from flatpack.partitioner.solvers import available_solvers, get_solver
from flatpack.partitioner.solvers.base import CostSolver
from flatpack.partitioner.workload import RECOMPUTE, Workload
from flatpack.platform.calibration import Calibration
from flatpack.platform.catalog import get_platform
from flatpack.profiler import ProfileOptions
from flatpack.progress import ProgressLine
from flatpack.rundir import PRIVATE_FILE_MODE, RUN_FILE, RunDirectory, RunRecord, fingerprint_changes
from flatpack.runtime import timeline
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec, check_loss
from flatpack.runtime.settings import split_options
from flatpack.runtime.spec import ASYNC_SCHEDULE, SCHEDULES, check_async_options
from flatpack.stage.settings import PRECISIONS
from flatpack.table import plural
from flatpack.verdict import pipeline_optimizer_state, verdict
from flatpack.weights import save_state_dict, state_dict_of

LOG = logs.get("job")


# --loss names on the command line and what the runtime calls them
LOSS_NAMES = {"cross-entropy": "cross_entropy", "cross_entropy": "cross_entropy", "mse": "mse",
              "output": "output"}


@dataclass
class JobOptions:
    batch: int = 32
    micro_batches: int = 4
    iterations: int | None = 4     # None with --data: --epochs full passes over the data
    # any torch.optim optimizer by name (adam, adamw, sgd: momentum 0.9 unless optimizer_args
    # says otherwise, ...) with its keyword options, or a whole OptimizerSpec (then the knobs
    # below it stand for are taken from it)
    optimizer: str | OptimizerSpec = "adam"
    lr: float = 0.01
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    # a learning-rate schedule by name (cosine, linear, step, ... or a torch.optim.lr_scheduler
    # class) with its options, after ``warmup`` steps of linear warm-up; None: a constant rate
    schedule_lr: str | None = None
    schedule_args: dict[str, Any] = field(default_factory=dict)
    warmup: int = 0
    no_decay_bias_norm: bool = False       # weight_decay 0 for biases and norm weights (< 2 dims)
    clip_grad_norm: float | None = None    # the global gradient norm over every stage, at most this
    accumulate: int = 1                    # optimizer steps every K iterations: a K x larger batch
    # every N iterations (0: never) the loss (and for classification the accuracy) on held-out
    # data, through the inference path: eval_data (a --data SOURCE) or eval_fraction of --data
    eval_every: int = 0
    eval_data: Any = None
    eval_fraction: float = 0.0
    schedule: str = "sync"
    vertical_sync: bool = False            # 1f1b-async: every stage on the first stage's weight version
    sync: str = "pipelined"
    solver: str = "dp"
    passes: str | None = None
    replicas: tuple[int, ...] = (1, 2)
    memory_mb: tuple[int, ...] | None = None
    out: Path = field(default_factory=lambda: Path("flatpack-run"))
    verify: bool = True
    seed: int = 0
    # iterations between checkpoints; 0: the shortest interval whose upload costs at most 5%
    # of an iteration's time (funcpipe.checkpoint_cost). A lost function recovers with any
    # interval; `flatpack resume` after a crash of the runner restarts from the last one
    checkpoint_every: int = 0
    # "recommended": the solver's choice (FuncPipe's recommendation for dp); "fastest": the
    # fastest plan on dp's Pareto front
    pick: str = "recommended"
    # a NaN or infinity in the data or an iteration's loss: "warn", "error" (stop) or "ignore"
    non_finite: str = "warn"
    # --data: a directory or s3://bucket/prefix of shards, a module:factory returning a Dataset,
    # or (Python) a DataLoader or flatpack.data.DataSource; None: synthetic batches
    data: Any = None
    store_endpoint: str | None = None   # the S3 endpoint of an s3:// --data (None: AWS)
    epochs: int = 1
    shuffle: bool = True
    drop_last: bool = False
    # "auto": the model output's `loss` when it has one, else cross-entropy for (batch, classes)
    # outputs and mean squared error otherwise; or cross-entropy, mse
    loss: str = "auto"
    save: Path | None = None             # also write the trained state dict here (.safetensors)
    # fixed cuts instead of the solver's: N stages of balanced parameter bytes, or a stage
    # beginning at each named module (torch.distributed.pipelining's split points)
    stages: int | None = None
    split_points: tuple[str, ...] = ()
    # a calibration file (flatpack calibrate --target local, or flatpack profile --target):
    # the prediction uses its measurements instead of the catalog's and the store round trip
    # measured at deploy; the plan records its digest
    calibration: Path | None = None
    # "bf16"/"fp16": autocast in every stage, float32 master weights and optimizer state,
    # bfloat16/float16 tensors between stages, fp16 with GradScaler's loss scaling
    # (runtime.precision); the verdict's reference autocasts and rounds at the cuts too
    precision: str = "fp32"
    # "auto": the solver may let a stage recompute its activations in the backward instead of
    # keeping them (a smaller tier for one more forward); "never": every stage keeps them
    recompute: str = "never"
    # re-fit the cost model to each epoch of --epoch-iterations iterations and switch to a plan
    # predicted at least replan_threshold faster (backends.replan; the run ends with the
    # weights a run on one plan reaches)
    replan: bool = False
    epoch_iterations: int | None = None
    replan_threshold: float = DEFAULT_THRESHOLD

    def check(self) -> None:
        """Refuses options no run can use, each with its cause and fix, before anything is
        loaded, compiled or started (``flatpack run``/``demo`` call it first)."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise InputError(message)

        need(isinstance(self.batch, int) and self.batch >= 1,
             f"--batch must be a positive number of samples per iteration, got {self.batch}; use e.g. --batch 32")
        need(isinstance(self.micro_batches, int) and self.micro_batches >= 1,
             f"--micro-batches must be at least 1, got {self.micro_batches}; use e.g. --micro-batches 4")
        need(self.micro_batches <= self.batch,
             f"--micro-batches {self.micro_batches} is more than the {self.batch} samples of a batch, so some "
             f"micro-batches would be empty; use at most --micro-batches {self.batch} or a larger --batch")
        if self.batch % self.micro_batches:
            fits = next(m for m in range(self.micro_batches, 0, -1) if self.batch % m == 0)
            raise InputError(f"--batch {self.batch} does not divide into {self.micro_batches} equal micro-batches "
                             f"(the plan and the cost model assume equal ones); use --micro-batches {fits} or a "
                             f"--batch that is a multiple of {self.micro_batches}, e.g. "
                             f"{self.batch + self.micro_batches - self.batch % self.micro_batches}")
        need((self.iterations is None and self.data is not None)
             or (isinstance(self.iterations, int) and self.iterations >= 1),
             f"--iterations must be at least 1 (the number of global batches to train), got {self.iterations}")
        need(isinstance(self.epochs, int) and self.epochs >= 1,
             f"--epochs must be at least 1 (full passes over --data), got {self.epochs}")
        need(self.data is not None or (self.epochs == 1 and not self.drop_last and self.store_endpoint is None),
             "--epochs, --drop-last and --store-endpoint apply to --data; give --data SOURCE or leave them out")
        if ":" in str(self.loss):
            check_loss(self.loss)      # refuses it, saying why (data never names code)
        need(self.loss == "auto" or self.loss in LOSS_NAMES,
             f"--loss must be auto or one of {', '.join(LOSS_NAMES)}, got {self.loss!r}")
        need(self.save is None or Path(self.save).suffix == ".safetensors",
             f"--save {self.save}: the weights are written as safetensors; name the file *.safetensors")
        need(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
             f"--lr must be a positive, finite learning rate, got {self.lr}; use e.g. --lr 0.01")
        spec = self.optimizer_spec()      # refuses unknown names and options, listing the valid ones
        need(self.schedule in SCHEDULES, f"--schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        check_async_options(self.schedule, self.vertical_sync, self.replicas, spec, precision=self.precision)
        need(self.iterations is None or self.iterations % spec.accumulate == 0,
             f"--iterations {self.iterations} is not a multiple of --accumulate {spec.accumulate}: the last "
             f"{(self.iterations or 0) % spec.accumulate} iterations would never step; use --iterations "
             f"{(self.iterations or 0) // spec.accumulate * spec.accumulate or spec.accumulate} or another "
             "--accumulate")
        need(spec.schedule is None or self.iterations is None
             or spec.schedule.warmup < self.optimizer_steps(self.iterations),
             f"--warmup {spec.schedule.warmup if spec.schedule else 0} is not shorter than the run's "
             f"{self.optimizer_steps(self.iterations or 0)} optimizer steps; use a shorter warm-up or more "
             "--iterations")
        need(isinstance(self.eval_every, int) and self.eval_every >= 0,
             f"--eval-every must be a number of iterations >= 0 (0: no evaluation), got {self.eval_every}")
        need(isinstance(self.eval_fraction, (int, float)) and 0 <= self.eval_fraction < 1,
             f"--eval-fraction must be in [0, 1) (the share of --data held out), got {self.eval_fraction}; "
             "use e.g. --eval-fraction 0.1")
        need(not self.eval_every or self.data is None or self.eval_data is not None or self.eval_fraction > 0,
             "--eval-every needs held-out data: give --eval-data SOURCE or --eval-fraction F (of --data)")
        need(bool(self.eval_every) or (self.eval_data is None and not self.eval_fraction),
             "--eval-data and --eval-fraction apply to --eval-every N; give it, or leave them out")
        need(not self.eval_fraction or self.data is not None,
             "--eval-fraction holds out a share of --data; give --data SOURCE, or --eval-data SOURCE instead")
        need(self.eval_data is None or not self.eval_fraction,
             "--eval-data and --eval-fraction both name the held-out data; give one")
        need(bool(self.replicas) and all(isinstance(d, int) and d >= 1 for d in self.replicas),
             f"--replicas lists data-parallel degrees, each at least 1, got {','.join(map(str, self.replicas))}; "
             "use e.g. --replicas 1,2")
        need(min(self.replicas) <= self.micro_batches,
             f"every degree in --replicas {','.join(map(str, self.replicas))} exceeds the {self.micro_batches} "
             "micro-batches of an iteration, so replicas would idle; allow --replicas 1 or use more --micro-batches")
        if self.memory_mb:
            platform = get_platform("local")
            for size in self.memory_mb:
                need(isinstance(size, int) and size >= 1, f"--memory takes tiers in MB, each positive, got {size}")
                platform.tier(size)   # names the sizes the local platform offers
        need(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
             f"checkpoint_every must be 0 (only the last iteration) or a positive count, got {self.checkpoint_every}")
        need(self.pick in ("recommended", "fastest"), f"pick must be 'recommended' or 'fastest', got {self.pick!r}")
        need(self.non_finite in NON_FINITE,
             f"--non-finite must be one of {', '.join(NON_FINITE)}, got {self.non_finite!r}")
        need(not self.out.exists() or self.out.is_dir(),
             f"--out {self.out} is a file; give a directory (it is created if missing)")
        if self.calibration is not None:
            # read and checked now: a bad file is refused before anything is compiled or started
            need(Calibration.load(self.calibration).platform == "local",
                 f"--calibration {self.calibration} was measured on another target; flatpack run trains on local "
                 "functions: use `flatpack calibrate --target local`")
        need(self.stages is None or (isinstance(self.stages, int) and self.stages >= 1),
             f"--stages must be a positive number of stages, got {self.stages}")
        need(self.stages is None or not self.split_points,
             "--stages and --split-points both fix the cuts; give one (N split points make N + 1 stages)")
        need((self.stages is None and not self.split_points) or self.pick == "recommended",
             "--pick chooses from the solver's front; with --stages or --split-points the cuts are fixed")

        need(self.precision in PRECISIONS,
             f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}; use fp32 (the default), bf16 "
             "(autocast with float32 master weights) or fp16 (the same with a loss scaler)")
        need(self.recompute in RECOMPUTE,
             f"--recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}; use never (the default: every "
             "stage keeps its activations) or auto (the solver may recompute them per stage to fit a smaller tier)")
        if self.pick != "fastest":
            solver_for(self.solver)
        self._check_replan(need)

    def _check_replan(self, need: Any) -> None:
        need(self.replan or (self.epoch_iterations is None and self.replan_threshold == DEFAULT_THRESHOLD),
             "--epoch-iterations and --replan-threshold apply to --replan; give it, or leave them out")
        if not self.replan:
            return
        need(isinstance(self.epoch_iterations, int) and self.epoch_iterations > SKIP_FIRST,
             f"--replan re-plans every --epoch-iterations N iterations from the iterations after each epoch's first "
             f"{SKIP_FIRST} (cold starts, warm-up); give --epoch-iterations {SKIP_FIRST + 1} or more")
        need(self.iterations is None or self.iterations > (self.epoch_iterations or 0),
             f"--epoch-iterations {self.epoch_iterations} is not shorter than the run's {self.iterations} "
             "iterations, so there is no epoch boundary to re-plan at; use fewer or more --iterations")
        need(isinstance(self.replan_threshold, (int, float)) and 0 <= self.replan_threshold < 1,
             f"--replan-threshold is the least predicted saving that switches plans, a share in [0, 1), got "
             f"{self.replan_threshold}; use e.g. {DEFAULT_THRESHOLD}")
        need(self.schedule != ASYNC_SCHEDULE,
             "--replan switches plans between epochs, and 1f1b-async has micro-batches in flight across "
             "iterations with stashed weights no checkpoint holds; use --schedule sync or 1f1b, or leave --replan out")
        need(self.precision == "fp32",
             f"--replan with --precision {self.precision}: tensors are rounded to {self.precision} at the stage "
             "boundaries, which move with the plan, so the single-process check cannot reproduce the run; use "
             "--precision fp32 with --replan")
        need(not self.eval_every,
             "--replan switches plans at --epoch-iterations boundaries inside one training call, and --eval-every "
             "trains as calls of N iterations; give one of them")


    def optimizer_steps(self, iterations: int) -> int:
        """The optimizer steps of ``iterations``: one per K under --accumulate K, and one per
        micro-batch under 1f1b-async (PipeDream's minibatch)."""
        if self.schedule == ASYNC_SCHEDULE:
            return iterations * self.micro_batches
        return iterations // self.accumulate if isinstance(self.accumulate, int) and self.accumulate >= 1 else 1

    def optimizer_spec(self, iterations: int | None = None) -> OptimizerSpec:
        """The run's optimizer as the plain data every stage and the reference build it from;
        a schedule's length (cosine's T_max, ...) defaults to the run's optimizer steps after
        the warm-up. An unknown name or option is an InputError listing the valid ones."""
        iterations = iterations or self.iterations or 1
        if isinstance(self.optimizer, OptimizerSpec):
            knobs = ("optimizer_args", "schedule_lr", "schedule_args", "warmup", "no_decay_bias_norm", "clip_grad_norm",
                     "accumulate")
            defaults = JobOptions()
            given = [name for name in knobs if getattr(self, name) != getattr(defaults, name)]
            if given:
                raise InputError(f"optimizer is an OptimizerSpec, which holds {', '.join(given)} itself; set them "
                                 "in the spec, not beside it")
            return self.optimizer
        if self.schedule_args and not self.schedule_lr:
            raise InputError("--schedule-args apply to --schedule-lr NAME; give it, or leave them out")
        options = dict(self.optimizer_args)
        lr = options.pop("lr", self.lr)
        schedule = (ScheduleSpec(self.schedule_lr, dict(self.schedule_args), self.warmup) if self.schedule_lr
                    else ScheduleSpec("constant", {}, self.warmup) if self.warmup else None)
        return OptimizerSpec(self.optimizer, lr, options, self.no_decay_bias_norm,
                             schedule.with_length(self.optimizer_steps(iterations)) if schedule is not None else None,
                             self.clip_grad_norm, self.accumulate)


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
    of balanced parameter bytes. Every stage one replica; :class:`WithTiers` gives each the
    smallest memory tier that fits."""

    split_points: tuple[str, ...] = ()
    stages: int | None = None

    @property
    def name(self) -> str:
        return f"split-points {','.join(self.split_points)}" if self.split_points else plural(self.stages or 0, "stage")

    def __call__(self, problem: Any) -> Any:
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


def check_split_points(model: nn.Module, points: Sequence[str]) -> None:
    """Refuses split points that name no module of ``model``, with the close matches."""
    modules = dict(model.named_modules())
    for point in points:
        if point not in modules:
            close = difflib.get_close_matches(point, list(modules), n=3, cutoff=0.5)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise InputError(f"--split-points: {type(model).__name__} has no module {point!r}; {hint}name modules as "
                             "model.named_modules() does, e.g. bert.encoder.layer.2")


def _dp() -> CostSolver:
    """dp, the exact cost-model solver, whose front the job reports and picks from."""
    return cast(CostSolver, get_solver("dp"))  # the registry's "dp" is solvers.dp.Dp, a CostSolver


@dataclass(frozen=True)
class FastestOnFront:
    """A solver: the fastest plan on dp's Pareto front."""

    name: str = "dp-fastest"

    def __call__(self, problem: Any) -> Any:
        return _dp().front(problem).plans[0]


@dataclass
class JobResult:
    compiled: Any
    train: Any
    comparison: Any
    calibrated: Any          # the comparison with β and t_lat measured on iteration 1 (None for short runs)
    max_param_diff: float | None
    equivalent: bool | None
    files: list[Path]
    evaluations: list[Any] = field(default_factory=list)   # evaluation.Evaluation, every --eval-every

    def to_json(self) -> dict[str, Any]:
        """What ``flatpack run --json`` prints: the plan, the training's figures, predicted vs
        measured, the verdict and the files written."""
        train = self.train
        return {"digest": self.compiled.digest, "plan": self.compiled.plan.to_json(),
                "iterations": len(train.losses), "losses": list(train.losses), "wall_s": train.wall_s,
                "samples_per_s": train.samples_per_s, "dollars": train.dollars,
                "restarts": [restart.describe() for restart in train.restarts],
                "switches": [switch.to_json() for switch in train.switches],
                "comparison": self.comparison.to_json(),
                "calibrated": self.calibrated.to_json() if self.calibrated is not None else None,
                "equivalent": self.equivalent, "max_param_diff": self.max_param_diff,
                "evaluations": [dataclasses.asdict(found) for found in self.evaluations],
                "files": [str(path) for path in self.files]}


@dataclass
class ResumeResult:
    """What ``flatpack resume`` did: ``state`` is the run's state after it ("done", or
    "abandoned" with --clean); ``resumed_after`` the checkpoint's iteration it continued
    after (None: from the first iteration, or nothing to resume); ``iterations`` how many it
    trained; ``trained_path`` the weights of a finished run."""

    run_dir: Path
    state: str
    resumed_after: int | None = None
    iterations: int = 0
    final_loss: float | None = None
    trained_path: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"run_dir": str(self.run_dir), "state": self.state, "resumed_after": self.resumed_after,
                "iterations": self.iterations, "final_loss": self.final_loss,
                "trained_path": str(self.trained_path) if self.trained_path is not None else None}


def without_dropout(model: nn.Module) -> int:
    """Dropout draws a fresh mask in every stage and micro-batch (seeded per iteration, stage
    and micro-batch: ``training.micro_batch_seed``), which single-process training of the
    original module cannot reproduce, so ``flatpack run`` trains with p = 0 in every
    ``nn.Dropout*`` module, the run and the reference alike, and its verdict says so. Returns
    how many modules had p > 0."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            count += module.p > 0
            module.p = 0.0
    return count


def synthetic_batches(model: nn.Module, example: Any, batch: int, count: int,
                      seed: int) -> tuple[list[tuple[Any, torch.Tensor]], str]:
    """Random inputs shaped like the example at ``batch`` rows, and the loss to train with:
    class targets under cross-entropy when the model outputs (batch, classes), otherwise
    random targets of the output's shape under mean squared error."""
    generator = torch.Generator().manual_seed(seed)
    names = list(example) if isinstance(example, dict) else None
    leaves = list(example.values()) if names is not None else example if isinstance(example, (tuple, list)) \
        else (example,)
    with torch.no_grad():
        raw = call(model.eval(), example)
    model.train()
    output = first_output(raw)
    # a HuggingFace model given labels computes its own loss and needs no targets
    loss = "output" if own_loss(raw) else "cross_entropy" if output.dim() == 2 else "mse"
    batches = []
    for _ in range(count):
        inputs = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                inputs.append(leaf)
            elif leaf.is_floating_point():
                inputs.append(torch.randn((batch, *leaf.shape[1:]), generator=generator, dtype=leaf.dtype))
            else:
                high = int(leaf.max()) + 1 if leaf.numel() else 2
                inputs.append(torch.randint(0, max(high, 2), (batch, *leaf.shape[1:]), generator=generator))
        if loss == "output":
            target = None
        elif loss == "cross_entropy":
            target = torch.randint(0, output.shape[-1], (batch,), generator=generator)
        else:
            target = torch.randn((batch, *output.shape[1:]), generator=generator, dtype=output.dtype)
        batches.append((dict(zip(names, inputs)) if names is not None else tuple(inputs), target))
    return batches, loss


def own_loss(output: Any) -> bool:
    """Does the model return its own loss first (a HuggingFace ModelOutput given labels)?"""
    return isinstance(output, dict) and next(iter(output), None) == "loss" and output["loss"] is not None


def choose_loss(model: nn.Module, inputs: Any, target: Any, asked: str) -> str:
    """The loss a run trains with (``--loss``): the model output's ``loss`` when it has one,
    else the one asked for, else cross-entropy for (batch, classes) outputs and integer
    targets and mean squared error otherwise. Refuses what cannot work, before any process starts."""
    with torch.no_grad():
        output = call(model.eval(), inputs)
    model.train()
    if own_loss(output):
        if asked not in ("auto", "output"):
            raise InputError(f"the model returns its own loss (its output's 'loss', from the labels input), so "
                             f"--loss {asked} cannot apply; leave --loss out, or drop 'labels' from the data and "
                             "give a 'target' instead")
        return "output"
    if asked != "auto":
        name = LOSS_NAMES.get(asked, asked)
        if name == "output":
            raise InputError("--loss output: the model's output has no 'loss'; give it labels or choose "
                             "cross-entropy or mse")
        if target is None:
            raise InputError(f"--loss {asked} needs targets but the data has none; add a 'target' tensor to every "
                             "shard (or the model's 'labels' input, for a model that computes its own loss)")
        return name
    if target is None:
        raise InputError("the data has no targets ('target', 'targets' or 'y') and the model computes no loss of its "
                         "own; add a 'target' tensor to every shard, or 'labels' for a HuggingFace model")
    first = first_output(output)
    if first.dim() == 2 and not target.is_floating_point() and target.dim() == 1:
        return "cross_entropy"
    if first.shape[1:] == target.shape[1:]:
        return "mse"
    raise InputError(f"cannot choose a loss for output of shape {tuple(first.shape)} and targets of shape "
                     f"{tuple(target.shape)} ({target.dtype}); give --loss cross-entropy or mse, or make the "
                     "model return its own loss")


def training_data(model: nn.Module, example: Any, options: JobOptions) -> tuple[Any, str, int]:
    """The run's batches (a list, or :class:`flatpack.data.Batches` built on demand from
    ``--data``), its loss and its iterations, checked before anything is compiled."""
    if options.data is None:
        count = options.iterations or 4
        batches, loss = synthetic_batches(model, example, options.batch, count, options.seed)
        if options.loss != "auto" and LOSS_NAMES.get(options.loss, options.loss) != loss:
            raise InputError(f"--loss {options.loss} needs real targets; the synthetic batches (no --data) train "
                             f"with {loss}. Give --data SOURCE, or leave --loss out")
        return batches, loss, count

    source = parse_source(options.data, endpoint=options.store_endpoint)
    if options.eval_fraction:
        source = split_shards(source, options.eval_fraction)[0]
    batches = make_batches(source, model, example, batch=options.batch, epochs=options.epochs,
                           iterations=options.iterations, shuffle=options.shuffle, seed=options.seed,
                           drop_last=options.drop_last)
    inputs, target = batches(0)

    check_against_example(example, inputs, f"--data {batches.description}")
    if batches.batch != options.batch:
        raise InputError(f"the DataLoader yields batches of {batches.batch} samples but --batch is {options.batch}; "
                         "give the run the loader's batch size")
    return batches, choose_loss(model, inputs, target, options.loss), len(batches)


def evaluation_batches(model: nn.Module, example: Any, options: JobOptions,
                       loss: str) -> Sequence[tuple[Any, Any]] | Batches:
    """The held-out batches ``--eval-every`` evaluates on, one pass in order: ``--eval-data``,
    the shards ``--eval-fraction`` holds out of ``--data``, or (synthetic training data) two
    synthetic batches drawn with another seed. Checked against the model and the training
    ``loss`` before launch (held-out data without the labels a model's own loss needs would
    otherwise be scored on its logits)."""
    if options.eval_data is None and not options.eval_fraction:
        return synthetic_batches(model, example, options.batch, 2, options.seed + 1)[0]
    if options.eval_data is not None:
        source = parse_source(options.eval_data, endpoint=options.store_endpoint)
    else:
        source = split_shards(parse_source(options.data, endpoint=options.store_endpoint), options.eval_fraction)[1]
    # a partial last batch is left out: eval batches, like training ones, have one size
    batches = make_batches(source, model, example, batch=options.batch, shuffle=False, drop_last=True)
    inputs, target = batches[0]
    check_against_example(example, inputs, f"--eval-data {batches.description}")
    scored = choose_loss(model, inputs, target, options.loss)
    if scored != loss:
        raise InputError(f"the held-out data ({batches.description}) would be scored with {scored} but the run trains "
                         f"with {loss}; give it the same tensors as --data (targets or labels alike)")
    return batches


def run_training(model: nn.Module, example: Any, options: JobOptions, *, stream: TextIO) -> JobResult:
    """Trains ``model`` as ``options`` say, reporting on ``stream``. A run refused before it
    started (a flatpack error other than RunFailure, before its run record was written)
    leaves no run directory behind where this call created it."""
    out = Path(options.out)
    created = not out.exists()
    try:
        return _run_training(model, example, options, stream=stream)
    except FlatpackError as err:
        if created and not isinstance(err, RunFailure) and out.is_dir() and not (out / RUN_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


def _run_training(model: nn.Module, example: Any, options: JobOptions, *, stream: TextIO) -> JobResult:
    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    options.check()
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError(f"{type(model).__name__} has no trainable parameters (none, or all with requires_grad="
                         "False), so there is nothing to train; give a model with parameters, or use flatpack "
                         "compile/deploy to serve it")
    torch.manual_seed(options.seed)
    dropouts = without_dropout(model)
    RunDirectory(options.out).create()    # 0700 when flatpack makes it: the run's model and data are private
    # one thread: the profile is then what a one-vCPU function computes, and the workers use one too
    with torch_threads(1):
        batches, loss, iterations = training_data(model, example, options)
        options = dataclasses.replace(options, iterations=iterations)
        if options.data is not None:
            order = ("in the DataLoader's order" if batches.source.kind == "loader" else
                     f"shuffled, seed {options.seed}" if options.shuffle else "in order")
            LOG.info(f"data: {batches.description}, {plural(batches.per_epoch, 'batch', 'batches')} of "
                     f"{options.batch} per epoch, {plural(iterations, 'iteration')} ({order}"
                     f"{', last partial batch dropped' if options.drop_last else ''}); loss: "
                     f"{'the model output' + chr(39) + 's own' if loss == 'output' else loss}")
        example_batch = batches[0][0]
        held_out = evaluation_batches(model, example, options, loss) if options.eval_every else None
        spec = options.optimizer_spec()
        say(f"optimizer: {spec.describe()}")
        # the cost model counts the state of the optimizer the run names, read from the optimizer
        workload = Workload("train", batch=options.batch, micro_batches=options.micro_batches,
                            optimizer="adam" if spec.is_adam_like else "sgd-momentum", sync=options.sync,
                            optimizer_state_factor=spec.state_factor(),
                            precision=options.precision, recompute=options.recompute)
        started = time.perf_counter()
        extra: dict[str, Any] = {"replicas": options.replicas}
        if options.memory_mb:
            extra["memory_mb"] = options.memory_mb
        # profile at the micro-batch size the workers run (and two smaller ones for the fit):
        # extrapolating a·batch+b from much smaller batches overestimates vectorized layers
        micro = max(1, options.batch // options.micro_batches)
        sizes = tuple(sorted({max(1, micro // 4), max(1, micro // 2), micro}))
        if options.split_points:
            check_split_points(model, options.split_points)
        solver = (WithTiers(FixedCuts(options.split_points, options.stages))
                  if options.stages or options.split_points
                  else FastestOnFront() if options.pick == "fastest" else solver_for(options.solver))
        # the weights and buffers training starts from (profiling runs the model in train
        # mode, which moves BatchNorm's running statistics): the reference starts here too
        initial = copy.deepcopy(model)
        compiled = flatpack.compile(model, example_batch, target="local", solver=solver, passes=options.passes,
                                    profile=ProfileOptions(batch_sizes=sizes, repeats=3,
                                                           progress=None if logs.progress_enabled() else False),
                                    workload=workload, calibration=options.calibration, **extra)
        LOG.info(f"compiled {type(model).__name__} for target local in {time.perf_counter() - started:.1f} s: "
                 f"{plural(compiled.plan.num_layers, 'layer')}, solver {getattr(solver, 'name', solver)}")
        if compiled.problem is None:  # flatpack.compile keeps the problem it solved; a loaded artifact may not
            raise FlatpackError("the compiled artifact carries no partitioning problem, which training predicts from")
        _print_front(compiled, say)
        compiled.save(options.out / "compiled")    # private (0600/0700), as Compiled.save writes by default
        say(f"artifact digest {compiled.digest} (flatpack resume --digest checks the saved artifact against it)")
        reads_target = loss != "output"    # a model that returns its loss reads no target key
        cost = report.predicted_iteration(compiled.problem, compiled.plan, reads_target=reads_target,
                                          schedule=options.schedule)
        say(f"\nchosen plan ({options.pick}): predicted {cost.iteration_s * 1000:.0f} ms and "
            f"${cost.dollars_per_iteration:.3g} per iteration")
        recomputing = [str(index) for index, stage in enumerate(compiled.plan.stages) if stage.recompute]
        if recomputing:
            say(f"stage{'s' * (len(recomputing) > 1)} {', '.join(recomputing)} recompute their activations in the "
                "backward (the tier chosen does not hold them; one more forward each)")
        checkpoints = funcpipe.checkpoint_cost(compiled.problem, compiled.plan)
        every = options.checkpoint_every or checkpoints.interval_for(cost.iteration_s, iterations)
        if options.schedule == ASYNC_SCHEDULE:
            # micro-batches are in flight between iterations: only a drained pipeline checkpoints
            every = options.eval_every or iterations
            why = "1f1b-async checkpoints only where its pipeline drains, at the end of each call"
        elif options.checkpoint_every:
            why = "as asked"
        elif checkpoints.overhead(cost.iteration_s, every) <= 0.05:
            why = "the shortest interval whose upload costs at most 5% of an iteration"
        else:
            why = "a checkpoint costs more than 5% of the run's iterations: only the last is taken"
        LOG.info(f"checkpoints every {every} iteration{'s' * (every != 1)} ({why}): "
                 f"{checkpoints.bytes / 2**20:.1f} MiB each, {checkpoints.upload_s * 1000:.0f} ms of upload, "
                 f"{checkpoints.overhead(cost.iteration_s, every) * 100:.1f}% of an iteration amortized")
        # the run directory keeps what `flatpack resume` needs until the run succeeds: the
        # batches, the run record and the S3 server's data (checkpoints included)
        directory = RunDirectory(options.out)
        directory.remove_store()      # an earlier run's in the same directory: this run replaces it
        data_record = _data_record(batches, options)
        if data_record is None:
            if options.data is not None:
                LOG.info("the DataLoader cannot be reopened by name, so its batches are copied into the run "
                         "directory for flatpack resume")
            fingerprint = directory.save_batches(batches)
        else:
            # what the run trains on, so that resume refuses data changed since (a shard
            # replaced with one of the same shapes would otherwise train silently)
            fingerprint = batches.source.fingerprint()
        # every setting that decides the arithmetic, micro-batches included (a loaded artifact has
        # no workload to default them from), so `flatpack resume` retrains the same way
        train_options = {"optimizer": spec.to_json(), "schedule": options.schedule,
                         "vertical_sync": options.vertical_sync,
                         "sync": options.sync, "threads": 1, "checkpoint_every": every,
                         "non_finite": options.non_finite, "precision": options.precision,
                         "micro_batches": compiled.plan.micro_batches_for(compiled.problem.workload)}
        record = RunRecord(run=f"run-{uuid.uuid4().hex[:10]}", loss=loss, iterations=iterations,
                           data=data_record, train_options=train_options, fingerprint=fingerprint)
        directory.write(record)
        with _resumable(directory), local.deploy(compiled, workdir=directory.logs, data_dir=directory.store,
                                                 run=record.run) as deployment:
            LOG.info(f"deployed {plural(sum(s.replicas for s in compiled.plan.stages), 'function')} (one process each) "
                     f"sharing a local S3 server at {deployment.store_url.split('?')[0]}")
            if compiled.problem.calibration is not None:   # measured by a separate flatpack calibrate run
                problem = compiled.problem
                LOG.info(f"store request latency from the calibration file: "
                         f"{problem.platform.storage_latency_s * 1000:.1f} ms")
            else:
                problem = dataclasses.replace(compiled.problem, platform=dataclasses.replace(
                    compiled.problem.platform, storage_latency_s=deployment.measure_latency()))
                LOG.info(f"store round trip measured: {problem.platform.storage_latency_s * 1000:.1f} ms "
                         "(replaces the catalog's assumption in the prediction)")
            replan = ({"replan": ReplanPolicy(options.replan_threshold, on_switch=_recording_switches(directory)),
                       "epoch_iterations": options.epoch_iterations} if options.replan else None)
            result, evaluations = train_and_evaluate(deployment, batches, iterations, loss, train_options,
                                                     options.eval_every, held_out, say, replan)
            # after a switch the deployment runs the last plan
            final = deployment.compiled
            pipelined_state = pipeline_optimizer_state(deployment, final) if options.verify else {}
        record = directory.read()
        if result.switches:
            # the finished run's compiled/ is the plan that trained last, as its events.json is
            final.save(directory.compiled)
            retired, record = record.compiled, dataclasses.replace(record, compiled=directory.compiled.name)
            directory.write(record)
            shutil.rmtree(directory.root / retired, ignore_errors=True)
        _finish(directory, record, compiled, result.parameters, say, options.save)
        say(f"\ntrained {plural(iterations, 'iteration')} in {result.wall_s:.1f} s ({result.samples_per_s:.1f} "
            f"samples/s), ${result.dollars:.6f} at the platform's prices")
        for restart in result.restarts:
            say(f"  {restart.describe()}")
        for switch in result.switches:
            say(f"  re-planned {switch.describe()}")
        if options.replan and not result.switches:
            say(f"  re-planned every {plural(options.epoch_iterations or 0, 'iteration')}: no other plan was "
                f"predicted at least {options.replan_threshold * 100:.0f}% faster, the run kept its plan")
        if evaluations:
            say("held-out evaluation (through the inference path): " + "; ".join(
                f"iter {found.iteration}: loss {found.loss:.4f}"
                + (f", accuracy {found.accuracy:.3f}" if found.accuracy is not None else "") for found in evaluations))
        # iteration 0 pays the cold start; with enough iterations, iteration 1 measures β
        skip = 2 if iterations >= 3 else min(1, iterations - 1)
        # after a switch, the last plan against the iterations it ran
        measured = ([event for event in result.events if event.iteration > result.switches[-1].iteration]
                    if result.switches else result.events)
        comparison = report.compare(problem, final.plan, measured, skip_first=skip, reads_target=reads_target,
                                    schedule=options.schedule)
        say("\npredicted (FuncPipe model) vs measured, per micro-batch and per iteration:")
        say(comparison.table())
        calibrated = in_run_calibration = None
        try:
            # FuncPipe's in-run calibration (β and t_lat from iteration 1) stands in for a
            # calibration file; with one, the prediction above is already calibrated
            if skip == 2 and compiled.problem.calibration is None and not result.switches:
                in_run_calibration = report.calibrate(problem, compiled.plan, result.events, iteration=1)
        except FlatpackError as err:  # the calibration is context: a measured β < 1 is refused by the platform
            LOG.info(f"no calibration on iteration 1: {err}")
        if in_run_calibration is not None:
            tuned, beta, latency = in_run_calibration
            calibrated = report.compare(tuned, final.plan, measured, skip_first=skip,
                                        reads_target=reads_target, schedule=options.schedule)
            say(f"calibrated on iteration 1 as FuncPipe's profiler does in the target (β = {beta:.2f} compute "
                f"slowdown, t_lat = {latency * 1000:.1f} ms per transfer): predicted "
                f"{calibrated.predicted_iteration_s * 1000:.1f} ms, error {_percent(calibrated.iteration_error)} "
                "on the later iterations")
        # the timeline, for `flatpack plan --from-run` (analysis.refit) to re-fit the model to
        (options.out / EVENTS_FILE).write_bytes(timeline.dumps(measured))
        # loading a stage (a cold start) is not part of an iteration; the chart shows the iterations
        running = [event for event in result.events if event.kind != "load"]
        schedule = report.predicted_schedule(problem, final.plan, reads_target=reads_target,
                                             schedule=options.schedule)
        files = [options.out / "compiled", gantt.plot(running, options.out / "timeline.png", predicted=schedule,
                                                      title=f"{type(model).__name__}: {len(final.plan.stages)} "
                                                            "stages on local functions"),
                 chrome_trace.write(result.events, options.out / "timeline.json", predicted=schedule)]
        say(f"\nwrote {files[1]} (the Gantt chart, predicted above measured), {files[2]} (the same as a Chrome "
            f"trace: open it in ui.perfetto.dev or chrome://tracing) and the stage artifacts in {files[0]}")
        max_diff = equivalent = None
        if options.verify:
            found = verdict(initial, compiled, batches, options, loss, result.parameters, pipelined_state,
                            dropouts=dropouts, example=example_batch)
            say(found.describe())
            max_diff, equivalent = found.max_weight_diff, found.equivalent
        return JobResult(final, result, comparison, calibrated, max_diff, equivalent, files, evaluations)


def _percent(error: float | None) -> str:
    """A relative error as a signed percentage; "-" when there was nothing to compare with."""
    return "-" if error is None else f"{error * 100:+.1f}%"


def train_and_evaluate(deployment: Any, batches: Any, iterations: int, loss: str, train_options: dict[str, Any],
                       eval_every: int, held_out: Iterable[tuple[Any, Any]] | None,
                       say: Any, replan: dict[str, Any] | None = None) -> tuple[Any, list[Any]]:
    """Trains ``iterations`` batches; with ``eval_every`` N, as calls of N iterations (each
    continues from the previous one's checkpoint: weights, optimizer state, the schedule's
    position, accumulated gradients), after each of which the held-out batches go through the
    inference path (the deployment serves the latest checkpoint) and the loss (and accuracy)
    joins the progress line and the report. ``replan``: the re-planning options of the one
    call (``JobOptions.check`` refuses them with ``eval_every``). Returns the calls' results
    as one and the evaluations."""
    if not eval_every:
        return deployment.train(batches, iterations=iterations, loss=loss, progress=logs.progress_enabled(),
                                **train_options, **(replan or {})), []
    if held_out is None:
        raise ValueError(f"eval_every={eval_every} evaluates on held-out batches; pass them as held_out")
    degrees = [stage.replicas for stage in deployment.compiled.plan.stages]
    line = ProgressLine(iterations, first_batch_rows(batches[0]), deployment.dollars_per_second(degrees),
                        None if logs.progress_enabled() else io.StringIO())   # -q: no progress
    results, evaluations, done = [], [], 0
    with line:
        while done < iterations:
            length = min(eval_every, iterations - done)
            results.append(deployment.train(lambda index, offset=done: batches[offset + index], iterations=length,
                                            loss=loss, progress=line, batch_offset=done, **train_options))
            done += length
            found = evaluate(deployment.infer, held_out, loss, iteration=done)
            evaluations.append(found)
            line.note = found.short()   # the line stays open across the calls: `with line` ends it
            say(found.describe())
    return merge_results(results), evaluations


# -- the run directory: resume after any crash --------------------------------------------------

def _recording_switches(directory: RunDirectory) -> Any:
    """What a plan switch does to the run directory once the new plan's store prefix is whole
    (``backends.replan``): the new plan's artifact saved beside the old, then ``run.json``
    (replaced atomically) names the new prefix and artifact. A crash before that resumes the
    old plan from its prefix, one after it the new plan from its own: never a mix."""
    def on_switch(switch: PlanSwitch, compiled: Any) -> None:
        name = f"compiled-{switch.run}"
        compiled.save(directory.root / name)
        record = directory.read()
        directory.write(dataclasses.replace(record, run=switch.run, compiled=name))
        if record.compiled != directory.compiled.name:
            shutil.rmtree(directory.root / record.compiled, ignore_errors=True)   # an earlier switch's
        LOG.info(f"re-planned after iteration {switch.iteration}: the run continues as {switch.run} with the "
                 f"artifact in {directory.root / name} (digest {compiled.digest[:16]}…)")

    return on_switch


@contextlib.contextmanager
def _resumable(directory: RunDirectory) -> Iterator[None]:
    """Says how to resume when training stops early for any reason (a failure, Ctrl-C, SIGTERM):
    the run directory keeps the store's data and checkpoints."""
    try:
        yield
    except BaseException as err:
        why = "interrupted" if isinstance(err, KeyboardInterrupt) else "stopped by an error"
        LOG.warning(f"training {why}; the run directory {directory.root} keeps its checkpoints. Continue it with:\n"
                    f"    flatpack resume {directory.root}")
        raise


def _data_record(batches: Any, options: JobOptions) -> dict | None:
    """What ``run.json`` records of a ``--data`` source so that ``flatpack resume`` reads the
    same batches again: the source and how it was batched (None: synthetic batches, or a
    DataLoader, which cannot be reopened by name: the run directory keeps those batches)."""
    if not isinstance(batches, Batches) or batches.source is None or batches.source.to_json() is None:
        return None
    return {"source": batches.source.to_json(), "batch": options.batch, "epochs": options.epochs,
            "iterations": options.iterations, "shuffle": options.shuffle, "seed": options.seed,
            "drop_last": options.drop_last, "layout": batches.layout_json()}


def _finish(directory: RunDirectory, record: RunRecord, compiled: Any, parameters: dict[str, torch.Tensor],
            say: Any, save: Path | None = None) -> None:
    """A finished run: its trained weights in the run directory (and at ``save``), the
    store's data removed."""
    state = state_dict_of(compiled, parameters)
    trained = save_state_dict(state, directory.trained_path)
    os.chmod(trained, PRIVATE_FILE_MODE)    # the trained model is the user's: private, like the run directory
    directory.write(dataclasses.replace(record, state="done"))
    directory.remove_store()
    say(f"trained weights (the model's state_dict: load with model.load_state_dict(flatpack.load_state_dict(path))) "
        f"in {trained}")
    if save is not None:
        saved = save_state_dict(state, save)
        os.chmod(saved, PRIVATE_FILE_MODE)
        say(f"saved them to {saved}")


def resume_training(root: Path, *, stream: TextIO, clean: bool = False, digest: str | None = None,
                    verify_key: str | None = None, data: str | None = None, name: str | None = None,
                    min_version: int | None = None, trust_file: str | None = None,
                    accept_changed_data: bool = False) -> ResumeResult:
    """``flatpack resume RUN_DIR``: continues a run ``flatpack run`` started, after any crash,
    from the last checkpoint every stage took, on the run's own batches, to the weights the
    uninterrupted run would have reached. ``clean``: discard the run's store data instead.
    ``digest`` / ``verify_key`` (and the signature's ``name``, ``min_version``, ``trust_file``):
    what the run's compiled artifact is checked against (``flatpack.load``). ``data``: a run
    whose data came from a dataset factory names it again (``run.json`` is data and never
    names code to import). The data is checked against the fingerprint the run recorded at its
    start; ``accept_changed_data`` resumes on changed data anyway (with a warning naming what
    changed)."""
    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    directory = RunDirectory(root)
    record = directory.read()
    if record.state == "done":
        say(f"{root}: the run finished; its trained weights are in {directory.trained_path}. Nothing to resume")
        return ResumeResult(root, "done", trained_path=directory.trained_path)
    if clean:
        directory.remove_store()
        directory.write(dataclasses.replace(record, state="abandoned"))
        say(f"removed the store data of {root}; the run cannot be resumed any more")
        return ResumeResult(root, "abandoned")
    if record.state != "running":
        raise InputError(f"{root} is a run in state {record.state!r}; only a running one can be resumed")
    if not directory.store.is_dir():
        raise InputError(f"{directory.store} is missing: the run's checkpoints are gone, so it cannot be resumed. "
                         "Start it again with flatpack run")
    _check_optimizer(record, directory)
    # a run that switched plans names the artifact of its current plan (``_recording_switches``),
    # always a directory inside the run directory
    compiled = flatpack.load(directory.compiled_path(record), digest=digest, verify_key=verify_key, name=name,
                             min_version=min_version, trust_file=trust_file)
    batches: Any
    if record.data is not None:
        batches = batches_from_record(record.data, factory=data)
        LOG.info(f"re-reading the run's data: {batches.description}")
        current = batches.source.fingerprint() if batches.source is not None else None
        _check_data(directory, record, current, accept_changed_data)
    else:
        _check_data(directory, record, directory.batches_fingerprint() if directory.batches_path.is_file() else None,
                    accept_changed_data)
        batches = directory.load_batches()
    with torch_threads(1):   # as run_training trains
        with _resumable(directory), local.deploy(compiled, workdir=directory.logs, data_dir=directory.store,
                                                 run=record.run) as deployment:
            done = deployment.consistent_checkpoint()
            calls = deployment.calls()
            resumed_after = done if calls else None
            if not calls:
                LOG.info("the run had not started training; training it from the start")
                result = deployment.train(batches, *split_options(record.train_options or {}),
                                          iterations=record.iterations, loss=record.loss,
                                          progress=logs.progress_enabled())
            else:
                LOG.info(f"resuming run {record.run} after iteration {done} (the last checkpoint every stage took)"
                         if done is not None else f"resuming run {record.run} from its first iteration")
                result = deployment.resume(batches, progress=logs.progress_enabled())
                # a run evaluated every N iterations trained as calls of N: the calls it had
                # not begun follow the resumed one (without the evaluations)
                last = deployment.calls()[-1]
                trained = last.batch_offset + last.iterations
                if trained < record.iterations:
                    LOG.info(f"training the run's last {plural(record.iterations - trained, 'iteration')}")
                    rest = deployment.train(lambda index: batches[trained + index],
                                            *split_options(record.train_options or {}),
                                            iterations=record.iterations - trained, loss=record.loss,
                                            progress=logs.progress_enabled(), batch_offset=trained)
                    result = rest if result is None else merge_results([result, rest])
            parameters = deployment.parameters()
        if result is not None:
            say(f"\ntrained {len(result.losses)} more iterations in {result.wall_s:.1f} s; final loss "
                f"{result.losses[-1]:.4f}")
        _finish(directory, record, compiled, parameters, say)
        return ResumeResult(root, "done", resumed_after, len(result.losses) if result is not None else 0,
                            result.losses[-1] if result is not None and result.losses else None,
                            directory.trained_path)


def _check_optimizer(record: RunRecord, directory: RunDirectory) -> None:
    """The record's optimizer settings as an OptimizerSpec takes them: a hostile value is an
    InputError naming run.json, not a TypeError from inside train()."""
    optimizer = (record.train_options or {}).get("optimizer")
    if optimizer is None:
        return
    try:
        OptimizerSpec.of(optimizer)
    except FlatpackError as err:
        raise InputError(f"{directory.record_path}: train_options.optimizer: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise InputError(f"{directory.record_path}: train_options.optimizer is not an optimizer flatpack wrote "
                         f"({type(err).__name__}: {err}); it is written by `flatpack run`") from None


def _check_data(directory: RunDirectory, record: RunRecord, current: dict[str, Any] | None, accept: bool) -> None:
    """Refuses to resume on data that changed since the run started (its recorded
    fingerprint), naming what changed, unless ``accept`` (``--accept-changed-data``): then a
    warning names it. A record from before fingerprints resumes with one warning."""
    if record.fingerprint is None:
        LOG.warning(f"{directory.record_path} records no fingerprint of the run's data (a run started by an older "
                    "flatpack), so this resume cannot check that the data is what the run trained on")
        return
    if current is None:
        raise InputError(f"{directory.record_path} records a fingerprint of the run's data, but its data source "
                         "cannot be fingerprinted now; resume it on the data it started with")
    changes = fingerprint_changes(record.fingerprint, current)
    if not changes:
        return
    listed = "; ".join(changes[:10]) + (f"; and {len(changes) - 10} more" if len(changes) > 10 else "")
    if accept:
        LOG.warning(f"the run's data changed since it started ({listed}); resuming on it as "
                    "--accept-changed-data asks: the result is not the run it started as")
        return
    raise InputError(f"the run's data changed since it started: {listed}. Resuming would train on other data than "
                     "the run began with; restore the data, or pass --accept-changed-data to resume on it anyway")


def _print_front(compiled: Any, say: Any) -> None:
    try:
        front = _dp().front(compiled.problem)
    except Exception as err:  # noqa: BLE001 - the front is context; the chosen plan still runs
        LOG.warning(f"no front: {err}")
        return
    say(plan_report.text_report(compiled.problem, plan_report.Selection.of_front(front), "plan front (dp)"))
