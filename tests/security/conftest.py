"""Fixtures for the security battery: a small compiled artifact saved fresh for each test,
a sentinel path that hostile payloads would create if any of their code ran, and the
shared local S3 server of the integration tests (for the worker tests)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import flatpack
from flatpack.stage.integrity import INDEX_FILE, Index
from tests.integration.conftest import s3_server  # noqa: F401 - the shared SeaweedFS fixture

BATCH = 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(scope="session")
def compiled() -> flatpack.Compiled:
    return flatpack.compile(make_model(), (torch.randn(BATCH, 8),), stages=2)


@pytest.fixture
def out(compiled: flatpack.Compiled, tmp_path: Path) -> Path:
    """A freshly saved artifact directory."""
    return compiled.save(tmp_path / "out")


@pytest.fixture
def sentinel(tmp_path: Path) -> Path:
    """A file that only a hostile payload creates; every test asserts it never appears."""
    return tmp_path / "pwned"


def rewrite_index(root: Path) -> str:
    """What an attacker who can write the whole directory does after changing files: a new,
    self-consistent index. Returns its digest (not the one the user pinned)."""
    files = {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*"))
             if path.is_file() and not path.is_symlink() and path.name != INDEX_FILE}
    files.pop("flatpack.index.sig", None)
    index = Index.build(files)
    (root / INDEX_FILE).write_bytes(index.raw)
    return index.digest


def hostile_stage_source(source: str, sentinel: Path) -> str:
    """Stage code that creates the sentinel as soon as it is executed."""
    return f"open({str(sentinel)!r}, 'w').close()\n" + source


def rewrite_weights(out: Path, data: bytes) -> Path:
    """Stage 1's weights replaced, its manifest and the index made consistent: only the
    framing checks stand between the bytes and the safetensors parser."""
    weights = out / "stage_001" / "weights.safetensors"
    weights.write_bytes(data)
    manifest_path = out / "stage_001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["weights.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    rewrite_index(out)
    return weights
