"""The main job: compile a model for a target, show the plan front, deploy it, train a few
pipelined iterations, print predicted versus measured, check equivalence with single-process
training and leave the plots. ``flatpack run`` and ``flatpack demo`` call :func:`run_training`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence, TextIO

import torch
from torch import nn

import flatpack
from flatpack import logs, schedules
from flatpack.analysis import chrome_trace, gantt, report
from flatpack.analysis.reference import call, first_output, torch_threads
from flatpack.analysis.refit import EVENTS_FILE
from flatpack.backends import RUN_TARGETS, local
from flatpack.backends import ray as ray_backend
from flatpack.backends.functions import merge_results, workload_of
from flatpack.backends.elastic_policy import ElasticPolicy
from flatpack.backends.replan import PlanSwitch, ReplanPolicy
from flatpack.data import (Batches, ShardSource, SyntheticSource, batches_from_record, check_against_example,
                           first_batch_rows, make_batches, parse_source, split_shards)
from flatpack.errors import FlatpackError, InputError, RunFailure
from flatpack.evaluation import evaluate
from flatpack.job_options import LOSS_NAMES, SYNTHETIC_ITERATIONS, JobOptions, PlanOptions
from flatpack.partitioner import report as plan_report
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.objective import evaluate as price_plan
from flatpack.partitioner.solvers.wrappers import check_split_points, dp, run_solver
from flatpack.partitioner.workload import Workload
from flatpack.profiler import ProfileOptions
from flatpack.progress import ProgressLine
from flatpack.rundir import PRIVATE_FILE_MODE, RUN_FILE, RunDirectory, RunRecord, fingerprint_changes
from flatpack.runtime import timeline
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.settings import RunControls, TrainSettings, split_options
from flatpack.table import plural
from flatpack.verdict import pipeline_optimizer_state, verdict
from flatpack.weights import save_state_dict, state_dict_of

LOG = logs.get("job")


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
                "decisions": [decision.to_json() for decision in train.decisions],
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


def dropout_modules(model: nn.Module) -> int:
    """How many ``nn.Dropout*`` modules of ``model`` have p > 0. ``flatpack run`` trains with
    them on: each stage draws its masks from a seed per batch of the run's data, stage and
    micro-batch (``training.micro_batch_seed``), and the verdict's reference draws the same ones
    (``reference.StageSeeds``)."""
    return sum(1 for module in model.modules()
               if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0)


def without_dropout(model: nn.Module) -> int:
    """Sets p = 0 in every ``nn.Dropout*`` module of ``model``, for a caller that compares a
    run with the original module's own outputs (a test, a benchmark); returns how many had
    p > 0. ``flatpack run`` does not: it trains with dropout on."""
    count = dropout_modules(model)
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return count


def synthetic_source(model: nn.Module, example: Any, seed: int) -> tuple[SyntheticSource, str]:
    """Random inputs shaped like the example, and the loss to train with: class targets under
    cross-entropy when the model outputs (batch, classes), otherwise random targets of the
    output's shape under mean squared error; none when the model computes its own loss."""
    with torch.no_grad():
        raw = call(model.eval(), example)
    model.train()
    output = first_output(raw)
    # a HuggingFace model given labels computes its own loss and needs no targets
    loss = "output" if own_loss(raw) else "cross_entropy" if output.dim() == 2 else "mse"
    return SyntheticSource.like(example, output, loss, seed), loss


def synthetic_batches(model: nn.Module, example: Any, batch: int, count: int,
                      seed: int) -> tuple[Batches, str]:
    """``count`` synthetic batches of ``batch`` rows (:func:`synthetic_source`), each drawn
    when it is asked for, and the loss to train with."""
    source, loss = synthetic_source(model, example, seed)
    return make_batches(source, None, None, batch=batch, iterations=count), loss


def own_loss(output: Any) -> bool:
    """Does the model return its own loss first (a HuggingFace ModelOutput given labels)?"""
    return isinstance(output, dict) and next(iter(output), None) == "loss" and output["loss"] is not None


def _shapes(inputs: Any) -> str:
    """The tensors of a batch's inputs as ``name (rows, ...)``, for an error message."""
    named = inputs.items() if isinstance(inputs, dict) else (
        (f"input {position}", value)
        for position, value in enumerate(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
    return ", ".join(f"{name} {tuple(value.shape)}" for name, value in named if isinstance(value, torch.Tensor))


def forward_on_the_data(model: nn.Module, inputs: Any, where: str) -> Any:
    """The model's output on a batch of the data, in eval mode, without gradients. Data the
    model cannot take (4-channel images for a 3-channel convolution, another width) is bad
    input found here, before any process starts, not a traceback from inside the model."""
    try:
        with torch.no_grad():
            return call(model.eval(), inputs)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        cause = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise InputError(f"{where}: the model cannot run on the data's inputs ({_shapes(inputs)}): {cause}. Reshape "
                         "or convert the data to what the model takes, or give a MODEL built for this data") from None
    finally:
        model.train()


def choose_loss(model: nn.Module, inputs: Any, target: Any, asked: str, where: str = "the data") -> str:
    """The loss a run trains with (``--loss``): the model output's ``loss`` when it has one,
    else the one asked for, else cross-entropy for (batch, classes) outputs and integer
    targets and mean squared error otherwise. Refuses what cannot work, before any process
    starts; ``where`` names the data in its errors."""
    output = forward_on_the_data(model, inputs, where)
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
    """The run's batches (:class:`flatpack.data.Batches`, built on demand from ``--data`` or
    drawn at random like the example), its loss and its iterations, checked before anything
    is compiled."""
    data, asked = options.batches, options.train.loss
    if data.data is None:
        count = data.iterations or SYNTHETIC_ITERATIONS
        batches, loss = synthetic_batches(model, example, data.batch, count, data.seed)
        if asked != "auto" and LOSS_NAMES.get(asked, asked) != loss:
            raise InputError(f"--loss {asked} needs real targets; the synthetic batches (no --data) train "
                             f"with {loss}. Give --data SOURCE, or leave --loss out")
        return batches, loss, count

    source = parse_source(data.data, endpoint=data.store_endpoint)
    if options.evaluation.eval_fraction:
        source = split_shards(source, options.evaluation.eval_fraction)[0]
    batches = make_batches(source, model, example, batch=data.batch, epochs=data.epochs,
                           iterations=data.iterations, shuffle=data.shuffle, seed=data.seed,
                           drop_last=data.drop_last)
    inputs, target = batches(0)

    where = f"--data {batches.description}"
    check_against_example(example, inputs, where)
    if batches.batch != data.batch:
        raise InputError(f"the DataLoader yields batches of {batches.batch} samples but --batch is {data.batch}; "
                         "give the run the loader's batch size")
    return batches, choose_loss(model, inputs, target, asked, _naming_shards(source, where)), len(batches)


def _naming_shards(source: Any, where: str) -> str:
    """``where``, with the shards named when the source has them: every shard has the first
    one's tensors, shapes and dtypes (``ShardSource.scan`` checked), so what one batch shows
    holds for each of them."""
    if not isinstance(source, ShardSource):
        return where
    shards, schema = source.scan()
    names = [name for name, _ in shards]
    listed = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    columns = ", ".join(f"{column} (rows, {', '.join(map(str, shape.shape))})" for column, shape in schema.items())
    return f"{where}, shards {listed}, each holding {columns}"


def evaluation_batches(model: nn.Module, example: Any, options: JobOptions,
                       loss: str) -> Sequence[tuple[Any, Any]] | Batches:
    """The held-out batches ``--eval-every`` evaluates on, one pass in order: ``--eval-data``,
    the shards ``--eval-fraction`` holds out of ``--data``, or (synthetic training data) two
    synthetic batches drawn with another seed. Checked against the model and the training
    ``loss`` before launch (held-out data without the labels a model's own loss needs would
    otherwise be scored on its logits)."""
    data, held = options.batches, options.evaluation
    if held.eval_data is None and not held.eval_fraction:
        return synthetic_batches(model, example, data.batch, 2, data.seed + 1)[0]
    if held.eval_data is not None:
        source = parse_source(held.eval_data, endpoint=data.store_endpoint)
    else:
        source = split_shards(parse_source(data.data, endpoint=data.store_endpoint), held.eval_fraction)[1]
    # a partial last batch is left out: eval batches, like training ones, have one size
    batches = make_batches(source, model, example, batch=data.batch, shuffle=False, drop_last=True)
    inputs, target = batches[0]
    check_against_example(example, inputs, f"--eval-data {batches.description}")
    scored = choose_loss(model, inputs, target, options.train.loss, f"--eval-data {batches.description}")
    if scored != loss:
        raise InputError(f"the held-out data ({batches.description}) would be scored with {scored} but the run trains "
                         f"with {loss}; give it the same tensors as --data (targets or labels alike)")
    return batches



def run_training(model: nn.Module, example: Any, options: JobOptions, *, stream: TextIO) -> JobResult:
    """Trains ``model`` as ``options`` say, reporting on ``stream``. A run refused before it
    started (a flatpack error other than RunFailure, before its run record was written)
    leaves no run directory behind where this call created it."""
    out = Path(options.output.out)
    created = not out.exists()
    try:
        return _run_training(model, example, options, stream=stream)
    except FlatpackError as err:
        if created and not isinstance(err, RunFailure) and out.is_dir() and not (out / RUN_FILE).exists():
            shutil.rmtree(out, ignore_errors=True)
        raise


@dataclass
class _Run:
    """What the steps of one run hand on to the next (see :func:`_run_training`)."""

    options: JobOptions
    say: Callable[..., None]
    batches: Any = None
    loss: str = ""
    iterations: int = 0
    held_out: Any = None
    compiled: Any = None
    settings: TrainSettings | None = None
    directory: RunDirectory | None = None
    problem: Any = None            # the compiled problem, with the store latency this deployment measured
    final: Any = None              # the compiled artifact that trained last (another after a re-plan)
    result: Any = None
    evaluations: list[Any] = field(default_factory=list)
    pipelined_state: dict[str, Any] = field(default_factory=dict)
    plan_label: str = ""           # how the plan that runs was chosen (fixed cuts, recommended, fastest)

    @property
    def reads_target(self) -> bool:
        return self.loss != "output"    # a model that returns its loss reads no target key

    @property
    def out(self) -> Path:
        return Path(self.options.output.out)


def _run_training(model: nn.Module, example: Any, options: JobOptions, *, stream: TextIO) -> JobResult:
    """The run, step by step: check, prepare the data, compile and plan, record the run,
    deploy and train, finish, compare with the prediction, plot, and the verdict."""
    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    options.check()
    _check_trainable(model)
    torch.manual_seed(options.batches.seed)
    dropouts = dropout_modules(model)
    RunDirectory(options.output.out).create()    # 0700 when flatpack makes it: the run's model and data are private
    run = _Run(options, say)
    # one thread: the profile is then what a one-vCPU function computes, and the workers use one too
    with torch_threads(1):
        _prepare_data(run, model, example)
        # the weights and buffers training starts from (profiling runs the model in train
        # mode, which moves BatchNorm's running statistics): the reference starts here too
        initial = copy.deepcopy(model)
        _compile(run, model)
        every = _checkpoint_interval(run, _predict(run))
        _record(run, every)
        _deploy_and_train(run)
        _finish_run(run)
        comparison, calibrated = _compare(run)
        files = _plots(run, type(model).__name__)
        max_diff, equivalent = _verdict(run, initial, dropouts)
        return JobResult(run.final, run.result, comparison, calibrated, max_diff, equivalent, files, run.evaluations)


def _check_trainable(model: nn.Module) -> None:
    if not any(p.requires_grad for p in model.parameters()):
        raise InputError(f"{type(model).__name__} has no trainable parameters (none, or all with requires_grad="
                         "False), so there is nothing to train; give a model with parameters, or use flatpack "
                         "compile/deploy to serve it")


def _prepare_data(run: _Run, model: nn.Module, example: Any) -> None:
    """The batches, the loss and the iterations (the options then say how many), and the
    held-out batches of --eval-every."""
    options = run.options
    batches, loss, iterations = training_data(model, example, options)
    run.options = options = options.with_changes(iterations=iterations)
    run.batches, run.loss, run.iterations = batches, loss, iterations
    if options.batches.data is not None:
        data = options.batches
        order = ("in the DataLoader's order" if batches.source.kind == "loader" else
                 f"shuffled, seed {data.seed}" if data.shuffle else "in order")
        LOG.info(f"data: {batches.description}, {plural(batches.per_epoch, 'batch', 'batches')} of "
                 f"{data.batch} per epoch, {plural(iterations, 'iteration')} ({order}"
                 f"{', last partial batch dropped' if data.drop_last else ''}); loss: "
                 f"{'the model output' + chr(39) + 's own' if loss == 'output' else loss}")
    run.held_out = evaluation_batches(model, example, options, loss) if options.evaluation.eval_every else None


def _compile(run: _Run, model: nn.Module) -> None:
    """Profiles, plans and compiles the model for local functions; prints the front and
    saves the artifact into the run directory."""
    options, say = run.options, run.say
    spec = options.optimizer_spec()
    say(f"optimizer: {spec.describe()}")
    train, plan = options.train, options.plan
    # the cost model counts the state of the optimizer the run names, read from the optimizer
    workload = Workload("train", batch=options.batches.batch, micro_batches=train.micro_batches,
                        optimizer="adam" if spec.is_adam_like else "sgd-momentum", sync=train.sync,
                        schedule=train.schedule, optimizer_state_factor=spec.state_factor(),
                        precision=train.precision, recompute=plan.recompute)
    started = time.perf_counter()
    extra: dict[str, Any] = {"replicas": plan.replicas}
    if plan.memory_mb:
        extra["memory_mb"] = plan.memory_mb
    # profile at the micro-batch size the workers run (and two smaller ones for the fit):
    # extrapolating a·batch+b from much smaller batches overestimates vectorized layers
    micro = max(1, options.batches.batch // train.micro_batches)
    sizes = tuple(sorted({max(1, micro // 4), max(1, micro // 2), micro}))
    if plan.split_points:
        check_split_points(model, plan.split_points)
    solver = run_solver(plan.pick, plan.solver, plan.stages, plan.split_points, plan.replicas, plan.stage_replicas)
    if plan.target == "ray":    # the plan is made for the cluster's nodes (platform.catalog.ray)
        ray_backend.connect(plan.address)
    compiled = flatpack.compile(model, run.batches[0][0], target=plan.target, solver=solver, passes=plan.passes,
                                profile=ProfileOptions(batch_sizes=sizes, repeats=3,
                                                       progress=None if logs.progress_enabled() else False),
                                workload=workload, calibration=plan.calibration, **extra)
    LOG.info(f"compiled {type(model).__name__} for target {plan.target} in {time.perf_counter() - started:.1f} s: "
             f"{plural(compiled.plan.num_layers, 'layer')}, solver {getattr(solver, 'name', solver)}")
    if compiled.problem is None:  # flatpack.compile keeps the problem it solved; a loaded artifact may not
        raise FlatpackError("the compiled artifact carries no partitioning problem, which training predicts from")
    run.plan_label = _plan_label(options, solver)
    _print_plans(compiled, run.plan_label, say)
    compiled.save(run.out / "compiled")    # private (0600/0700), as Compiled.save writes by default
    say(f"artifact digest {compiled.digest} (flatpack resume --digest checks the saved artifact against it)")
    run.compiled = compiled


def _predict(run: _Run) -> Any:
    """The chosen plan's predicted iteration, said; returns it."""
    compiled, say = run.compiled, run.say
    cost = report.predicted_iteration(compiled.problem, compiled.plan, reads_target=run.reads_target,
                                      schedule=run.options.train.schedule)
    front_s = price_plan(compiled.problem, compiled.plan).time_s
    say(f"\nthe plan that runs ({run.plan_label}), schedule {run.options.train.schedule}: predicted "
        f"{cost.iteration_s * 1000:.0f} ms and ${cost.dollars_per_iteration:.3g} per iteration (the front's "
        f"{front_s * 1000:.0f} ms plus the schedule's order and, where the functions share this host, its CPU"
        + ("; after training, the comparison re-prices it with the store's round trip measured at deploy)"
           if compiled.problem.calibration is None else ")"))
    recomputing = [str(index) for index, stage in enumerate(compiled.plan.stages) if stage.recompute]
    if recomputing:
        say(f"stage{'s' * (len(recomputing) > 1)} {', '.join(recomputing)} recompute their activations in the "
            "backward (the tier chosen does not hold them; one more forward each)")
    return cost


def _checkpoint_interval(run: _Run, cost: Any) -> int:
    """The iterations between checkpoints: --checkpoint-every, else the cost model's choice."""
    options, iterations = run.options, run.iterations
    checkpoints = funcpipe.checkpoint_cost(run.compiled.problem, run.compiled.plan)
    every = options.train.checkpoint_every or checkpoints.interval_for(cost.iteration_s, iterations)
    if not schedules.get(options.train.schedule).flush:
        # micro-batches are in flight between iterations: only a drained pipeline checkpoints
        every = options.evaluation.eval_every or iterations
        why = f"{options.train.schedule} checkpoints only where its pipeline drains, at the end of each call"
    elif options.train.checkpoint_every:
        why = "as asked"
    elif checkpoints.overhead(cost.iteration_s, every) <= 0.05:
        why = "the shortest interval whose upload costs at most 5% of an iteration"
    else:
        why = "a checkpoint costs more than 5% of the run's iterations: only the last is taken"
    LOG.info(f"checkpoints every {every} iteration{'s' * (every != 1)} ({why}): "
             f"{checkpoints.bytes / 2**20:.1f} MiB each, {checkpoints.upload_s * 1000:.0f} ms of upload, "
             f"{checkpoints.overhead(cost.iteration_s, every) * 100:.1f}% of an iteration amortized")
    return every


def _record(run: _Run, every: int) -> None:
    """The run directory keeps what `flatpack resume` needs until the run succeeds: the
    batches (or what names them, with their fingerprint), the run record and the S3
    server's data (checkpoints included)."""
    options, batches = run.options, run.batches
    directory = RunDirectory(options.output.out)
    directory.remove_store()      # an earlier run's in the same directory: this run replaces it
    data_record = _data_record(batches, options)
    if data_record is None:
        if options.batches.data is not None:
            LOG.info("the DataLoader cannot be reopened by name, so its batches are copied into the run "
                     "directory for flatpack resume")
        fingerprint = directory.save_batches(batches)
    else:
        # what the run trains on, so that resume refuses data changed since (a shard
        # replaced with one of the same shapes would otherwise train silently)
        fingerprint = batches.source.fingerprint()
    # every setting that decides the arithmetic, micro-batches included (a loaded artifact has
    # no workload to default them from), so `flatpack resume` retrains the same way
    run.settings = options.train_settings(loss=run.loss, checkpoint_every=every,
                                          micro_batches=run.compiled.plan.micro_batches_for(
                                              workload_of(run.compiled)))
    record = RunRecord(run=f"run-{uuid.uuid4().hex[:10]}", loss=run.loss, iterations=run.iterations,
                       data=data_record, train_options=recorded_options(run.settings, options.train.non_finite),
                       fingerprint=fingerprint, target=options.plan.target)
    directory.write(record)
    run.directory = directory


def recorded_options(settings: TrainSettings, non_finite: str) -> dict[str, Any]:
    """What ``run.json`` records of a training call (its ``train_options``), the keyword
    options ``flatpack resume`` trains with again."""
    return {"optimizer": settings.optimizer.to_json(), "schedule": settings.schedule,
            "vertical_sync": settings.vertical_sync, "sync": settings.sync, "threads": settings.threads,
            "checkpoint_every": settings.checkpoint_every, "non_finite": non_finite,
            "precision": settings.precision, "micro_batches": settings.micro_batches}


def train_call(deployment: Any, batches: Any, settings: TrainSettings, controls: RunControls) -> Any:
    """``deployment.train`` with the run's settings and controls, whole: the one place the
    job starts a training call (resume repeats what the store's call record holds)."""
    return deployment.train(batches, settings, controls)


def _deploy_and_train(run: _Run) -> None:
    """Deploys the plan to local functions sharing a local S3 server, measures the store's
    round trip (unless a calibration file did), trains (and evaluates), and reads what the
    verdict compares."""
    options, directory, compiled = run.options, run.directory, run.compiled
    assert directory is not None and run.settings is not None    # _record made them
    record = directory.read()
    with _resumable(directory), deploy_for(options.plan.target, options.plan.address, compiled,
                                           workdir=directory.logs, data_dir=directory.store,
                                           run=record.run) as deployment:
        where = "one process each" if options.plan.target == "local" else "one Ray task each"
        LOG.info(f"deployed {plural(compiled.plan.workers, 'function')} ({where}) "
                 f"sharing a local S3 server at {deployment.store_url.split('?')[0]}")
        run.problem = _measured_problem(compiled, deployment)
        controls = RunControls(iterations=run.iterations, progress=logs.progress_enabled(),
                               non_finite=options.train.non_finite, **epoch_policies(options.plan, directory))
        run.result, run.evaluations = train_and_evaluate(deployment, run.batches, run.settings, controls,
                                                         options.evaluation.eval_every, run.held_out, run.say)
        # after a switch the deployment runs the last plan
        run.final = deployment.compiled
        run.pipelined_state = pipeline_optimizer_state(deployment, run.final) if options.output.verify else {}


def epoch_policies(plan: PlanOptions, directory: RunDirectory) -> dict[str, Any]:
    """The RunControls of ``--replan`` or ``--elastic auto``: the policy asked at every
    ``--epoch-iterations`` boundary, recording each plan switch in the run directory. Cuts the
    user fixed (``--stages``, ``--split-points``) stay: ``--elastic auto`` then changes the
    replica degrees only."""
    on_switch = _recording_switches(directory)
    if plan.elastic is not None:
        degrees = plan.elastic_replicas or (1,)
        return {"elastic": ElasticPolicy(plan.elastic_objective, min(degrees),
                                         max(degrees) if plan.elastic_replicas else None,
                                         cuts=plan.stages is None and not plan.split_points, on_switch=on_switch),
                "epoch_iterations": plan.epoch_iterations}
    if plan.replan:
        return {"replan": ReplanPolicy(plan.replan_threshold, on_switch=on_switch),
                "epoch_iterations": plan.epoch_iterations}
    return {}


def _measured_problem(compiled: Any, deployment: Any) -> Any:
    """The compiled problem with the store latency this deployment measured, unless a
    calibration file (a separate flatpack calibrate run) measured it."""
    if compiled.problem.calibration is not None:
        problem = compiled.problem
        LOG.info(f"store request latency from the calibration file: "
                 f"{problem.platform.storage_latency_s * 1000:.1f} ms")
        return problem
    problem = dataclasses.replace(compiled.problem, platform=dataclasses.replace(
        compiled.problem.platform, storage_latency_s=deployment.measure_latency()))
    LOG.info(f"store round trip measured: {problem.platform.storage_latency_s * 1000:.1f} ms "
             "(replaces the catalog's assumption in the prediction)")
    return problem


def _finish_run(run: _Run) -> None:
    """The trained weights saved, the run directory naming the plan that trained last, and
    what the training did, said."""
    options, directory, result, say = run.options, run.directory, run.result, run.say
    assert directory is not None    # _record made it
    record = directory.read()
    if result.switches:
        # the finished run's compiled/ is the plan that trained last, as its events.json is
        run.final.save(directory.compiled)
        retired, record = record.compiled, dataclasses.replace(record, compiled=directory.compiled.name)
        directory.write(record)
        shutil.rmtree(directory.root / retired, ignore_errors=True)
    _finish(directory, record, run.compiled, result.parameters, say, options.output.save)
    say(f"\ntrained {plural(run.iterations, 'iteration')} in {result.wall_s:.1f} s ({result.samples_per_s:.1f} "
        f"samples/s), ${result.dollars:.6f} at the platform's prices")
    for restart in result.restarts:
        say(f"  {restart.describe()}")
    for decision in result.decisions:
        say(f"  elastic {decision.describe()}")
    for switch in result.switches if not result.decisions else ():
        say(f"  re-planned {switch.describe()}")
    if options.plan.replan and not result.switches:
        say(f"  re-planned every {plural(options.plan.epoch_iterations or 0, 'iteration')}: no other plan was "
            f"predicted at least {options.plan.replan_threshold * 100:.0f}% faster, the run kept its plan")
    if run.evaluations:
        say("held-out evaluation (through the inference path): " + "; ".join(
            f"iter {found.iteration}: loss {found.loss:.4f}"
            + (f", accuracy {found.accuracy:.3f}" if found.accuracy is not None else "") for found in run.evaluations))


def _measured_events(run: _Run) -> list[Any]:
    """The iterations the last plan ran (after a switch, those after it)."""
    result = run.result
    return ([event for event in result.events if event.iteration > result.switches[-1].iteration]
            if result.switches else result.events)


def _compare(run: _Run) -> tuple[Any, Any]:
    """Predicted against measured, and FuncPipe's in-run calibration (β and t_lat from
    iteration 1) where no calibration file stands in for it; the timeline written for
    `flatpack plan --from-run` (analysis.refit) to re-fit the model to."""
    result, say, schedule = run.result, run.say, run.options.train.schedule
    # iteration 0 pays the cold start; with enough iterations, iteration 1 measures β
    skip = 2 if run.iterations >= 3 else min(1, run.iterations - 1)
    measured = _measured_events(run)
    comparison = report.compare(run.problem, run.final.plan, measured, skip_first=skip,
                                reads_target=run.reads_target, schedule=schedule)
    latency_ms = run.problem.platform.storage_latency_s * 1000
    basis = ("uncalibrated, the store round trip measured at deploy" if run.problem.calibration is None
             else "calibrated, the store round trip from the calibration file")
    say(f"\npredicted (FuncPipe model, the plan that ran; {basis}: {latency_ms:.1f} ms) vs measured, per "
        "micro-batch and per iteration:")
    say(comparison.table())
    calibrated = in_run_calibration = None
    try:
        # with a calibration file, the prediction above is already calibrated
        if skip == 2 and run.compiled.problem.calibration is None and not result.switches:
            in_run_calibration = report.calibrate(run.problem, run.compiled.plan, result.events, iteration=1)
    except FlatpackError as err:  # the calibration is context: a measured β < 1 is refused by the platform
        LOG.info(f"no calibration on iteration 1: {err}")
    if in_run_calibration is not None:
        tuned, beta, latency = in_run_calibration
        calibrated = report.compare(tuned, run.final.plan, measured, skip_first=skip,
                                    reads_target=run.reads_target, schedule=schedule)
        say(f"calibrated on iteration 1 as FuncPipe's profiler does in the target (β = {beta:.2f} compute "
            f"slowdown, t_lat = {latency * 1000:.1f} ms per transfer): predicted "
            f"{calibrated.predicted_iteration_s * 1000:.1f} ms, error {_percent(calibrated.iteration_error)} "
            "on the later iterations")
    # an elastic run's decisions beside the timeline, predicted and measured effect each
    decisions = {"decisions": [decision.to_json() for decision in result.decisions]} if result.decisions else {}
    (run.out / EVENTS_FILE).write_bytes(timeline.dumps(measured, **decisions))
    return comparison, calibrated


def _plots(run: _Run, model_name: str) -> list[Path]:
    """The Gantt chart and the Chrome trace, predicted above measured."""
    out = run.out
    # loading a stage (a cold start) is not part of an iteration; the chart shows the iterations
    running = [event for event in run.result.events if event.kind != "load"]
    schedule = report.predicted_schedule(run.problem, run.final.plan, reads_target=run.reads_target,
                                         schedule=run.options.train.schedule)
    # the epoch boundaries' decisions, across every worker's row
    marks = [found.mark() for found in (run.result.decisions or run.result.switches)]
    files = [out / "compiled", gantt.plot(running, out / "timeline.png", predicted=schedule, marks=marks,
                                          title=f"{model_name}: {len(run.final.plan.stages)} stages on local "
                                                "functions"),
             chrome_trace.write(run.result.events, out / "timeline.json", predicted=schedule, marks=marks)]
    run.say(f"\nwrote {files[1]} (the Gantt chart, predicted above measured), {files[2]} (the same as a Chrome "
            f"trace: open it in ui.perfetto.dev or chrome://tracing) and the stage artifacts in {files[0]}")
    return files


def _verdict(run: _Run, initial: nn.Module, dropouts: int) -> tuple[float | None, bool | None]:
    """The run against single-process training from the same weights (--no-verify: none)."""
    if not run.options.output.verify:
        return None, None
    found = verdict(initial, run.compiled, run.batches, run.options, run.loss, run.result.parameters,
                    run.pipelined_state, dropouts=dropouts, example=run.batches[0][0],
                    replanned=bool(run.result.switches))
    run.say(found.describe())
    return found.max_weight_diff, found.equivalent


def _percent(error: float | None) -> str:
    """A relative error as a signed percentage; "-" when there was nothing to compare with."""
    return "-" if error is None else f"{error * 100:+.1f}%"


def train_and_evaluate(deployment: Any, batches: Any, settings: TrainSettings, controls: RunControls,
                       eval_every: int, held_out: Iterable[tuple[Any, Any]] | None,
                       say: Any) -> tuple[Any, list[Any]]:
    """Trains ``controls.iterations`` batches; with ``eval_every`` N, as calls of N iterations
    (each continues from the previous one's checkpoint: weights, optimizer state, the
    schedule's position, accumulated gradients), after each of which the held-out batches go
    through the inference path (the deployment serves the latest checkpoint) and the loss
    (and accuracy) joins the progress line and the report. Re-planning (``controls.replan``)
    runs in the one call (``JobOptions.check`` refuses it with ``eval_every``). Returns the
    calls' results as one and the evaluations."""
    if not eval_every:
        return train_call(deployment, batches, settings, controls), []
    if held_out is None:
        raise ValueError(f"eval_every={eval_every} evaluates on held-out batches; pass them as held_out")
    iterations = controls.iterations or 0
    degrees = [stage.replicas for stage in deployment.compiled.plan.stages]
    line = ProgressLine(iterations, first_batch_rows(batches[0]), deployment.dollars_per_second(degrees),
                        None if logs.progress_enabled() else io.StringIO())   # -q: no progress
    results, evaluations, done = [], [], 0
    with line:
        while done < iterations:
            length = min(eval_every, iterations - done)
            call_controls = controls.replace(iterations=length, progress=line, batch_offset=done)
            results.append(train_call(deployment, lambda index, offset=done: batches[offset + index], settings,
                                      call_controls))
            done += length
            found = evaluate(deployment.infer, held_out, settings.loss, iteration=done)
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
    """What ``run.json`` records of the run's data so that ``flatpack resume`` reads (or, for
    synthetic batches, draws) the same batches again: the source and how it was batched
    (None: a DataLoader, which cannot be reopened by name: the run directory keeps its batches)."""
    if not isinstance(batches, Batches) or batches.source is None or batches.source.to_json() is None:
        return None
    data = options.batches
    # synthetic batches are as many as the run trains, whatever the options left unset
    iterations = len(batches) if isinstance(batches.source, SyntheticSource) else data.iterations
    return {"source": batches.source.to_json(), "batch": data.batch, "epochs": data.epochs,
            "iterations": iterations, "shuffle": data.shuffle, "seed": data.seed,
            "drop_last": data.drop_last, "layout": batches.layout_json()}


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


def deploy_for(target: str, address: str | None, compiled: Any, **options: Any) -> Any:
    """``flatpack run``'s and ``resume``'s deployment: the local backend's functions, or
    (``target="ray"``) the same functions as Ray tasks on the cluster at ``address``; ``options``
    are ``local.deploy``'s, which both take."""
    if target not in RUN_TARGETS:
        raise InputError(f"flatpack run and resume train on {' or '.join(RUN_TARGETS)} functions, not {target!r}")
    if target == "ray":
        return ray_backend.deploy(compiled, address=address, **options)
    if address is not None:
        raise InputError("--address names the Ray cluster to run on; give --target ray with it, or leave it out")
    return local.deploy(compiled, **options)


def resume_training(root: Path, *, stream: TextIO, clean: bool = False, digest: str | None = None,
                    verify_key: str | None = None, data: str | None = None, name: str | None = None,
                    min_version: int | None = None, trust_file: str | None = None,
                    accept_changed_data: bool = False, target: str | None = None,
                    address: str | None = None) -> ResumeResult:
    """``flatpack resume RUN_DIR``: continues a run ``flatpack run`` started, after any crash,
    from the last checkpoint every stage took, on the run's own batches, to the weights the
    uninterrupted run would have reached. ``clean``: discard the run's store data instead.
    ``digest`` / ``verify_key`` (and the signature's ``name``, ``min_version``, ``trust_file``):
    what the run's compiled artifact is checked against (``flatpack.load``). ``data``: a run
    whose data came from a dataset factory names it again (``run.json`` is data and never
    names code to import). The data is checked against the fingerprint the run recorded at its
    start; ``accept_changed_data`` resumes on changed data anyway (with a warning naming what
    changed). ``target``: where the functions run (None: where the run's record says they ran,
    ``run.json``'s ``target``); ``address``: the Ray cluster's (None: Ray's "auto"; run.json
    names none, being data)."""
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
    if target is None and record.target not in RUN_TARGETS:
        raise InputError(f"{directory.record_path}: target is {record.target!r}, where flatpack run never trains; "
                         f"resume it with --target {' or --target '.join(RUN_TARGETS)}")
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
        with _resumable(directory), deploy_for(target or record.target, address, compiled, workdir=directory.logs,
                                               data_dir=directory.store, run=record.run) as deployment:
            done = deployment.consistent_checkpoint()
            resumed_after = done if deployment.calls() else None
            result = _resume_calls(deployment, batches, record, done)
            parameters = deployment.parameters()
        if result is not None:
            say(f"\ntrained {len(result.losses)} more iterations in {result.wall_s:.1f} s; final loss "
                f"{result.losses[-1]:.4f}")
        _finish(directory, record, compiled, parameters, say)
        return ResumeResult(root, "done", resumed_after, len(result.losses) if result is not None else 0,
                            result.losses[-1] if result is not None and result.losses else None,
                            directory.trained_path)


def _resume_calls(deployment: Any, batches: Any, record: RunRecord, done: int | None) -> Any:
    """The training calls of a resumed run: all of it when none had begun, else the call that
    stopped (from checkpoint ``done``) and the calls it had not begun."""
    if not deployment.calls():
        LOG.info("the run had not started training; training it from the start")
        return deployment.train(batches, *split_options(record.train_options or {}), iterations=record.iterations,
                                loss=record.loss, progress=logs.progress_enabled())
    LOG.info(f"resuming run {record.run} after iteration {done} (the last checkpoint every stage took)"
             if done is not None else f"resuming run {record.run} from its first iteration")
    result = deployment.resume(batches, progress=logs.progress_enabled())
    # a run evaluated every N iterations trained as calls of N: the calls it had
    # not begun follow the resumed one (without the evaluations)
    last = deployment.calls()[-1]
    trained = last.batch_offset + last.iterations
    if trained >= record.iterations:
        return result
    LOG.info(f"training the run's last {plural(record.iterations - trained, 'iteration')}")
    rest = deployment.train(lambda index: batches[trained + index], *split_options(record.train_options or {}),
                            iterations=record.iterations - trained, loss=record.loss,
                            progress=logs.progress_enabled(), batch_offset=trained)
    return rest if result is None else merge_results([result, rest])


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


def _plan_label(options: JobOptions, solver: Any) -> str:
    """How the plan that runs was chosen, in the words the report labels it with."""
    plan = options.plan
    if plan.stages or plan.split_points:
        return f"fixed cuts: {getattr(solver, 'name', solver)}"
    return plan.pick if plan.pick == "fastest" else f"{getattr(solver, 'name', solver)}'s {plan.pick}"


def _same_plan(one: Any, other: Any) -> bool:
    def key(plan: Any) -> tuple:
        return tuple(plan.ranges), tuple((stage.memory_mb, stage.replicas) for stage in plan.stages)
    return key(one) == key(other)


def prediction_basis(problem: Any) -> str:
    """What the cost model's figures rest on, as the report says it before its first
    prediction: a calibration file (flatpack calibrate), or the catalog's figures alone."""
    calibration = problem.calibration
    if calibration is None:
        return (f"uncalibrated: the catalog's figures for the {problem.platform.name} tiers over this host's profile "
                f"(`flatpack calibrate --target {problem.platform.name}` measures them; --calibration FILE predicts "
                "with what it wrote)")
    measured = f" on {calibration.target.date}" if calibration.target is not None else ""
    return f"calibrated: {calibration.platform}'s tiers as measured{measured} (--calibration)"


def _print_plans(compiled: Any, label: str, say: Any) -> None:
    """dp's front for context, the plan that runs marked on it when it is one of its plans,
    then the plan that runs stage by stage, labelled by how it was chosen (fixed cuts, the
    solver's recommendation, the fastest)."""
    problem, running = compiled.problem, compiled.plan
    say(f"predictions (FuncPipe's cost model) {prediction_basis(problem)}")
    try:
        front = dp().front(problem)
    except Exception as err:  # noqa: BLE001 - the front is context; the chosen plan still runs
        LOG.warning(f"no front: {err}")
        front = None
    if front is not None:
        on_front = next((index for index, plan in enumerate(front.plans) if _same_plan(plan, running)), None)
        selection = (plan_report.Selection(tuple(front.plans), on_front, "front", label) if on_front is not None
                     else plan_report.Selection.of_front(front))
        where = ("★ marks the plan that runs" if on_front is not None
                 else "the plan that runs is not on it; ★ marks the recommended plan")
        say("\n".join([f"Pareto front (dp): {plural(len(front.plans), 'plan')}, fastest first; {where}", "",
                        plan_report.front_table(problem, selection), "", plan_report.explain(problem, selection)]))
    say(f"\nthe plan that runs ({label}) by stage — " + plan_report.stage_breakdown(problem, running))
