"""The ``flatpack`` command: inspect, profile, plan, platforms, compile, run, demo, deploy, teardown."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import flatpack
from flatpack import logs, safeio
from flatpack.errors import FlatpackError, InputError, PlanError, RunFailure
from flatpack.interrupts import Interrupted, clean_shutdown
from flatpack.ir.profile import OPTIMIZERS
from flatpack.partitioner.workload import MODES
from flatpack.stage.integrity import INDEX_FILE, SIGNATURE_FILE
from flatpack.stage.settings import SCHEDULES, SYNC_METHODS
from flatpack.table import format_table, plural
from flatpack.version import __version__

if TYPE_CHECKING:
    import torch

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10
    import tomli as tomllib

LOG = logs.get("cli")
# a config is a flat table of a verb's options: a few hundred bytes
MAX_CONFIG_BYTES = safeio.MiB


def load_factory(spec: str, size: str = "tiny") -> tuple[torch.nn.Module, Any]:
    """MODEL is ``path/to/file.py:factory``, ``package.module:factory`` or a registered model
    name (flatpack.models: a built-in example, or a zoo model built at ``size``)."""
    # start-up time: a verb imports what it runs
    from flatpack import models

    named = models.find(spec)
    if named is not None:
        return named.build(size)
    source, colon, attribute = spec.rpartition(":")
    if not colon and not spec.endswith(".py"):
        close = models.close_matches(spec)
        if close:
            raise InputError(f"unknown model {spec!r}; did you mean {' or '.join(close)}? (see flatpack inspect "
                             "--help for what MODEL may be)")
    if not colon or not source or not attribute:
        raise InputError(f"MODEL {spec!r} must be path/to/file.py:factory, package.module:factory, one "
                         f"of the built-in examples ({', '.join(models.model_names(models.EXAMPLE))}) or a zoo "
                         f"model ({', '.join(models.model_names(models.ZOO))})")
    # start-up time: a verb imports what it runs
    from flatpack.factories import import_factory

    factory = import_factory(spec, "MODEL")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InputError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    return result


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _describe_values(values: list[dict]) -> str:
    parts = []
    for value in values:
        if value["kind"] == "tensor":
            shape = "×".join(str(s) for s in value["shape"]) or "scalar"
            parts.append(f"{value['name']}[{shape} {value['dtype']}]")
        else:
            parts.append(f"{value['name']}({value['type']})")
    return ", ".join(parts)


def chain_table(chain: dict, plan_ranges: list[tuple[int, int]] | None = None) -> str:
    """The chain as a text table: index, name, ops, params, boundary tensors and bytes."""
    stage_of = {}
    for stage, (start, end) in enumerate(plan_ranges or []):
        for index in range(start, end + 1):
            stage_of[index] = stage
    rows = [("#", "stage" if plan_ranges else "", "layer", "ops", "params", "boundary out", "bytes")]
    for layer in chain["layers"]:
        boundary = layer["boundary"]
        rows.append((str(layer["index"]), str(stage_of.get(layer["index"], "")), layer["name"][:44],
                     layer["ops"][:48], human_bytes(layer["param_bytes"]),
                     _describe_values(boundary["values"])[:80], human_bytes(boundary["bytes"])))
    lines = format_table(rows[0], rows[1:]).splitlines()
    inputs = chain["inputs"]
    lines.insert(0, f"frontend: {chain['frontend']}   layers: {len(chain['layers'])}   parameters: "
                    f"{human_bytes(chain['total_param_bytes'])}   inputs: {_describe_values(inputs['values'])}")
    return "\n".join(lines)


def profile_table(profile: Any) -> str:
    # start-up time: a verb imports what it runs
    from flatpack.ir.profile import stage_saved_bytes

    """Per layer: forward and backward milliseconds at batch 1 and per extra sample, the
    serving (no-grad) forward at batch 1, and the bytes a stage holds for it."""
    rows = [("#", "layer", "fwd ms", "+/sample", "bwd ms", "+/sample", "serve ms", "params", "saved/sample",
             "out/sample", "peak @1")]
    for index, layer in enumerate(profile.layers):
        rows.append((str(index), layer.name[:40], f"{layer.forward_s.at(1) * 1e3:.3f}",
                     f"{layer.forward_s.per_sample * 1e3:.3f}", f"{layer.backward_s.at(1) * 1e3:.3f}",
                     f"{layer.backward_s.per_sample * 1e3:.3f}", f"{layer.inference_line().at(1) * 1e3:.3f}",
                     human_bytes(layer.param_bytes),
                     human_bytes(layer.saved_bytes.per_sample), human_bytes(layer.output_bytes.per_sample),
                     human_bytes(layer.peak_bytes.at(1))))
    lines = format_table(rows[0], rows[1:]).splitlines()
    host = profile.host
    source = "cache hit" if profile.cache_hit else f"measured in {profile.wall_s:.1f} s"
    lines.insert(0, f"profile: {source}   host: {host.cpu}, {host.threads} threads, torch {host.torch_version}   "
                    f"batch sizes: {', '.join(map(str, profile.batch_sizes))}   repeats: {profile.repeats}")
    layers = profile.layers
    lines.append(f"whole model as one stage, per sample: fwd+bwd "
                 f"{sum(layer.forward_s.per_sample + layer.backward_s.per_sample for layer in layers) * 1e3:.3f} ms "
                 f"(+{sum(layer.forward_s.fixed + layer.backward_s.fixed for layer in layers) * 1e3:.3f} ms per "
                 "micro-batch), "
                 f"saved activations {human_bytes(stage_saved_bytes(layers, 1))} at batch 1, "
                 f"parameters {human_bytes(sum(layer.param_bytes for layer in layers))}")
    lines.extend(f"note: {note}" for note in profile.notes)
    return "\n".join(lines)


def pipeline_for(args: argparse.Namespace) -> str | None:
    """The --passes given, else a named model's own pipeline, else the default (None)."""
    # start-up time: a verb imports what it runs
    from flatpack import models

    named = models.find(args.model)
    if args.passes is None and named is not None:
        return named.passes
    return args.passes


def _compile_args(parser: argparse.ArgumentParser, model_optional: bool = False) -> None:
    """MODEL and how it is cut; ``model_optional``: a verb that can take its model from
    elsewhere (plan --from-run) declares MODEL with ``nargs="?"``."""
    parser.add_argument("model", nargs="?" if model_optional else None, default=None,
                        help="path/to/file.py:factory, package.module:factory, a built-in "
                                      "example (tiny-resnet, mlp, bert, hf-gpt2, llama, vit, hf-resnet) or a "
                                      "zoo model (vgg16, resnet50, amoebanet-d18, bert-large, rnn-3, ...)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"],
                        help="size of a zoo model: reduced for quick runs, or the papers' full size")
    parser.add_argument("--passes", default=None, help='pass pipeline, e.g. "fuse-elementwise,merge-branches,'
                                                       'coarsen{max-layers=48,by=time}"')


def _trust_args(parser: argparse.ArgumentParser) -> None:
    """What a loaded artifact is checked against, beyond its own index."""
    parser.add_argument("--digest", default=None, help="the artifact digest `flatpack compile` printed: the index "
                                                       "must have this sha256")
    parser.add_argument("--verify-key", default=None, help="the index must be signed (flatpack sign) under this key: "
                                                           "an Ed25519 public key file (PEM), or env:NAME for HMAC")
    parser.add_argument("--name", default=None, help="with --verify-key: the signature must name this artifact "
                                                     "(without it, any artifact the key signed passes), e.g. "
                                                     "--name bert-prod")
    parser.add_argument("--min-version", type=int, default=None, metavar="N",
                        help="with --verify-key: the signed version must be at least N (an older build is refused "
                             "as a rollback)")
    parser.add_argument("--trust-file", default=None, metavar="PATH",
                        help="with --name: a file recording the highest version accepted per key and name; an "
                             "older one is refused and a newer one recorded (created on first use)")


JSON_HELP = ("print a JSON document on stdout instead of the text report (diagnostics stay on stderr), e.g. "
             "flatpack {verb} ... --json | jq .")


def _json_flag(parser: argparse.ArgumentParser, verb: str) -> None:
    """``--json`` on a verb that reports: the JSON document on stdout instead of the text."""
    parser.add_argument("--json", action="store_const", const="-", default=None, help=JSON_HELP.format(verb=verb))


def _json_or_file(parser: argparse.ArgumentParser, verb: str, what: str) -> None:
    """``--json [FILE]`` on inspect, profile and plan: alone (or ``-``), as :func:`_json_flag`;
    with FILE, the text report on stdout and the document written to FILE."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help=f"{JSON_HELP.format(verb=verb)}; --json FILE prints the text report and writes "
                             f"{what} to FILE")


def report(args: argparse.Namespace, text: str | None, document: Any) -> None:
    """A verb's report on stdout: ``text``, or with ``--json`` the JSON ``document`` (a value,
    or a function giving it) instead; ``--json FILE`` writes the document to FILE as well as
    printing the text. Text None: the verb printed its report as it went."""
    destination = getattr(args, "json", None)
    if destination in ("-", True):
        print(_json_text(document))
        return
    if text is not None:
        print(text)
    if destination:
        Path(destination).write_text(_json_text(document) + "\n")
        LOG.info("wrote %s", destination)


def _json_text(document: Any) -> str:
    return json.dumps(document() if callable(document) else document, indent=2, default=str)


def cmd_inspect(args: argparse.Namespace) -> int:
    model, inputs = load_factory(args.model, args.size)
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=1)
    report(args, chain_table(compiled.chain), compiled.chain)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs

    # start-up time: a verb imports what it runs
    from flatpack.partitioner.plan import Plan

    plan = None
    if args.plan is not None:
        # the bounded reader: a missing, non-regular, huge or malformed file is a PlanError naming it
        plan = Plan.load(args.plan)
    model, inputs = load_factory(args.model, args.size)
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=args.stages, solver=args.solver,
                                target=args.target, out_dir=args.out, calibration=args.calibration, plan=plan,
                                force=args.force)
    text = (f"{chain_table(compiled.chain, compiled.plan.ranges)}\n\n"
            f"wrote {plural(len(compiled.plan.stages), 'stage')} to {args.out}\ndigest {compiled.digest}\n"
            "  pin it where the artifact is used (flatpack check/resume --digest, flatpack.load(dir, digest=...)), "
            "or sign it: flatpack sign DIR --key KEY --name NAME --version N")
    report(args, text, {"out": args.out, "digest": compiled.digest, "stages": len(compiled.plan.stages),
                        "plan": compiled.plan.to_json(), "chain": compiled.chain})
    return 0


def cmd_sign(args: argparse.Namespace) -> int:
    """Signs an artifact's index and subject after checking every file against the index."""
    digest = flatpack.sign(args.dir, args.key, name=args.name, version=args.version, digest=args.digest)
    signature = Path(args.dir) / SIGNATURE_FILE
    report(args, f"signed {Path(args.dir) / INDEX_FILE} (digest {digest}) as {args.name} version {args.version} "
                 f"into {signature}",
           {"index": str(Path(args.dir) / INDEX_FILE), "digest": digest, "signature": str(signature),
            "name": args.name, "version": args.version})
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Verifies an artifact as ``flatpack.load`` does, without running any of it: it *is*
    ``flatpack.load`` (index, sizes, sha256, the signature and its subject, the vocabulary of
    ``flatpack.json``, its plan, every manifest and every safetensors framing), so a directory
    ``load`` would refuse fails here with the same ArtifactError (exit 2), and none of the
    stage code is imported."""
    compiled = flatpack.load(args.dir, digest=args.digest, verify_key=args.verify_key, name=args.name,
                             min_version=args.min_version, trust_file=args.trust_file)
    if compiled.trust == "directory":
        LOG.warning("the index itself was trusted only as far as this directory is: pass --digest (the digest "
                    "compile printed) or --verify-key to check it against something held elsewhere")
    files = len(compiled.index.files)
    signature = compiled.signature
    text = (f"{args.dir}: {plural(files, 'file')} {'matches' if files == 1 else 'match'} the index; "
            f"digest {compiled.digest}")
    if signature is not None and signature.name is not None:
        text += f"\nsigned as {signature.name} version {signature.version} at {signature.signed_at} ({signature.key})"
    elif signature is not None:
        text += f"\nsigned with a v1 signature, which names no artifact or version ({signature.key})"
    if signature is not None and args.name is None:
        LOG.warning("no name was required (--name), so any artifact signed by this key would pass here too, e.g. "
                    "another model or an older build copied over this directory; pass --name (and --min-version "
                    "or --trust-file) to refuse those")
    report(args, text, {"dir": args.dir, "files": files, "digest": compiled.digest, "trust": compiled.trust,
                        "signature": None if signature is None else signature.to_json()})
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.profiler import ProfileOptions

    model, inputs = load_factory(args.model, args.size)
    if args.target:
        # start-up time: a verb imports what it runs
        from flatpack.backends.profiling import profile_command

        return profile_command(model, inputs, target=args.target,
                               tiers=_positive_ints(args.tiers, "--tiers") if args.tiers else None,
                               batch_sizes=_positive_ints(args.batch_sizes), repeats=args.repeats,
                               passes=pipeline_for(args), out=args.out, parallel=args.parallel,
                               timeout_s=args.timeout, emulate=args.emulate, region=args.region,
                               show=lambda text, document: report(args, text, document))
    options = ProfileOptions(batch_sizes=tuple(_positive_ints(args.batch_sizes)), repeats=args.repeats,
                             max_seconds=args.max_seconds, use_cache=not args.no_cache,
                             progress=logs.progress_enabled())
    compiled = flatpack.compile(model, inputs, passes=pipeline_for(args), stages=1, profile=options)
    profile = compiled.profile
    if profile is None:  # compile profiles whenever given ProfileOptions
        raise FlatpackError(f"{type(model).__name__} was compiled without a profile, so there is nothing to report")
    report(args, profile_table(profile), profile.to_json)
    return 0


def _positive_ints(text: str, what: str = "batch sizes") -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{what}: expected comma-separated positive integers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise InputError(f"{what} must be positive integers, got {text!r}")
    return values


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
        counts = _positive_ints(args.micro_batches, "--micro-batches")
        micro_batches = min(counts)
        if len(counts) > 1:
            options = options.with_changes(micro_batches=tuple(counts))
    if args.memory is not None:
        options = options.with_changes(memory_mb=tuple(_positive_ints(args.memory, "--memory")))
    if args.replicas is not None:
        options = options.with_changes(replicas=tuple(_positive_ints(args.replicas, "--replicas")))
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


def _check_tiers(target: str, memory_mb: Sequence[int]) -> None:
    """Unknown tiers are refused before profiling, not after."""
    # start-up time: a verb imports what it runs
    from flatpack.platform.catalog import get_platform, platform_names

    if target not in platform_names():
        raise InputError(f"unknown target {target!r}; flatpack targets: {', '.join(platform_names())}")
    platform = get_platform(target)
    for size in memory_mb:
        platform.tier(size)


def cmd_plan(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.compiler import build_problem
    from flatpack.profiler import ProfileOptions
    from flatpack.partitioner import report as plan_report
    from flatpack.partitioner.objective import Weights, cost_model_for

    if args.from_run is not None:
        return _plan_from_run(args)
    if args.model is None:
        raise InputError("flatpack plan needs MODEL (or --from-run RUN_DIR to re-plan a finished run)")
    solver = _cost_solver(args.solver)
    if args.front == "exact" and not hasattr(solver, "exact_front"):
        raise InputError(f"--front exact needs solver dp (every non-dominated plan, exactly); solver "
                         f"{args.solver!r} gives the weight pairs' front only: drop --front exact or use --solver dp")
    if args.front == "exact" and (args.slo is not None or args.weights is not None):
        raise InputError("--front exact prints the whole front; --slo and --weights pick one plan: give one or the "
                         "other")
    solver = _with_time_limit(solver, args)
    workload, options = _plan_workload(args)
    _check_tiers(args.target, options.memory_mb or ())
    if args.plot:
        # start-up time: a verb imports what it runs
        from flatpack.partitioner import plot

        plot.require_matplotlib()
        plot.check_destination(args.plot)
    profile = ProfileOptions(batch_sizes=tuple(_positive_ints(args.batch_sizes)), repeats=args.repeats,
                             max_seconds=args.max_seconds, use_cache=not args.no_cache,
                             progress=None if logs.progress_enabled() else False)   # None: on a terminal

    split_points = _names(args.split_points)
    if (args.stages is not None or split_points) and (args.slo is not None or args.weights is not None):
        raise InputError("--stages and --split-points fix the cuts; --slo and --weights choose them: give one or "
                         "the other")
    if args.stages is not None and split_points:
        raise InputError("--stages and --split-points both fix the cuts; give one (N split points make N + 1 "
                         "stages)")
    if args.stages is not None and args.stages < 1:
        raise InputError(f"--stages must be a positive number of stages, got {args.stages}")
    model, inputs = load_factory(args.model, args.size)
    if split_points:
        # start-up time: a verb imports what it runs
        from flatpack.job import check_split_points

        check_split_points(model, split_points)
    problem = build_problem(model, inputs, target=args.target, passes=pipeline_for(args), profile=profile,
                            workload=workload, calibration=args.calibration, **options.given())
    started = time.perf_counter()
    if args.stages is not None or split_points:
        # start-up time: a verb imports what it runs
        from flatpack.job import FixedCuts
        from flatpack.partitioner.cost.funcpipe import with_tiers
        from flatpack.partitioner.objective import annotate, evaluate

        cuts = FixedCuts(split_points, args.stages)
        fixed = with_tiers(problem, cuts(problem))
        selection = plan_report.Selection.of_cuts(annotate(fixed, evaluate(problem, fixed)), cuts.name)
    elif workload.slo_s is not None:
        selection = plan_report.Selection.within_slo(solver.within_slo(problem, workload.slo_s), workload.slo_s)
    elif args.weights is not None:
        selection = plan_report.Selection.of_weights(solver(problem), Weights.of(options.weights).label())
    else:
        selection = plan_report.Selection.of_front(solver.exact_front(problem) if args.front == "exact"
                                                   else solver.front(problem))
    solve_s = time.perf_counter() - started

    title = _plan_title(args, problem, cost_model_for(problem).name, solve_s)
    text = plan_report.text_report(problem, selection, title)
    if args.time_limit is not None:
        text += "\n\n" + plan_report.proof_summary(selection, args.time_limit)
    report(args, text, lambda: plan_report.report_json(problem, selection, _plan_context(args, problem)))
    if args.plot:
        # one pick alone says little on a plot: draw it against the front
        context = _front_for_context(solver, problem) if selection.kind != "front" else ()
        plot.plot_selection(selection, args.plot, title=_plot_title(args, problem), inference=workload.mode == "infer",
                            context=context)
        LOG.info("wrote %s", args.plot)
    return 0


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


def _model_label(args: argparse.Namespace) -> str:
    # start-up time: a verb imports what it runs
    from flatpack import models

    named = models.find(args.model)
    return named.label(args.size) if named is not None else args.model


def _plan_context(args: argparse.Namespace, problem: Any) -> dict[str, Any]:
    """What a JSON report records about the run, beside the plans."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.objective import cost_model_for

    workload = problem.workload
    return {"model": _model_label(args), "target": problem.platform.name, "mode": workload.mode,
            "batch": workload.batch, "micro_batches": workload.micro_batches, "optimizer": workload.optimizer,
            "sync": workload.sync, "solver": args.solver, "cost_model": cost_model_for(problem).name,
            "layers": len(problem.chain), "layer_names": [layer.name for layer in problem.chain],
            "options": {key: list(value) if isinstance(value, tuple) else value
                        for key, value in problem.options.given().items()}}


def _plan_title(args: argparse.Namespace, problem: Any, cost_model: str, solve_s: float) -> str:
    workload = problem.workload
    shape = (f"train, batch {workload.batch}, M {workload.micro_batches}, {workload.optimizer}, {workload.sync} sync"
             if workload.mode == "train" else f"infer, batch {workload.batch} per request")
    return (f"{_model_label(args)} on {problem.platform.name}: {shape}; {plural(len(problem.chain), 'layer')}; "
            f"solver {args.solver} ({solve_s:.2f} s); {cost_model} cost model")


def _plot_title(args: argparse.Namespace, problem: Any) -> str:
    return (f"{_model_label(args)} on {problem.platform.name}, {problem.workload.mode} batch "
            f"{problem.workload.batch}, solver {args.solver}")


def cmd_platforms(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.platform.catalog import describe_platforms, get_platform, platform_names

    names = args.names or platform_names()
    report(args, None if args.json else describe_platforms(names),
           lambda: [get_platform(name).to_json() for name in names])
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.job import JobOptions, run_training

    iterations = args.iterations if args.iterations is not None or args.data else 4
    options = JobOptions(batch=args.batch, micro_batches=args.micro_batches, iterations=iterations,
                         **_training_knobs(args), schedule=args.schedule, vertical_sync=args.vertical_sync,
                         sync=args.sync,
                         solver=args.solver, passes=args.passes, replicas=_ints(args.replicas, "--replicas"),
                         memory_mb=_ints(args.memory, "--memory") if args.memory else None, out=Path(args.out),
                         verify=not args.no_verify, pick=args.pick, checkpoint_every=args.checkpoint_every,
                         non_finite=args.non_finite, data=args.data, store_endpoint=args.store_endpoint,
                         epochs=args.epochs, shuffle=not args.no_shuffle, drop_last=args.drop_last, loss=args.loss,
                         save=Path(args.save) if args.save else None, seed=args.seed, stages=args.stages,
                         split_points=_names(args.split_points), precision=args.precision,
                         recompute=args.recompute, calibration=Path(args.calibration) if args.calibration else None,
                         replan=args.replan, epoch_iterations=args.epoch_iterations,
                         target=args.target, address=args.address,
                         **({"replan_threshold": args.replan_threshold} if args.replan_threshold is not None else {}))
    # every option is checked before the model is built and before any process starts
    options.check()
    model, inputs = load_factory(args.model, args.size)
    result = run_training(model, inputs, options, stream=_text_stream(args))
    report(args, None, result.to_json)
    return 0 if result.equivalent in (None, True) else 1


def _text_stream(args: argparse.Namespace) -> Any:
    """Where a verb that reports as it goes (run, resume, demo) prints its text report: stdout,
    or stderr under --json, whose document is then stdout's only content."""
    return sys.stderr if args.json else sys.stdout


def _training_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """The JobOptions of the run parser's training-knob block."""
    # start-up time: a verb imports what it runs
    from flatpack.runtime.optim import parse_options

    return {"optimizer": args.optimizer, "lr": args.lr,
            "optimizer_args": parse_options(args.optimizer_args, "--optimizer-args"),
            "no_decay_bias_norm": args.no_decay_bias_norm, "schedule_lr": args.schedule_lr,
            "schedule_args": parse_options(args.schedule_args, "--schedule-args"), "warmup": args.warmup,
            "clip_grad_norm": args.clip_grad_norm, "accumulate": args.accumulate, "eval_every": args.eval_every,
            "eval_data": args.eval_data, "eval_fraction": args.eval_fraction}


def cmd_resume(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.job import resume_training

    result = resume_training(Path(args.run_dir), stream=_text_stream(args), clean=args.clean, digest=args.digest,
                             verify_key=args.verify_key, data=args.data, name=args.name,
                             min_version=args.min_version, trust_file=args.trust_file,
                             accept_changed_data=args.accept_changed_data, target=args.target,
                             address=args.address)
    report(args, None, result.to_json)
    return 0


def _names(text: str | None) -> tuple[str, ...]:
    """``--split-points a,b``: module names, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text else ()


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"{flag} takes comma-separated integers, got {text!r}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.backends.target_calibration import cached_local_calibration
    from flatpack.job import JobOptions, run_training

    tiers = (512, 1024)
    options = JobOptions(batch=64, micro_batches=8, iterations=args.iterations, optimizer="adam", lr=0.01,
                         passes="fuse-elementwise,merge-branches,coarsen{max-layers=8,by=time}", replicas=(1, 2),
                         memory_mb=tiers, pick="fastest", out=Path(args.out),
                         calibration=Path(args.calibration) if args.calibration not in (None, "none", "auto") else None)
    options.check()
    # the model before the host calibration (minutes when not cached): a misspelt name is refused at once
    model, inputs = load_factory(args.model, "tiny")
    if args.calibration in (None, "auto"):
        # measured once per host and cached: the prediction the demo prints is then calibrated
        options = dataclasses.replace(options, calibration=cached_local_calibration(tiers, LOG.info))
    LOG.info(f"flatpack demo: {args.model} (reduced size) trained as a pipeline of local functions")
    result = run_training(model, inputs, options, stream=_text_stream(args))
    report(args, None, result.to_json)
    return 0 if result.equivalent else 1


CLOUD_OPTIONS = {
    "aws-lambda": ("name", "region", "bucket", "base_image", "lock"),
    "alibaba-fc": ("name", "region", "bucket", "account", "namespace", "role_arn", "base_image", "lock"),
    "gpu-container": ("name", "image", "base_image", "lock", "backend"),
}


def cmd_deploy(args: argparse.Namespace) -> int:
    """Compiles MODEL for a target, then writes everything a deployment needs into --out and
    (without --dry-run) creates it in the account."""
    # start-up time: a verb imports what it runs
    from flatpack.job import FastestOnFront
    from flatpack.backends import get_backend
    from flatpack.profiler import ProfileOptions
    from flatpack.partitioner.workload import Workload

    if args.target not in CLOUD_OPTIONS:
        raise InputError(f"flatpack deploy targets {', '.join(CLOUD_OPTIONS)}; the local and ray targets run "
                         "from the process that trains (flatpack run MODEL [--target ray --address ADDRESS])")
    if args.backend is not None and args.target != "gpu-container":
        raise InputError(f"--backend chooses the gpu-container ranks' collective backend; {args.target} functions "
                         "talk through the store. Leave --backend out, or use --target gpu-container")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise InputError(f"--out {out} is not empty; deploy writes a fresh directory (its deployment record is what "
                         "flatpack teardown reads)")
    backend = get_backend(args.target)
    if args.lock is not None:
        lock_path = Path(args.lock)
        if not lock_path.is_file():
            raise InputError(f"--lock {lock_path}: no such file; generate one with python -m flatpack.backends.lock "
                             "function|gpu --out FILE")
        args.lock = lock_path.read_text()
    options = {key: getattr(args, key) for key in CLOUD_OPTIONS[args.target] if getattr(args, key, None) is not None}
    extra: dict[str, Any] = {}
    if args.memory:
        extra["memory_mb"] = _ints(args.memory, "--memory")
    if args.replicas:
        extra["replicas"] = _ints(args.replicas, "--replicas")
    _check_tiers(args.target, extra.get("memory_mb", ()))
    model, inputs = load_factory(args.model, args.size)
    workload = Workload("train", batch=args.batch, micro_batches=args.micro_batches)
    started = time.perf_counter()
    if args.pick not in ("recommended", "fastest"):
        raise InputError(f"--pick must be 'recommended' or 'fastest', got {args.pick!r}")
    solver = FastestOnFront() if args.pick == "fastest" else args.solver
    compiled = flatpack.compile(model, inputs, target=args.target, solver=solver, passes=pipeline_for(args),
                                workload=workload, calibration=args.calibration,
                                profile=ProfileOptions(batch_sizes=(1, 2), repeats=3), **extra)
    stages = ", ".join(f"{start}-{end} ({stage.memory_mb or '-'} MB x{stage.replicas})"
                       for (start, end), stage in zip(compiled.plan.ranges, compiled.plan.stages))
    LOG.info(f"compiled {args.model} for {args.target} in {time.perf_counter() - started:.1f} s: "
             f"{plural(len(compiled.plan.stages), 'stage')}, layers {stages}")
    document = {"target": args.target, "out": str(out), "dry_run": args.dry_run, "digest": compiled.digest,
                "plan": compiled.plan.to_json()}
    if args.dry_run or args.target == "gpu-container":
        # start-up time: a verb imports what it runs (a gpu-container deployment is the user's kubectl apply of
        # what this writes)
        from flatpack.backends.gpu_container import write_context

        files = backend.package(compiled, **options)
        write_context(files, out)      # launch.sh (gpu-container) executable, as the Dockerfile expects
        what = ("dry run: nothing was created" if args.dry_run else
                "flatpack calls no cluster API for gpu-container: apply the manifests yourself")
        commands = files["commands.sh"].decode()
        report(args, f"{_file_tree(out, files)}\n\n{what}. The commands that create this deployment "
                     f"({out / 'commands.sh'}):\n\n{commands}",
               {**document, "created": [], "files": {path: len(data) for path, data in sorted(files.items())},
                "commands": commands})
        return 0
    deployment = backend.deploy(compiled, out=out, **options)
    ledger = deployment.ledger
    report(args, f"deployed {ledger.name} to {args.target} ({ledger.region}):\n"
                 + format_table(["kind", "name"], [(entry["kind"], entry["name"]) for entry in ledger.created],
                                indent="  ")
                 + f"\nthe deployment record is {out / 'deployment.json'}; remove everything with: "
                   f"flatpack teardown {out}",
           {**document, "name": ledger.name, "region": ledger.region, "created": ledger.created,
            "record": str(out / "deployment.json")})
    return 0


def _file_tree(out: Path, files: dict[str, bytes]) -> str:
    """The files written, with the runtime's own sources summed up in one line per image."""
    runtime: dict[str, tuple[int, int]] = {}
    rows = []
    for path, data in sorted(files.items()):
        parts = path.split("/")
        if "flatpack" in parts[:-1]:
            root = "/".join(parts[:parts.index("flatpack") + 1])
            count, size = runtime.get(root, (0, 0))
            runtime[root] = (count + 1, size + len(data))
            continue
        rows.append((path, f"{len(data):,}", ""))
    rows += [(root + "/", f"{size:,}", f"{plural(count, 'file')}: the flatpack runtime")
             for root, (count, size) in runtime.items()]
    return (f"wrote {plural(len(files), 'file')}, {sum(map(len, files.values())) / 1e6:.1f} MB, into {out}:\n"
            + format_table(["file", "bytes", ""], rows, numeric={1}, indent="  "))


def cmd_teardown(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.backends import cloud, get_backend

    ledger = cloud.Ledger.load(args.record)
    document = {"name": ledger.name, "target": ledger.target, "region": ledger.region}
    if not ledger.created:
        report(args, f"{ledger.name}: nothing left to remove", {**document, "removed": []})
        return 0
    removed = get_backend(ledger.target).teardown(args.record)
    report(args, f"removed from {ledger.target} ({ledger.region}): {', '.join(removed)}",
           {**document, "removed": list(removed)})
    return 0


EXIT_CODES = """exit codes: 0 success; 1 a run failed (a function's error, out of memory, a function that
refused its stage, an equivalence check that failed); 2 bad input (an option, a model, a file, an artifact
refused by load or check before any of its code ran; nothing was started);
128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM; the run directory stays resumable)"""


def _fixed_cut_args(parser: argparse.ArgumentParser, verb: str) -> None:
    """``--stages`` and ``--split-points``: one plan with fixed cuts instead of the solver's,
    which ``plan`` prices and ``run`` trains (one replica each, the smallest tier that fits)."""
    parser.add_argument("--stages", type=int, default=None, metavar="N",
                        help=f"{verb} one plan cut into N stages of balanced parameter bytes instead of the "
                             "solver's (one replica each, the smallest memory tier that fits), e.g. --stages 4")
    parser.add_argument("--split-points", default=None, metavar="MODULE[,MODULE...]",
                        help=f"{verb} one plan with a stage beginning at each named module (as "
                             "torch.distributed.pipelining's SplitPoint.BEGINNING; names as model.named_modules() "
                             "gives them), e.g. --split-points bert.encoder.layer.2")


def _verbosity_args(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q``: declared on the main parser (for --help) and on the probe that
    :func:`parse_arguments` takes them from, anywhere on the command line."""
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more diagnostics on stderr (debug: every logger's name), e.g. flatpack run mlp -v; "
                             "reports and --json output stay on stdout")
    parser.add_argument("-q", "--quiet", action="count", default=0,
                        help="only warnings and errors on stderr (no progress), e.g. flatpack plan bert -q")


def _connect_ray(args: argparse.Namespace) -> None:
    """``--target ray``: connects to the cluster at ``--address`` first (the platform is read
    from it; the deployment then uses this connection). ``--address`` is refused elsewhere."""
    address = getattr(args, "address", None)
    if args.target == "ray":
        from flatpack.backends import ray as ray_backend

        ray_backend.connect(address)
    elif address is not None:
        raise InputError("--address names the Ray cluster to run on; give --target ray with it, or leave it out")


RAY_ADDRESS_HELP = ("--target ray: the Ray cluster (auto: the one `ray start` runs here or $RAY_ADDRESS; "
                    "ray://HOST:10001; local: a one-node cluster started in this process)")


def cmd_calibrate(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.backends.target_calibration import calibrate_target, calibration_summary
    from flatpack.platform.catalog import get_platform

    path = Path(args.out) if args.out is not None else Path("calibration.json")
    if get_platform(args.target).kind == "container":
        calibration = _calibrate_container(args, path)
        report(args, f"{calibration_summary(calibration)}\n"
                     f"digest {calibration.digest[:16]} (plans made with --calibration {path} record it)",
               calibration.to_json)
        return 0
    given = [flag for flag, value in (("--ranks", args.ranks), ("--backend", args.backend), ("--device", args.device),
                                      ("--from-probe", args.from_probe)) if value is not None]
    if given:
        raise InputError(f"{' and '.join(given)} choose the ranks of a GPU-container calibration; {args.target}'s "
                         "functions talk through the store. Leave them out, or use --target gpu-container")
    _connect_ray(args)
    calibration = calibrate_target(args.target, tiers=_ints(args.tiers, "--tiers") if args.tiers else None, out=path,
                                   emulate=args.emulate, region=args.region, round_trips=args.round_trips,
                                   probe_bytes=int(args.probe_mb * (1 << 20)), timeout_s=args.timeout,
                                   report=LOG.info, task_iterations=args.probe_iterations)
    report(args, f"{calibration_summary(calibration)}\n"
                 f"digest {calibration.digest[:16]} (plans made with --calibration {path} record it)",
           calibration.to_json)
    return 0


def _calibrate_container(args: argparse.Namespace, path: Path) -> Any:
    """``flatpack calibrate`` on a container platform: the ranks' link and all-reduce, measured
    here or read from the probe's result measured in a cluster (``--from-probe``)."""
    # start-up time: a verb imports what it runs
    from flatpack.backends.collective_calibration import (DEFAULT_RANKS, calibrate_collective,
                                                          calibration_from_probe)

    given = [flag for flag, value in (("--emulate", args.emulate), ("--region", args.region)) if value]
    if given:
        raise InputError(f"{' and '.join(given)} place calibration functions; {args.target} is measured by ranks "
                         "on this machine. Leave them out")
    tiers = _ints(args.tiers, "--tiers") if args.tiers else None
    if args.from_probe is not None:
        local = [flag for flag, value in (("--ranks", args.ranks), ("--backend", args.backend),
                                          ("--device", args.device)) if value is not None]
        if local:
            raise InputError(f"{' and '.join(local)} choose ranks to start here, and --from-probe reads what ranks "
                             "measured elsewhere: give one or the other")
        return calibration_from_probe(args.from_probe, args.target, tiers=tiers, out=path, report=LOG.info)
    return calibrate_collective(args.target, tiers=tiers, out=path,
                                ranks=DEFAULT_RANKS if args.ranks is None else args.ranks, backend=args.backend,
                                device=args.device, timeout_s=args.timeout, report=LOG.info)


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a misspelt option, verb or choice (difflib's close
    matches; Python 3.11's argparse has no suggest_on_error), said on one error line, exit 2."""

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        assert parsed is not None    # parse_known_args returns a namespace
        if extras:
            verb = self._verb_parser(parsed)
            options = sorted({name for action in verb._actions for name in action.option_strings})
            said = []
            after_option = False   # a word after an unrecognized --option is taken as its value
            for extra in extras:
                if not extra.startswith("-"):
                    if not after_option:
                        said.append(f"unrecognized argument {extra!r}")
                    after_option = False
                    continue
                name, equals, _ = extra.partition("=")
                after_option = not equals
                close = difflib.get_close_matches(name, options, n=1)
                said.append(f"unrecognized option {name}" + (f"; did you mean {close[0]}?" if close else ""))
            verb.exit(2, f"{verb.prog}: error: {'; '.join(said)} (see {verb.prog} --help)\n")
        return parsed

    def _verb_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The verb's own parser (whose options an unrecognized one is matched against), or this one."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                verb = action.choices.get(str(getattr(parsed, action.dest, None)), self)
                return verb if isinstance(verb, argparse.ArgumentParser) else self
        return self

    def error(self, message: str) -> Any:
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match is None:
            super().error(message)
        given, choices = match.group(1), re.findall(r"'([^']*)'", match.group(2))
        close = difflib.get_close_matches(given, choices, n=2)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        if message.startswith("argument command:"):
            message = f"unknown verb {given!r}{hint} (the verbs: {', '.join(choices)}; see {self.prog} --help)"
        else:
            message = f"{message}{hint}"
        self.exit(2, f"{self.prog}: error: {message}\n")


CONFIG_HELP = ("defaults for the verb's options from a TOML file whose keys are the option names "
               "(batch = 64, micro-batches = 8, replicas = [1, 2]); options given on the command line win, and "
               "another verb's keys are skipped. Give it anywhere: flatpack run vgg16 --config run.toml")


def _every_verb(sub: Any) -> None:
    """What every verb's --help shows: --config (:func:`parse_arguments` takes it from
    anywhere on the command line) and the exit codes."""
    for verb_parser in sub.choices.values():
        verb_parser.add_argument("--config", metavar="FILE.toml", help=CONFIG_HELP)
        verb_parser.epilog = EXIT_CODES


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flatpack", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flatpack {__version__}")
    _verbosity_args(parser)
    parser.add_argument("--config", metavar="FILE.toml", help=CONFIG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    inspect_parser = sub.add_parser("inspect", help="print the layer chain of a model")
    _compile_args(inspect_parser)
    _json_or_file(inspect_parser, "inspect", "the chain")
    inspect_parser.set_defaults(run=cmd_inspect)

    compile_parser = sub.add_parser("compile", help="compile a model into stage artifacts")
    _compile_args(compile_parser)
    compile_parser.add_argument("--stages", type=int, default=2)
    compile_parser.add_argument("--solver", default=None,
                                help="a registered solver (default balanced), options in braces: 'rl{episodes=2000}'")
    compile_parser.add_argument("--target", default="local")
    compile_parser.add_argument("--out", required=True, help="output directory")
    compile_parser.add_argument("--calibration", default=None, metavar="FILE",
                                help="what was measured inside the target (flatpack calibrate / profile --target); "
                                     "the plan records its digest")
    compile_parser.add_argument("--plan", default=None, metavar="PLAN.json",
                                help="compile with this plan (e.g. a compiled artifact's plan.json) instead of "
                                     "solving; refused when it was made for another graph, target, calibration or "
                                     "flatpack version")
    compile_parser.add_argument("--force", action="store_true",
                                help="--plan: use the plan even when it was made for something else (a warning)")
    _json_flag(compile_parser, "compile")
    compile_parser.set_defaults(run=cmd_compile)

    profile_parser = sub.add_parser("profile", help="measure every layer's time and memory on this host, or "
                                                    "(--target) on every memory tier inside a target")
    _compile_args(profile_parser)
    profile_parser.add_argument("--batch-sizes", default="1,2,4", help="micro-batch sizes to fit a·batch+b over")
    profile_parser.add_argument("--repeats", type=int, default=5, help="timed runs per layer and size (median)")
    profile_parser.add_argument("--max-seconds", type=float, default=None, help="time budget for measuring")
    profile_parser.add_argument("--no-cache", action="store_true", help="measure again even if cached")
    _json_or_file(profile_parser, "profile", "the profile (with --target: the calibration)")
    profile_parser.add_argument("--target", default=None, help="profile inside this target: a profiler function "
                                "per memory tier; writes the calibration file plans for the target use")
    profile_parser.add_argument("--tiers", default=None, help="--target: memory tiers in MB (default the target's)")
    profile_parser.add_argument("--out", default=None, help="--target: the calibration file "
                                                            "(default calibration-<target>.json)")
    profile_parser.add_argument("--emulate", action="store_true", help="--target: run the target's tiers as local "
                                "functions, each held to its tier's CPU share, instead of deploying")
    profile_parser.add_argument("--parallel", type=int, default=1, help="--target: functions at a time")
    profile_parser.add_argument("--region", default=None,
                                help="--target: the cloud region of the profiler functions (default: AWS_REGION, "
                                     "AWS_DEFAULT_REGION or the boto3 profile's; ALIBABA_CLOUD_REGION_ID), "
                                     "e.g. --region eu-west-1")
    profile_parser.add_argument("--timeout", type=float, default=900.0, help="--target: seconds per function")
    profile_parser.set_defaults(run=cmd_profile)

    calibrate_parser = sub.add_parser(
        "calibrate", help="measure a target (any model): compute speed against this host, store latency "
                          "distribution, bandwidth, invoke latency, optimizer step; writes calibration.json",
        description="Deploys a calibration function to the target, one per memory tier (locally: processes held to "
                    "each tier's CPU share and link), then two small probe pipelines per tier (each worker task's "
                    "seconds beyond the cost model, and FuncPipe's beta), and writes what it measured to a "
                    "versioned calibration file that compile, plan and run take with --calibration.")
    calibrate_parser.add_argument("--target", required=True, help="platform to measure (see flatpack platforms)")
    calibrate_parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    calibrate_parser.add_argument("--tiers", default=None, metavar="MB[,MB...]",
                                  help="memory tiers to measure (default: the target's)")
    calibrate_parser.add_argument("--out", default=None, help="the calibration file (default calibration.json)")
    calibrate_parser.add_argument("--emulate", action="store_true",
                                  help="run the target's tiers as local functions instead of deploying")
    calibrate_parser.add_argument("--region", default=None, help="the cloud region of the calibration functions")
    calibrate_parser.add_argument("--round-trips", type=int, default=60,
                                  help="small puts and gets per tier for the latency distribution (default 60)")
    calibrate_parser.add_argument("--probe-mb", type=float, default=4.0,
                                  help="MB moved each way per tier to measure bandwidth (default 4)")
    calibrate_parser.add_argument("--probe-iterations", type=int, default=8,
                                  help="iterations of each probe pipeline that measures the task terms (default 8; "
                                       "the first 2 are not measured), and one more timed request of each serving "
                                       "probe; 0: no probes")
    calibrate_parser.add_argument("--ranks", type=int, default=None,
                                  help="gpu-container: ranks that time messages, and all-reduces among 2 to this many "
                                       "(default 4)")
    calibrate_parser.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                                  help="gpu-container: the ranks' collective backend (default: nccl with a GPU per "
                                       "rank, else gloo)")
    calibrate_parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                                  help="gpu-container: where the ranks' tensors live (default cuda with a GPU)")
    calibrate_parser.add_argument("--from-probe", default=None, metavar="PROBE_JSON",
                                  help="gpu-container: fit what the probe measured in a cluster (torchrun ... -m "
                                       "flatpack.runtime.collective_probe --out PROBE_JSON; the image ships it) "
                                       "instead of starting ranks here")
    calibrate_parser.add_argument("--timeout", type=float, default=300.0, help="seconds per function (gpu-container: "
                                                                                "for all the ranks)")
    _json_flag(calibrate_parser, "calibrate")
    calibrate_parser.set_defaults(run=cmd_calibrate)

    plan_parser = sub.add_parser("plan", help="profile a model and print the Pareto front of plans (time vs cost)",
                                 description="Profiles MODEL, solves for the plans that trade time against cost "
                                             "on the target and prints them, FuncPipe's recommendation marked, "
                                             "then the chosen plan stage by stage. --slo picks the cheapest plan "
                                             "within a time bound, --weights the optimum of one weight pair.")
    _compile_args(plan_parser, model_optional=True)
    plan_parser.add_argument("--target", default="aws-lambda", help="platform (see flatpack platforms)")
    plan_parser.add_argument("--mode", default="train", choices=MODES,
                             help="a training iteration (FuncPipe, Hydrozoa, PipeDream) or an inference request "
                                  "(Gillis)")
    plan_parser.add_argument("--batch", type=int, default=64, help="global batch of an iteration or a request")
    plan_parser.add_argument("--micro-batches", default=None, metavar="M[,M...]",
                             help="micro-batches per iteration; several let the solver choose (default 4)")
    plan_parser.add_argument("--optimizer", default="sgd-momentum", choices=OPTIMIZERS)
    plan_parser.add_argument("--sync", default="pipelined", choices=SYNC_METHODS,
                             help="gradient scatter-reduce model (FuncPipe eq. 2 or LambdaML's eq. 1)")
    plan_parser.add_argument("--solver", default="dp",
                             help="dp (default, exact), miqp, brute (small chains only), or the learning solvers "
                                  "rl and bayes; options in braces: 'rl{episodes=5000,seed=1}'")
    plan_parser.add_argument("--memory", default=None, metavar="MB[,MB...]",
                             help="memory tiers to consider (default: the platform's)")
    plan_parser.add_argument("--replicas", default=None, metavar="D[,D...]",
                             help="data-parallel degrees to consider (default 1,2,4,8,16)")
    plan_parser.add_argument("--max-workers", type=int, default=None,
                             help="most workers one fork-join group forks (inference; default 8)")
    plan_parser.add_argument("--cost-model", default=None, choices=["hydrozoa", "pipedream", "funcpipe"],
                             help="training model on GPU containers (default hydrozoa)")
    goal = plan_parser.add_mutually_exclusive_group()
    goal.add_argument("--slo", type=float, default=None, metavar="SECONDS",
                      help="the cheapest plan whose time meets this bound")
    goal.add_argument("--weights", default=None, metavar="COST,TIME",
                      help="the one plan minimizing COST·MB·s + TIME·seconds, e.g. 1,65536 or 1,2^16")
    plan_parser.add_argument("--front", default="weights", choices=["weights", "exact"],
                             help="weights: the optima of FuncPipe's four weight pairs (default); exact: every "
                                  "non-dominated (time, cost) plan, the four pairs tagged on it (solver dp, "
                                  "FuncPipe's model)")
    plan_parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                             help="anytime: each solve of dp or miqp stops after SECONDS and returns its best plan "
                                  "with a proven lower bound; the report prints each plan's gap to it (default: "
                                  "run to the proof)")
    _fixed_cut_args(plan_parser, "price")
    plan_parser.add_argument("--plot", default=None, metavar="FILE", help="draw time vs cost to FILE (.png, .svg, "
                                                                          ".pdf; needs matplotlib)")
    _json_or_file(plan_parser, "plan", "the plans with their breakdowns")
    plan_parser.add_argument("--calibration", default=None, metavar="FILE",
                             help="seconds measured inside the target, overriding the host-to-tier model")
    plan_parser.add_argument("--batch-sizes", default="1,2,4", help="profile: micro-batch sizes to fit a·batch+b over")
    plan_parser.add_argument("--repeats", type=int, default=5, help="profile: timed runs per layer and size")
    plan_parser.add_argument("--max-seconds", type=float, default=None, help="profile: time budget for measuring")
    plan_parser.add_argument("--no-cache", action="store_true", help="profile again even if cached")
    plan_parser.add_argument("--from-run", default=None, metavar="RUN_DIR",
                             help="re-plan a finished `flatpack run --out RUN_DIR` from its measured timeline: "
                                  "prints the old plan, the new plan and the predicted saving (MODEL left out)")
    plan_parser.set_defaults(run=cmd_plan)

    platforms_parser = sub.add_parser("platforms", help="print the platform catalog (--json adds each number's source)")
    platforms_parser.add_argument("names", nargs="*", help="platforms to show (default: all)")
    platforms_parser.add_argument("--json", action="store_true", help=JSON_HELP.format(verb="platforms"))
    platforms_parser.set_defaults(run=cmd_platforms)

    run_parser = sub.add_parser(
        "run", help="compile, plan, deploy to local functions, train, report predicted vs measured and check "
                    "equivalence with single-process training",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compiles MODEL, plans it, deploys it to local functions sharing a local S3 server, trains it "
                    "(on --data, or on synthetic batches), reports predicted vs measured and checks the result "
                    "against single-process training.",
        epilog="examples:\n"
               "  flatpack run mlp                                   synthetic batches, 4 iterations\n"
               "  flatpack run bert --data shards/ --batch 8 --micro-batches 4 --epochs 2 \\\n"
               "      --save bert.safetensors                        keyword inputs (input_ids, attention_mask,\n"
               "                                                     labels): the model's own loss\n"
               "  AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... flatpack run model.py:build \\\n"
               "      --data s3://bucket/train/ --store-endpoint http://127.0.0.1:8333 --loss cross-entropy\n"
               "  flatpack run model.py:build --data mydata.py:dataset --drop-last --loss mypkg.losses:focal\n"
               "then: model.load_state_dict(flatpack.load_state_dict('bert.safetensors'))")
    run_parser.add_argument("model", help="path/to/file.py:factory, package.module:factory, an example or a zoo model")
    run_parser.add_argument("--size", default="tiny", choices=["tiny", "full"], help="zoo model size")
    run_parser.add_argument("--target", default="local", help="where the functions run: local or ray")
    run_parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    run_parser.add_argument("--batch", type=int, default=32)
    run_parser.add_argument("--micro-batches", type=int, default=4)
    run_parser.add_argument("--iterations", type=int, default=None,
                            help="global batches to train (default 4 on synthetic data; with --data, --epochs full "
                                 "passes; past an epoch's end the data starts again, reshuffled)")
    run_parser.add_argument("--data", default=None, metavar="SOURCE",
                            help="the training data: a directory of shards (*.safetensors, *.pt saved with "
                                 "torch.save, *.npz) holding the inputs by the model's argument names and the "
                                 "target as 'target' (a HuggingFace model may take 'labels' instead), an "
                                 "s3://bucket/prefix of such shards, or package.module:factory / file.py:factory "
                                 "returning a torch Dataset or IterableDataset. e.g. --data shards/")
    run_parser.add_argument("--store-endpoint", default=None, metavar="URL",
                            help="the S3 endpoint of an s3:// --data (default AWS), e.g. http://127.0.0.1:8333; "
                                 "credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile")
    run_parser.add_argument("--epochs", type=int, default=1, help="full passes over --data (default 1)")
    run_parser.add_argument("--no-shuffle", action="store_true",
                            help="read --data in order (default: shard and sample order shuffled per epoch, "
                                 "seeded by --seed)")
    run_parser.add_argument("--drop-last", action="store_true",
                            help="drop an epoch's final partial batch (without it, data whose size --batch does "
                                 "not divide is refused: every batch is cut into the same micro-batches)")
    run_parser.add_argument("--seed", type=int, default=0, help="seeds the shuffling, the synthetic data and the "
                                                                 "initial weights' copy (default 0)")
    run_parser.add_argument("--loss", default="auto",
                            help="auto (default: the model output's 'loss' when it has one, as a HuggingFace model "
                                 "given labels; else cross-entropy for (batch, classes) outputs, mse otherwise), "
                                 "cross-entropy or mse; any other loss: make the model return it. "
                                 "e.g. --loss cross-entropy")
    run_parser.add_argument("--save", default=None, metavar="PATH.safetensors",
                            help="also write the trained weights here, by the original model's state_dict names "
                                 "(tied weights once); load with model.load_state_dict(flatpack.load_state_dict("
                                 "PATH)). e.g. --save trained.safetensors")
    # -- the training knobs (issue 22): optimizer, schedule, clipping, accumulation, evaluation --
    run_parser.add_argument("--optimizer", default="adam",
                            help="any torch.optim optimizer by name: adam (default), adamw, sgd (momentum 0.9 unless "
                                 "--optimizer-args says otherwise), rmsprop, ...")
    run_parser.add_argument("--optimizer-args", default="", metavar="K=V[,K=V...]",
                            help="the optimizer's keyword options as Python literals, e.g. "
                                 "lr=3e-4,weight_decay=0.01,betas=(0.9,0.95)")
    run_parser.add_argument("--lr", type=float, default=0.01, help="the learning rate (or lr= in --optimizer-args)")
    run_parser.add_argument("--no-decay-bias-norm", action="store_true",
                            help="no weight decay for biases and normalization weights (parameters of fewer than 2 "
                                 "dimensions): a second parameter group with weight_decay=0")
    run_parser.add_argument("--schedule-lr", default=None, metavar="NAME",
                            help="a learning-rate schedule stepped once per optimizer step: cosine, linear, step, "
                                 "exponential, polynomial, onecycle, or a torch.optim.lr_scheduler class; cosine and "
                                 "linear run to the end of the run unless --schedule-args says otherwise")
    run_parser.add_argument("--schedule-args", default="", metavar="K=V[,K=V...]",
                            help="the schedule's keyword options, e.g. step_size=10,gamma=0.5")
    run_parser.add_argument("--warmup", type=int, default=0, metavar="STEPS",
                            help="linear warm-up from lr/(STEPS+1) over STEPS optimizer steps before the schedule")
    run_parser.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                            help="scale the gradients so that their global norm over every stage is at most MAX, as "
                                 "torch.nn.utils.clip_grad_norm_ on the whole model")
    run_parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                            help="step the optimizer every K iterations on their summed gradients: a K times larger "
                                 "effective batch in the memory of one")
    run_parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                            help="every N iterations, the loss (and for classification the accuracy) on held-out "
                                 "data through the inference path, in the progress line and the report")
    run_parser.add_argument("--eval-data", default=None, metavar="SOURCE",
                            help="the held-out data for --eval-every, a source as --data takes (without --data: two "
                                 "synthetic batches of another seed)")
    run_parser.add_argument("--eval-fraction", type=float, default=0.0, metavar="F",
                            help="hold out the last F of --data's shards (whole shards) for --eval-every")
    run_parser.add_argument("--schedule", default="sync", choices=SCHEDULES,
                            help="FuncPipe's synchronous schedule, PipeDream's 1F1B with a flush, or PipeDream's "
                                 "asynchronous 1F1B: no flush, an optimizer step per micro-batch, weight stashing "
                                 "(one replica per stage; the pipeline drains at the end of each call)")
    run_parser.add_argument("--vertical-sync", action="store_true",
                            help="with --schedule 1f1b-async: every stage computes a micro-batch with the weight "
                                 "version the first stage used for it (PipeDream's vertical sync)")
    run_parser.add_argument("--sync", default="pipelined", choices=SYNC_METHODS,
                            help="pipelined scatter-reduce (FuncPipe) or LambdaML's three phases")
    run_parser.add_argument("--solver", default="dp")
    _fixed_cut_args(run_parser, "train")
    run_parser.add_argument("--passes", default=None)
    run_parser.add_argument("--replicas", default="1,2", metavar="D[,D...]")
    run_parser.add_argument("--memory", default=None, metavar="MB[,MB...]")
    run_parser.add_argument("--out", default="flatpack-run", help="where the timeline PNG and worker logs go")
    run_parser.add_argument("--pick", default="recommended", choices=["recommended", "fastest"],
                            help="FuncPipe's recommended plan from the front, or its fastest")
    run_parser.add_argument("--no-verify", action="store_true", help="skip the single-process equivalence check")
    run_parser.add_argument("--non-finite", default="warn", choices=["warn", "error", "ignore"],
                            help="a NaN or infinity in the data or in an iteration's loss: warn (default), stop the "
                                 "run (error; it stays resumable), or ignore")
    run_parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                            help="checkpoint every N iterations (0, the default: the shortest interval whose "
                                 "upload costs at most 5%% of an iteration, by the cost model); a lost function "
                                 "recovers with any N, and `flatpack resume` restarts after the last checkpoint")
    run_parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                            help="bf16: autocast in every stage with float32 master weights and optimizer state; "
                                 "tensors cross stage boundaries in bfloat16 (half the bytes, which the planner "
                                 "counts). fp16: the same in float16, with torch.amp.GradScaler's loss scaling (a "
                                 "step any stage overflowed in is skipped on every stage)")
    run_parser.add_argument("--recompute", default="never", choices=["never", "auto"],
                            help="auto: the solver may let a stage recompute its activations in the backward instead "
                                 "of keeping them (less memory, one more forward); the plan shows which do")
    run_parser.add_argument("--calibration", default=None, metavar="FILE",
                            help="what `flatpack calibrate --target local` measured: the prediction uses it (the plan "
                                 "records its digest)")
    run_parser.add_argument("--replan", action="store_true",
                            help="every --epoch-iterations N iterations, re-fit the cost model to what the run "
                                 "measured, solve again, and switch the run onto a plan predicted at least "
                                 "--replan-threshold faster (the checkpoints move onto the new cuts: the run ends "
                                 "with the weights one plan reaches)")
    run_parser.add_argument("--epoch-iterations", type=int, default=None, metavar="N",
                            help="with --replan: the iterations between re-plans (at least 3: each re-fit leaves out "
                                 "an epoch's first 2)")
    run_parser.add_argument("--replan-threshold", type=float, default=None, metavar="F",
                            help="with --replan: the least predicted saving, a share of an iteration, that switches "
                                 "plans (default 0.05: below the re-fitted model's own error a switch's cold starts "
                                 "would not pay)")
    _json_flag(run_parser, "run")
    run_parser.set_defaults(run=cmd_run)
    resume_parser = sub.add_parser("resume", help="continue a `flatpack run` that stopped (a crash, Ctrl-C, a lost "
                                                  "server) from its last checkpoint, to the same weights")
    resume_parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of the run")
    resume_parser.add_argument("--target", default="local", help="where the run's functions run: local or ray")
    resume_parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    resume_parser.add_argument("--data", default=None, metavar="MODULE:FACTORY",
                               help="a run whose --data was a dataset factory names it again (run.json records it, "
                                    "but never names code to import), e.g. --data mydata.py:make")
    resume_parser.add_argument("--clean", action="store_true",
                               help="remove the run's store data instead of resuming it")
    resume_parser.add_argument("--accept-changed-data", action="store_true",
                               help="resume even though the run's data (shards, the dataset factory's file, the "
                                    "batches file) changed since it started; a warning names what changed")
    _trust_args(resume_parser)
    _json_flag(resume_parser, "resume")
    resume_parser.set_defaults(run=cmd_resume)

    sign_parser = sub.add_parser("sign", help="sign a compiled artifact's index (for teams that build and deploy on "
                                              "different machines)")
    sign_parser.add_argument("dir", metavar="DIR", help="the directory `flatpack compile --out` wrote")
    sign_parser.add_argument("--key", required=True, help="an Ed25519 private key file (PEM: openssl genpkey "
                                                          "-algorithm ed25519 -out key.pem), or env:NAME for "
                                                          "HMAC-SHA256 with the key in environment variable NAME")
    sign_parser.add_argument("--name", required=True, help="the artifact's name, which verifiers require with "
                                                           "--name: 1-64 of a-z 0-9 . _ -, e.g. bert-prod")
    sign_parser.add_argument("--version", type=int, required=True, metavar="N",
                             help="the build's version, a positive integer that goes up with each build "
                                  "(verifiers refuse older ones with --min-version or --trust-file)")
    sign_parser.add_argument("--digest", default=None, help="refuse to sign unless the index has this digest")
    _json_flag(sign_parser, "sign")
    sign_parser.set_defaults(run=cmd_sign)
    check_parser = sub.add_parser("check", help="verify a compiled artifact (index, every file, signature) without "
                                                "running it")
    check_parser.add_argument("dir", metavar="DIR", help="the directory `flatpack compile --out` wrote")
    _trust_args(check_parser)
    _json_flag(check_parser, "check")
    check_parser.set_defaults(run=cmd_check)

    deploy_parser = sub.add_parser("deploy", help="compile a model for a cloud target and deploy it (or, with "
                                                  "--dry-run, write everything and print the commands)")
    _compile_args(deploy_parser)
    deploy_parser.add_argument("--target", required=True, help="aws-lambda, alibaba-fc or gpu-container")
    deploy_parser.add_argument("--out", required=True, help="directory for the build contexts, policies, commands "
                                                            "and the deployment record")
    deploy_parser.add_argument("--dry-run", action="store_true", help="write the files and print the commands; "
                                                                      "create nothing")
    deploy_parser.add_argument("--batch", type=int, default=32, help="global batch the plan is made for")
    deploy_parser.add_argument("--micro-batches", type=int, default=4)
    deploy_parser.add_argument("--solver", default="dp")
    deploy_parser.add_argument("--pick", default="recommended", help="recommended (the solver's choice) or fastest "
                                                                      "(the fastest plan on dp's front)")
    deploy_parser.add_argument("--memory", default=None, help="memory tiers the solver may pick (MB, comma-separated)")
    deploy_parser.add_argument("--replicas", default=None, help="replica degrees the solver may pick")
    deploy_parser.add_argument("--calibration", default=None, help="calibration file (flatpack profile --target)")
    deploy_parser.add_argument("--name", default=None, help="deployment name (default fp-<model>-<random>)")
    deploy_parser.add_argument("--region", default=None)
    deploy_parser.add_argument("--bucket", default=None, help="bucket name (default <name>-<account>)")
    deploy_parser.add_argument("--account", default=None, help="alibaba-fc: the account id")
    deploy_parser.add_argument("--namespace", default=None, help="alibaba-fc: the Container Registry namespace")
    deploy_parser.add_argument("--role-arn", dest="role_arn", default=None, help="alibaba-fc: the functions' RAM role")
    deploy_parser.add_argument("--backend", default=None, choices=["nccl", "gloo"],
                               help="gpu-container: the collective backend of the ranks: nccl (default; one GPU per "
                                    "rank) or gloo (CPU-only clusters), e.g. --backend gloo")
    deploy_parser.add_argument("--image", default=None, help="gpu-container: the image name to build and push "
                                                             "(default <name>:latest)")
    deploy_parser.add_argument("--base-image", dest="base_image", default=None,
                               help="the images' base as name:tag@sha256:<digest> (default: the catalog's, pinned by "
                                    "digest; a tag alone is refused)")
    deploy_parser.add_argument("--lock", default=None, help="a hash-locked requirements file for the images (default: "
                                                            "flatpack's committed lock; every pin needs --hash)")
    _json_flag(deploy_parser, "deploy")
    deploy_parser.set_defaults(run=cmd_deploy)

    teardown_parser = sub.add_parser("teardown", help="remove everything a deployment created")
    teardown_parser.add_argument("record", help="the --out directory of flatpack deploy (or its deployment.json)")
    _json_flag(teardown_parser, "teardown")
    teardown_parser.set_defaults(run=cmd_teardown)

    demo_parser = sub.add_parser("demo", help="the main job: compile a zoo model, plan it, train it on local "
                                              "functions through a local S3 server, report and verify")
    demo_parser.add_argument("--model", default="vgg16",
                             help="a zoo model (built at reduced size) or a built-in example, keyword-input "
                                  "HuggingFace ones included, e.g. --model bert")
    demo_parser.add_argument("--iterations", type=int, default=12,
                             help="iterations to train (default 12): the first two (cold start, warm-up) are not "
                                  "measured, and the median of the rest is set beside the prediction. Fewer "
                                  "measure the run before its steady state: the invoker feeds the first 4 "
                                  "iterations' data before the workers start and deletes nothing before the "
                                  "first checkpoint")
    demo_parser.add_argument("--out", default="flatpack-demo",
                             help="the run directory: chart, artifacts, logs, trained weights (default "
                                  "./flatpack-demo)")
    demo_parser.add_argument("--calibration", default="auto", metavar="FILE|auto|none",
                             help="predict with what `flatpack calibrate --target local` measured: a file, auto (the "
                                  "default: this host's, measured on the first demo and cached) or none (the "
                                  "catalog's figures and the store round trip measured at deploy)")
    _json_flag(demo_parser, "demo")
    demo_parser.set_defaults(run=cmd_demo)
    _every_verb(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logs.configure(0)
    try:
        args = parse_arguments(build_parser(), argv)
    except FlatpackError as err:       # a bad --config file
        LOG.error("%s", err)
        return 2
    logs.configure(args.verbosity)
    try:
        # SIGINT, SIGTERM and SIGHUP take the KeyboardInterrupt path: the commands' own
        # with/finally blocks stop the functions and the S3 server; see flatpack/interrupts.py
        with clean_shutdown():
            return args.run(args)
    except RunFailure as err:          # it started and failed: exit 1 (EXIT_CODES)
        LOG.error("run failed: %s", err)
        return 1
    except FlatpackError as err:
        LOG.error("%s", err)
        return 2
    except BrokenPipeError:  # output piped into `head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as interrupt:
        code = interrupt.exit_code if isinstance(interrupt, Interrupted) else 130
        _say_interrupted(getattr(args, "out", None), "SIGINT" if code == 130 else str(interrupt))
        return code


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parses ``argv``; with ``--config FILE.toml`` (any verb that takes options) the file's
    keys become the verb's defaults first, so options on the command line still win. Keys
    are the options' names without dashes (``micro-batches`` or ``micro_batches``); an
    unknown key is refused with the close matches."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, verbosity = _take_verbosity(argv)
    logs.configure(verbosity)   # -q silences the config's note on skipped keys too
    args = _parse_with_config(parser, argv)
    args.verbosity = verbosity
    return args


def _take_verbosity(argv: list[str]) -> tuple[list[str], int]:
    """``-v``/``-q`` wherever they stand (before or after the verb), and the rest of argv."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _verbosity_args(probe)
    known, rest = probe.parse_known_args(argv)
    return rest, known.verbose - known.quiet


def _parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if "--config" not in argv and not any(arg.startswith("--config=") for arg in argv):
        return parser.parse_args(argv)
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config")
    known, rest = probe.parse_known_args(argv)
    verb = next((arg for arg in rest if not arg.startswith("-")), None)
    subparsers = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    if verb not in subparsers.choices:
        return parser.parse_args(rest)    # argparse names the missing or unknown verb
    sub = subparsers.choices[verb]
    others = {action.dest for name, other in subparsers.choices.items() if name != verb
              for action in other._actions if action.option_strings and action.dest not in ("help", "config")}
    sub.set_defaults(**config_defaults(known.config, sub, others))
    return parser.parse_args(rest)


def config_defaults(path: str, parser: argparse.ArgumentParser,
                    others: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The defaults a TOML config file gives ``parser``'s options (see :func:`parse_arguments`).
    A key that is not ``parser``'s option but is in ``others`` (another verb's options, as
    dests) is skipped, and the skipped keys named once at info level: one file serves every
    verb. A key that is no verb's option is refused with the close matches."""
    # a regular file of bounded size (a FIFO or /dev/zero given as --config is refused, not read)
    raw = safeio.read_bounded(path, limit=MAX_CONFIG_BYTES, what=f"--config {path}")
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"--config {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as err:   # its message ends "(at line L, column C)"
        raise InputError(f"--config {path} is not valid TOML: {err}") from None
    except RecursionError:
        raise InputError(f"--config {path} nests arrays or tables too deep for the TOML parser; a flatpack config "
                         "is a flat table of options") from None
    options = {action.dest: action for action in parser._actions
               if action.option_strings and action.dest not in ("help", "config")}
    defaults: dict[str, Any] = {}
    verb = parser.prog.split()[-1]
    skipped = []
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest not in options and dest in others:
            skipped.append(key)
            continue
        if dest not in options:
            names = sorted(name.replace("_", "-") for name in options)
            close = difflib.get_close_matches(key.replace("_", "-"), names, n=2)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise InputError(f"--config {path}: {key!r} is not an option of `flatpack {verb}`; "
                             f"{hint}the options are: {', '.join(names)}")
        action = options[dest]
        value = _config_value(path, key, action, value)
        wanted = action.type if action.type in (int, float) else None
        if wanted is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                   or (wanted is int and isinstance(value, float))):
            raise InputError(f"--config {path}: {key!r} takes {'a whole number' if wanted is int else 'a number'}, "
                             f"got {value!r}")
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) and not isinstance(value, bool):
            raise InputError(f"--config {path}: {key!r} is a switch; give true or false, got {value!r}")
        if action.choices is not None and value not in action.choices:
            raise InputError(f"--config {path}: {key!r} must be one of {', '.join(map(str, action.choices))}, "
                             f"got {value!r}")
        defaults[dest] = value
    if skipped:
        LOG.info("--config %s: %s %s not %s option of `flatpack %s` (another verb's); skipped",
                 path, ", ".join(skipped), "is" if len(skipped) == 1 else "are", "an" if len(skipped) == 1 else "its",
                 verb)
    return defaults


def _config_value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A config ``value`` as the command line would give ``action``: an option that takes
    text (a comma list such as --micro-batches, a name) takes a TOML string, number or array
    of them (``micro-batches = 2``, ``replicas = [1, 2]``), as the text ``"2"`` or ``"1,2"``."""
    takes_text = action.type is None and action.nargs != 0 and not isinstance(
        action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                 argparse._CountAction))
    if not takes_text:
        return value
    scalar = (str, int, float)
    if isinstance(value, list):   # lists as TOML arrays, for the comma-separated options
        if not value or any(isinstance(item, bool) or not isinstance(item, scalar) for item in value):
            raise InputError(f"--config {path}: {key!r} takes text, a number or an array of them (e.g. {key} = "
                             f"[1, 2] for --{key.replace('_', '-')} 1,2), got {value!r}")
        return ",".join(str(item) for item in value)
    if isinstance(value, bool) or not isinstance(value, scalar):
        raise InputError(f"--config {path}: {key!r} takes text, a number or an array of them (e.g. {key} = [1, 2] "
                         f"for --{key.replace('_', '-')} 1,2), got {value!r}")
    return str(value)


def _say_interrupted(out: str | None, how: str) -> None:
    """After a stop signal (part of ``main``): where the run's files are and how to go on."""
    lines = [f"flatpack: stopped by {how}; every process it started has been stopped"]
    if out and (Path(out) / "run.json").is_file():
        lines.append(f"the run directory is {out}; continue the run with: flatpack resume {out}")
    elif out and Path(out).is_dir():
        lines.append(f"what it wrote so far is in {out}")
    try:
        LOG.warning("%s", "\n".join(lines).removeprefix("flatpack: "))
    except Exception:  # noqa: BLE001 - stderr may be gone with the terminal (SIGHUP)
        pass


if __name__ == "__main__":
    sys.exit(main())
