"""Files written whole or not at all: the one way flatpack replaces a record, a cache entry or
a rank's report that another process may read (or write) at the same moment."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomic(path: str | os.PathLike, data: bytes | str, *, prefix: str | None = None,
                 mode: int = 0o666) -> Path:
    """Writes ``data`` (str: UTF-8) to ``path`` so that a reader sees the old file or the
    whole new one, never part of one, and returns ``path``. The bytes go to a temporary file
    of this writer's own in ``path``'s directory (named ``prefix`` + a random part; default
    ``.<name>.``) that then replaces ``path``: a rename within one directory is atomic. Two
    writers of one path at once both succeed and the last replace wins (with one shared
    temporary name, one writer's replace moved the other's half-written file away). If the
    write fails the temporary is removed and ``path`` is untouched. The directory must exist.
    ``mode``: the new file's permissions less the umask (default: what ``open()`` gives).

    Not fsynced: the threat is a process killed mid-write (kill-and-resume), which a rename
    survives; a power cut may still lose the latest version."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    if prefix is None:
        prefix = f".{path.name}."
    temporary = path.with_name(f"{prefix}{secrets.token_hex(6)}.tmp")
    # O_EXCL: a name no other writer holds; by default 0o666 less the umask, as open(path, "w")
    # would give (tempfile.mkstemp's 0o600 would make a shared calibration or run record private)
    handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(payload)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return path
