"""The ``flatpack`` command: inspect, profile, plan, platforms, compile, run, demo, deploy, teardown."""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

from flatpack import logs
from flatpack.cli.common import human_bytes, load_factory, pipeline_for
from flatpack.cli.parser import (CONFIG_HELP, EXIT_CODES, Parser, config_defaults, every_verb, parse_arguments,
                                 verb_parsers, verbosity_args)
from flatpack.errors import FlatpackError, RunFailure
from flatpack.interrupts import Interrupted, clean_shutdown
from flatpack.version import __version__

__all__ = ["build_parser", "config_defaults", "human_bytes", "load_factory", "main", "parse_arguments",
           "pipeline_for", "verb_parsers"]

LOG = logs.get("cli")

# the verbs in the order --help lists them, and the module that adds each one's parser
VERB_ORDER = ("inspect", "compile", "profile", "calibrate", "plan", "platforms", "run", "resume", "sign", "check",
              "deploy", "teardown", "serve", "demo")
def verb_modules() -> tuple[Any, ...]:
    """The modules that add the verbs' parsers, imported when the parser is built (start-up
    time: `flatpack --version` imports none of them)."""
    # start-up time: --version answers without these (the done-when's 0.3 s)
    from flatpack.cli import artifacts, cloud, measuring, planning, training
    from flatpack.serve import command as serve_command

    return artifacts, measuring, planning, training, cloud, serve_command


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="flatpack", description=__doc__, epilog=EXIT_CODES,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flatpack {__version__}")
    verbosity_args(parser)
    parser.add_argument("--config", metavar="FILE.toml", help=CONFIG_HELP)
    subparsers = parser.add_subparsers(dest="command", required=True)
    adders = {verb: add for module in verb_modules() for verb, add in module.VERBS.items()}
    for verb in VERB_ORDER:
        adders[verb](subparsers)
    every_verb(subparsers)
    return parser


# what a library warning tells a Python user to do, in the command line's words
CLI_TERMS = {
    "Profile larger batch sizes (ProfileOptions(batch_sizes=...)) or more repeats; profile.flat_slopes lists them.":
        "Give a larger --batch (run, plan and demo profile at the micro-batch size and its halves), or larger "
        "--batch-sizes and --repeats to flatpack profile; the prediction is otherwise unaffected.",
}


@contextlib.contextmanager
def warnings_through_the_logger() -> Iterator[None]:
    """While a verb runs, a library warning is one ``flatpack: warning:`` line through the
    logger (so ``-q`` keeps it and nothing prints a Python source line), in the command line's
    words (:data:`CLI_TERMS`), once per command however often it is raised."""
    said: set[str] = set()

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        text = str(message)
        for python, cli in CLI_TERMS.items():
            text = text.replace(python, cli)
        if text not in said:
            said.add(text)
            LOG.warning("%s", text)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        # what argparse's --version does (print, exit 0), without building every verb's parser
        print(f"flatpack {__version__}")
        raise SystemExit(0)
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
        with clean_shutdown(), warnings_through_the_logger():
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
