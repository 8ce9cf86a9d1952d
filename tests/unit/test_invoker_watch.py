"""A function ends with its invoker, whichever thread of the invoker started it
(``flatpack.runtime.invoker_watch``), and a child forked through ``interrupts.on_lasting_thread``
dies with its process, not with the thread that asked for it.

Each invoker is a fresh interpreter that starts its child from a thread other than its main
one (as ``flatpack serve`` does), prints the child's pid, and is then SIGKILLed: no handler of
it runs, so only the child's own watch (or the kernel's PR_SET_PDEATHSIG) can end the child.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from flatpack.runtime import invoker_watch
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV
from tests.proctree import kill_all, stat, wait_gone

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PDEATHSIG is Linux's")

GONE_WITHIN_S = 30.0      # a bound for a loaded host; the watch itself wakes at once (pidfd)


def _invoker(code: str) -> tuple[subprocess.Popen, dict[int, int]]:
    """A fresh interpreter running ``code``, which prints its child's pid; returns it and the
    child (pid -> start time)."""
    invoker = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert invoker.stdout is not None
    child = int(invoker.stdout.readline())
    info = stat(child)
    assert info is not None and info[0] != "Z", "the child should be running"
    return invoker, {child: info[2]}


def _kill(invoker: subprocess.Popen) -> None:
    invoker.kill()
    invoker.wait()
    if invoker.stdout is not None:
        invoker.stdout.close()


def test_a_worker_started_from_another_thread_exits_when_its_invoker_is_sigkilled(tmp_path):
    """The real function process (``python -m flatpack.runtime.worker``) waiting for its spec in
    a store: started from a thread, so without PR_SET_PDEATHSIG; its invoker is SIGKILLed."""
    role = Role("run-x/never-written", 0, 0, 0, 0, kind="infer-master")
    env = {ROLE_ENV: role.dumps(), STORE_ENV: f"file://{tmp_path}"}
    invoker, child = _invoker(f"""
        import os, subprocess, sys, threading, time
        started = []
        def start():
            started.append(subprocess.Popen([sys.executable, "-m", "flatpack.runtime.worker"],
                                            env={{**os.environ, **{env!r}}}, start_new_session=True))
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()
        print(started[0].pid, flush=True)
        time.sleep(600)
        """)
    try:
        time.sleep(1.0)     # the worker is loading or already waiting for its spec (120 s)
        _kill(invoker)
        assert wait_gone(child, GONE_WITHIN_S) == {}
    finally:
        _kill(invoker)
        kill_all(child)


def test_a_child_forked_on_the_lasting_thread_outlives_the_asking_thread_and_dies_with_the_process():
    invoker, child = _invoker("""
        import subprocess, threading, time
        from flatpack.interrupts import die_with_parent, on_lasting_thread
        started = []
        def start():
            started.append(on_lasting_thread(lambda: subprocess.Popen(["sleep", "600"],
                                                                      preexec_fn=die_with_parent())))
        thread = threading.Thread(target=start)
        thread.start()
        thread.join()       # the asking thread has ended: PR_SET_PDEATHSIG set on it would fire now
        time.sleep(0.5)
        assert started[0].poll() is None, "the child died with the thread that asked for it"
        print(started[0].pid, flush=True)
        time.sleep(600)
        """)
    try:
        _kill(invoker)
        assert wait_gone(child, GONE_WITHIN_S) == {}
    finally:
        _kill(invoker)
        kill_all(child)


def test_on_lasting_thread_returns_the_result_and_raises_the_error_on_the_callers_thread():
    results: list[object] = []

    def ask() -> None:
        results.append(threading.current_thread().name)
        from flatpack.interrupts import on_lasting_thread

        results.append(on_lasting_thread(lambda: threading.current_thread().name))
        try:
            on_lasting_thread(lambda: 1 / 0)
        except ZeroDivisionError as err:
            results.append(type(err).__name__)

    thread = threading.Thread(target=ask, name="asker")
    thread.start()
    thread.join()
    assert results == ["asker", "flatpack-lasting", "ZeroDivisionError"]


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "polling"])
def test_watch_invoker_calls_on_gone_when_the_watched_process_exits(monkeypatch, pidfd):
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
        monkeypatch.setattr(invoker_watch, "POLL_S", 0.02)
    gone = threading.Event()
    watched = subprocess.Popen(["sleep", "600"])
    try:
        thread = invoker_watch.watch_invoker(watched.pid, on_gone=gone.set)
        assert thread is not None and not gone.wait(0.3), "on_gone ran while the process was alive"
        watched.kill()
        watched.wait()
        assert gone.wait(GONE_WITHIN_S)
    finally:
        watched.kill()
        watched.wait()


def test_watch_invoker_of_a_process_already_gone_calls_on_gone_at_once():
    finished = subprocess.Popen(["true"])
    finished.wait()
    gone = threading.Event()
    assert invoker_watch.watch_invoker(finished.pid, on_gone=gone.set) is None
    assert gone.is_set()
    gone.clear()
    # an invoker that is pid 1 (flatpack as a container's entry point) is watched, not taken for gone
    assert invoker_watch.watch_invoker(1, on_gone=gone.set) is not None
    assert not gone.wait(0.2)


def test_the_invoker_pid_comes_from_the_environment_when_given(monkeypatch):
    monkeypatch.delenv(invoker_watch.INVOKER_PID_ENV, raising=False)
    assert invoker_watch.invoker_pid() == os.getppid()
    monkeypatch.setenv(invoker_watch.INVOKER_PID_ENV, str(os.getpid()))
    assert invoker_watch.invoker_pid() == os.getpid()
    monkeypatch.setenv(invoker_watch.INVOKER_PID_ENV, "not-a-pid")
    assert invoker_watch.invoker_pid() == os.getppid()
