"""What ``flatpack run`` (and ``demo``, and a Python caller of :func:`flatpack.job.run_training`)
is asked to do, in the groups ``flatpack run --help`` shows: the batches trained on, the
training, the held-out evaluation, the plan and the output. Each group is a frozen dataclass
with its own ``check()``; :class:`JobOptions` holds one of each, checks them together (the
few rules that join two groups are said there) and builds the :class:`TrainSettings` of the
training call in one place (:meth:`JobOptions.train_settings`).

A Python caller names options flat, as the command line does: ``JobOptions.of(batch=8,
micro_batches=2, out=path)``; the command line's table of them is ``flatpack.cli.run_options``
(``tests/unit/test_run_options.py`` checks that every field here has exactly one flag there)."""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from flatpack.backends import RUN_TARGETS
from flatpack.backends.replan import DEFAULT_THRESHOLD, SKIP_FIRST
from flatpack import schedules
from flatpack.errors import InputError
from flatpack.partitioner.solvers.wrappers import PICKS, solver_for
from flatpack.partitioner.workload import RECOMPUTE
from flatpack.platform.calibration import Calibration
from flatpack.platform.catalog import get_platform
from flatpack.runtime.elastic import OBJECTIVES
from flatpack.runtime.optim import OptimizerSpec, ScheduleSpec, check_loss
from flatpack.runtime.settings import TrainSettings
from flatpack.schedules import DEFAULT_SCHEDULE, Setup
from flatpack.stage.settings import NON_FINITE, PRECISIONS

# --loss names on the command line and what the runtime calls them
LOSS_NAMES = {"cross-entropy": "cross_entropy", "cross_entropy": "cross_entropy", "mse": "mse",
              "output": "output"}
# the iterations of a run on synthetic batches that names none
SYNTHETIC_ITERATIONS = 4


def need(ok: bool, message: str) -> None:
    """An InputError with ``message`` (the cause and the fix) unless ``ok``."""
    if not ok:
        raise InputError(message)


# the replica degrees the solver may give a stage unless --replicas says otherwise
DEFAULT_REPLICAS: tuple[int, ...] = (1, 2)

@dataclass(frozen=True)
class BatchOptions:
    """The batches a run trains on: their size, how many, and where they come from."""

    batch: int = 32
    iterations: int | None = SYNTHETIC_ITERATIONS     # None with --data: --epochs full passes over the data
    # --data: a directory or s3://bucket/prefix of shards, a module:factory returning a Dataset,
    # or (Python) a DataLoader or flatpack.data.DataSource; None: synthetic batches
    data: Any = None
    store_endpoint: str | None = None   # the S3 endpoint of an s3:// --data (None: AWS)
    epochs: int = 1
    shuffle: bool = True
    drop_last: bool = False
    seed: int = 0

    def check(self) -> None:
        need(isinstance(self.batch, int) and self.batch >= 1,
             f"--batch must be a positive number of samples per iteration, got {self.batch}; use e.g. --batch 32")
        need((self.iterations is None and self.data is not None)
             or (isinstance(self.iterations, int) and self.iterations >= 1),
             f"--iterations must be at least 1 (the number of global batches to train), got {self.iterations}")
        need(isinstance(self.epochs, int) and self.epochs >= 1,
             f"--epochs must be at least 1 (full passes over --data), got {self.epochs}")
        need(self.data is not None or (self.epochs == 1 and not self.drop_last and self.store_endpoint is None),
             "--epochs, --drop-last and --store-endpoint apply to --data; give --data SOURCE or leave them out")


@dataclass(frozen=True)
class TrainOptions:
    """How the pipeline trains: micro-batches, optimizer and its schedule, loss, pipeline
    schedule, gradient sync, precision, checkpoints and what a NaN does."""

    micro_batches: int = 4
    # any torch.optim optimizer by name (adam, adamw, sgd: momentum 0.9 unless optimizer_args
    # says otherwise, ...) with its keyword options, or a whole OptimizerSpec (then the knobs
    # below it stand for are taken from it)
    optimizer: str | OptimizerSpec = "adam"
    lr: float = 0.01
    optimizer_args: dict[str, Any] = field(default_factory=dict)
    no_decay_bias_norm: bool = False       # weight_decay 0 for biases and norm weights (< 2 dims)
    # a learning-rate schedule by name (cosine, linear, step, ... or a torch.optim.lr_scheduler
    # class) with its options, after ``warmup`` steps of linear warm-up; None: a constant rate
    schedule_lr: str | None = None
    schedule_args: dict[str, Any] = field(default_factory=dict)
    warmup: int = 0
    clip_grad_norm: float | None = None    # the global gradient norm over every stage, at most this
    accumulate: int = 1                    # optimizer steps every K iterations: a K x larger batch
    # "auto": the model output's `loss` when it has one, else cross-entropy for (batch, classes)
    # outputs and mean squared error otherwise; or cross-entropy, mse
    loss: str = "auto"
    schedule: str = DEFAULT_SCHEDULE       # a registered schedule's name (flatpack.schedules)
    vertical_sync: bool = False            # 1f1b-async: every stage on the first stage's weight version
    sync: str = "pipelined"
    # "bf16"/"fp16": autocast in every stage, float32 master weights and optimizer state,
    # bfloat16/float16 tensors between stages, fp16 with GradScaler's loss scaling
    # (runtime.precision); the verdict's reference autocasts and rounds at the cuts too
    precision: str = "fp32"
    # iterations between checkpoints; 0: the shortest interval whose upload costs at most 5%
    # of an iteration's time (funcpipe.checkpoint_cost). A lost function recovers with any
    # interval; `flatpack resume` after a crash of the runner restarts from the last one
    checkpoint_every: int = 0
    # a NaN or infinity in the data or an iteration's loss: "warn", "error" (stop) or "ignore"
    non_finite: str = "warn"

    def optimizer_steps(self, iterations: int) -> int:
        """The optimizer steps of ``iterations``: one per K under --accumulate K, and one per
        micro-batch under an asynchronous schedule (PipeDream's minibatch: ``Schedule.optimizer_steps``)."""
        if not (isinstance(self.accumulate, int) and self.accumulate >= 1):
            return 1
        return iterations * schedules.get(self.schedule).optimizer_steps(self.micro_batches) // self.accumulate

    def optimizer_spec(self, iterations: int) -> OptimizerSpec:
        """The optimizer as the plain data every stage and the reference build it from; a
        schedule's length (cosine's T_max, ...) defaults to the optimizer steps of
        ``iterations`` after the warm-up. An unknown name or option is an InputError listing
        the valid ones."""
        if isinstance(self.optimizer, OptimizerSpec):
            knobs = ("optimizer_args", "schedule_lr", "schedule_args", "warmup", "no_decay_bias_norm", "clip_grad_norm",
                     "accumulate")
            defaults = TrainOptions()
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

    def check(self, batches: BatchOptions) -> OptimizerSpec:
        """Refuses what no run can use; returns the optimizer it checked."""
        need(isinstance(self.micro_batches, int) and self.micro_batches >= 1,
             f"--micro-batches must be at least 1, got {self.micro_batches}; use e.g. --micro-batches 4")
        self._check_micro_batches(batches.batch)
        if ":" in str(self.loss):
            check_loss(self.loss)      # refuses it, saying why (data never names code)
        need(self.loss == "auto" or self.loss in LOSS_NAMES,
             f"--loss must be auto or one of {', '.join(LOSS_NAMES)}, got {self.loss!r}")
        need(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
             f"--lr must be a positive, finite learning rate, got {self.lr}; use e.g. --lr 0.01")
        spec = self.optimizer_spec(batches.iterations or 1)   # refuses unknown names and options, listing them
        schedules.get(self.schedule)    # an unknown name is refused, listing the known ones
        self._check_steps(spec, batches.iterations)
        need(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
             f"checkpoint_every must be 0 (only the last iteration) or a positive count, got {self.checkpoint_every}")
        need(self.non_finite in NON_FINITE,
             f"--non-finite must be one of {', '.join(NON_FINITE)}, got {self.non_finite!r}")
        need(self.precision in PRECISIONS,
             f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}; use fp32 (the default), bf16 "
             "(autocast with float32 master weights) or fp16 (the same with a loss scaler)")
        return spec

    def _check_micro_batches(self, batch: int) -> None:
        need(self.micro_batches <= batch,
             f"--micro-batches {self.micro_batches} is more than the {batch} samples of a batch, so some "
             f"micro-batches would be empty; use at most --micro-batches {batch} or a larger --batch")
        if batch % self.micro_batches:
            fits = next(m for m in range(self.micro_batches, 0, -1) if batch % m == 0)
            raise InputError(f"--batch {batch} does not divide into {self.micro_batches} equal micro-batches "
                             f"(the plan and the cost model assume equal ones); use --micro-batches {fits} or a "
                             f"--batch that is a multiple of {self.micro_batches}, e.g. "
                             f"{batch + self.micro_batches - batch % self.micro_batches}")

    def _check_steps(self, spec: OptimizerSpec, iterations: int | None) -> None:
        """Every iteration steps (``--accumulate``), and the warm-up ends before the run does."""
        need(iterations is None or iterations % spec.accumulate == 0,
             f"--iterations {iterations} is not a multiple of --accumulate {spec.accumulate}: the last "
             f"{(iterations or 0) % spec.accumulate} iterations would never step; use --iterations "
             f"{(iterations or 0) // spec.accumulate * spec.accumulate or spec.accumulate} or another "
             "--accumulate")
        need(spec.schedule is None or iterations is None or spec.schedule.warmup < self.optimizer_steps(iterations),
             f"--warmup {spec.schedule.warmup if spec.schedule else 0} is not shorter than the run's "
             f"{self.optimizer_steps(iterations or 0)} optimizer steps; use a shorter warm-up or more "
             "--iterations")


@dataclass(frozen=True)
class EvaluationOptions:
    """Every ``eval_every`` iterations (0: never) the loss (and for classification the
    accuracy) on held-out data, through the inference path: ``eval_data`` (a --data SOURCE)
    or ``eval_fraction`` of --data."""

    eval_every: int = 0
    eval_data: Any = None
    eval_fraction: float = 0.0

    def check(self, batches: BatchOptions) -> None:
        need(isinstance(self.eval_every, int) and self.eval_every >= 0,
             f"--eval-every must be a number of iterations >= 0 (0: no evaluation), got {self.eval_every}")
        need(isinstance(self.eval_fraction, (int, float)) and 0 <= self.eval_fraction < 1,
             f"--eval-fraction must be in [0, 1) (the share of --data held out), got {self.eval_fraction}; "
             "use e.g. --eval-fraction 0.1")
        need(not self.eval_every or batches.data is None or self.eval_data is not None or self.eval_fraction > 0,
             "--eval-every needs held-out data: give --eval-data SOURCE or --eval-fraction F (of --data)")
        need(bool(self.eval_every) or (self.eval_data is None and not self.eval_fraction),
             "--eval-data and --eval-fraction apply to --eval-every N; give it, or leave them out")
        need(not self.eval_fraction or batches.data is not None,
             "--eval-fraction holds out a share of --data; give --data SOURCE, or --eval-data SOURCE instead")
        need(self.eval_data is None or not self.eval_fraction,
             "--eval-data and --eval-fraction both name the held-out data; give one")


@dataclass(frozen=True)
class PlanOptions:
    """How the run is planned: the solver (or fixed cuts), the search space, the calibration,
    and re-planning between epochs."""

    # where the functions run: "local" (processes of this machine) or "ray" (the same functions
    # as Ray tasks on the cluster at ``address``: None/"auto", "ray://host:port", "local")
    target: str = "local"
    address: str | None = None
    solver: str = "dp"
    passes: str | None = None
    replicas: tuple[int, ...] = DEFAULT_REPLICAS
    memory_mb: tuple[int, ...] | None = None
    # "recommended": the solver's choice (FuncPipe's recommendation for dp); "fastest": the
    # fastest plan on dp's Pareto front
    pick: str = "recommended"
    # fixed cuts instead of the solver's: N stages of balanced parameter bytes, or a stage
    # beginning at each named module (torch.distributed.pipelining's split points)
    stages: int | None = None
    split_points: tuple[str, ...] = ()
    # with fixed cuts: each stage's replica degree, in stage order (PipeDream's 1F1B-RR plans
    # replicate stages unevenly); not the solver's candidate degrees, which ``replicas`` lists
    stage_replicas: tuple[int, ...] = ()
    # "auto": the solver may let a stage recompute its activations in the backward instead of
    # keeping them (a smaller tier for one more forward); "never": every stage keeps them
    recompute: str = "never"
    # a calibration file (flatpack calibrate --target local, or flatpack profile --target):
    # the prediction uses its measurements instead of the catalog's and the store round trip
    # measured at deploy; the plan records its digest
    calibration: Path | None = None
    # re-fit the cost model to each epoch of --epoch-iterations iterations and switch to a plan
    # predicted at least replan_threshold faster (backends.replan; the run ends with the
    # weights a run on one plan reaches)
    replan: bool = False
    epoch_iterations: int | None = None
    replan_threshold: float = DEFAULT_THRESHOLD
    # "auto": at each --epoch-iterations boundary re-fit the cost model and change the replica
    # degrees (and cuts) when the predicted saving of elastic_objective exceeds the model's own
    # error on the run (backends.elastic_policy); elastic_replicas: the degrees' floor and
    # ceiling (their least and greatest; None: 1 and the micro-batches)
    elastic: str | None = None
    elastic_objective: str = "time"
    elastic_replicas: tuple[int, ...] | None = None

    def check(self, micro_batches: int) -> None:
        need(bool(self.replicas) and all(isinstance(d, int) and d >= 1 for d in self.replicas),
             f"--replicas lists data-parallel degrees, each at least 1, got {','.join(map(str, self.replicas))}; "
             "use e.g. --replicas 1,2")
        need(min(self.replicas) <= micro_batches,
             f"every degree in --replicas {','.join(map(str, self.replicas))} exceeds the {micro_batches} "
             "micro-batches of an iteration, so replicas would idle; allow --replicas 1 or use more --micro-batches")
        need(self.target in RUN_TARGETS, f"flatpack run trains on {' or '.join(RUN_TARGETS)} functions, not "
             f"{self.target!r}; to deploy to a cloud target use `flatpack deploy MODEL --target {self.target} --out "
             "DIR` (then train from Python with the deployment, see docs/cloud.md)")
        need(self.address is None or self.target == "ray",
             "--address names the Ray cluster to run on; give --target ray with it, or leave it out")
        if self.memory_mb:
            platform = get_platform(self.target)
            for size in self.memory_mb:
                need(isinstance(size, int) and size >= 1, f"--memory takes tiers in MB, each positive, got {size}")
                platform.tier(size)   # names the sizes the target's platform offers
        need(self.pick in PICKS, f"pick must be one of {', '.join(map(repr, PICKS))}, got {self.pick!r}")
        if self.calibration is not None:
            # read and checked now: a bad file is refused before anything is compiled or started
            need(Calibration.load(self.calibration).platform == self.target,
                 f"--calibration {self.calibration} was measured on another target; flatpack run trains on "
                 f"{self.target} functions: use `flatpack calibrate --target {self.target}`")
        self._check_cuts()
        need(max(self.stage_replicas, default=1) <= micro_batches,
             f"--stage-replicas {','.join(map(str, self.stage_replicas))} gives a stage more replicas than the "
             f"{micro_batches} micro-batches of an iteration, so replicas would idle; use at most {micro_batches}")
        need(self.recompute in RECOMPUTE,
             f"--recompute {self.recompute!r} is not one of {', '.join(RECOMPUTE)}; use never (the default: every "
             "stage keeps its activations) or auto (the solver may recompute them per stage to fit a smaller tier)")
        if self.pick != "fastest":
            solver_for(self.solver)
        need(self.replan or self.replan_threshold == DEFAULT_THRESHOLD,
             "--replan-threshold applies to --replan; give it, or leave it out")
        need(self.replan or self.elastic is not None or self.epoch_iterations is None,
             "--epoch-iterations applies to --replan and --elastic auto; give one, or leave it out")
        self._check_elastic(micro_batches)

    def _check_elastic(self, micro_batches: int) -> None:
        need(self.elastic in (None, "auto"), f"--elastic takes auto (the policy re-fits the cost model at every "
             f"epoch boundary), got {self.elastic!r}; a policy of your own: train(elastic=...) from Python")
        need(self.elastic is not None or (self.elastic_objective == "time" and self.elastic_replicas is None),
             "--elastic-objective and --elastic-replicas apply to --elastic auto; give it, or leave them out")
        need(not (self.elastic and self.replan), "--elastic auto changes replica degrees and re-plans the cuts at "
             "the --epoch-iterations boundaries, and --replan replaces the plan there; give one of them")
        need(self.elastic_objective in OBJECTIVES, f"--elastic-objective is one of {', '.join(OBJECTIVES)}, got "
             f"{self.elastic_objective!r}")
        degrees = self.elastic_replicas or (1,)
        need(all(isinstance(d, int) and d >= 1 for d in degrees) and min(degrees) <= micro_batches,
             f"--elastic-replicas gives the least and greatest replicas of a stage, each at least 1 and the least at "
             f"most the {micro_batches} micro-batches, got {','.join(map(str, degrees))}; use e.g. "
             f"--elastic-replicas 1,{micro_batches}")

    @property
    def switches_plans(self) -> bool:
        """--replan or --elastic auto: the run may move onto another plan at epoch boundaries."""
        return self.replan or self.elastic is not None

    def _check_cuts(self) -> None:
        need(self.stages is None or (isinstance(self.stages, int) and self.stages >= 1),
             f"--stages must be a positive number of stages, got {self.stages}")
        need(self.stages is None or not self.split_points,
             "--stages and --split-points both fix the cuts; give one (N split points make N + 1 stages)")
        need((self.stages is None and not self.split_points) or self.pick == "recommended",
             "--pick chooses from the solver's front; with --stages or --split-points the cuts are fixed")
        self._check_stage_replicas()

    def _check_stage_replicas(self) -> None:
        if not self.stage_replicas:
            return
        degrees = ",".join(map(str, self.stage_replicas))
        need(all(isinstance(d, int) and d >= 1 for d in self.stage_replicas),
             f"--stage-replicas gives each stage's replica degree, each at least 1, got {degrees}")
        need(self.stages is not None or bool(self.split_points),
             f"--stage-replicas {degrees} gives the degree of each stage of fixed cuts; give --stages "
             f"{len(self.stage_replicas)} (or --split-points) with it, or let the solver choose from --replicas")
        count = self.stages if self.stages is not None else len(self.split_points) + 1
        need(len(self.stage_replicas) == count,
             f"--stage-replicas {degrees} names {len(self.stage_replicas)} degrees for {count} stages; give one per "
             "stage, in stage order")
        need(self.replicas == DEFAULT_REPLICAS,
             f"--stage-replicas {degrees} fixes each stage's degree and --replicas {','.join(map(str, self.replicas))} "
             "gives the solver's candidates (or one degree for every stage): give one or the other")

    def check_replan(self, iterations: int | None) -> None:
        """--replan's or --elastic auto's own options (what they cannot combine with is
        :meth:`JobOptions.check`'s)."""
        flag = "--replan" if self.replan else "--elastic auto"
        need(isinstance(self.epoch_iterations, int) and self.epoch_iterations > SKIP_FIRST,
             f"{flag} re-fits the cost model every --epoch-iterations N iterations from the iterations after each "
             f"epoch's first {SKIP_FIRST} (cold starts, warm-up); give --epoch-iterations {SKIP_FIRST + 1} or more")
        need(iterations is None or iterations > (self.epoch_iterations or 0),
             f"--epoch-iterations {self.epoch_iterations} is not shorter than the run's {iterations} "
             "iterations, so there is no epoch boundary to re-plan at; use fewer or more --iterations")
        need(isinstance(self.replan_threshold, (int, float)) and 0 <= self.replan_threshold < 1,
             f"--replan-threshold is the least predicted saving that switches plans, a share in [0, 1), got "
             f"{self.replan_threshold}; use e.g. {DEFAULT_THRESHOLD}")


@dataclass(frozen=True)
class OutputOptions:
    """Where the run writes (the run directory, the trained weights) and whether it checks
    the result against single-process training."""

    out: Path = field(default_factory=lambda: Path("flatpack-run"))
    save: Path | None = None             # also write the trained state dict here (.safetensors)
    verify: bool = True

    def check(self) -> None:
        need(self.save is None or Path(self.save).suffix == ".safetensors",
             f"--save {self.save}: the weights are written as safetensors; name the file *.safetensors")
        need(not Path(self.out).exists() or Path(self.out).is_dir(),
             f"--out {self.out} is a file; give a directory (it is created if missing)")


# JobOptions's groups by attribute, in the order `flatpack run --help` shows them
GROUPS: dict[str, type] = {"batches": BatchOptions, "train": TrainOptions, "evaluation": EvaluationOptions,
                           "plan": PlanOptions, "output": OutputOptions}


def group_of(name: str) -> str:
    """The group that holds option ``name``; an unknown name is refused with the close matches."""
    for group, cls in GROUPS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            return group
    known = sorted(option_names())
    close = difflib.get_close_matches(name, known, n=2)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise InputError(f"JobOptions has no option {name!r}; {hint}the options are: {', '.join(known)}")


def option_names() -> list[str]:
    """Every option of every group, as :meth:`JobOptions.of` takes them."""
    return [f.name for cls in GROUPS.values() for f in dataclasses.fields(cls)]


@dataclass(frozen=True)
class JobOptions:
    """Everything a run is asked to do, one frozen group per part (see the module doc)."""

    batches: BatchOptions = field(default_factory=BatchOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    evaluation: EvaluationOptions = field(default_factory=EvaluationOptions)
    plan: PlanOptions = field(default_factory=PlanOptions)
    output: OutputOptions = field(default_factory=OutputOptions)

    @classmethod
    def of(cls, **options: Any) -> JobOptions:
        """The options named flat (``batch=8, out=path``), each put in its group."""
        return cls().with_changes(**options)

    def with_changes(self, **options: Any) -> JobOptions:
        """These options with the ones named flat replaced."""
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            grouped.setdefault(group_of(name), {})[name] = value
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **changes)
                                            for group, changes in grouped.items()})

    def check(self) -> None:
        """Refuses options no run can use, each with its cause and fix, before anything is
        loaded, compiled or started (``flatpack run``/``demo`` call it first)."""
        self.batches.check()
        spec = self.train.check(self.batches)
        self.evaluation.check(self.batches)
        self.plan.check(self.train.micro_batches)
        self.output.check()
        # what the schedule does not run with, each with its cause and fix
        # the degrees are known here only where the user fixed them (the solver picks the others,
        # and the run's spec checks them before any function starts)
        schedules.get(self.train.schedule).check(Setup(
            replicas=self.plan.stage_replicas, vertical_sync=self.train.vertical_sync,
            clip_grad_norm=spec.clip_grad_norm, accumulate=spec.accumulate, precision=self.train.precision,
            replan=bool(self.plan.replan), elastic=self.plan.elastic is not None,
            micro_batches=self.train.micro_batches))
        if self.plan.switches_plans:
            self._check_replan()

    def _check_replan(self) -> None:
        """What --replan and --elastic auto cannot combine with, from the other groups."""
        self.plan.check_replan(self.batches.iterations)
        flag = "--replan" if self.plan.replan else "--elastic auto"
        need(self.train.precision == "fp32",
             f"{flag} with --precision {self.train.precision}: tensors are rounded to {self.train.precision} at "
             "the stage boundaries, which move with the plan, so the single-process check cannot reproduce the run; "
             f"use --precision fp32 with {flag}")
        need(not self.evaluation.eval_every,
             f"{flag} switches plans at --epoch-iterations boundaries inside one training call, and --eval-every "
             "trains as calls of N iterations; give one of them")

    def optimizer_steps(self, iterations: int) -> int:
        return self.train.optimizer_steps(iterations)

    def optimizer_spec(self, iterations: int | None = None) -> OptimizerSpec:
        """The run's optimizer (:meth:`TrainOptions.optimizer_spec`) over ``iterations``,
        by default the run's."""
        return self.train.optimizer_spec(iterations or self.batches.iterations or 1)

    def train_settings(self, *, loss: str, checkpoint_every: int, micro_batches: int | None = None) -> TrainSettings:
        """The settings of the run's training call, with what the run resolved: the ``loss``
        the data and model train with, the checkpoint interval, and the micro-batches
        ``Plan.micro_batches_for`` resolved (None: the backend resolves them from the plan,
        whose workload holds --micro-batches)."""
        return TrainSettings(optimizer=self.optimizer_spec(), loss=loss,
                             micro_batches=micro_batches, schedule=self.train.schedule,
                             sync=self.train.sync, threads=1, checkpoint_every=checkpoint_every,
                             precision=self.train.precision, vertical_sync=self.train.vertical_sync)
