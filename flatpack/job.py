"""The main job: compile a model for a target, show the plan front, deploy it, train a few
pipelined iterations, print predicted versus measured, check equivalence with single-process
training and leave the plots. ``flatpack run`` and ``flatpack demo`` call :func:`run_training`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from flatpack.errors import InputError
from flatpack.runtime.reference import call, first_output, train_single_process


@dataclass
class JobOptions:
    batch: int = 32
    micro_batches: int = 4
    iterations: int = 4
    optimizer: str = "adam"
    lr: float = 0.01
    schedule: str = "sync"
    sync: str = "pipelined"
    solver: str = "dp"
    passes: str | None = None
    replicas: tuple[int, ...] = (1, 2)
    memory_mb: tuple[int, ...] | None = None
    out: Path = field(default_factory=lambda: Path("flatpack-run"))
    verify: bool = True
    seed: int = 0
    # checkpoints are upload traffic the cost model does not count: by default only the last
    checkpoint_every: int = 0
    # "recommended": the solver's choice (FuncPipe's recommendation for dp); "fastest": the
    # fastest plan on dp's Pareto front
    pick: str = "recommended"


@dataclass(frozen=True)
class FastestOnFront:
    """A solver: the fastest plan on dp's Pareto front."""

    name: str = "dp-fastest"

    def __call__(self, problem: Any) -> Any:
        from flatpack.partitioner.solvers import get_solver

        return get_solver("dp").front(problem).plans[0]


@dataclass
class JobResult:
    compiled: Any
    train: Any
    comparison: Any
    calibrated: Any          # the comparison with β and t_lat measured on iteration 1 (None for short runs)
    max_param_diff: float | None
    equivalent: bool | None
    files: list[Path]


def without_dropout(model: nn.Module) -> nn.Module:
    """Dropout draws a fresh mask in every stage and micro-batch, so a pipelined run can match
    single-process training only without it; the equivalence check sets p = 0."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def synthetic_batches(model: nn.Module, example: Any, batch: int, count: int,
                      seed: int) -> tuple[list[tuple[Any, torch.Tensor]], str]:
    """Random inputs shaped like the example at ``batch`` rows, and the loss to train with:
    class targets under cross-entropy when the model outputs (batch, classes), otherwise
    random targets of the output's shape under mean squared error."""
    generator = torch.Generator().manual_seed(seed)
    leaves = example if isinstance(example, (tuple, list)) else (example,)
    with torch.no_grad():
        output = first_output(call(model.eval(), example))
    model.train()
    loss = "cross_entropy" if output.dim() == 2 else "mse"
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
        target = (torch.randint(0, output.shape[-1], (batch,), generator=generator) if loss == "cross_entropy"
                  else torch.randn((batch, *output.shape[1:]), generator=generator, dtype=output.dtype))
        batches.append((tuple(inputs), target))
    return batches, loss


def run_training(model: nn.Module, example: Any, options: JobOptions, *, stream: TextIO) -> JobResult:
    import flatpack
    from flatpack.backends import local
    from flatpack.ir.profiler import ProfileOptions
    from flatpack.partitioner.cost import funcpipe
    from flatpack.partitioner.workload import Workload
    from flatpack.runtime import gantt, report

    def say(text: str = "") -> None:
        print(text, file=stream, flush=True)

    if isinstance(example, dict):
        raise InputError("flatpack run trains models called with positional inputs; wrap a keyword-input model")
    torch.manual_seed(options.seed)
    without_dropout(model)
    options.out.mkdir(parents=True, exist_ok=True)
    # one thread: the profile is then what a one-vCPU function computes, and the workers use one too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        batches, loss = synthetic_batches(model, example, options.batch, options.iterations, options.seed)
        example_batch = batches[0][0]
        workload = Workload("train", batch=options.batch, micro_batches=options.micro_batches,
                            optimizer="adam" if options.optimizer == "adam" else "sgd-momentum", sync=options.sync)
        started = time.perf_counter()
        extra = {"replicas": options.replicas}
        if options.memory_mb:
            extra["memory_mb"] = options.memory_mb
        # profile at the micro-batch size the workers run (and two smaller ones for the fit):
        # extrapolating a·batch+b from much smaller batches overestimates vectorized layers
        micro = max(1, options.batch // options.micro_batches)
        sizes = tuple(sorted({max(1, micro // 4), max(1, micro // 2), micro}))
        if options.pick not in ("recommended", "fastest"):
            raise InputError(f"pick must be 'recommended' or 'fastest', got {options.pick!r}")
        solver = FastestOnFront() if options.pick == "fastest" else options.solver
        compiled = flatpack.compile(model, example_batch, target="local", solver=solver, passes=options.passes,
                                    profile=ProfileOptions(batch_sizes=sizes, repeats=3), workload=workload, **extra)
        say(f"compiled {type(model).__name__} for target local in {time.perf_counter() - started:.1f} s: "
            f"{compiled.plan.num_layers} layers, solver {getattr(solver, 'name', solver)}")
        _print_front(compiled, say)
        compiled.save(options.out / "compiled")
        cost = funcpipe.iteration(compiled.problem, compiled.plan)
        say(f"\nchosen plan ({options.pick}): predicted {cost.iteration_s * 1000:.0f} ms and ${cost.dollars_per_iteration:.3g} per "
            "iteration")
        with local.deploy(compiled, workdir=options.out / "logs") as deployment:
            say(f"deployed {sum(s.replicas for s in compiled.plan.stages)} functions (one process each) sharing a "
                f"local S3 server at {deployment.store_url.split('?')[0]}")
            problem = dataclasses.replace(compiled.problem, platform=dataclasses.replace(
                compiled.problem.platform, storage_latency_s=deployment.measure_latency()))
            say(f"store round trip measured: {problem.platform.storage_latency_s * 1000:.1f} ms "
                "(replaces the catalog's assumption in the prediction)\n")
            result = deployment.train(batches, iterations=options.iterations,
                                      optimizer={"name": options.optimizer, "lr": options.lr},
                                      loss=loss, schedule=options.schedule, sync=options.sync,
                                      threads=1, progress=stream,
                                      checkpoint_every=options.checkpoint_every or options.iterations)
        say(f"\ntrained {options.iterations} iterations in {result.wall_s:.1f} s ({result.samples_per_s:.1f} "
            f"samples/s), ${result.dollars:.6f} at the platform's prices")
        for restart in result.restarts:
            say(f"  {restart.describe()}")
        # iteration 0 pays the cold start; with enough iterations, iteration 1 measures β
        skip = 2 if options.iterations >= 3 else min(1, options.iterations - 1)
        comparison = report.compare(problem, compiled.plan, result.events, skip_first=skip)
        say("\npredicted (FuncPipe model) vs measured, per micro-batch and per iteration:")
        say(comparison.table())
        calibrated = None
        if skip == 2:
            tuned, beta, latency = report.calibrate(problem, compiled.plan, result.events, iteration=1)
            calibrated = report.compare(tuned, compiled.plan, result.events, skip_first=skip)
            say(f"calibrated on iteration 1 as FuncPipe's profiler does in the target (β = {beta:.2f} compute "
                f"slowdown, t_lat = {latency * 1000:.1f} ms per transfer): predicted "
                f"{calibrated.predicted_iteration_s * 1000:.1f} ms, error {calibrated.iteration_error * 100:+.1f}% "
                "on the later iterations")
        # loading a stage (a cold start) is not part of an iteration; the chart shows the iterations
        running = [event for event in result.events if event.kind != "load"]
        files = [options.out / "compiled", gantt.plot(running, options.out / "timeline.png",
                            predicted=report.predicted_schedule(problem, compiled.plan),
                            title=f"{type(model).__name__}: {len(compiled.plan.stages)} stages on local functions")]
        say(f"\nwrote {files[1]} (the Gantt chart, predicted above measured) and the stage artifacts in {files[0]}")
        max_diff = equivalent = None
        if options.verify:
            reference, _ = train_single_process(model, batches, options.iterations, loss=loss,
                                                optimizer={"name": options.optimizer, "lr": options.lr})
            max_diff, equivalent = _compare_parameters(result.parameters, reference)
            verdict = "passed" if equivalent else "FAILED"
            say(f"equivalence with single-process training: {verdict} (max |parameter difference| {max_diff:.3g} "
                f"after {options.iterations} iterations)")
        return JobResult(compiled, result, comparison, calibrated, max_diff, equivalent, files)
    finally:
        torch.set_num_threads(threads)


def _compare_parameters(parameters: dict[str, torch.Tensor], reference: nn.Module) -> tuple[float, bool]:
    worst, close = 0.0, True
    for name, expected in reference.state_dict().items():
        got = parameters.get(name)
        if got is None:
            return float("inf"), False
        worst = max(worst, float((got.float() - expected.float()).abs().max()) if got.numel() else 0.0)
        close = close and torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    return worst, close


def _print_front(compiled: Any, say: Any) -> None:
    from flatpack.partitioner.solvers import get_solver
    from flatpack.partitioner import report as plan_report

    try:
        front = get_solver("dp").front(compiled.problem)
    except Exception as err:  # noqa: BLE001 - the front is context; the chosen plan still runs
        say(f"(no front: {err})")
        return
    say(plan_report.text_report(compiled.problem, plan_report.Selection.of_front(front), "plan front (dp)"))
