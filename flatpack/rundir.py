"""A training run's directory: what ``flatpack run`` leaves so that ``flatpack resume`` can
finish it after any crash (a worker, the runner, the S3 server, the machine).

Layout (``run.json`` says what is where)::

    RUN/run.json                  the run id, loss, iterations and state ("running", "done")
    RUN/compiled/                 the stage artifacts (``Compiled.save``); run.json's ``compiled``
                                  names another after a ``--replan`` switch, until the run ends
    RUN/batches.safetensors       the global batches the run trains on, in order
    RUN/store/                    the local S3 server's data: artifacts, checkpoints, tensors
    RUN/logs/                     the functions' logs
    RUN/trained.safetensors       the trained weights by original name, once the run is done

The store data stays until the run succeeds (then it is removed unless kept) so that a
resumed run finds its checkpoints; nothing of a run lives in the system temp directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from flatpack.atomic import write_atomic
from flatpack.errors import InputError
from flatpack.safeio import expect_mapping, finite, load_json, open_regular, parse_json

RUN_FILE = "run.json"
BATCHES_FILE = "batches.safetensors"
TRAINED_FILE = "trained.safetensors"
RUN_VERSION = 1
# far above any record flatpack writes (a few KiB; a shard list of a large directory is the bulk)
RUN_FILE_LIMIT = 16 << 20

# A run's files are private by default: on a shared host another user must not read the model,
# its weights or its data (docs/security.md, "A run directory is data").
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600

# bounds of the numbers a record may hold: generous for any real run, small enough that a
# hostile value cannot ask for a billion processes or iterations
MAX_ITERATIONS = 100_000_000
MAX_MICRO_BATCHES = 65_536
MAX_THREADS = 1_024
MAX_BATCH = 1 << 24
MAX_EPOCHS = 1_000_000
MAX_SEED = (1 << 63) - 1
MAX_TEXT = 4_096
MAX_FILES = 1_000_000
MAX_INPUTS = 1_024
RUN_STATES = ("running", "done", "abandoned")
# a target's name as run.json records it (``backends.RUN_TARGETS`` says which ones resume runs:
# checked there, so that this module and the command line's import stay free of the backends)
TARGET_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
# the run id prefixes every store key of the run: one plain name, never a path
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# the artifact directory run.json names: one plain name inside the run directory
COMPILED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

# knobs of deployment.train() that only tests and chaos runs set in-process: a record never
# drives them (a hostile run.json would inject a failure or a 1e9 s sleep into the resume)
TEST_ONLY_TRAIN_OPTIONS = frozenset({"faults", "store_faults", "time_limit_s", "timeout_s", "wait_timeout_s",
                                     "straggler_ratio", "elastic", "epoch_iterations", "replan", "progress",
                                     "batch_offset"})

LOG = logging.getLogger("flatpack.rundir")


def _text(value: Any, what: str, *, limit: int = MAX_TEXT, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InputError(f"{what} must be a string, not {type(value).__name__}")
    if len(value) > limit:
        raise InputError(f"{what} has {len(value):,} characters; at most {limit:,} are allowed")
    return value


def _flag(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"{what} must be true or false, not {type(value).__name__} {value!r:.60}")
    return value


def _whole(value: Any, what: str, low: int, high: int, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    return int(finite(value, what=what, low=low, high=high, integer=True))


def _choice(value: Any, what: str, choices: Sequence[str]) -> str:
    if value not in choices or not isinstance(value, str):
        raise InputError(f"{what} is {value!r:.60}; it must be one of {', '.join(choices)}")
    return value


def _target(value: Any, what: str) -> str:
    """A target's name: lower-case letters, digits and '-' (a platform name, never an address)."""
    if not isinstance(value, str) or not TARGET_NAME.fullmatch(value):
        raise InputError(f"{what} is {value!r:.60}; it must name a target such as local or ray (letters, digits and "
                         "'-', at most 32), never an address")
    return value


def _only(data: dict[str, Any], what: str, allowed: Sequence[str]) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise InputError(f"{what} has unknown field{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; "
                         f"it may have {', '.join(allowed)} (it is written by `flatpack run`)")


def _json_value(value: Any, what: str) -> None:
    """A nested record value (an optimizer's options) made only of JSON scalars, lists and
    objects with finite numbers; the reader already bounded its depth."""
    if isinstance(value, float) and not math.isfinite(value):
        raise InputError(f"{what} holds {value!r}; numbers must be finite")
    if isinstance(value, dict):
        for key, item in value.items():
            _json_value(item, f"{what}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _json_value(item, f"{what}[{index}]")
    elif not (value is None or isinstance(value, (str, int, float, bool))):
        raise InputError(f"{what} holds a {type(value).__name__}, which JSON does not have")


def _train_option_checks() -> dict[str, Callable[[Any, str], Any]]:
    def optimizer(value: Any, what: str) -> Any:
        if isinstance(value, str):
            return _text(value, what, limit=64)
        _json_value(expect_mapping(value, what=what), what)
        return value

    return {
        "optimizer": optimizer,
        "schedule": lambda value, what: _text(value, what, limit=64),
        "vertical_sync": _flag,
        "sync": lambda value, what: _text(value, what, limit=64, optional=True),
        "threads": lambda value, what: _whole(value, what, 1, MAX_THREADS),
        "checkpoint_every": lambda value, what: _whole(value, what, 1, MAX_ITERATIONS),
        "non_finite": lambda value, what: _choice(value, what, ("warn", "error", "ignore")),
        "precision": lambda value, what: _choice(value, what, ("fp32", "bf16", "fp16")),
        "micro_batches": lambda value, what: _whole(value, what, 1, MAX_MICRO_BATCHES, optional=True),
    }


TRAIN_OPTION_CHECKS = _train_option_checks()


def check_train_options(value: Any, where: str) -> dict[str, Any] | None:
    """``train_options`` of a record: only the settings that decide the arithmetic, each typed
    and bounded. A test-only knob (:data:`TEST_ONLY_TRAIN_OPTIONS`: injected faults, time
    limits) is dropped with a warning, since a file must never drive it; anything else
    unknown is refused."""
    if value is None:
        return None
    what = f"{where}: train_options"
    options = dict(expect_mapping(value, what=what))
    dropped = sorted(set(options) & TEST_ONLY_TRAIN_OPTIONS)
    if dropped:
        LOG.warning(f"{where}: ignoring train_options {', '.join(dropped)}: test-only settings are never read from a "
                    "run record (only in-process callers set them)")
        for name in dropped:
            del options[name]
    _only(options, what, tuple(TRAIN_OPTION_CHECKS))
    return {name: TRAIN_OPTION_CHECKS[name](option, f"{what}.{name}") for name, option in options.items()}


def check_fingerprint(value: Any, what: str) -> dict[str, Any] | None:
    """A data fingerprint (:func:`file_fingerprint`, ``DataSource.fingerprint``): plain
    strings and whole numbers, and ``files``: name -> {size, sha256 | etag}."""
    if value is None:
        return None
    fingerprint = expect_mapping(value, what=what)
    for key, item in fingerprint.items():
        if key == "files":
            files = expect_mapping(item, what=f"{what}.files")
            if len(files) > MAX_FILES:
                raise InputError(f"{what}.files lists {len(files):,} files; at most {MAX_FILES:,} are allowed")
            for name, entry in files.items():
                entry = expect_mapping(entry, what=f"{what}.files[{name!r:.80}]")
                _only(entry, f"{what}.files[{name!r:.80}]", ("size", "sha256", "etag"))
                _text(name, f"{what}.files key")
                _whole(entry.get("size"), f"{what}.files[{name!r:.80}].size", 0, 1 << 60)
                for digest in ("sha256", "etag"):
                    _text(entry.get(digest), f"{what}.files[{name!r:.80}].{digest}", limit=256, optional=True)
        elif isinstance(item, bool) or (not isinstance(item, (str, int)) and item is not None):
            raise InputError(f"{what}.{key} must be a string or a whole number, not {type(item).__name__}")
        elif isinstance(item, str):
            _text(item, f"{what}.{key}")
        elif isinstance(item, int):
            _whole(item, f"{what}.{key}", 0, 1 << 62)
    return fingerprint


def check_data(value: Any, where: str) -> dict[str, Any] | None:
    """``data`` of a record (``job._data_record``): the source and how it was batched."""
    if value is None:
        return None
    what = f"{where}: data"
    data = expect_mapping(value, what=what)
    _only(data, what, ("source", "batch", "epochs", "iterations", "shuffle", "seed", "drop_last", "layout"))
    for name in ("source", "batch", "epochs", "shuffle", "seed", "drop_last"):
        if name not in data:
            raise InputError(f"{what} has no {name}; it is written by `flatpack run`")
    _check_source(expect_mapping(data["source"], what=f"{what}.source"), f"{what}.source")
    _whole(data["batch"], f"{what}.batch", 1, MAX_BATCH)
    _whole(data["epochs"], f"{what}.epochs", 1, MAX_EPOCHS)
    _whole(data.get("iterations"), f"{what}.iterations", 1, MAX_ITERATIONS, optional=True)
    _whole(data["seed"], f"{what}.seed", -MAX_SEED, MAX_SEED)
    _flag(data["shuffle"], f"{what}.shuffle")
    _flag(data["drop_last"], f"{what}.drop_last")
    layout = data.get("layout")
    if layout is not None:
        layout = expect_mapping(layout, what=f"{what}.layout")
        _only(layout, f"{what}.layout", ("keyword", "inputs", "target"))
        _flag(layout.get("keyword"), f"{what}.layout.keyword")
        inputs = layout.get("inputs")
        if not isinstance(inputs, list) or len(inputs) > MAX_INPUTS:
            raise InputError(f"{what}.layout.inputs must be a list of at most {MAX_INPUTS:,} input names")
        for index, name in enumerate(inputs):
            _text(name, f"{what}.layout.inputs[{index}]", limit=256)
        _text(layout.get("target"), f"{what}.layout.target", limit=256, optional=True)
    return data


def _check_synthetic(source: dict[str, Any], what: str) -> None:
    """A synthetic source's record: bounded JSON here; each leaf's shape and dtype are
    checked where the batches are drawn (``data.SyntheticSource``)."""
    _only(source, what, ("kind", "inputs", "names", "target", "seed"))
    inputs, names = source.get("inputs"), source.get("names")
    if not isinstance(inputs, list) or len(inputs) > MAX_INPUTS:
        raise InputError(f"{what}.inputs must be a list of at most {MAX_INPUTS:,} input leaves")
    for index, leaf in enumerate(inputs):
        _json_value(expect_mapping(leaf, what=f"{what}.inputs[{index}]"), f"{what}.inputs[{index}]")
    if names is not None:
        if not isinstance(names, list) or len(names) > MAX_INPUTS:
            raise InputError(f"{what}.names must be a list of at most {MAX_INPUTS:,} input names")
        for index, name in enumerate(names):
            _text(name, f"{what}.names[{index}]", limit=256)
    if source.get("target") is not None:
        _json_value(expect_mapping(source["target"], what=f"{what}.target"), f"{what}.target")
    _whole(source.get("seed"), f"{what}.seed", -MAX_SEED, MAX_SEED)


def _check_source(source: dict[str, Any], what: str) -> None:
    """A source read again by name (a directory, an s3:// prefix or a dataset factory) or
    drawn again (synthetic)."""
    kind = _choice(source.get("kind"), f"{what}.kind", ("directory", "s3", "factory", "synthetic"))
    if kind == "synthetic":
        _check_synthetic(source, what)
        return
    _only(source, what, ("kind", "path", "url", "endpoint", "spec", "shards", "side"))
    needed = {"directory": "path", "s3": "url", "factory": "spec"}[kind]
    _text(source.get(needed), f"{what}.{needed}")
    _text(source.get("endpoint"), f"{what}.endpoint", optional=True)
    _text(source.get("side"), f"{what}.side", limit=64, optional=True)
    if "shards" in source:
        shards = source["shards"]
        if not isinstance(shards, list) or len(shards) > MAX_FILES:
            raise InputError(f"{what}.shards must be a list of at most {MAX_FILES:,} shard names")
        for index, name in enumerate(shards):
            _text(name, f"{what}.shards[{index}]")


@dataclass
class RunRecord:
    """``run.json``: enough to resume a run without the user's model code. It is data, never
    instructions (docs/security.md): every field is typed and bounded when read
    (:meth:`loads`), names no code and no path outside the run directory, and drives no
    test-only knob."""

    run: str                      # the run id: the prefix of every store key of the run
    loss: str
    iterations: int
    state: str = "running"        # "running" until the last iteration is checkpointed, then "done"
    # a --data run: its source and batching (flatpack.data.batches_from_record), read again on
    # resume instead of a copy in batches.safetensors; None: the batches are in the directory
    data: dict | None = None
    # the train() settings (optimizer, schedule, sync, checkpoints), for a resume of a run
    # that stopped before its first call was recorded in the store
    train_options: dict | None = None
    version: int = RUN_VERSION
    # the directory of the stage artifacts of the plan the run trains (a `--replan` switch
    # names the new plan's, ``compiled-<run>``), relative to the run directory
    compiled: str = "compiled"
    # what the run trained on, taken at its start (DataSource.fingerprint, or the batches
    # file's file_fingerprint): resume refuses changed data. None: a record from before
    # fingerprints, whose data cannot be checked
    fingerprint: dict | None = field(default=None)
    # where its functions ran (``flatpack run --target``): resume runs them there again unless
    # told otherwise. A cluster's address is not recorded: resume never connects to a machine
    # that run.json names (it is data); it takes --address, else Ray's "auto"
    target: str = "local"

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def loads(cls, text: str | bytes, where: Path) -> RunRecord:
        """The record in ``text``, every field typed and range-checked: an InputError names
        ``where`` and the field, never a TypeError from deep inside a resume."""
        return cls.from_json(parse_json(text, what=str(where)), where)

    @classmethod
    def from_json(cls, value: Any, where: Path) -> RunRecord:
        data = expect_mapping(value, what=str(where))
        if data.get("version") != RUN_VERSION or isinstance(data.get("version"), bool):
            raise InputError(f"{where} has run-record version {data.get('version')!r:.40}; this flatpack reads "
                             f"version {RUN_VERSION}. Resume it with the flatpack version that started it")
        _only(data, str(where), ("run", "loss", "iterations", "state", "data", "train_options", "version",
                                 "compiled", "fingerprint", "target"))
        for name in ("run", "loss", "iterations"):
            if name not in data:
                raise InputError(f"{where} has no {name}; it is written by `flatpack run`")
        run = _text(data["run"], f"{where}: run", limit=128)
        if not RUN_ID.fullmatch(run):
            raise InputError(f"{where}: run {run!r} is not a run id (letters, digits, '.', '_' and '-', at most 128)")
        compiled = _text(data.get("compiled", "compiled"), f"{where}: compiled", limit=128)
        if not COMPILED_NAME.fullmatch(compiled):
            raise InputError(f"{where}: compiled {compiled!r} must name a directory inside the run directory (one "
                             "plain name such as 'compiled'; no '/', '..' or absolute path)")
        return cls(run=run, loss=_text(data["loss"], f"{where}: loss", limit=64),
                   iterations=_whole(data["iterations"], f"{where}: iterations", 1, MAX_ITERATIONS),
                   state=_choice(data.get("state", "running"), f"{where}: state", RUN_STATES),
                   data=check_data(data.get("data"), str(where)),
                   train_options=check_train_options(data.get("train_options"), str(where)),
                   compiled=compiled,
                   fingerprint=check_fingerprint(data.get("fingerprint"), f"{where}: fingerprint"),
                   target=_target(data.get("target", "local"), f"{where}: target"))


def file_fingerprint(path: Path, *, what: str) -> dict[str, Any]:
    """``path``'s size and sha256, read in chunks (a regular file, no link followed)."""
    fd = open_regular(path, what=what)
    digest = hashlib.sha256()
    size = 0
    try:
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return {"size": size, "sha256": digest.hexdigest()}


def fingerprint_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two data fingerprints, one line each: a shard added, removed, or
    changed in size or hash, or another property (the factory's file hash, the length)."""
    changes: list[str] = []
    for key in sorted(set(recorded) | set(current)):
        if key == "files":
            continue
        if recorded.get(key) != current.get(key):
            changes.append(f"{key} was {recorded.get(key)!r:.200} and is now {current.get(key)!r:.200}")
    old, new = recorded.get("files") or {}, current.get("files") or {}
    for name in sorted(set(old) - set(new)):
        changes.append(f"{name!r:.200} was removed")
    for name in sorted(set(new) - set(old)):
        changes.append(f"{name!r:.200} was added")
    for name in sorted(set(old) & set(new)):
        before, after = old[name], new[name]
        if before.get("size") != after.get("size"):
            changes.append(f"{name!r:.200} changed size ({before.get('size')} bytes, now {after.get('size')})")
        elif any(before.get(digest) != after.get(digest) for digest in ("sha256", "etag")):
            digest = "sha256" if before.get("sha256") != after.get("sha256") else "etag"
            changes.append(f"{name!r:.200} changed content ({digest} {str(before.get(digest))[:16]}…, now "
                           f"{str(after.get(digest))[:16]}…)")
    return changes


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @property
    def record_path(self) -> Path:
        return self.root / RUN_FILE

    @property
    def compiled(self) -> Path:
        return self.root / "compiled"

    @property
    def store(self) -> Path:
        return self.root / "store"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def batches_path(self) -> Path:
        return self.root / BATCHES_FILE

    @property
    def trained_path(self) -> Path:
        return self.root / TRAINED_FILE

    def create(self) -> None:
        """The run directory, made 0700 when this call creates it (a directory the user made
        keeps its mode; the files flatpack writes in it are 0600 either way)."""
        if not self.root.exists():
            self.root.mkdir(parents=True, mode=PRIVATE_DIR_MODE)
            os.chmod(self.root, PRIVATE_DIR_MODE)    # mkdir's mode is less the umask; 0700 is the point

    def read(self) -> RunRecord:
        if not self.record_path.is_file():
            raise InputError(f"{self.root} has no {RUN_FILE}: it is not a run directory written by `flatpack run` "
                             "(give the --out directory of the run to resume)")
        return RunRecord.from_json(load_json(self.record_path, limit=RUN_FILE_LIMIT, what=str(self.record_path)),
                                   self.record_path)

    def write(self, record: RunRecord) -> None:
        """Replaces ``run.json`` atomically (a crash never leaves half a record), 0600."""
        self.create()
        write_atomic(self.record_path, record.dumps(), mode=PRIVATE_FILE_MODE)

    def compiled_path(self, record: RunRecord) -> Path:
        """The artifact directory ``record`` names, which must lie inside the run directory:
        a name checked by :meth:`RunRecord.from_json` and no symbolic link (one could point
        anywhere, and the artifact would load with no warning)."""
        path = self.root / record.compiled
        where = f"{self.record_path}: compiled {record.compiled!r}"
        if path.is_symlink():
            raise InputError(f"{where} is a symbolic link; the run's artifact must be a directory inside the run "
                             "directory (replace the link with the directory)")
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise InputError(f"{where} resolves outside the run directory {self.root}; the run's artifact must be "
                             "inside it")
        if not path.is_dir() or not stat.S_ISDIR(path.lstat().st_mode):
            raise InputError(f"{where} is not a directory in {self.root}; the run's artifact is missing")
        return path

    def save_batches(self, batches: Sequence[tuple[Any, Any]]) -> dict[str, Any]:
        """Writes the batches (0600) and returns their fingerprint, for run.json."""
        self.create()
        save_file(pack_batches(batches), str(self.batches_path))
        os.chmod(self.batches_path, PRIVATE_FILE_MODE)
        return self.batches_fingerprint()

    def batches_fingerprint(self) -> dict[str, Any]:
        return {"kind": "batches", "files": {BATCHES_FILE: file_fingerprint(self.batches_path,
                                                                            what="the run's batches")}}

    def load_batches(self) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor | None]]:
        if not self.batches_path.is_file():
            raise InputError(f"{self.batches_path} is missing: the run's batches are needed to resume it on the same "
                             "data")
        try:
            tensors = load_file(str(self.batches_path))
        except Exception as err:  # noqa: BLE001 - a corrupt or foreign file: name it and the cause
            raise InputError(f"{self.batches_path} is not a batches file flatpack wrote ({type(err).__name__}: "
                             f"{err}); the run cannot be resumed on its data") from None
        if any(key.count("/") != 1 for key in tensors):
            raise InputError(f"{self.batches_path} holds entries that are not batches (b<i>/<part>); the run cannot "
                             "be resumed on its data")
        return unpack_batches(tensors)

    def remove_store(self) -> None:
        shutil.rmtree(self.store, ignore_errors=True)


def pack_batches(batches: Sequence[tuple[Any, Any]]) -> dict[str, torch.Tensor]:
    """Global ``(inputs, target)`` batches as safetensors entries ``b<i>/x<k>`` and ``b<i>/y``."""
    tensors: dict[str, torch.Tensor] = {}
    for index, (inputs, target) in enumerate(batches):
        # keyword inputs by name (k:<name>), positional ones by position (x<k>)
        named = ({f"k:{name}": leaf for name, leaf in inputs.items()} if isinstance(inputs, dict) else
                 {f"x{position:03d}": leaf for position, leaf in
                  enumerate(inputs if isinstance(inputs, (tuple, list)) else (inputs,))})
        for part, leaf in named.items():
            if not isinstance(leaf, torch.Tensor):
                raise InputError(f"batch {index}'s input {part} is a {type(leaf).__name__}; a run directory keeps "
                                 "tensor inputs only")
            tensors[f"b{index:06d}/{part}"] = leaf.contiguous()
        if target is not None:
            tensors[f"b{index:06d}/y"] = target.contiguous()
    return tensors


def unpack_batches(tensors: dict[str, torch.Tensor]) -> list[tuple[Any, torch.Tensor | None]]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        batch, part = key.split("/", 1)
        grouped.setdefault(batch, {})[part] = tensor
    batches = []
    for batch in sorted(grouped):
        parts = grouped[batch]
        keywords = {name[2:]: tensor for name, tensor in parts.items() if name.startswith("k:")}
        inputs = keywords or tuple(parts[name] for name in sorted(name for name in parts if name.startswith("x")))
        batches.append((inputs, parts.get("y")))
    return batches
