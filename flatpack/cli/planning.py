"""The planning verbs: ``plan`` (profile a model and print the Pareto front of plans, or
re-plan a finished run) and ``platforms`` (the catalog)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any

from flatpack import logs
from flatpack.cli.common import (JSON_HELP, check_tiers, compile_args, fixed_cut_args, json_or_file, load_factory,
                                 model_label, names, pipeline_for, positive_ints, report, solvers_help,
                                 targets_help)
from flatpack.cli.parser import RegistryChoice
from flatpack.errors import InputError, PlanError
from flatpack.ir.profile import OPTIMIZERS
from flatpack.partitioner.workload import MODES
from flatpack.stage.settings import SYNC_METHODS
from flatpack.table import plural

LOG = logs.get("cli")


def _container_cost_models() -> list[str]:
    """The cost models --cost-model chooses among: those that price training on GPU
    containers (the cost models' registry)."""
    # start-up time: the registry loads the cost models, which load torch
    from flatpack.partitioner.cost.registry import models_pricing

    return models_pricing("train", "container")


def _number(text: str) -> float:
    """A float, or a power written ``2^16`` as FuncPipe writes its weights."""
    base, caret, exponent = text.strip().partition("^")
    try:
        return float(base) ** float(exponent) if caret else float(base)
    except (ValueError, OverflowError):
        raise InputError(f"--weights: {text.strip()!r} is not a number (write 65536 or 2^16)") from None


def _weights(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise InputError(f"--weights takes two numbers, the weight on cost (MB·s) and on time (s), such as "
                         f"1,65536 or 1,2^16; got {text!r}")
    return _number(parts[0]), _number(parts[1])


def _cost_solver(name: str) -> Any:
    """The named solver, if it prices plans with the cost models (it has a front and an SLO
    mode); otherwise an error listing the ones that do."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.solvers import available_solvers, get_solver

    try:
        solver = get_solver(name)
    except ImportError as err:
        raise InputError(f"solver {name!r} is registered but cannot be loaded in this install ({err}); try "
                         "--solver brute on a small chain") from None
    if hasattr(solver, "front") and hasattr(solver, "within_slo"):
        return solver
    usable = []
    for other in available_solvers():
        try:
            candidate = get_solver(other)
        except ImportError:
            continue
        if hasattr(candidate, "front"):
            usable.append(other)
    raise InputError(f"solver {name!r} does not price plans with a cost model, so it has no front, SLO or "
                     f"weighted mode; flatpack plan needs one of: {', '.join(usable)}")


def _with_time_limit(solver: Any, args: argparse.Namespace) -> Any:
    """``solver`` with ``--time-limit`` as its anytime option (``time_limit_s`` of dp and
    miqp: past it they return their best plan and a proven lower bound); refused, before
    anything is profiled, where it cannot apply."""
    limit = args.time_limit
    if limit is None:
        return solver
    if not math.isfinite(limit) or limit <= 0:
        raise InputError(f"--time-limit must be a positive number of seconds, got {limit:g}; leave it out to let "
                         "the solver run to its proof")
    if (not dataclasses.is_dataclass(solver) or isinstance(solver, type)
            or "time_limit_s" not in {f.name for f in dataclasses.fields(solver)}):
        raise InputError(f"--time-limit applies to the exact solvers with an anytime search (dp, miqp); solver "
                         f"{args.solver!r} has no time limit: drop --time-limit or use --solver dp")
    if args.front == "exact":
        raise InputError("--front exact runs dp to its proof (every non-dominated plan) and has no time limit: drop "
                         "--time-limit, or use --front weights for the weight pairs' optima under the limit")
    if args.stages is not None or args.split_points:
        raise InputError("--stages and --split-points fix the cuts, so no solver runs: drop --time-limit")
    return dataclasses.replace(solver, time_limit_s=limit)


def _plan_workload(args: argparse.Namespace) -> tuple[Any, Any]:
    """The Workload and the search-space options (Problem.options) the flags ask for."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.options import ProblemOptions
    from flatpack.partitioner.workload import Workload

    options = ProblemOptions()
    micro_batches = None
    if args.micro_batches is not None:
        if args.mode == "infer":
            raise InputError("--micro-batches applies to training; an inference request serves --batch samples "
                             "at once")
        counts = positive_ints(args.micro_batches, "--micro-batches")
        micro_batches = min(counts)
        if len(counts) > 1:
            options = options.with_changes(micro_batches=tuple(counts))
    if args.memory is not None:
        options = options.with_changes(memory_mb=tuple(positive_ints(args.memory, "--memory")))
    if args.replicas is not None:
        options = options.with_changes(replicas=tuple(positive_ints(args.replicas, "--replicas")))
    if args.max_workers is not None:
        if args.max_workers < 0:
            raise InputError(f"--max-workers must be >= 0, got {args.max_workers}")
        options = options.with_changes(max_workers=args.max_workers)
    if args.cost_model is not None:
        options = options.with_changes(cost_model=args.cost_model)
    if args.weights is not None:
        options = options.with_changes(weights=_weights(args.weights))
    workload = Workload(args.mode, batch=args.batch, micro_batches=micro_batches, optimizer=args.optimizer,
                        sync=args.sync, slo_s=args.slo)
    return workload, options


def cmd_plan(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.partitioner import report as plan_report
    from flatpack.partitioner.objective import cost_model_for

    if args.from_run is not None:
        return _plan_from_run(args)
    if args.model is None:
        raise InputError("flatpack plan needs MODEL (or --from-run RUN_DIR to re-plan a finished run)")
    solver = _checked_solver(args)
    if args.plot:
        # start-up time: a verb imports what it runs
        from flatpack.partitioner import plot

        plot.require_matplotlib()
        plot.check_destination(args.plot)
    split_points = _checked_cuts(args)
    problem = plan_problem(args, split_points)
    started = time.perf_counter()
    selection = _select(args, solver, problem, split_points)
    solve_s = time.perf_counter() - started

    title = _plan_title(args, problem, cost_model_for(problem).name, solve_s)
    text = plan_report.text_report(problem, selection, title)
    if args.time_limit is not None:
        text += "\n\n" + plan_report.proof_summary(selection, args.time_limit)
    report(args, text, lambda: plan_report.report_json(problem, selection, _plan_context(args, problem)))
    if args.plot:
        # one pick alone says little on a plot: draw it against the front
        context = _front_for_context(solver, problem) if selection.kind != "front" else ()
        plot.plot_selection(selection, args.plot, title=_plot_title(args, problem),
                            inference=problem.workload.mode == "infer", context=context)
        LOG.info("wrote %s", args.plot)
    return 0


def plan_problem(args: argparse.Namespace, split_points: tuple[str, ...] = ()) -> Any:
    """The Problem ``flatpack plan`` solves for its parsed ``args``: the workload and
    search-space flags, the profile options, the model, then ``build_problem`` (trace,
    passes, profile from the disk cache when there). ``benchmarks/solvers.py`` builds its
    instances through it, so that the solver is measured on the user's instance."""
    # start-up time: a verb imports what it runs
    from flatpack.compiler import build_problem
    from flatpack.profiler import ProfileOptions

    workload, options = _plan_workload(args)
    check_tiers(args.target, options.memory_mb or ())
    profile = ProfileOptions(batch_sizes=tuple(positive_ints(args.batch_sizes)), repeats=args.repeats,
                             max_seconds=args.max_seconds, use_cache=not args.no_cache,
                             progress=None if logs.progress_enabled() else False)   # None: on a terminal
    model, inputs = load_factory(args.model, args.size)
    if split_points:
        # start-up time: a verb imports what it runs
        from flatpack.partitioner.solvers.wrappers import check_split_points

        check_split_points(model, split_points)
    return build_problem(model, inputs, target=args.target, passes=pipeline_for(args), profile=profile,
                         workload=workload, calibration=args.calibration, **options.given())


def _checked_solver(args: argparse.Namespace) -> Any:
    """The solver --solver names, with --time-limit, refused where --front exact cannot use it."""
    solver = _cost_solver(args.solver)
    if args.front == "exact" and not hasattr(solver, "exact_front"):
        raise InputError(f"--front exact needs solver dp (every non-dominated plan, exactly); solver "
                         f"{args.solver!r} gives the weight pairs' front only: drop --front exact or use --solver dp")
    if args.front == "exact" and (args.slo is not None or args.weights is not None):
        raise InputError("--front exact prints the whole front; --slo and --weights pick one plan: give one or the "
                         "other")
    return _with_time_limit(solver, args)


def _checked_cuts(args: argparse.Namespace) -> tuple[str, ...]:
    """The --split-points, refused with what they cannot be given with."""
    split_points = names(args.split_points)
    if (args.stages is not None or split_points) and (args.slo is not None or args.weights is not None):
        raise InputError("--stages and --split-points fix the cuts; --slo and --weights choose them: give one or "
                         "the other")
    if args.stages is not None and split_points:
        raise InputError("--stages and --split-points both fix the cuts; give one (N split points make N + 1 "
                         "stages)")
    if args.stages is not None and args.stages < 1:
        raise InputError(f"--stages must be a positive number of stages, got {args.stages}")
    if args.stage_replicas is not None:
        degrees = args.stage_replicas
        if args.stages is None and not split_points:
            raise InputError(f"--stage-replicas {degrees} gives the degree of each stage of fixed cuts; give --stages "
                             "(or --split-points) with it, or let the solver choose from --replicas")
        if args.replicas is not None:
            raise InputError(f"--stage-replicas {degrees} fixes each stage's degree and --replicas {args.replicas} "
                             "gives one for every stage: give one or the other")
        positive_ints(degrees, "--stage-replicas")
    return split_points


def _select(args: argparse.Namespace, solver: Any, problem: Any, split_points: tuple[str, ...]) -> Any:
    """The plans to report: the fixed cuts, the cheapest within --slo, the --weights optimum,
    or the front."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner import report as plan_report
    from flatpack.partitioner.objective import Weights

    workload = problem.workload
    if args.stages is not None or split_points:
        # start-up time: a verb imports what it runs
        from flatpack.partitioner.cost.funcpipe import with_tiers
        from flatpack.partitioner.objective import annotate, evaluate
        from flatpack.partitioner.solvers.wrappers import FixedCuts

        stage_replicas = positive_ints(args.stage_replicas, "--stage-replicas") if args.stage_replicas else ()
        cuts = FixedCuts.of(split_points, args.stages, problem.options.replicas, stage_replicas)
        fixed = with_tiers(problem, cuts(problem))
        return plan_report.Selection.of_cuts(annotate(fixed, evaluate(problem, fixed)), cuts.name)
    if workload.slo_s is not None:
        return plan_report.Selection.within_slo(solver.within_slo(problem, workload.slo_s), workload.slo_s)
    if args.weights is not None:
        return plan_report.Selection.of_weights(solver(problem), Weights.of(problem.options.weights).label())
    return plan_report.Selection.of_front(solver.exact_front(problem) if args.front == "exact"
                                          else solver.front(problem))


def _plan_from_run(args: argparse.Namespace) -> int:
    """``flatpack plan --from-run RUN_DIR``: re-fit the model to the run's timeline, solve
    again, print old plan, new plan and the predicted saving (``--json FILE``: the new plan)."""
    # start-up time: a verb imports what it runs
    from flatpack.compiler import replan_run

    if args.model is not None:
        raise InputError(f"--from-run {args.from_run} re-plans the model that run trained; leave MODEL "
                         f"({args.model}) out")
    replanned = replan_run(args.from_run, solver=args.solver)
    report(args, replanned.describe(), lambda: json.loads(replanned.new.dumps()))
    return 0


def _front_for_context(solver: Any, problem: Any) -> tuple:
    """The front behind an SLO or weighted pick; none when it cannot be solved (the pick
    alone is still worth drawing). The front ignores the SLO and the weights option."""
    try:
        return solver.front(problem).plans
    except PlanError:
        return ()


def _plan_context(args: argparse.Namespace, problem: Any) -> dict[str, Any]:
    """What a JSON report records about the run, beside the plans."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.objective import cost_model_for

    workload = problem.workload
    return {"model": model_label(args), "target": problem.platform.name, "mode": workload.mode,
            "batch": workload.batch, "micro_batches": workload.micro_batches, "optimizer": workload.optimizer,
            "sync": workload.sync, "solver": args.solver, "cost_model": cost_model_for(problem).name,
            "layers": len(problem.chain), "layer_names": [layer.name for layer in problem.chain],
            "options": {key: list(value) if isinstance(value, tuple) else value
                        for key, value in problem.options.given().items()}}


def _plan_title(args: argparse.Namespace, problem: Any, cost_model: str, solve_s: float) -> str:
    workload = problem.workload
    shape = (f"train, batch {workload.batch}, M {workload.micro_batches}, {workload.optimizer}, {workload.sync} sync"
             if workload.mode == "train" else f"infer, batch {workload.batch} per request")
    return (f"{model_label(args)} on {problem.platform.name}: {shape}; {plural(len(problem.chain), 'layer')}; "
            f"solver {args.solver} ({solve_s:.2f} s); {cost_model} cost model")


def _plot_title(args: argparse.Namespace, problem: Any) -> str:
    return (f"{model_label(args)} on {problem.platform.name}, {problem.workload.mode} batch "
            f"{problem.workload.batch}, solver {args.solver}")


def cmd_platforms(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.platform.catalog import describe_platforms, get_platform, platform_names

    names = args.names or platform_names()
    report(args, None if args.json else describe_platforms(names),
           lambda: [get_platform(name).to_json() for name in names])
    return 0



def _add_plan(subparsers: Any) -> None:
    parser = subparsers.add_parser("plan", help="profile a model and print the Pareto front of plans (time vs cost)",
                                 description="Profiles MODEL, solves for the plans that trade time against cost "
                                             "on the target and prints them, FuncPipe's recommendation marked, "
                                             "then the chosen plan stage by stage. --slo picks the cheapest plan "
                                             "within a time bound, --weights the optimum of one weight pair.")
    compile_args(parser, model_optional=True)
    parser.add_argument("--target", default="aws-lambda", help=f"platform: {targets_help()}")
    parser.add_argument("--mode", default="train", choices=MODES,
                        help="a training iteration (FuncPipe, Hydrozoa, PipeDream) or an inference request "
                             "(Gillis)")
    parser.add_argument("--batch", type=int, default=64, help="global batch of an iteration or a request")
    parser.add_argument("--micro-batches", default=None, metavar="M[,M...]",
                        help="micro-batches per iteration; several let the solver choose (default 4)")
    parser.add_argument("--optimizer", default="sgd-momentum", choices=OPTIMIZERS)
    parser.add_argument("--sync", default="pipelined", choices=SYNC_METHODS,
                        help="gradient scatter-reduce model (FuncPipe eq. 2 or LambdaML's eq. 1)")
    parser.add_argument("--solver", default="dp",
                        help=f"a solver that prices plans with the cost models: dp (default, exact), miqp, brute "
                             f"(small chains only), or the learning solvers rl and bayes (registered: "
                             f"{solvers_help()}); options in braces: 'rl{{episodes=5000,seed=1}}'")
    parser.add_argument("--memory", default=None, metavar="MB[,MB...]",
                        help="memory tiers to consider (default: the platform's)")
    parser.add_argument("--replicas", default=None, metavar="D[,D...]",
                        help="data-parallel degrees to consider (default 1,2,4,8,16)")
    parser.add_argument("--stage-replicas", default=None, metavar="D,D[,D...]",
                        help="with --stages or --split-points: each stage's own data-parallel degree, in stage order "
                             "(e.g. --stages 3 --stage-replicas 1,2,1, as flatpack run takes it)")
    parser.add_argument("--max-workers", type=int, default=None,
                        help="most workers one fork-join group forks (inference; default 8)")
    parser.add_argument("--cost-model", default=None, action=RegistryChoice, names=_container_cost_models,
                        metavar="MODEL",
                        help="training model on GPU containers (default hydrozoa)")
    goal = parser.exclusive_group()
    goal.add_argument("--slo", type=float, default=None, metavar="SECONDS",
                      help="the cheapest plan whose time meets this bound")
    goal.add_argument("--weights", default=None, metavar="COST,TIME",
                      help="the one plan minimizing COST·MB·s + TIME·seconds, e.g. 1,65536 or 1,2^16")
    parser.add_argument("--front", default="weights", choices=["weights", "exact"],
                        help="weights: the optima of FuncPipe's four weight pairs (default); exact: every "
                             "non-dominated (time, cost) plan, the four pairs tagged on it (solver dp, "
                             "FuncPipe's model)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="anytime: each solve of dp or miqp stops after SECONDS and returns its best plan "
                             "with a proven lower bound; the report prints each plan's gap to it (default: "
                             "run to the proof)")
    fixed_cut_args(parser, "price")
    parser.add_argument("--plot", default=None, metavar="FILE", help="draw time vs cost to FILE (.png, .svg, "
                        ".pdf; needs matplotlib)")
    json_or_file(parser, "plan", "the plans with their breakdowns")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="seconds measured inside the target, overriding the host-to-tier model")
    parser.add_argument("--batch-sizes", default="1,2,4", help="profile: micro-batch sizes to fit a·batch+b over")
    parser.add_argument("--repeats", type=int, default=5, help="profile: timed runs per layer and size")
    parser.add_argument("--max-seconds", type=float, default=None, help="profile: time budget for measuring")
    parser.add_argument("--no-cache", action="store_true", help="profile again even if cached")
    parser.add_argument("--from-run", default=None, metavar="RUN_DIR",
                        help="re-plan a finished `flatpack run --out RUN_DIR` from its measured timeline: "
                             "prints the old plan, the new plan and the predicted saving (MODEL left out)")
    parser.set_defaults(run=cmd_plan)


def _add_platforms(subparsers: Any) -> None:
    parser = subparsers.add_parser("platforms", help="print the platform catalog (--json adds each number's source)")
    parser.add_argument("names", nargs="*", help="platforms to show (default: all)")
    parser.add_argument("--json", action="store_true", help=JSON_HELP.format(verb="platforms"))
    parser.set_defaults(run=cmd_platforms)


# each verb's parser, added to the command's subparsers (flatpack.cli.build_parser orders them)
VERBS = {"plan": _add_plan, "platforms": _add_platforms}
