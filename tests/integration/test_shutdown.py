"""Stopping ``flatpack run`` mid-training leaves nothing behind (issue 16, finding 7).

Each test starts ``python -m flatpack run`` with TMPDIR pointed at a fresh empty directory,
waits until its functions are running, notes every process it started (its descendants, from
/proc), signals it, and then checks: it exits (a run that hangs fails the test after 60 s;
how long a stop takes is a benchmark's figure, not a test's, on a shared host), none of those
processes is alive, and the temp directory is still empty. Linux only (/proc, and
PR_SET_PDEATHSIG for the SIGKILL case).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proctree import cmdline, descendants, kill_all, wait_gone

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")]

STARTUP_TIMEOUT_S = 300.0     # compile + profile + deploy on two busy cores
EXIT_TIMEOUT_S = 60.0         # a stop that hangs; the seconds a stop takes are reported, not asserted


# ---- a run to stop ------------------------------------------------------------------------------

class Run:
    def __init__(self, tmp_path: Path) -> None:
        self.temp = tmp_path / "tmp"
        self.temp.mkdir()
        self.out = tmp_path / "out"
        self.log_path = tmp_path / "run.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - open for the run's life, closed in close()
        # torch keeps its compile cache in $TMPDIR/torchinductor_$USER unless told otherwise: a
        # cache that outlives every run by design, not an entry a run leaves behind
        env = {**os.environ, "TMPDIR": str(self.temp), "PYTHONUNBUFFERED": "1",
               "TORCHINDUCTOR_CACHE_DIR": str(self.temp.parent / "torchinductor")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flatpack", "run", "vgg16", "--batch", "16", "--micro-batches", "2",
             "--iterations", "30", "--no-verify", "--out", str(self.out)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.started: dict[int, int] = {}

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_training(self) -> dict[int, int]:
        """Waits until the functions run; returns every process the run started."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"the run ended before training:\n{self.output()[-3000:]}"
            tree = descendants(self.process.pid)
            commands = [cmdline(pid) for pid in tree]
            workers = [c for c in commands if "flatpack.runtime.worker" in c]
            if workers and any("weed" in c for c in commands):
                time.sleep(1.0)      # into the iterations
                self.started = descendants(self.process.pid)
                assert self.started, "the run's processes vanished"
                return self.started
            time.sleep(0.2)
        pytest.fail(f"no function started within {STARTUP_TIMEOUT_S:.0f} s:\n{self.output()[-3000:]}")

    def wait_exit(self, timeout_s: float) -> float:
        """Seconds until the run process exited (fails past ``timeout_s``)."""
        started = time.monotonic()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not exit within {timeout_s:.0f} s of the signal:\n{self.output()[-3000:]}")
        return time.monotonic() - started

    def wait_children_gone(self, timeout_s: float = 15.0) -> dict[int, str]:
        return wait_gone(self.started, timeout_s)

    def close(self) -> None:
        """Whatever the test found, leave nothing running."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        kill_all(self.started)
        self.log.close()


@pytest.fixture
def run(tmp_path: Path):
    started = Run(tmp_path)
    try:
        yield started
    finally:
        started.close()


def _temp_entries(run: Run) -> list[str]:
    return sorted(str(path.relative_to(run.temp)) for path in run.temp.rglob("*"))


# ---- the tests ------------------------------------------------------------------------------------

def test_sigterm_stops_every_process_and_leaves_no_temp_entry(run):
    run.wait_for_training()
    run.process.send_signal(signal.SIGTERM)
    run.wait_exit(timeout_s=EXIT_TIMEOUT_S)
    output = run.output()
    assert run.process.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert run.wait_children_gone(timeout_s=1.0) == {}
    assert _temp_entries(run) == []
    assert "stopped by SIGTERM" in output and "Traceback" not in output, output[-3000:]
    # the store data and logs of the run live under --out, not in the temp directory
    assert (run.out / "logs").is_dir()


def test_a_second_ctrl_c_during_the_shutdown_still_leaves_nothing_running(run):
    run.wait_for_training()
    first = time.monotonic()
    # more Ctrl-C while it stops: some land in the teardown, some during the interpreter's exit
    for pause in (0.0, 0.02, 0.05, 0.1, 0.2, 0.4):
        time.sleep(pause)
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGINT)
    run.wait_exit(timeout_s=EXIT_TIMEOUT_S - (time.monotonic() - first))
    output = run.output()
    assert run.process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert run.wait_children_gone(timeout_s=1.0) == {}
    assert _temp_entries(run) == []
    assert "stopped by SIGINT" in output and "Traceback" not in output, output[-3000:]


def test_sigkill_of_the_runner_takes_its_functions_and_server_with_it(run):
    started = run.wait_for_training()
    assert any("weed" in cmdline(pid) for pid in started)
    run.process.send_signal(signal.SIGKILL)
    run.wait_exit(timeout_s=30)
    assert run.wait_children_gone(timeout_s=15.0) == {}
    # no handler ran: what survives is the run directory, never a temp entry
    assert _temp_entries(run) == []


# ---- where a deployment's files live ------------------------------------------------------------

@pytest.fixture
def fresh_tmpdir(tmp_path, monkeypatch):
    import tempfile

    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    # torch's compile cache outlives every run by design (as in Run above): where this test is the
    # first in its process to start a deployment's processes, one of them creates it under TMPDIR
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor"))
    monkeypatch.setattr(tempfile, "tempdir", None)      # re-read TMPDIR
    yield temp


def test_a_deployment_keeps_a_given_data_dir_and_removes_its_temporary_one(tmp_path, fresh_tmpdir):
    import torch

    import flatpack
    from flatpack.backends import local
    from tests.models import MLP

    compiled = flatpack.compile(MLP(), (torch.randn(4, 8),), stages=2)
    store_dir = tmp_path / "run" / "store"
    deployment = local.deploy(compiled, data_dir=store_dir, workdir=tmp_path / "run" / "logs")
    key = deployment.keys.artifact(0, "manifest.json")
    assert deployment.store.exists(key)
    assert list(fresh_tmpdir.iterdir()) == []
    deployment.teardown()                         # kept: a resumed run reads it
    assert (store_dir / "data").is_dir() and not (store_dir / "s3.json").exists()

    from flatpack.runtime.s3server import LocalS3Server

    with LocalS3Server(data_dir=store_dir) as server, server.store() as store:
        assert store.exists(key)                  # a new server, new ports and keys, same objects
    local.deploy(compiled, data_dir=store_dir).teardown(clean=True)
    assert not store_dir.exists()

    deployment = local.deploy(compiled)           # nobody gave a directory: a temporary one
    assert deployment.server.directory.parent == fresh_tmpdir and deployment.workdir.is_relative_to(fresh_tmpdir)
    deployment.teardown()
    assert list(fresh_tmpdir.iterdir()) == []
