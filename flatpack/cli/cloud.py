"""The cloud verbs: ``deploy`` (compile a model for a cloud target and deploy it, or write
everything with ``--dry-run``) and ``teardown`` (remove what a deployment created)."""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path
from typing import Any

import flatpack
from flatpack import logs
from flatpack.cli.common import check_tiers, compile_args, ints, json_flag, load_factory, pipeline_for, report
from flatpack.errors import InputError
from flatpack.partitioner.solvers import PICKS
from flatpack.table import format_table, plural

LOG = logs.get("cli")

# the deploy flags that name where and how a deployment is made; a target's backend takes those
# its functions accept by keyword (:func:`cloud_options`)
CLOUD_FLAGS = ("name", "region", "bucket", "account", "namespace", "role_arn", "image", "base_image", "lock",
               "backend")


def deploy_targets() -> list[str]:
    """The targets a backend (flatpack.backends.BACKENDS) deploys to in an account or cluster:
    every one but those of the local platform kind, which run in-process (flatpack run)."""
    # start-up time: a verb imports what it runs
    from flatpack.backends import BACKENDS
    from flatpack.platform.catalog import get_platform

    return [name for name in BACKENDS.names() if get_platform(name).kind != "local"]


def cloud_options(backend: Any, packages_only: bool) -> tuple[str, ...]:
    """The cloud flags ``backend``'s ``package`` takes by keyword (and its ``deploy`` too,
    unless the command line only packages for it: gpu-container, whose manifests the user
    applies)."""
    def keywords(function: Any) -> set[str]:
        return set(inspect.signature(function).parameters)

    taken = keywords(backend.package) if packages_only else keywords(backend.package) & keywords(backend.deploy)
    return tuple(flag for flag in CLOUD_FLAGS if flag in taken)


def cmd_deploy(args: argparse.Namespace) -> int:
    """Compiles MODEL for a target, then writes everything a deployment needs into --out and
    (without --dry-run) creates it in the account."""
    # start-up time: a verb imports what it runs
    from flatpack.backends import get_backend

    targets = deploy_targets()
    if args.target not in targets:
        raise InputError(f"flatpack deploy targets {', '.join(targets)}; the local target runs in-process "
                         "(flatpack run MODEL)")
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
    packages_only = args.dry_run or args.target == "gpu-container"
    options = {key: getattr(args, key) for key in cloud_options(backend, args.target == "gpu-container")
               if getattr(args, key, None) is not None}
    endpoint = _endpoint(args)
    if endpoint is not None:
        options["endpoint"] = endpoint
    # what the account needs (region, credentials) is said before the model is compiled
    check_access = None if packages_only else getattr(backend, "check_access", None)
    if check_access is not None:
        check_access(**options)
    compiled = _compile_for(args)
    document = {"target": args.target, "out": str(out), "dry_run": args.dry_run, "digest": compiled.digest,
                "plan": compiled.plan.to_json()}
    if endpoint is not None:
        # start-up time: a verb imports what it runs
        from flatpack.backends.lambda_endpoint import describe_price, price

        LOG.info(f"serving endpoint: {describe_price(endpoint)}")
        document["endpoint_price"] = price(endpoint)
    if packages_only:
        return _write_deployment(args, backend, compiled, options, document)
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


def _endpoint(args: argparse.Namespace) -> Any:
    """The serving endpoint ``--endpoint`` asks for (aws-lambda only), or None."""
    if args.endpoint is None:
        if args.provisioned:
            raise InputError("--provisioned-concurrency keeps the serving master warm; give --endpoint AWS_IAM with it")
        return None
    if args.target != "aws-lambda":
        raise InputError(f"--endpoint exposes a serving master through a Lambda function URL; {args.target} has none. "
                         "Use --target aws-lambda, or serve with flatpack serve")
    # start-up time: a verb imports what it runs
    from flatpack.backends.lambda_endpoint import Endpoint

    return Endpoint(auth=args.endpoint, provisioned=args.provisioned)


def _compile_for(args: argparse.Namespace) -> Any:
    """MODEL compiled for the target with the plan the flags ask for."""
    # start-up time: a verb imports what it runs
    from flatpack.partitioner.solvers.wrappers import FastestOnFront
    from flatpack.partitioner.workload import Workload
    from flatpack.profiler import ProfileOptions

    extra: dict[str, Any] = {}
    if args.memory:
        extra["memory_mb"] = ints(args.memory, "--memory")
    if args.replicas:
        extra["replicas"] = ints(args.replicas, "--replicas")
    check_tiers(args.target, extra.get("memory_mb", ()))
    model, inputs = load_factory(args.model, args.size)
    # an endpoint serves fork-join inference: the plan is made for it
    workload = (Workload("infer", batch=args.batch) if getattr(args, "endpoint", None) else
                Workload("train", batch=args.batch, micro_batches=args.micro_batches))
    started = time.perf_counter()
    solver = FastestOnFront() if args.pick == "fastest" else args.solver
    compiled = flatpack.compile(model, inputs, target=args.target, solver=solver, passes=pipeline_for(args),
                                workload=workload, calibration=args.calibration,
                                profile=ProfileOptions(batch_sizes=(1, 2), repeats=3), **extra)
    stages = ", ".join(f"{start}-{end} ({stage.memory_mb or '-'} MB x{stage.replicas})"
                       for (start, end), stage in zip(compiled.plan.ranges, compiled.plan.stages))
    LOG.info(f"compiled {args.model} for {args.target} in {time.perf_counter() - started:.1f} s: "
             f"{plural(len(compiled.plan.stages), 'stage')}, layers {stages}")
    return compiled


def _write_deployment(args: argparse.Namespace, backend: Any, compiled: Any, options: dict[str, Any],
                      document: dict[str, Any]) -> int:
    """A dry run, or a gpu-container deployment (the user's kubectl apply of what this
    writes): the files and the commands that create the deployment."""
    # start-up time: a verb imports what it runs
    from flatpack.backends.gpu_container import write_context

    out = Path(args.out)
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

    written = Path(args.record)
    if (written / "commands.sh").is_file() and not (written / cloud.RECORD_FILE).exists():
        report(args, f"{written} holds the files of a dry run (or a gpu-container deployment): flatpack created "
                     "nothing there, so there is nothing to remove. What you created by running its commands.sh "
                     "is not recorded: remove it the same way, or deploy without --dry-run so that flatpack "
                     "teardown can remove it", {"dir": str(written), "dry_run": True, "removed": []})
        return 0
    ledger = cloud.Ledger.load(args.record)
    document = {"name": ledger.name, "target": ledger.target, "region": ledger.region}
    if not ledger.created:
        report(args, f"{ledger.name}: nothing left to remove", {**document, "removed": []})
        return 0
    removed = get_backend(ledger.target).teardown(args.record)
    report(args, f"removed from {ledger.target} ({ledger.region}): {', '.join(removed)}",
           {**document, "removed": list(removed)})
    return 0



def _add_deploy(subparsers: Any) -> None:
    parser = subparsers.add_parser("deploy", help="compile a model for a cloud target and deploy it (or, with "
                                                  "--dry-run, write everything and print the commands)")
    compile_args(parser)
    parser.add_argument("--target", required=True,
                        help="a target whose backend packages a deployment: aws-lambda, alibaba-fc or "
                             "gpu-container (flatpack.backends.BACKENDS)")
    parser.add_argument("--out", required=True, help="directory for the build contexts, policies, commands "
                                                            "and the deployment record")
    parser.add_argument("--dry-run", action="store_true", help="write the files and print the commands; "
                                                                      "create nothing")
    parser.add_argument("--batch", type=int, default=32, help="global batch the plan is made for")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--solver", default="dp")
    parser.add_argument("--pick", default="recommended", choices=PICKS,
                        help="recommended (the solver's choice) or fastest (the fastest plan on dp's front)")
    parser.add_argument("--memory", default=None, help="memory tiers the solver may pick (MB, comma-separated)")
    parser.add_argument("--replicas", default=None, help="replica degrees the solver may pick")
    parser.add_argument("--calibration", default=None, help="calibration file (flatpack profile --target)")
    parser.add_argument("--name", default=None, help="deployment name (default fp-<model>-<random>)")
    parser.add_argument("--region", default=None)
    parser.add_argument("--bucket", default=None, help="bucket name (default <name>-<account>)")
    parser.add_argument("--account", default=None, help="alibaba-fc: the account id")
    parser.add_argument("--namespace", default=None, help="alibaba-fc: the Container Registry namespace")
    parser.add_argument("--role-arn", dest="role_arn", default=None, help="alibaba-fc: the functions' RAM role")
    parser.add_argument("--backend", default=None, choices=["nccl", "gloo"],
                               help="gpu-container: the collective backend of the ranks: nccl (default; one GPU per "
                                    "rank) or gloo (CPU-only clusters), e.g. --backend gloo")
    parser.add_argument("--image", default=None, help="gpu-container: the image name to build and push "
                                                             "(default <name>:latest)")
    parser.add_argument("--base-image", dest="base_image", default=None,
                               help="the images' base as name:tag@sha256:<digest> (default: the catalog's, pinned by "
                                    "digest; a tag alone is refused)")
    parser.add_argument("--lock", default=None, help="a hash-locked requirements file for the images (default: "
                                                            "flatpack's committed lock; every pin needs --hash)")
    parser.add_argument("--endpoint", default=None, choices=["AWS_IAM", "NONE"],
                        help="aws-lambda: compile for inference and expose the serving master through a function URL "
                             "of this auth type (AWS_IAM: signed callers only; NONE: public, with a warning)")
    parser.add_argument("--provisioned-concurrency", dest="provisioned", type=int, default=0,
                        help="aws-lambda with --endpoint: serving-master environments kept warm (billed while "
                             "configured; the price is printed)")
    json_flag(parser, "deploy")
    parser.set_defaults(run=cmd_deploy)


def _add_teardown(subparsers: Any) -> None:
    parser = subparsers.add_parser("teardown", help="remove everything a deployment created")
    parser.add_argument("record", help="the --out directory of flatpack deploy (or its deployment.json)")
    json_flag(parser, "teardown")
    parser.set_defaults(run=cmd_teardown)


# each verb's parser, added to the command's subparsers (flatpack.cli.build_parser orders them)
VERBS = {"deploy": _add_deploy, "teardown": _add_teardown}
