"""What the local backend uploads for a compiled model: the whole artifact and its index, by
store key below the run prefix (``local.package``; ``flatpack run --replan`` uploads a new
plan's the same way)."""

from __future__ import annotations

from flatpack.compiler import Compiled
from flatpack.stage.integrity import INDEX_FILE


def package(compiled: Compiled) -> dict[str, bytes]:
    """The deployment's files, by store key below the run prefix: the whole artifact and its
    index (``artifacts/flatpack.index.json``), which workers check against the digest in
    their invocation."""
    files = {f"artifacts/{name}": data for name, data in compiled.files().items()}
    files[f"artifacts/{INDEX_FILE}"] = compiled.index.raw
    return files
