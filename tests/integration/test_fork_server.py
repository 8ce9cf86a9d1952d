"""The fork server (``flatpack.runtime.forkserver``, ``flatpack.runtime.forked``): a local
function forked from it trains exactly as a fresh interpreter does, its handle behaves as
``subprocess.Popen`` does where flatpack uses one, nothing it started outlives a SIGKILLed
invoker, and without it (``FLATPACK_FORK_SERVER=0``, no pidfds, a server that fails) the
local backend starts fresh interpreters.

Most tests fork a worker that waits for a spec nobody writes (a file store; the worker polls
for 120 s), or one whose role does not parse (it exits 1 at once). Tests that break a server
give it an environment of its own (an extra ``PYTHON*`` variable), so the test session's
shared server is left alone. Linux only (/proc, pidfds).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from flatpack.backends import local
from flatpack.runtime import forked, forkserver
from flatpack.interrupts import kill_children, track
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV
from tests.integration.test_local_training import batches, compiled_with, make_model

pytestmark = pytest.mark.skipif(forked.unavailable_reason({}) is not None,
                                reason=f"no fork server here: {forked.unavailable_reason({})}")

GONE_WITHIN_S = 15.0


def waiting_env(tmp_path: Path, own_server: bool = False) -> dict[str, str]:
    """A function that waits (polling a file store) for a spec nobody writes; ``own_server``:
    with an environment that gets a fork server of its own."""
    role = Role("run-never/spec/g0000", 0, 0, 0, 1, digest="0" * 64)
    env = {**os.environ, ROLE_ENV: role.dumps(), STORE_ENV: (tmp_path / "store").as_uri(), "PYTHONUNBUFFERED": "1"}
    if own_server:
        env["PYTHONFLATPACKTEST"] = uuid.uuid4().hex   # a PYTHON* variable: read at start-up, so a server of its own
    return env


def failing_env() -> dict[str, str]:
    """A function whose role does not parse: the worker exits 1 at once."""
    return {**os.environ, ROLE_ENV: "{not a role", STORE_ENV: "file:///nonexistent", "PYTHONUNBUFFERED": "1"}


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _wait_gone(pids: list[int]) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (alive := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


# ---- training -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_forked_function_trains_bit_identically_to_a_fresh_interpreter(s3_server, monkeypatch):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [2, 1], 4)
    data = batches(3)
    started: list[type] = []
    invoke = local.invoke

    def recording(deployment, role):
        process = invoke(deployment, role)
        started.append(type(process))
        return process

    monkeypatch.setattr(local, "invoke", recording)
    results = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(forked.FORK_SERVER_ENV, mode)
        with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
            results[mode] = deployment.train(data, iterations=3, optimizer={"name": "adam", "lr": 0.01})
        kinds = set(started)
        started.clear()
        assert kinds == ({forked.ForkedProcess} if mode == "1" else {subprocess.Popen}), (mode, kinds)
    forked_run, fresh_run = results["1"], results["0"]
    assert forked_run.losses == fresh_run.losses
    assert forked_run.parameters.keys() == fresh_run.parameters.keys()
    for name, value in fresh_run.parameters.items():
        assert torch.equal(forked_run.parameters[name], value), name


# ---- the handle -------------------------------------------------------------------------------

def test_a_forked_function_has_its_own_session_log_directory_and_title(tmp_path):
    env = waiting_env(tmp_path)
    log = tmp_path / "function.log"
    process = forked.spawn(env, log, cwd=str(tmp_path))
    assert isinstance(process, forked.ForkedProcess)
    try:
        deadline = time.monotonic() + 60
        while b"flatpack.runtime.worker" not in Path(f"/proc/{process.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the function never took the worker's title"
            time.sleep(0.05)
        fields = _stat(process.pid)
        assert fields is not None
        assert int(fields[3]) == process.pid        # its own session (and process group), as setsid makes it
        assert os.readlink(f"/proc/{process.pid}/fd/1") == str(log)
        assert os.readlink(f"/proc/{process.pid}/fd/2") == str(log)
        assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
        assert process.poll() is None and process.returncode is None
    finally:
        process.kill()
        process.wait(timeout=30)


def test_a_handle_reports_exit_codes_timeouts_and_kills_as_popen_does(tmp_path):
    failing = forked.spawn(failing_env(), tmp_path / "failing.log")
    assert failing is not None
    assert failing.wait(timeout=60) == 1 and failing.poll() == 1 and failing.returncode == 1
    assert "JSONDecodeError" in (tmp_path / "failing.log").read_text()
    failing.kill()           # after the end: nothing to signal, no error

    waiting = forked.spawn(waiting_env(tmp_path), tmp_path / "waiting.log")
    assert waiting is not None
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(timeout=0.2)
    waiting.terminate()
    assert waiting.wait(timeout=30) == -signal.SIGTERM

    killed = forked.spawn(waiting_env(tmp_path), tmp_path / "killed.log")
    assert killed is not None
    track(killed)
    kill_children()          # what the first stop signal does (flatpack.interrupts)
    assert killed.wait(timeout=30) == -signal.SIGKILL


def test_a_lost_fork_server_reports_its_functions_killed_and_a_new_one_starts(tmp_path):
    env = waiting_env(tmp_path, own_server=True)
    first = forked.spawn(env, tmp_path / "first.log")
    assert first is not None
    server = first.server
    try:
        server.process.kill()
        assert first.wait(timeout=30) == -signal.SIGKILL     # it died with its server
        assert not _alive(first.pid)
        second = forked.spawn(env, tmp_path / "second.log")
        assert second is not None and second.server is not server
        second.kill()
        assert second.wait(timeout=30) == -signal.SIGKILL
    finally:
        forked.stop_all()


# ---- dies with the invoker -------------------------------------------------------------------

INVOKER = """
import json, os, sys, threading, time
from pathlib import Path
from flatpack.runtime import forked
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV

tmp, from_thread = Path(sys.argv[1]), sys.argv[2] == "thread"
role = Role("run-never/spec/g0000", 0, 0, 0, 1, digest="0" * 64)
env = {**os.environ, ROLE_ENV: role.dumps(), STORE_ENV: (tmp / "store").as_uri(), "PYTHONUNBUFFERED": "1"}
handles = []
start = lambda: handles.extend(forked.spawn(env, tmp / f"f{index}.log") for index in range(3))
if from_thread:   # a thread that ends before the kill: the server has no PDEATHSIG, only its socket
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
else:
    start()
server = handles[0].server.process.pid
print(json.dumps({"server": server, "functions": [handle.pid for handle in handles]}), flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("started_from", ["main", "thread"])
def test_sigkill_of_the_invoker_leaves_no_function_and_no_fork_server_alive(tmp_path, started_from):
    invoker = subprocess.Popen([sys.executable, "-c", INVOKER, str(tmp_path), started_from], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    started: list[int] = []
    try:
        assert invoker.stdout is not None
        line = invoker.stdout.readline()
        assert line.startswith("{"), f"the invoker did not start its functions: {line}{invoker.stdout.read()}"
        pids = json.loads(line)
        started = [pids["server"], *pids["functions"]]
        assert all(_alive(pid) for pid in started)
        assert all(_stat(pid)[1] == str(pids["server"]) for pid in pids["functions"])  # type: ignore[index]
        invoker.kill()
        invoker.wait()
        assert _wait_gone(started) == []
    finally:
        if invoker.poll() is None:
            invoker.kill()
            invoker.wait()
        for pid in started:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


# ---- without a fork server ---------------------------------------------------------------------

def test_fork_server_0_starts_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.setenv(forked.FORK_SERVER_ENV, "0")
    assert forked.unavailable_reason() == f"{forked.FORK_SERVER_ENV}=0"
    assert forked.spawn({**failing_env(), forked.FORK_SERVER_ENV: "0"}, tmp_path / "f.log") is None


def test_where_python_has_no_pidfds_functions_start_as_fresh_interpreters(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")
    assert "pidfd_open" in (forked.unavailable_reason({}) or "")
    assert forked.spawn(failing_env(), tmp_path / "f.log") is None


def test_a_fork_server_that_fails_to_start_is_said_once_and_functions_start_fresh(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(forked, "SERVER_MODULE", "flatpack.no_such_module")
    env = waiting_env(tmp_path, own_server=True)
    with caplog.at_level(logging.WARNING, logger="flatpack.forked"):
        assert forked.spawn(env, tmp_path / "a.log") is None
        assert forked.spawn(env, tmp_path / "b.log") is None
    warnings = [record.getMessage() for record in caplog.records if record.name == "flatpack.forked"]
    assert len(warnings) == 1 and "fresh interpreters" in warnings[0] and "no_such_module" in warnings[0]


# ---- what a server runs: its programs only ------------------------------------------------------

def test_a_program_that_is_not_a_servers_is_refused_before_any_server_starts(tmp_path):
    with pytest.raises(ValueError, match="function, rank"):
        forked.spawn(failing_env(), tmp_path / "f.log", program="flatpack.cli")


def test_a_server_told_another_program_says_so_and_functions_start_fresh(tmp_path, monkeypatch, caplog):
    """A server started for a name outside PROGRAMS (an invoker of another flatpack version,
    say) imports nothing and answers with the reason; the invoker falls back, once."""
    monkeypatch.setitem(forkserver.PROGRAMS, "ghost", forkserver.Program("flatpack.runtime.worker"))  # here only
    env = waiting_env(tmp_path, own_server=True)
    with caplog.at_level(logging.WARNING, logger="flatpack.forked"):
        assert forked.spawn(env, tmp_path / "a.log", program="ghost") is None
    warnings = [record.getMessage() for record in caplog.records if record.name == "flatpack.forked"]
    assert len(warnings) == 1 and "ghost" in warnings[0]


def test_a_request_whose_arguments_are_not_strings_is_refused(tmp_path):
    request = forkserver.SpawnRequest(env={}, log=str(tmp_path / "f.log"), cwd=None, argv=("--out", "x"))
    assert forkserver.SpawnRequest.loads(request.dumps()) == request
    hostile = json.dumps({"env": {}, "log": "f.log", "cwd": None, "argv": ["--out", {"x": 1}]}).encode()
    with pytest.raises(TypeError, match="argv"):
        forkserver.SpawnRequest.loads(hostile)
    with pytest.raises(ValueError, match="not 'flatpack.cli'"):
        forkserver.preload("flatpack.cli")
