"""Every format flatpack reads from someone else, mutated structurally by Hypothesis and fed
to its public reader: the reader returns, or raises a flatpack error naming the file; never
another exception type, never a hang (5 s per case), never a memory blow-up (1 GiB of peak
RSS per case). The mutators and readers are in ``tests/security/fuzz_formats.py``, shared
with ``benchmarks/fuzz.py``, which runs them by the tens of thousands (docs/security.md, "One
bounded reader"). Under the ``ci`` profile the examples are derandomized: the same ~360
cases every run.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flatpack
from tests.security.fuzz_formats import Format, Workspace, deep, formats, guarded

EXAMPLES_PER_FORMAT = 30
SECONDS_PER_CASE = 5
RSS_PER_CASE = 1 << 30
NAMES = ("index", "flatpack.json", "manifest.json", "weights.safetensors", "index.sig", "run.json", "plan",
         "calibration", "config.toml", "shard.safetensors", "shard.pt", "shard.npz")


@pytest.fixture(scope="module")
def workspace(compiled: flatpack.Compiled, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Format]:
    space = Workspace(tmp_path_factory.mktemp("fuzz"), compiled)
    found = {fmt.name: fmt for fmt in formats(space)}
    assert tuple(found) == NAMES, "a format was added or renamed: list it in NAMES"
    return found


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=EXAMPLES_PER_FORMAT)
@given(rng=st.randoms(use_true_random=False))
def test_a_mutant_is_read_or_refused_with_a_flatpack_error(workspace, name, rng: random.Random):
    fmt = workspace[name]
    data = fmt.case(rng)
    result = guarded(fmt, data, seconds=SECONDS_PER_CASE)
    assert result.kind in ("accepted", "refused"), \
        f"{name}: {result.kind}: {result.message} (mutant's first bytes: {data[:120]!r})"
    assert result.seconds < SECONDS_PER_CASE
    assert result.rss_growth < RSS_PER_CASE, f"{name}: the case grew peak RSS by {result.rss_growth:,} bytes"


def test_the_seeds_are_accepted(workspace):
    """The mutants start from files each reader accepts: a refusal means the mutation did it."""
    for name, fmt in workspace.items():
        result = guarded(fmt, fmt.seed)
        assert result.kind == "accepted", f"{name}: {result.message}"


# -- the same readers as the command line reaches them: exit 2, no traceback -------------------

def _flatpack(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run([sys.executable, "-m", "flatpack", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.mark.slow
def test_check_of_a_deep_index_exits_2_without_a_traceback(out):
    index = out / "flatpack.index.json"
    index.write_text(deep(200_000, random.Random(0)))
    done = _flatpack("check", str(out))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "flatpack.index.json" in done.stderr


@pytest.mark.slow
def test_a_deep_toml_config_exits_2_naming_the_file(tmp_path):
    config = tmp_path / "deep.toml"
    config.write_text("batch = " + "[" * 100_000 + "1" + "]" * 100_000 + "\n")
    done = _flatpack("plan", "--config", str(config))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and str(config) in done.stderr
