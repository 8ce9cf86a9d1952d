"""One bounded reader for every file flatpack reads that someone else may have written: an
artifact's index, ``flatpack.json``, manifests, safetensors headers, ``run.json``, plans,
calibrations, TOML configs and data shards.

Each read refuses, with a flatpack error naming the file, what would otherwise hang, blow up
memory or surface as a traceback from deep inside: a FIFO or device (``open`` would block or
read forever), a directory, a symlink (``O_NOFOLLOW``), a file larger than its format's limit
(checked with ``fstat`` before a byte is read, so a 6 GiB sparse file costs nothing), JSON
nested deeper than any flatpack format writes (json's parser would raise RecursionError, and
the code walking the result would recurse as deep), duplicate keys, and the non-standard
constants ``NaN``/``Infinity`` that Python's json accepts. ``finite`` checks a number read
from such a file. The fuzzer in ``tests/security/test_fuzz_formats.py`` (and
``benchmarks/fuzz.py``, at scale) holds every format to this.
"""

from __future__ import annotations

import json
import math
import os
import stat
from typing import Any

from flatpack.errors import FlatpackError, InputError

# Deeper than any JSON flatpack writes (a nested output structure is the deepest, a few levels
# per container) and far below the interpreter's recursion limit.
MAX_JSON_DEPTH = 64
MiB = 1 << 20


def _fail(error: type[FlatpackError], message: str) -> FlatpackError:
    return error(message)


def open_regular(path: str | os.PathLike, *, what: str, error: type[FlatpackError] = InputError,
                 dir_fd: int | None = None) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a symlink.

    ``O_NONBLOCK`` makes opening a FIFO return at once instead of waiting for a writer (and a
    device never gets read): the descriptor's type is checked with ``fstat`` and anything but a
    regular file refused. ``dir_fd`` opens ``path`` relative to an open directory (see
    :func:`open_beneath`), so no component of the path is looked up by name again."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        raise _fail(error, f"{what}: {path} does not exist") from None
    except IsADirectoryError:
        raise _fail(error, f"{what}: {path} is a directory, not a file") from None
    except OSError as exc:
        if exc.errno == getattr(os, "ELOOP", 40):
            raise _fail(error, f"{what}: {path} is a symbolic link; flatpack follows none "
                               "(replace it with the file itself)") from None
        raise _fail(error, f"{what}: cannot open {path}: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a FIFO, socket or device)"
        raise _fail(error, f"{what}: {path} is {kind}; only regular files are read")
    os.set_blocking(fd, True)
    return fd


def read_bounded(path: str | os.PathLike, *, limit: int, what: str, error: type[FlatpackError] = InputError,
                 dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, refused before reading when ``fstat`` says it is
    larger than ``limit`` bytes; a file that grows while it is read is refused too."""
    fd = open_regular(path, what=what, error=error, dir_fd=dir_fd)
    try:
        return read_fd(fd, limit=limit, what=what, path=path, error=error)
    finally:
        os.close(fd)


def read_fd(fd: int, *, limit: int, what: str, path: str | os.PathLike,
            error: type[FlatpackError] = InputError) -> bytes:
    """The bytes of the open regular file ``fd`` (from :func:`open_regular` or
    :func:`open_beneath`), refused before reading when ``fstat`` says it has more than
    ``limit`` bytes, and refused if it grows past ``limit`` while it is read."""
    size = os.fstat(fd).st_size
    if size > limit:
        raise _fail(error, f"{what}: {path} has {size:,} bytes, more than the {limit:,} this file may have")
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, min(limit + 1 - total, MiB))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise _fail(error, f"{what}: {path} grew past the {limit:,} bytes this file may have while it was read")
    return b"".join(chunks)


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (strings skipped), found
    without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_json(data: bytes | str, *, what: str, error: type[FlatpackError] = InputError,
               max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` parsed as strict JSON: UTF-8, at most ``max_depth`` levels deep, no duplicate
    keys, no ``NaN``/``Infinity`` and no number that overflows a float (``1e999``); anything
    else is ``error`` naming ``what``."""
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as exc:
        raise _fail(error, f"{what} is not UTF-8 text (byte {exc.start}): {exc.reason}") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise _fail(error, f"{what} nests {depth} levels deep; flatpack reads at most {max_depth}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ValueError(f"the key {key!r} appears twice")
            result[key] = value
        return result

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    def finite_float(literal: str) -> float:
        # 1e999 is valid JSON that Python's float() turns into inf, which NaN checks downstream miss
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"the number {literal[:40]} is too large for a float")
        return value

    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constant,
                          parse_float=finite_float)
    except (ValueError, RecursionError) as exc:
        raise _fail(error, f"{what} is not valid JSON: {exc}") from None


def load_json(path: str | os.PathLike, *, limit: int, what: str, error: type[FlatpackError] = InputError,
              max_depth: int = MAX_JSON_DEPTH, dir_fd: int | None = None) -> Any:
    """:func:`read_bounded` then :func:`parse_json`, naming ``what`` (the file) in every error."""
    raw = read_bounded(path, limit=limit, what=what, error=error, dir_fd=dir_fd)
    return parse_json(raw, what=what, error=error, max_depth=max_depth)


def expect_mapping(value: Any, *, what: str, error: type[FlatpackError] = InputError) -> dict[str, Any]:
    """``value`` when it is a JSON object, else ``error`` naming ``what``."""
    if not isinstance(value, dict):
        raise _fail(error, f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def finite(value: Any, *, what: str, low: float | None = None, high: float | None = None, integer: bool = False,
           error: type[FlatpackError] = InputError) -> float:
    """``value`` as a finite number in ``[low, high]`` (an integer when ``integer``); booleans,
    strings, NaN and infinities are refused naming ``what`` (the file and field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(error, f"{what} must be a number, not {type(value).__name__} {value!r:.60}")
    # an int is finite and whole however large (and float() of a 400-digit one overflows)
    if isinstance(value, float) and not math.isfinite(value):
        raise _fail(error, f"{what} must be finite, not {value!r}")
    if integer and isinstance(value, float) and not value.is_integer():
        raise _fail(error, f"{what} must be a whole number, not {value!r}")
    if low is not None and value < low:
        raise _fail(error, f"{what} is {value!r:.40}, below its least allowed value {low:g}")
    if high is not None and value > high:
        raise _fail(error, f"{what} is {value!r:.40}, above its greatest allowed value {high:g}")
    return value


def open_directory(path: str | os.PathLike, *, what: str, error: type[FlatpackError] = InputError) -> int:
    """A descriptor of the directory ``path`` (the path the user named; links on the way to it
    are theirs to make). Files inside it are then reached with :func:`open_beneath`, so nothing
    below it is looked up by name from the top again. The caller closes the descriptor."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise _fail(error, f"{what}: {path} does not exist") from None
    except NotADirectoryError:
        raise _fail(error, f"{what}: {path} is not a directory") from None
    except OSError as exc:
        raise _fail(error, f"{what}: cannot open {path}: {exc.strerror or exc}") from None


def open_beneath(root_fd: int, relative: str, *, what: str, error: type[FlatpackError] = InputError,
                 directory: bool = False) -> int:
    """A descriptor of ``relative`` below the open directory ``root_fd``, walked one component at
    a time with ``O_NOFOLLOW``: a symlink at any component (a stage directory swapped for a link
    between a scan and an open, not only the file itself) is refused, and so are ``..``, ``.``,
    empty and absolute parts. The last component must be a regular file (a directory when
    ``directory``). The caller closes the descriptor."""
    parts = relative.split("/")
    if relative.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise _fail(error, f"{what}: {relative!r} is not a plain relative path")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.dup(root_fd)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            if last and not directory:
                next_fd = open_regular(part, what=what, error=error, dir_fd=fd)
            else:
                try:
                    next_fd = os.open(part, flags, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (getattr(os, "ELOOP", 40), getattr(os, "ENOTDIR", 20)):
                        raise _fail(error, f"{what}: {part!r} in {relative!r} is a symbolic link or not a "
                                           "directory; flatpack follows no link inside a directory it reads") from None
                    raise _fail(error, f"{what}: cannot open {relative!r} ({part!r}): {exc.strerror or exc}") from None
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_beneath(root_fd: int, relative: str, *, limit: int, what: str,
                 error: type[FlatpackError] = InputError) -> bytes:
    """:func:`read_bounded` of ``relative`` reached by :func:`open_beneath` (no link followed)."""
    fd = open_beneath(root_fd, relative, what=what, error=error)
    try:
        return read_fd(fd, limit=limit, what=what, path=relative, error=error)
    finally:
        os.close(fd)
