"""flatpack.interrupts: stop signals become one clean path, and children die with their parent.

Each case runs in a fresh interpreter: a stop signal leaves its shield installed on purpose
(the process is on its way out), which must not happen to pytest's own process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def _python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@linux_only
def test_a_child_started_with_die_with_parent_dies_when_its_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        from flatpack.interrupts import die_with_parent
        child = subprocess.Popen(["sleep", "120"], preexec_fn=die_with_parent())
        print(child.pid, flush=True)
        time.sleep(120)
        """)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    try:
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()
        parent.stdout.close()


def test_sigterm_becomes_an_interrupted_keyboard_interrupt_and_workers_are_killed_at_once():
    result = _python("""
        import os, signal, subprocess, time
        from flatpack.interrupts import Interrupted, clean_shutdown, track
        worker = track(subprocess.Popen(["sleep", "120"]))
        try:
            with clean_shutdown():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        except KeyboardInterrupt as err:
            print(type(err).__name__, isinstance(err, Interrupted) and err.exit_code)
        print("worker", worker.wait(timeout=10))
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["Interrupted 143", f"worker {-signal.SIGKILL}"]
    assert "SIGTERM received" in result.stderr


def test_signals_during_the_shutdown_are_shielded_and_said_once():
    result = _python("""
        import os, signal, time
        from flatpack.interrupts import clean_shutdown
        with clean_shutdown():
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)
            except KeyboardInterrupt:
                # the teardown (a with/finally inside the command): further Ctrl-C and
                # SIGTERM must not break into it
                for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM):
                    os.kill(os.getpid(), sig)
                    time.sleep(0.05)
                print("teardown finished")
        # on the way out (at-exit handlers, finalization) they stay ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        print("exited normally")
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["teardown", "finished", "exited", "normally"]
    assert result.stderr.count("still stopping") == 1


def test_a_teardown_that_hangs_is_cut_short():
    started = time.monotonic()
    result = _python("""
        import os, signal, time
        from flatpack.interrupts import clean_shutdown
        try:
            with clean_shutdown(force_after_s=1.0):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
        except KeyboardInterrupt:
            time.sleep(60)     # a hung teardown
        """)
    assert result.returncode == 128 + signal.SIGTERM
    assert "exiting now" in result.stderr
    assert time.monotonic() - started < 30


def test_without_a_signal_the_previous_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    from flatpack.interrupts import clean_shutdown

    with clean_shutdown():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@linux_only
def test_an_interrupted_cli_command_says_so_and_exits_128_plus_the_signal():
    # a stand-in command that receives SIGTERM while it runs
    result = _python("""
        import os, signal, sys
        import flatpack.cli as cli
        import flatpack.cli.planning as planning
        def slow(args):
            os.kill(os.getpid(), signal.SIGTERM)
            import time; time.sleep(30)
        planning.cmd_platforms = slow     # build_parser binds the name when main() calls it
        sys.exit(cli.main(["platforms"]))
        """)
    assert result.returncode == 143, result.stderr
    assert "stopped by SIGTERM" in result.stderr and "Traceback" not in result.stderr
