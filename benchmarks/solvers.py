"""Exact solvers on FuncPipe's problem, measured: solve time and objective of ``dp``, ``miqp``
and ``brute`` (where it can finish) for zoo models coarsened to L layers, on aws-lambda
(FuncPipe's 8 memory tiers), training with a global batch of 64 in M = 16 micro-batches
(FuncPipe's micro-batch size 4), data-parallel degrees d ∈ {1, 2, 4, 8, 16}, at FuncPipe's
four weight pairs (α₁, α₂) ∈ {(1, 0), (1, 2¹⁶), (1, 2¹⁹), (1, 2²²)}.

    python benchmarks/solvers.py                       # every model and L (tens of minutes)
    python benchmarks/solvers.py --quick               # one model, L = 16 and 32
    python benchmarks/solvers.py --models bert-large --layers 16,32,64,128 --solvers dp,miqp \\
        --miqp-time-limit 60 --timeout 300 --repeats 1
    python benchmarks/solvers.py --models gpt2-medium-48 --layers 192 --solvers dp --no-profile \\
        --check-layers 0                               # the 48-block GPT-2-medium chain (synthetic_gpt)
    python benchmarks/solvers.py --done-when           # issue 20's table: bert-large and
        # amoebanet-d36 at L = 64 and 128, dp against dp-reference, all four weight pairs and
        # the one-call front (about 10 minutes on 2 quiet cores, most of it the reference)

How each model becomes a chain of L layers (issue 42: the benchmark is the user's path): the
problem ``flatpack plan MODEL --size full --target aws-lambda --batch 64 --micro-batches 16
--solver dp --passes "<base passes>,coarsen{max-layers=L,by=time}"`` builds, through the CLI's
own parser and ``cli.planning.plan_problem`` (trace, passes, the profile with the CLI's
options, read from the disk cache when there; :func:`cli_problem`). Where coarsening leaves
fewer than L layers, the row's L is marked with ``*``. The 48-block GPT chain, which no zoo
entry has, is built by :func:`synthetic_gpt` with the CLI's profile options. Build seconds are
printed apart from solve seconds.

    python benchmarks/solvers.py --issue-42 --models bert-large,amoebanet-d36,gpt2-medium-48 \
        --layers 64,128 --repeats 3 --robustness 20 --timeout 300
        # the CLI's front, timed with and without --replicas, and the perturbed-profile
        # property: the slowest of 20 perturbed solves over their median (target <= 3)

What is measured, per (model, L, weight pair, solver), each solve in a forked child process
killed after ``--timeout`` seconds (dp, brute) or ``--miqp-timeout`` (miqp):

* solve s: wall time of ``solver.solve(problem, goal)`` in the child, the median of
  ``--repeats`` runs (dp and brute; miqp runs once since it has a time limit); for dp also
  the CPU seconds of the child (``cpu`` in the status column), which other load on a shared
  machine inflates far less than the wall time;
* dp-reference: ``dp{reference=true}``, dp as it stood before issue 20 (every label number
  compared on its own, each prefix quantity at its own least in the bound) — exact too, so
  its objective must equal dp's wherever it finishes (the summary prints the ratio);
* the plan's objective α₁·cost_MB·s + α₂·t_iter (``objective.evaluate(...).objective``, the
  same function for every solver), t_iter, dollars per iteration, stages, d, and the
  solver's status (and gap for miqp; labels built/kept for dp);
* miqp is warm-started from dp's plan of the same goal (what ``Miqp(hint="dp")`` does), handed
  over with ``Miqp.solve_from`` so dp does not run twice; its solve s is CP-SAT's part plus
  dp's measured seconds (``hint_s``), i.e. what ``Miqp(hint="dp").solve`` would take. Where
  dp timed out, miqp starts cold;
* brute only where ``brute.plan_count`` is at most ``--brute-limit``, as one ``solve_all`` pass
  that prices every plan once for all four weight pairs (its solve s is that pass, shown on
  each weight's row); otherwise the row says how many plans it would price;
* per (model, L): dp's whole four-point front, as the sum of the four solves and as one
  ``Dp.front`` call (which shares the per-(M, d) tables and seeds each weight pair with the
  plans of the earlier ones), and miqp's objective over dp's;
* where dp's time goes: extra dp solves per (model, L) under cProfile at the weight pairs
  ``--profile-weights`` names, each stopped at ``--timeout`` (the profile of the part that
  ran is kept; cProfile adds overhead to the many small calls, so the fractions are
  indicative), split into the label dominance filter (``_pareto``), building labels
  (``_extend``/``_last_stage``/``_enter``), bound pruning (``_within_bounds``), the beam pass's
  ranking (``_best_per_group``), per-configuration setup (``_chain``, ``_prefix_bounds``,
  ``_prefix_fronts``, ``_priced_prefix_fronts``, ``_stage_tensor_table``), the configuration
  screens (``unsearched_bound``, which build the priced fronts on first use, so the two
  overlap) and the rest;
* a cross-check at ``--check-layers`` (default 4) where brute force can price every plan of the
  full space: the three solvers' objectives side by side.

The host's core count and load average are printed at the start and the end: the solvers'
times scale with whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import math
import multiprocessing
import os
import pstats
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # ``python benchmarks/solvers.py`` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# a base pipeline per model that keeps at least 128 layers where the model allows it
# (full size; layer counts measured with these pipelines: bert-large 146, amoebanet-d36 129,
# resnet101 107 — no pipeline we tried gives ResNet-101 more than 107 fused layers)
BASE_PASSES = {
    "bert-large": "fuse-elementwise,merge-branches{max-crossing=3}",
    "amoebanet-d36": "fuse-elementwise,merge-branches{max-crossing=3}",
    "amoebanet-d18": "fuse-elementwise,merge-branches{max-crossing=3}",
    "resnet101": "fuse-elementwise",
}
DEFAULT_MODELS = ("bert-large", "amoebanet-d36", "resnet101")
SOLVERS = ("dp", "dp-reference", "miqp", "brute")
# dp-reference: dp as it stood before issue 20 (componentwise label filter, looser bound); its
# objectives must equal dp's wherever it finishes
DP_SPECS = {"dp": "dp", "dp-reference": "dp{reference=true}"}
# the table of issue 20's "Done when" (two models at L = 64 and 128, dp against its reference)
DONE_WHEN = ["--models", "bert-large,amoebanet-d36", "--layers", "64,128", "--solvers", "dp,dp-reference",
             "--timeout", "120", "--front-timeout", "120", "--no-profile", "--check-layers", "0"]
# GPT-2-medium-sized (issue 20): no zoo entry has 48 blocks, so the chain is built from one
# profiled block (synthetic_gpt)
SYNTHETIC_GPT = "gpt2-medium-48"
GPT_BLOCKS, GPT_LAYERS_PER_BLOCK, GPT_TOKENS = 48, 4, 1024
TARGET = "aws-lambda"
REPLICAS = (1, 2, 4, 8, 16)
BATCH, MICRO_BATCHES = 64, 16


# --- building the problems -------------------------------------------------------------------


@dataclasses.dataclass
class Base:
    """A model traced once, through its base passes, profiled."""

    name: str
    passes: str
    graph: Any
    leaves: list
    layers: int
    trace_s: float
    profile_s: float
    cache_hit: bool
    problem: Any = None       # a synthetic chain's Problem (built at one length; no graph to coarsen)


def base_chain(name: str, batch: int, profile_options) -> Base:
    if name == SYNTHETIC_GPT:
        return synthetic_gpt(batch, profile_options)

    from flatpack import compiler, zoo
    from flatpack.ir.graph import LayerGraph
    from flatpack.ir.passes import resolve
    from flatpack.ir.trace import flatten_inputs, trace

    passes = BASE_PASSES.get(name) or zoo.entry(name).passes or "fuse-elementwise,merge-branches"
    started = time.perf_counter()
    model, inputs = zoo.build(name, "full", batch)
    model.train()
    traced = trace(model, inputs, {})
    graph = LayerGraph.from_traced(traced)
    leaves = flatten_inputs(traced.signature, inputs, {})[0]
    trace_s = time.perf_counter() - started
    started = time.perf_counter()
    # the compiler's own path: passes, then the profile (read from the disk cache when there)
    graph, profile = compiler._passes_with_profile(graph, resolve(passes), profile_options, leaves)
    profile_s = time.perf_counter() - started
    return Base(name, passes, graph, leaves, len(graph.layers), trace_s, profile_s, profile.cache_hit)


def synthetic_gpt(batch: int, profile_options) -> Base:
    """A GPT-2-medium-sized chain of ``GPT_BLOCKS`` transformer blocks that no zoo entry has,
    built from one profiled block: GPT2LMHeadModel at GPT-2 medium's width (1024, 16 heads,
    1024 tokens, 50257-token vocabulary) with 3 blocks, traced, through the base passes (each
    block becomes 4 layers) and profiled like the zoo models; then its middle block's 4 layer
    profiles are repeated between the first and last blocks (``GPT_BLOCKS`` − 2 copies, each
    copy's boundary-value names made its own, so that a stage spanning copies counts each
    copy's tensors). The embeddings are merged into the first block's first layer and the
    final norm into the head (``merge_layer_profiles``), so that the chain has exactly
    4 × ``GPT_BLOCKS`` layers: 192 for 48 blocks."""
    import torch
    import transformers
    from flatpack import compiler
    from flatpack.ir.profile import LayerProfile, merge_layer_profiles
    from flatpack.partitioner.problem import ChainLayer
    from flatpack.partitioner.workload import Workload

    config = transformers.GPT2Config(n_embd=1024, n_head=16, n_layer=3, n_positions=GPT_TOKENS, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    inputs = (torch.randint(0, config.vocab_size, (batch, GPT_TOKENS)),)
    started = time.perf_counter()
    small = compiler.build_problem(model, inputs, target=TARGET, passes=BASE_PASSES["bert-large"],
                                   profile=profile_options, replicas=REPLICAS,
                                   workload=Workload("train", batch=BATCH, micro_batches=MICRO_BATCHES))
    profile_s = time.perf_counter() - started
    blocks = [[index for index, layer in enumerate(small.chain) if layer.name.startswith(f"transformer.h.{block}:")]
              for block in range(3)]
    if any(len(block) != GPT_LAYERS_PER_BLOCK for block in blocks[:2]):
        raise RuntimeError(f"expected {GPT_LAYERS_PER_BLOCK} layers per GPT-2 block after the base passes, got "
                           f"{[len(block) for block in blocks]}: {[layer.name for layer in small.chain]}")

    def profile_of(layer: ChainLayer) -> LayerProfile:
        if layer.profile is None:
            raise RuntimeError(f"layer {layer.name} of the profiled GPT-2 chain has no profile to copy")
        return layer.profile

    def merged(indices: list[int]) -> ChainLayer:
        layers = [small.chain[index] for index in indices]
        return ChainLayer("+".join(layer.name for layer in layers), sum(layer.param_bytes for layer in layers),
                          sum(layer.flops for layer in layers), layers[-1].boundary_bytes,
                          merge_layer_profiles("+".join(layer.name for layer in layers),
                                               [profile_of(layer) for layer in layers]))

    def copy(index: int, block: int) -> ChainLayer:
        layer = small.chain[index]
        profile = profile_of(layer)
        saved = {f"{value}@{block}": line for value, line in profile.saved_boundary_bytes.items()}
        return dataclasses.replace(layer, name=f"{layer.name}@{block}",
                                   profile=dataclasses.replace(profile, saved_boundary_bytes=saved))

    first, middle = blocks[0], blocks[1]
    head = [merged(list(range(first[0] + 1))), *(small.chain[index] for index in first[1:])]
    tail_start = middle[-1] + 1          # the last block, the final norm and the LM head
    tail_layers = list(range(tail_start, len(small.chain)))
    tail = [small.chain[index] for index in tail_layers[:GPT_LAYERS_PER_BLOCK - 1]]
    tail.append(merged(tail_layers[GPT_LAYERS_PER_BLOCK - 1:]))
    body = [copy(index, block) for block in range(1, GPT_BLOCKS - 1) for index in middle]
    chain = tuple(head + body + tail)
    problem = dataclasses.replace(small, chain=chain)
    return Base(SYNTHETIC_GPT, BASE_PASSES["bert-large"], None, [], len(chain), 0.0, profile_s, False, problem)


def problem_at(base: Base, layers: int, profile_options, workload=None, **options: Any):
    """The Problem a solver sees for ``base`` coarsened to ``layers`` (``build_problem``'s path
    without tracing again); by default this benchmark's training workload and replicas."""
    if base.problem is not None:
        if layers != base.layers or workload is not None or options:
            raise SystemExit(f"{base.name} is a synthetic chain built at L = {base.layers} with this benchmark's "
                             f"workload only; ask for --layers {base.layers} (and --check-layers 0)")
        return base.problem
    from flatpack import compiler
    from flatpack.ir.passes import resolve
    from flatpack.partitioner.problem import Problem
    from flatpack.partitioner.workload import Workload

    pipeline = resolve(f"coarsen{{max-layers={layers},by=time}}")
    graph, profile = compiler._passes_with_profile(base.graph, pipeline, profile_options, base.leaves)
    if workload is None:
        workload, options = Workload("train", batch=BATCH, micro_batches=MICRO_BATCHES), {"replicas": REPLICAS}
    return Problem.from_graph(graph, target=TARGET, workload=workload, profile=profile, **options)


def plan_argv(model: str, layers: int, replicas: str | None = None) -> list[str]:
    """The ``flatpack plan`` command line of issue 42 for ``model`` coarsened to ``layers``."""
    passes = f"{BASE_PASSES.get(model, BASE_PASSES['bert-large'])},coarsen{{max-layers={layers},by=time}}"
    argv = ["plan", model, "--size", "full", "--target", TARGET, "--batch", str(BATCH), "--micro-batches",
            str(MICRO_BATCHES), "--solver", "dp", "--passes", passes]
    return argv + (["--replicas", replicas] if replicas else [])


def cli_problem(model: str, layers: int, replicas: str | None = None) -> tuple[Any, float]:
    """The Problem ``flatpack plan`` builds for :func:`plan_argv` — its parser and its
    ``plan_problem`` (trace, passes, the profile with the CLI's options, from the disk cache
    when there) — and the seconds that took."""
    from flatpack.cli import build_parser, parse_arguments
    from flatpack.cli.planning import plan_problem

    args = parse_arguments(build_parser(), plan_argv(model, layers, replicas))
    started = time.perf_counter()
    problem = plan_problem(args)
    return problem, time.perf_counter() - started


def cli_profile_options():
    """The ProfileOptions ``flatpack plan`` uses by default (``--batch-sizes``, ``--repeats``),
    for the chain no zoo entry has (:func:`synthetic_gpt`)."""
    from flatpack.cli import build_parser, parse_arguments
    from flatpack.profiler import ProfileOptions

    args = parse_arguments(build_parser(), ["plan", "gpt2"])
    return ProfileOptions(batch_sizes=tuple(int(size) for size in args.batch_sizes.split(",")),
                          repeats=args.repeats, progress=False)


def instance(model: str, layers: int) -> tuple[Any, float]:
    """The problem solved for ``model`` at ``layers``, and the seconds building it took: the
    zoo models through :func:`cli_problem`; the 48-block GPT chain (no zoo entry, no
    coarsening) from :func:`synthetic_gpt` with the CLI's profile options."""
    if model != SYNTHETIC_GPT:
        return cli_problem(model, layers)
    started = time.perf_counter()
    base = synthetic_gpt(BATCH // MICRO_BATCHES, cli_profile_options())
    return problem_at(base, layers, None), time.perf_counter() - started


# --- solving in a child process, with a time limit -----------------------------------------------


TIMED_OUT = "timed out"


def in_child(work: Callable[[], Any], timeout_s: float) -> Any:
    """``work()`` in a forked process; its result, TIMED_OUT, or ("error", text)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def target() -> None:
        try:
            result = work()
        except BaseException as err:  # noqa: BLE001 - reported to the parent
            result = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=3)}")
        send.send(result)
        send.close()

    process = context.Process(target=target, daemon=True)
    process.start()
    send.close()
    try:
        if receive.poll(timeout_s):
            try:
                return receive.recv()
            except EOFError:
                return ("error", f"child exited with {process.exitcode}")
        return TIMED_OUT
    finally:
        if process.is_alive():
            process.kill()
        process.join()
        receive.close()


def timed_solve(solver, problem, goal, repeats: int) -> dict:
    """Wall seconds (the median of ``repeats``) and the CPU seconds of the same runs: on a
    shared machine the CPU figure says what the solve itself cost."""
    times, cpu, plan = [], [], None
    for _ in range(repeats):
        started, started_cpu = time.perf_counter(), time.process_time()
        plan = solver.solve(problem, goal)
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return {"plan": plan, "seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu), "runs": times}


PROFILE_GROUPS = {  # group → functions of funcpipe_dp (and objective.evaluate); cumulative seconds
    "per-layer label work (_labels_from; the next five lines are inside it)": ["_labels_from"],
    "  dominance filter (_pareto)": ["_pareto"],
    "  building labels (_extend, _last_stage, _enter)": ["_extend", "_last_stage", "_enter"],
    "  bound pruning (_within_bounds)": ["_within_bounds"],
    "  beam ranking (_best_per_group)": ["_best_per_group"],
    "  stage sync times (_Chain.sync)": ["sync"],
    "setup per (M, d) (_chain, _prefix_bounds, _prefix_fronts, _priced_prefix_fronts, _stage_tensor_table)": [
        "_chain", "_prefix_bounds", "_prefix_fronts", "_priced_prefix_fronts", "_stage_tensor_table"],
    "configuration screens (unsearched_bound)": ["unsearched_bound"],
    "final evaluate": ["evaluate"],
}


class _Interrupted(Exception):
    pass


def _interrupt(signum, frame):
    raise _Interrupted


def profiled_solve(solver, problem, goal, budget_s: float) -> dict:
    """One solve under cProfile, stopped by SIGALRM after ``budget_s`` (the profile of the part
    that ran is still returned)."""
    profiler = cProfile.Profile()
    signal.signal(signal.SIGALRM, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    interrupted = False
    started = time.perf_counter()
    profiler.enable()
    try:
        solver.solve(problem, goal)
    except _Interrupted:
        interrupted = True
    finally:
        profiler.disable()
        signal.setitimer(signal.ITIMER_REAL, 0)
    total = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    # (file, line, function) → (calls, primitive calls, tottime, cumtime, callers): the table pstats
    # documents in print_stats's output and keeps in an attribute typeshed leaves out
    raw = stats.stats  # pyright: ignore[reportAttributeAccessIssue]
    groups = {}
    for group, functions in PROFILE_GROUPS.items():
        seconds = 0.0
        for (filename, _, function), (_, _, _, cumtime, _) in raw.items():
            if function in functions and ("funcpipe_dp" in filename or (function == "evaluate"
                                          and "objective" in filename)):
                seconds += cumtime
        groups[group] = seconds
    top = sorted(((tottime, f"{Path(filename).name}:{function}", calls)
                  for (filename, _, function), (calls, _, tottime, _, _) in raw.items()), reverse=True)[:8]
    return {"total": total, "groups": groups, "top": top, "interrupted": interrupted}


# --- the benchmark -------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model: str
    layers: str
    weights: str
    solver: str
    seconds: float | None = None
    objective: float | None = None
    time_s: float | None = None
    dollars: float | None = None
    stages: int | None = None
    replicas: int | None = None
    status: str = ""
    labels: str = ""


def fmt(value: float | None, spec: str) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def describe_row(row: Row) -> str:
    return " | ".join([row.model, row.layers, row.weights, row.solver, fmt(row.seconds, ".3f"),
                       fmt(row.objective, ".6g"), fmt(row.time_s, ".3f"), fmt(row.dollars, ".4f"),
                       fmt(row.stages, "d"), fmt(row.replicas, "d"), row.status, row.labels])


HEADER = ["model", "L", "weights", "solver", "solve s", "objective", "t_iter s", "$ / iter", "stages", "d",
          "status / gap", "labels built / kept"]


def print_table_header() -> None:
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))


def emit(row: Row, rows: list[Row]) -> None:
    rows.append(row)
    print("| " + describe_row(row) + " |", flush=True)


def plan_row(row: Row, problem, plan, weights, seconds: float) -> Row:
    from flatpack.partitioner.objective import evaluate

    evaluation = evaluate(problem, plan)
    predictions = plan.predictions
    row.seconds = seconds
    row.objective = evaluation.objective(weights)
    row.time_s, row.dollars = evaluation.time_s, evaluation.dollars
    row.stages, row.replicas = len(plan.stages), plan.stages[0].replicas
    status = predictions.get("status", "")
    if predictions.get("gap"):
        status += f" gap {predictions['gap']:.2%}"
    if not evaluation.fits:
        status += " DOES NOT FIT"
    row.status = status
    if "labels_built" in predictions:
        row.labels = f"{predictions['labels_built']:,} / {predictions['labels_kept']:,}"
    return row


def run_problem(problem, model: str, label: str, args, rows: list[Row], summary: dict) -> None:
    from flatpack.partitioner.objective import FUNCPIPE_WEIGHTS, Weights
    from flatpack.partitioner.solvers import get_solver
    from flatpack.partitioner.solvers.base import Goal
    from flatpack.partitioner.solvers.brute import Brute, plan_count
    from flatpack.partitioner.solvers.dp import Dp

    weights_list = [Weights(*pair) for pair in FUNCPIPE_WEIGHTS]
    brute_plans = plan_count(problem)
    dp_plans: dict[str, Any] = {}
    dp_seconds: dict[str, float | None] = {}
    objectives: dict[tuple[str, str], float] = {}
    brute_result: Any = None
    for weights in weights_list:
        goal = Goal(weights)
        name = weights.label()
        for variant in [solver for solver in args.solvers if solver in DP_SPECS]:
            dp = get_solver(DP_SPECS[variant])
            result = in_child(lambda: timed_solve(dp, problem, goal, args.repeats), args.timeout * args.repeats)
            row = Row(model, label, name, variant)
            plan, seconds = None, None
            if result == TIMED_OUT:
                row.status = f"timed out after {args.timeout:g} s"
            elif isinstance(result, tuple):
                row.status = "error: " + result[1].splitlines()[0]
            else:
                plan, seconds = result["plan"], result["seconds"]
                plan_row(row, problem, plan, weights, seconds)
                row.status += f", cpu {result['cpu_seconds']:.2f} s"
                assert row.objective is not None, "plan_row priced the plan"
                objectives[variant, name] = row.objective
            if variant == "dp":
                dp_plans[name] = None if row.objective is None else plan
                dp_seconds[name] = None if row.objective is None else seconds
            emit(row, rows)
        if "miqp" in args.solvers:
            row = Row(model, label, name, "miqp")
            try:
                from flatpack.partitioner.solvers.miqp import Miqp
            except Exception as err:  # noqa: BLE001 - another engineer is finishing it
                row.status = f"skipped: miqp not importable ({type(err).__name__}: {err})"
                emit(row, rows)
                Miqp = None
            if Miqp is not None:
                miqp = Miqp(time_limit_s=args.miqp_time_limit, workers=2, hint="dp")
                hint, hint_s = dp_plans.get(name), dp_seconds.get(name) or 0.0

                def miqp_work(miqp=miqp, goal=goal, hint=hint, hint_s=hint_s):
                    started = time.perf_counter()
                    plan = miqp.solve_from(problem, goal, hint, "dp" if hint is not None else "none (dp timed out)",
                                           hint_s=hint_s)
                    return {"plan": plan, "seconds": time.perf_counter() - started + hint_s}

                result = in_child(miqp_work, args.miqp_timeout)
                if result == TIMED_OUT:
                    row.status = f"timed out after {args.miqp_timeout:g} s (killed)"
                elif isinstance(result, tuple):
                    row.status = "error: " + result[1].splitlines()[0]
                elif result["plan"] is None:
                    row.status = "no plan"
                else:
                    plan_row(row, problem, result["plan"], weights, result["seconds"])
                    predictions = result["plan"].predictions
                    row.labels = (f"cp-sat {predictions.get('search_s', math.nan):.1f} s, "
                                  f"{predictions.get('subproblems_proven')}/{predictions.get('subproblems')} "
                                  f"subproblems proven, plan from {predictions.get('plan_source')}")
                    assert row.objective is not None, "plan_row priced the plan"
                    objectives["miqp", name] = row.objective
                emit(row, rows)
        if "brute" in args.solvers:
            row = Row(model, label, name, "brute")
            if brute_plans > args.brute_limit:
                row.status = f"skipped ({brute_plans:.3g} plans)"
            else:
                if brute_result is None:  # one pass prices every plan once for all four goals
                    brute = Brute(max_plans=int(args.brute_limit))
                    goals = [Goal(w) for w in weights_list]

                    def brute_work(brute=brute, goals=goals):
                        started = time.perf_counter()
                        plans = brute.solve_all(problem, goals)
                        return {"plans": plans, "seconds": time.perf_counter() - started}

                    brute_result = in_child(brute_work, args.timeout)
                if brute_result == TIMED_OUT:
                    row.status = f"timed out after {args.timeout:g} s ({brute_plans:,} plans)"
                elif isinstance(brute_result, tuple):
                    row.status = "error: " + brute_result[1].splitlines()[0]
                else:
                    plan = brute_result["plans"][weights_list.index(weights)]
                    plan_row(row, problem, plan, weights, brute_result["seconds"])
                    row.labels = f"{brute_plans:,} plans, one pass for all 4 weights"
                    assert row.objective is not None, "plan_row priced the plan"
                    objectives["brute", name] = row.objective
            emit(row, rows)
    done = [seconds for seconds in dp_seconds.values() if seconds is not None]
    front = sum(done) if len(done) == len(weights_list) else None
    front_call = None
    if "dp" in args.solvers:
        def whole_front() -> float:
            started = time.perf_counter()
            Dp().front(problem)
            return time.perf_counter() - started
        result = in_child(whole_front, args.front_timeout)
        front_call = result if isinstance(result, float) else None
    ratios = {name: objectives["miqp", name] / objectives["dp", name]
              for name in (w.label() for w in weights_list)
              if ("miqp", name) in objectives and ("dp", name) in objectives}
    brute_ratios = {name: objectives["brute", name] / objectives["dp", name]
                    for name in (w.label() for w in weights_list)
                    if ("brute", name) in objectives and ("dp", name) in objectives}
    reference_ratios = {name: objectives["dp-reference", name] / objectives["dp", name]
                        for name in (w.label() for w in weights_list)
                        if ("dp-reference", name) in objectives and ("dp", name) in objectives}
    summary[model, label] = {"front": front, "front_call": front_call, "dp_done": len(done),
                             "dp_max": max(done) if done else None,
                             "ratios": ratios, "brute_ratios": brute_ratios, "brute_plans": brute_plans,
                             "reference_ratios": reference_ratios}
    if "dp" in args.solvers and args.profile:
        dp = get_solver("dp")
        summary[model, label]["profile"] = []
        for index in args.profile_weights:
            goal = Goal(weights_list[index])
            result = in_child(lambda: profiled_solve(dp, problem, goal, args.timeout), args.timeout + 120)
            summary[model, label]["profile"].append((goal.weights.label(), result))


def timed_front(problem) -> dict:
    """``flatpack plan``'s selection without --weights or --slo: dp's front over FuncPipe's
    four weight pairs; its wall and CPU seconds and the labels dp built."""
    from flatpack.partitioner.solvers.dp import Dp

    started, started_cpu = time.perf_counter(), time.process_time()
    front = Dp().front(problem)
    return {"seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - started_cpu,
            "labels": sum(plan.predictions.get("labels_built", 0) for plan in front.plans),
            "points": [(plan.predictions["time_s"], plan.predictions["dollars"]) for plan in front.plans]}


def spread(values: list[float]) -> str:
    return (f"median {statistics.median(values):.2f}, min {min(values):.2f}, max {max(values):.2f} "
            f"(n = {len(values)})")


def robustness(problem, count: int, timeout_s: float) -> list[dict]:
    """dp's front on ``count`` perturbed copies of ``problem`` (``partitioner.perturb``: each
    layer's times and bytes scaled by factors in [0.5, 2], seeds 0..count−1), each in a child
    killed after ``timeout_s``; a timed-out copy counts as ``timeout_s``."""
    from flatpack.partitioner.perturb import perturbed

    results = []
    for seed in range(count):
        copy = perturbed(problem, seed)
        result = in_child(lambda copy=copy: timed_front(copy), timeout_s)
        if not isinstance(result, dict):
            result = {"seconds": timeout_s, "cpu_seconds": timeout_s, "labels": 0, "status": str(result)[:80]}
        results.append(result)
    return results


def issue_42(models: list[str], layer_counts: list[int], args) -> None:
    """Issue 42's table: per model and L, the CLI's instance, dp's front (the solve ``flatpack
    plan`` prints) ``--repeats`` times, with and without ``--replicas 1,2,4,8,16``, then the
    perturbed-profile property: the slowest of ``--robustness`` perturbed solves over their
    median (target ≤ 3), in CPU seconds (what the solve costs on a loaded host) and wall."""
    print("| model | L | replicas flag | build s | front wall s | front cpu s | labels |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        for layers in layer_counts if model != SYNTHETIC_GPT else [GPT_BLOCKS * GPT_LAYERS_PER_BLOCK]:
            for replicas in (None, "1,2,4,8,16") if model != SYNTHETIC_GPT else (None,):
                if model == SYNTHETIC_GPT:
                    problem, build_s = instance(model, layers)
                else:
                    problem, build_s = cli_problem(model, layers, replicas)
                runs = [in_child(lambda: timed_front(problem), args.timeout) for _ in range(args.repeats)]
                done = [run for run in runs if isinstance(run, dict)]
                if not done:
                    print(f"| {model} | {len(problem.chain)} | {replicas or '-'} | {build_s:.1f} | {runs[0]} | | |")
                    continue
                print(f"| {model} | {len(problem.chain)} | {replicas or '-'} | {build_s:.1f} "
                      f"| {spread([run['seconds'] for run in done])} | {spread([run['cpu_seconds'] for run in done])} "
                      f"| {done[0]['labels']:,} |", flush=True)
            if args.robustness:
                results = robustness(problem, args.robustness, args.timeout)
                for key in ("cpu_seconds", "seconds"):
                    values = [result[key] for result in results]
                    ratio = max(values) / statistics.median(values)
                    print(f"  perturbed x{len(values)} {model} L={len(problem.chain)} {key}: {spread(values)}; "
                          f"slowest / median = {ratio:.2f} (target <= 3)", flush=True)
                labels = [result["labels"] for result in results]
                print(f"  labels built: median {statistics.median(labels):,.0f}, max {max(labels):,}", flush=True)


def summary_line(key: tuple[str, str], summary_row: dict, build_s: float | None) -> str:
    model, label = key
    front = (fmt(summary_row["front"], ".2f") if summary_row["front"] is not None
             else f"incomplete ({summary_row['dp_done']}/4 solved)")
    ratios = ", ".join(f"{name}: {ratio:.6f}" for name, ratio in summary_row["ratios"].items()) or "—"
    brute = (", ".join(f"{name}: {ratio:.6f}" for name, ratio in summary_row["brute_ratios"].items())
             or f"— ({summary_row['brute_plans']:.3g} plans)")
    call = fmt(summary_row["front_call"], ".2f") if summary_row["front_call"] is not None else "timed out"
    reference = ", ".join(f"{name}: {ratio:.12f}" for name, ratio in summary_row["reference_ratios"].items()) or "—"
    return (f"| {model} | {label} | {fmt(build_s, '.1f')} | {front} | {call} | {fmt(summary_row['dp_max'], '.2f')} | "
            f"{ratios} | {brute} | {reference} |")


def print_profile(model: str, label: str, weights: str, result: Any, file=None) -> None:
    out = functools.partial(print, file=file or sys.stdout)
    out(f"\ndp under cProfile, {model} L={label}, weights {weights}:")
    if result == TIMED_OUT or isinstance(result, tuple):
        out(f"  {result if result == TIMED_OUT else result[1].splitlines()[0]}")
        return
    total = result["total"]
    stopped = ", stopped by the timeout: the unfinished solve's profile" if result["interrupted"] else ""
    out(f"  total {total:.2f} s (with cProfile's overhead{stopped})")
    for group, seconds in result["groups"].items():
        out(f"  {seconds / total:6.1%}  {seconds:8.2f} s  {group}")
    out("  top functions by own time: " + "; ".join(f"{name} {tottime:.2f} s ({calls:,} calls)"
                                                     for tottime, name, calls in result["top"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated zoo names")
    parser.add_argument("--layers", default="16,32,64,128", help="comma-separated L")
    parser.add_argument("--solvers", default="dp,miqp,brute",
                        help="comma-separated, from " + ", ".join(SOLVERS))
    parser.add_argument("--miqp-time-limit", type=float, default=60.0, help="Miqp(time_limit_s=...)")
    parser.add_argument("--miqp-timeout", type=float, default=None,
                        help="kill a miqp solve after this many seconds (default: 2 × limit + 60)")
    parser.add_argument("--timeout", type=float, default=300.0, help="kill a dp or brute solve after this many s")
    parser.add_argument("--front-timeout", type=float, default=300.0,
                        help="kill the one-call Dp.front measurement after this many s")
    parser.add_argument("--repeats", type=int, default=1, help="dp and brute solves per point; the median is shown")
    parser.add_argument("--quick", action="store_true", help="the first model only, L = 16 and 32")
    parser.add_argument("--done-when", action="store_true",
                        help="issue 20's table: " + " ".join(DONE_WHEN) + " (options given after it override it)")
    parser.add_argument("--brute-limit", type=float, default=2e5,
                        help="run brute where it prices at most this many plans")
    parser.add_argument("--check-layers", type=int, default=4,
                        help="L of the three-solver cross-check on the first model (0: none)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the cProfile run of dp")
    parser.add_argument("--profile-weights", default="1,2",
                        help="indices into FuncPipe's four weight pairs for the cProfile runs (default 1,2: "
                             "(1, 2^16) and (1, 2^19))")
    parser.add_argument("--issue-42", action="store_true",
                        help="issue 42's table: the CLI's instance, dp's front, with and without --replicas, "
                             "and the perturbed-profile property (--robustness)")
    parser.add_argument("--robustness", type=int, default=20,
                        help="with --issue-42: perturbed copies solved per (model, L) (0: none)")
    argv = sys.argv[1:] if argv is None else argv
    if "--done-when" in argv:
        argv = DONE_WHEN + argv
    args = parser.parse_args(argv)
    args.solvers = [name.strip() for name in args.solvers.split(",") if name.strip()]
    unknown = set(args.solvers) - set(SOLVERS)
    if unknown:
        parser.error(f"unknown solver(s) {', '.join(sorted(unknown))}; choose from {', '.join(SOLVERS)}")
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    layer_counts = [int(value) for value in args.layers.split(",")]
    if args.quick:
        models, layer_counts = models[:1], [count for count in layer_counts if count <= 32] or [16, 32]
    args.profile_weights = [int(index) for index in args.profile_weights.split(",") if index.strip()]
    if args.miqp_timeout is None:
        args.miqp_timeout = 2 * args.miqp_time_limit + 60

    import torch

    print(f"host: {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"space: {TARGET}, train batch {BATCH} in M={MICRO_BATCHES} micro-batches, d ∈ {set(REPLICAS)}, "
          f"solvers {args.solvers}, miqp time limit {args.miqp_time_limit:g} s, timeout {args.timeout:g} s, "
          f"repeats {args.repeats}\n")

    # import every solver module here, once, so that no child's timed solve pays for an import
    import flatpack.partitioner.solvers.brute
    import flatpack.partitioner.solvers.dp
    import flatpack.partitioner.solvers.funcpipe_dp
    if "miqp" in args.solvers:
        try:
            import flatpack.partitioner.solvers.miqp  # noqa: F401
            from ortools.sat.python import cp_model  # noqa: F401 - miqp imports it on first use
        except Exception as err:  # noqa: BLE001 - reported on each miqp row
            print(f"miqp not importable: {type(err).__name__}: {err}")

    if args.issue_42:
        issue_42(models, layer_counts, args)
        return
    rows: list[Row] = []
    summary: dict = {}
    print_table_header()
    for name in models:
        for layers in layer_counts:
            problem, build_s = instance(name, layers)
            label = f"{layers}" if len(problem.chain) == layers else f"{len(problem.chain)}*"
            summary.setdefault("build", {})[name, label] = build_s
            run_problem(problem, name, label, args, rows, summary)
            # as it comes, on stderr (the tables on stdout stay whole): a cut-short run keeps it
            summary_row = summary[name, label]
            print("summary: " + summary_line((name, label), summary_row, build_s), file=sys.stderr, flush=True)
            for weights, result in summary_row.get("profile", []):
                print_profile(name, label, weights, result, file=sys.stderr)
                sys.stderr.flush()
    if args.check_layers and models:
        problem, _ = instance(models[0], args.check_layers)
        check_args = argparse.Namespace(**{**vars(args), "solvers": list(SOLVERS), "profile": False})
        run_problem(problem, models[0], f"{args.check_layers} (check)", check_args, rows, summary)

    print("\n* the base chain is shorter than the L asked for; the whole base chain is solved.")
    print("\nper (model, L): dp's four-point front (sum of the four solves), the slowest single dp solve, "
          "and miqp's (brute's) objective over dp's")
    print("| model | L | problem build s | dp front s (sum of solves) | Dp.front s (one call) | dp slowest solve s "
          "| miqp/dp objective | brute/dp objective | dp-reference/dp objective |")
    print("|---|---|---|---|---|---|---|---|")
    for key, summary_row in summary.items():
        if key != "build":
            print(summary_line(key, summary_row, summary["build"].get(key)))
    for key, summary_row in summary.items():
        if key != "build":
            model, label = key
            for weights, result in summary_row.get("profile", []):
                print_profile(model, label, weights, result)
    print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
