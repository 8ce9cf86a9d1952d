"""The command line's parser: argparse with a "did you mean" (:class:`Parser`), the verbs
and options it declared (read through public argparse only), ``-v``/``-q`` anywhere, and
``--config FILE.toml`` whose keys become a verb's defaults (:func:`parse_arguments`)."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Any, Callable, Iterable, Sequence

from flatpack import logs, safeio
from flatpack.errors import InputError

if sys.version_info >= (3, 11):
    import tomllib
else:   # Python 3.10
    import tomli as tomllib

LOG = logs.get("cli")
# a config is a flat table of a verb's options: a few hundred bytes
MAX_CONFIG_BYTES = safeio.MiB

EXIT_CODES = """exit codes: 0 success; 1 a run failed (a function's error, out of memory, a function that
refused its stage, an equivalence check that failed); 2 bad input (an option, a model, a file, an artifact
refused by load or check before any of its code ran; nothing was started);
128+N stopped by signal N (130 Ctrl-C, 143 SIGTERM; the run directory stays resumable)"""

CONFIG_HELP = ("defaults for the verb's options from a TOML file whose keys are the option names "
               "(batch = 64, micro-batches = 8, replicas = [1, 2]); options given on the command line win, and "
               "another verb's keys are skipped. Give it anywhere: flatpack run vgg16 --config run.toml")


class RegistryChoice(argparse.Action):
    """An option whose value must be one of a registry's names (``names()``), read when a
    value is checked rather than when the parser is built or its help printed: the registry
    may import torch, which ``--help`` must not. Its :attr:`choices` are those names, as
    argparse's and the --config file's checks ask them; give it a metavar."""

    def __init__(self, option_strings: Sequence[str], dest: str, names: Callable[[], Iterable[str]],
                 **options: Any) -> None:
        self.names = names
        super().__init__(option_strings, dest, **options)

    @property
    def choices(self) -> list[str]:   # type: ignore[override]
        return list(self.names())

    @choices.setter
    def choices(self, given: Any) -> None:
        """argparse's own choices are never given: the registry's names stand for them."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class Recorded:
    """An argument group of a :class:`Parser` whose options the parser records."""

    def __init__(self, parser: Parser, group: Any) -> None:
        self.parser, self.group = parser, group

    def add_argument(self, *names: str, **options: Any) -> argparse.Action:
        action = self.group.add_argument(*names, **options)
        self.parser.declared.append(action)
        return action


class Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a misspelt option, verb or choice (difflib's close
    matches; Python 3.11's argparse has no suggest_on_error), said on one error line, exit 2.
    It records the actions it declares (:attr:`declared`, also those added through
    :meth:`option_group` and :meth:`exclusive_group`) and its verbs (:attr:`subparsers`), so
    that nothing reads argparse's private attributes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.declared: list[argparse.Action] = []     # before argparse's __init__ adds -h
        self.subparsers: Any = None
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: Any, **options: Any) -> argparse.Action:
        action = super().add_argument(*names, **options)
        self.declared.append(action)
        return action

    def add_subparsers(self, **options: Any) -> Any:
        self.subparsers = super().add_subparsers(**options)
        return self.subparsers

    def option_group(self, title: str, description: str | None = None) -> Recorded:
        return Recorded(self, self.add_argument_group(title, description))

    def exclusive_group(self) -> Recorded:
        return Recorded(self, self.add_mutually_exclusive_group())

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        assert parsed is not None    # parse_known_args returns a namespace
        if extras:
            verb = self._verb_parser(parsed)
            options = sorted(option_strings(verb))
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
        if self.subparsers is None:
            return self
        verb = verb_parsers(self).get(str(getattr(parsed, self.subparsers.dest, None)), self)
        return verb if isinstance(verb, argparse.ArgumentParser) else self

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


def verb_parsers(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The verbs of a :class:`Parser`, by name (none for a parser without verbs)."""
    subparsers = getattr(parser, "subparsers", None)
    return dict(subparsers.choices) if subparsers is not None else {}


def declared(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options a :class:`Parser` declared (-h and --config too)."""
    return list(getattr(parser, "declared", ()))


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string (``--batch``, ``-v``) a :class:`Parser` declared."""
    return {name for action in declared(parser) for name in action.option_strings}


def every_verb(subparsers: Any) -> None:
    """What every verb's --help shows: --config (:func:`parse_arguments` takes it from
    anywhere on the command line) and the exit codes."""
    for verb_parser in subparsers.choices.values():
        verb_parser.add_argument("--config", metavar="FILE.toml", help=CONFIG_HELP)
        verb_parser.epilog = EXIT_CODES


def verbosity_args(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q``: declared on the main parser (for --help) and on the probe that
    :func:`parse_arguments` takes them from, anywhere on the command line."""
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more diagnostics on stderr (debug: every logger's name), e.g. flatpack run mlp -v; "
                             "reports and --json output stay on stdout")
    parser.add_argument("-q", "--quiet", action="count", default=0,
                        help="only warnings and errors on stderr (no progress), e.g. flatpack plan bert -q")


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
    verbosity_args(probe)
    known, rest = probe.parse_known_args(argv)
    return rest, known.verbose - known.quiet


def _parse_with_config(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if "--config" not in argv and not any(arg.startswith("--config=") for arg in argv):
        return parser.parse_args(argv)
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config")
    known, rest = probe.parse_known_args(argv)
    verb = next((arg for arg in rest if not arg.startswith("-")), None)
    verbs = verb_parsers(parser)
    if verb not in verbs:
        return parser.parse_args(rest)    # argparse names the missing or unknown verb
    others = {action.dest for name, other in verbs.items() if name != verb
              for action in declared(other) if action.option_strings and action.dest not in ("help", "config")}
    verbs[verb].set_defaults(**config_defaults(known.config, verbs[verb], others))
    return parser.parse_args(rest)


def config_defaults(path: str, parser: argparse.ArgumentParser,
                    others: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The defaults a TOML config file gives ``parser``'s options (see :func:`parse_arguments`).
    A key that is not ``parser``'s option but is in ``others`` (another verb's options, as
    dests) is skipped, and the skipped keys named once at info level: one file serves every
    verb. A key that is no verb's option is refused with the close matches."""
    table = _read_config(path)
    options = {action.dest: action for action in declared(parser)
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
        defaults[dest] = _checked_value(path, key, options[dest], value)
    if skipped:
        LOG.info("--config %s: %s %s not %s option of `flatpack %s` (another verb's); skipped",
                 path, ", ".join(skipped), "is" if len(skipped) == 1 else "are", "an" if len(skipped) == 1 else "its",
                 verb)
    return defaults


def _read_config(path: str) -> dict[str, Any]:
    """The TOML table of a config file: a regular file of bounded size (a FIFO or /dev/zero
    given as --config is refused, not read)."""
    raw = safeio.read_bounded(path, limit=MAX_CONFIG_BYTES, what=f"--config {path}")
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"--config {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as err:   # its message ends "(at line L, column C)"
        raise InputError(f"--config {path} is not valid TOML: {err}") from None
    except RecursionError:
        raise InputError(f"--config {path} nests arrays or tables too deep for the TOML parser; a flatpack config "
                         "is a flat table of options") from None


def _is_switch(action: argparse.Action) -> bool:
    """store_true and store_false: no value, a boolean constant."""
    return action.nargs == 0 and isinstance(action.const, bool)


def _checked_value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A config ``value`` for ``action``, as the command line would give it, or an InputError
    naming the file and the key."""
    value = _config_value(path, key, action, value)
    wanted = action.type if action.type in (int, float) else None
    if wanted is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                               or (wanted is int and isinstance(value, float))):
        raise InputError(f"--config {path}: {key!r} takes {'a whole number' if wanted is int else 'a number'}, "
                         f"got {value!r}")
    if _is_switch(action) and not isinstance(value, bool):
        raise InputError(f"--config {path}: {key!r} is a switch; give true or false, got {value!r}")
    if action.choices is not None and value not in action.choices:
        raise InputError(f"--config {path}: {key!r} must be one of {', '.join(map(str, action.choices))}, "
                         f"got {value!r}")
    return value


def _config_value(path: str, key: str, action: argparse.Action, value: Any) -> Any:
    """A config ``value`` as the command line would give ``action``: an option that takes
    text (a comma list such as --micro-batches, a name) takes a TOML string, number or array
    of them (``micro-batches = 2``, ``replicas = [1, 2]``), as the text ``"2"`` or ``"1,2"``."""
    takes_text = action.type is None and action.nargs != 0
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
