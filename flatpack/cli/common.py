"""What several verbs share: loading MODEL, the model's pass pipeline, the options every
compiling verb takes, ``--json`` and the report on stdout, and the comma-list parsers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from flatpack import logs
from flatpack.errors import InputError

if TYPE_CHECKING:
    import torch

RAY_ADDRESS_HELP = ("--target ray: the Ray cluster (auto: the one `ray start` runs here or $RAY_ADDRESS; "
                    "ray://HOST:10001; local: a one-node cluster started in this process)")


def connect_ray(args: argparse.Namespace) -> None:
    """``--target ray``: connects to the cluster at ``--address`` first (the platform is read
    from it; the deployment then uses this connection). ``--address`` is refused elsewhere."""
    address = getattr(args, "address", None)
    if args.target == "ray":
        # start-up time: a verb imports what it runs
        from flatpack.backends import ray as ray_backend

        ray_backend.connect(address)
    elif address is not None:
        raise InputError("--address names the Ray cluster to run on; give --target ray with it, or leave it out")


LOG = logs.get("cli")

JSON_HELP = ("print a JSON document on stdout instead of the text report (diagnostics stay on stderr), e.g. "
             "flatpack {verb} ... --json | jq .")


def load_factory(spec: str, size: str = "tiny") -> tuple[torch.nn.Module, Any]:
    """MODEL is ``path/to/file.py:factory``, ``package.module:factory`` or a registered model
    name (:func:`flatpack.models.load`)."""
    # start-up time: a verb imports what it runs
    from flatpack import models

    return models.load(spec, size)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def pipeline_for(args: argparse.Namespace) -> str | None:
    """The --passes given, else a named model's own pipeline, else the default (None)."""
    # start-up time: a verb imports what it runs
    from flatpack import models

    named = models.find(args.model)
    if args.passes is None and named is not None:
        return named.passes
    return args.passes


def model_label(args: argparse.Namespace) -> str:
    """MODEL as reports name it: a registered model with its size, else as given."""
    # start-up time: a verb imports what it runs
    from flatpack import models

    named = models.find(args.model)
    return named.label(args.size) if named is not None else args.model


def compile_args(parser: Any, model_optional: bool = False) -> None:
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


def trust_args(parser: Any) -> None:
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


def fixed_cut_args(parser: Any, verb: str) -> None:
    """``--stages`` and ``--split-points``: one plan with fixed cuts instead of the solver's,
    which ``plan`` prices and ``run`` trains (one replica each, or the one degree --replicas names; the
    smallest tier that fits)."""
    parser.add_argument("--stages", type=int, default=None, metavar="N", help=stages_help(verb))
    parser.add_argument("--split-points", default=None, metavar="MODULE[,MODULE...]", help=split_points_help(verb))


def stages_help(verb: str) -> str:
    return (f"{verb} one plan cut into N stages of balanced parameter bytes instead of the solver's (one replica "
            "each, or D with --replicas D; the smallest memory tier that fits), e.g. --stages 4")


def split_points_help(verb: str) -> str:
    return (f"{verb} one plan with a stage beginning at each named module (as torch.distributed.pipelining's "
            "SplitPoint.BEGINNING; names as model.named_modules() gives them), e.g. --split-points "
            "bert.encoder.layer.2")


def solvers_help() -> str:
    """The registered solvers, as the --solver help lists them."""
    # start-up time: the registry's names alone (no solver is imported)
    from flatpack.partitioner.solvers import available_solvers

    return ", ".join(available_solvers())


def json_flag(parser: Any, verb: str) -> None:
    """``--json`` on a verb that reports: the JSON document on stdout instead of the text."""
    parser.add_argument("--json", action="store_const", const="-", default=None, help=JSON_HELP.format(verb=verb))


def json_or_file(parser: Any, verb: str, what: str) -> None:
    """``--json [FILE]`` on inspect, profile and plan: alone (or ``-``), as :func:`json_flag`;
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


def text_stream(args: argparse.Namespace) -> Any:
    """Where a verb that reports as it goes (run, resume, demo) prints its text report: stdout,
    or stderr under --json, whose document is then stdout's only content."""
    return sys.stderr if args.json else sys.stdout


def positive_ints(text: str, what: str = "batch sizes") -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{what}: expected comma-separated positive integers, got {text!r}") from None
    if not values or any(value <= 0 for value in values):
        raise InputError(f"{what} must be positive integers, got {text!r}")
    return values


def names(text: str | None) -> tuple[str, ...]:
    """``--split-points a,b``: module names, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip()) if text else ()


def ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"{flag} takes comma-separated integers, got {text!r}") from None


def check_tiers(target: str, memory_mb: Sequence[int]) -> None:
    """Unknown tiers are refused before profiling, not after."""
    # start-up time: a verb imports what it runs
    from flatpack.platform.catalog import get_platform, platform_names

    if target not in platform_names():
        raise InputError(f"unknown target {target!r}; flatpack targets: {', '.join(platform_names())}")
    platform = get_platform(target)
    for size in memory_mb:
        try:
            platform.tier(size)
        except InputError as err:   # the catalog speaks of the platform; the user typed --memory
            raise InputError(f"--memory {size}: {err}") from None



def targets_help() -> str:
    """The catalog's platforms, as a --target's help lists them."""
    # start-up time: the catalog's names alone (a verb imports what it runs)
    from flatpack.platform.catalog import platform_names

    return ", ".join(platform_names())
