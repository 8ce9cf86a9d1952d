"""A warm base for stand-in invocations: a process that has imported what every function of
an image imports first (``torch``, which a flatpack image installs) and forks each invocation's
:mod:`~tests.standins.bootstrap` from there.

A fresh ``python bootstrap.py`` per invocation spent ~2 s of CPU importing torch, and the
suite's Lambda and FC tests invoke dozens of functions (issue 42). Forked, an invocation still
starts as a fresh runtime does in everything the function can see: its own session and
process group, its code directory as the working directory and first on ``sys.path``, its
own environment, stdin, log and result channel, the handler imported by the bootstrap (so
the image's own flatpack, from its code directory: nothing of flatpack is loaded here). What
differs: torch is already in ``sys.modules``, and the process's peak resident memory reads
lower (~150 MB where a fresh one that imports torch reads ~225 MB), as a runtime whose base
layer is already mapped would.

Started by :mod:`tests.standins.runner` as ``python -u zygote.py MODULES FD`` (a JSON list,
a descriptor) with stdin closed; it imports the standard library and ``MODULES`` only, says
``"ready"`` on ``FD`` (a ``SOCK_SEQPACKET`` socket) and then serves requests there: a request
is the JSON ``{"argv", "cwd", "env"}`` with four descriptors (stdin, log, result channel, exit
status); the answer is the child's pid as JSON. When a child ends, its exit status
(``subprocess``'s convention: negative for a signal) is written to that request's exit-status
descriptor as text, which is then closed. End of file on the control socket ends the zygote
and kills every child still running.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback

CHANNEL_FD = 3          # where a child finds its result channel (the bootstrap's channel_fd)
MAX_MESSAGE = 1 << 20
FDS_PER_REQUEST = 4
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL when the process that started this one goes (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _run_child(request: dict, stdin: int, log: int, channel: int, own_path: list[str]) -> None:
    """In the forked child: become the invocation's fresh runtime and run the bootstrap."""
    code = 1
    try:
        os.setsid()
        _die_with_parent()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(stdin, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.dup2(channel, CHANNEL_FD)
        # nothing of the zygote's (its control socket, other invocations' descriptors) stays open
        os.closerange(CHANNEL_FD + 1, os.sysconf("SC_OPEN_MAX"))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path as a fresh interpreter with this environment builds it: the script's
        # directory (the bootstrap puts the code directory there), then PYTHONPATH, then the rest
        python_path = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:] = [sys.path[0], *python_path, *own_path]
        spec = json.loads(request["argv"][1])
        spec["channel_fd"] = CHANNEL_FD
        sys.argv = [request["argv"][0], json.dumps(spec)]
        import runpy

        runpy.run_path(request["argv"][0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever the bootstrap raised goes to the function's log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream: nothing to flush
                pass
        os._exit(code)


def serve(control: socket.socket, own_path: list[str]) -> None:
    statuses: dict[int, int] = {}        # child pid -> its exit-status descriptor
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        while True:
            readable, _, _ = select.select([control, wakeup_read], [], [])
            if wakeup_read in readable:
                os.read(wakeup_read, 4096)
                _reap(statuses)
            if control not in readable:
                continue
            message, fds, _flags, _address = socket.recv_fds(control, MAX_MESSAGE, FDS_PER_REQUEST)
            if not message:
                return
            stdin, log, channel, status = fds
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(status)
                _run_child(json.loads(message), stdin, log, channel, own_path)
            for fd in (stdin, log, channel):
                os.close(fd)
            statuses[pid] = status
            control.send(json.dumps(pid).encode())
    finally:
        for pid in statuses:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def _reap(statuses: dict[int, int]) -> None:
    while statuses:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = statuses.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, str(os.waitstatus_to_exitcode(status)).encode())
            except OSError:
                pass    # the runner stopped waiting
            os.close(fd)


def main(argv: list[str]) -> None:
    _die_with_parent()
    # this file's directory, then the path as it was before the preloads: every child rebuilds
    # its own from there (the zygote's own PYTHONPATH entries dropped)
    own_pythonpath = {entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry}
    own_path = [entry for entry in sys.path[1:] if entry not in own_pythonpath]
    for name in json.loads(argv[1]):
        importlib.import_module(name)
    control = socket.socket(fileno=int(argv[2]))
    control.send(json.dumps("ready").encode())
    serve(control, own_path)


if __name__ == "__main__":
    main(sys.argv)
