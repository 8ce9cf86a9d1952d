"""The training verbs: ``run`` (compile, plan, deploy to local functions, train, report and
verify), ``resume`` (a run that stopped) and ``demo`` (the main job on a zoo model)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flatpack import logs
from flatpack.errors import InputError
from flatpack.backends import RUN_TARGETS
from flatpack.cli.common import RAY_ADDRESS_HELP, json_flag, load_factory, report, text_stream, trust_args
from flatpack.cli.run_options import add_run_options, job_values

LOG = logs.get("cli")


def cmd_run(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.job import run_training
    from flatpack.job_options import JobOptions

    values = job_values(args)
    if "iterations" not in values and values.get("data") is not None:
        values["iterations"] = None      # --data without --iterations: --epochs full passes
    options = JobOptions.of(**values)
    # every option is checked before the model is built and before any process starts
    options.check()
    args.out = str(options.output.out)   # where main's message after a stop signal finds the run directory
    model, inputs = load_factory(args.model, args.size)
    result = run_training(model, inputs, options, stream=text_stream(args))
    report(args, None, result.to_json)
    return 0 if result.equivalent in (None, True) else 1


def cmd_resume(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.job import resume_training

    result = resume_training(Path(args.run_dir), stream=text_stream(args), clean=args.clean, digest=args.digest,
                             verify_key=args.verify_key, data=args.data, name=args.name,
                             min_version=args.min_version, trust_file=args.trust_file,
                             accept_changed_data=args.accept_changed_data, target=args.target,
                             address=args.address)
    report(args, None, result.to_json)
    return 0


# the demo shows a pipeline: its cuts are fixed, since on a small host dp's fastest plan is often one stage
DEMO_STAGES = 2
# the memory tiers the demo plans over, and the ones its cached calibration measures
DEMO_TIERS = (512, 1024)
# --calibration's words beside a file: the cached one if any (auto), measure now, or the catalog's
CALIBRATION_CHOICES = ("auto", "measure", "none")
MEASURE_HINT = ("`flatpack demo --calibration measure` calibrates this host once (about 2 minutes on a quiet machine) "
                "and every later demo predicts with it")


def cmd_demo(args: argparse.Namespace) -> int:
    # start-up time: a verb imports what it runs
    from flatpack.job import run_training
    from flatpack.job_options import JobOptions

    given = Path(args.calibration) if args.calibration not in CALIBRATION_CHOICES else None
    if args.target != "local" and args.calibration == "measure":
        raise InputError(f"--calibration measure calibrates this host's local functions, not the {args.target} "
                         f"target; run `flatpack calibrate --target {args.target} --out FILE` and pass "
                         "--calibration FILE, or leave --calibration out (the run calibrates on its iteration 1)")
    options = JobOptions.of(batch=64, micro_batches=8, iterations=args.iterations, optimizer="adam", lr=0.01,
                            passes="fuse-elementwise,merge-branches,coarsen{max-layers=8,by=time}", stages=DEMO_STAGES,
                            memory_mb=DEMO_TIERS, out=Path(args.out), calibration=given, target=args.target,
                            address=args.address)
    options.check()
    # the model before any calibration (minutes when measured): a misspelt name is refused at once
    model, inputs = load_factory(args.model, "tiny")
    # the cached calibration is of this host's local functions: a Ray run predicts uncalibrated and
    # calibrates on its iteration 1, as a first local demo does
    if given is None and args.calibration != "none" and args.target == "local":
        options = options.with_changes(calibration=_demo_calibration(args.calibration))
    functions = "local functions" if args.target == "local" else f"Ray tasks on {args.address or 'auto'}"
    LOG.info(f"flatpack demo: {args.model} (reduced size) trained as a pipeline of {DEMO_STAGES} {functions} "
             "(fixed cuts: stages of balanced parameter bytes; on a host this small the solver's fastest plan is "
             "often one stage, which would show no pipeline)")
    result = run_training(model, inputs, options, stream=text_stream(args))
    report(args, None, result.to_json)
    if args.calibration == "auto" and options.plan.calibration is None:
        in_run = " and the run calibrated them on its iteration 1" if result.calibrated is not None else ""
        hint = MEASURE_HINT if args.target == "local" else (
            f"`flatpack calibrate --target {args.target} --out FILE` measures the cluster, and --calibration FILE "
            "predicts with it")
        LOG.info(f"the predictions above were uncalibrated (no calibration of this target is cached){in_run}; "
                 f"{hint}")
    return 0 if result.equivalent else 1


def _demo_calibration(choice: str) -> Path | None:
    """The calibration the demo predicts with: ``measure``, this host's measured now and
    cached; ``auto``, the cached one, or none. Why the first demo does not measure one
    (measuring takes longer than the demo): docs/training.md, "The first demo"."""
    # start-up time: a verb imports what it runs
    from flatpack.backends.target_calibration import find_local_calibration, measure_local_calibration

    if choice == "measure":
        return measure_local_calibration(DEMO_TIERS, LOG.info)
    # without one the report says its predictions are uncalibrated, and cmd_demo ends naming the command
    return find_local_calibration(DEMO_TIERS, LOG.info)


def _add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser(
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
    parser.add_argument("model", help="path/to/file.py:factory, package.module:factory, an example or a zoo model")
    parser.add_argument("--size", default="tiny", choices=["tiny", "full"], help="zoo model size")
    add_run_options(parser)
    json_flag(parser, "run")
    parser.set_defaults(run=cmd_run)


def _add_resume(subparsers: Any) -> None:
    parser = subparsers.add_parser("resume", help="continue a `flatpack run` that stopped (a crash, Ctrl-C, a lost "
                                                  "server) from its last checkpoint, to the same weights")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of the run")
    parser.add_argument("--target", default=None, choices=RUN_TARGETS,
                        help="where the run's functions run: local or ray (default: where the run started them, "
                             "as run.json records it)")
    parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    parser.add_argument("--data", default=None, metavar="MODULE:FACTORY",
                        help="a run whose --data was a dataset factory names it again (run.json records it, "
                             "but never names code to import), e.g. --data mydata.py:make")
    parser.add_argument("--clean", action="store_true",
                        help="remove the run's store data instead of resuming it")
    parser.add_argument("--accept-changed-data", action="store_true",
                        help="resume even though the run's data (shards, the dataset factory's file, the "
                             "batches file) changed since it started; a warning names what changed")
    trust_args(parser)
    json_flag(parser, "resume")
    parser.set_defaults(run=cmd_resume)


def _add_demo(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="the main job: compile a zoo model, plan it, train it on local "
                                              "functions through a local S3 server, report and verify")
    parser.add_argument("--model", default="vgg16",
                        help="a zoo model (built at reduced size) or a built-in example, keyword-input "
                             "HuggingFace ones included, e.g. --model bert")
    parser.add_argument("--iterations", type=int, default=12,
                        help="iterations to train (default 12): the first two (cold start, warm-up) are not "
                             "measured, and the median of the rest is set beside the prediction. Fewer "
                             "measure the run before its steady state: the invoker feeds the first 4 "
                             "iterations' data before the workers start and deletes nothing before the "
                             "first checkpoint")
    parser.add_argument("--out", default="flatpack-demo",
                        help="the run directory: chart, artifacts, logs, trained weights (default "
                             "./flatpack-demo)")
    parser.add_argument("--calibration", default="auto", metavar="FILE|auto|measure|none",
                        help="what the prediction is calibrated with: auto (the default: this host's cached "
                             "calibration; without one, the catalog's figures, the store round trip measured at "
                             "deploy and FuncPipe's in-run calibration on iteration 1), measure (calibrate this "
                             "host now, about 2 minutes once, and cache it for later demos), a file written by "
                             "`flatpack calibrate --target local`, or none (the catalog's figures, even when a "
                             "calibration is cached)")
    parser.add_argument("--target", default="local", choices=RUN_TARGETS,
                        help="where the stage functions run: local (processes on this host, the default) or ray "
                             "(Ray tasks; with --address local, a one-node Ray cluster the demo starts itself)")
    parser.add_argument("--address", default=None, help=RAY_ADDRESS_HELP)
    json_flag(parser, "demo")
    parser.set_defaults(run=cmd_demo)


# each verb's parser, added to the command's subparsers (flatpack.cli.build_parser orders them)
VERBS = {"run": _add_run, "resume": _add_resume, "demo": _add_demo}
