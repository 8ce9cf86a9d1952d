"""The invoker's side of the fork server (``flatpack.runtime.forkserver``): local functions
forked from a resident process that has torch imported, each one a :class:`ForkedProcess`
with the surface of ``subprocess.Popen`` the invoker, ``flatpack.interrupts`` and the
teardown use (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``, ``terminate``,
``send_signal``).

One fork server per invoker process, not per deployment: it holds nothing of a deployment
(each request carries the function's whole environment, log and working directory), so every
deployment a process makes (a test session's dozens, calibrate's probe pipelines) shares one
second and a half of imports. A process whose environment differs in what is read while
modules load (``PYTHON*``, ``OMP_*``, ``MKL_*``, ``TORCH*``, ``LD_*`` and the like) gets a
server of its own for it, and so does each program (``function`` or ``rank``) and start directory: the ranks of a
gpu-container deployment on this machine import the deployment's packaged flatpack (its
``PYTHONPATH`` and directory), from a server that deployment closes (:func:`close_servers`).

How each promise of a fresh interpreter is kept:

* **dies with the invoker**: the server is started with ``PR_SET_PDEATHSIG`` (from the main
  thread; ``flatpack.interrupts.die_with_parent``) and reads end of file on its control
  socket when the invoker goes however it goes, SIGKILL included, and then SIGKILLs every
  function; each function has ``PR_SET_PDEATHSIG`` towards the server
  (``tests/integration/test_fork_server.py``).
* **kill and exit codes**: the server hands over a pidfd of each function, through which
  :meth:`ForkedProcess.send_signal` signals it with no pid-reuse race, and reports each exit
  code as ``Popen`` would (negative: the signal). If the server itself is lost, every
  function is dying with it (PDEATHSIG): a handle reports ``-SIGKILL`` once its pidfd says the
  process ended, so the invoker treats it as a lost function and restarts it from its
  checkpoint, as it does for a SIGKILLed fresh one.
* **exactly once**: a request that got no answer started nothing that outlives the server.

``FLATPACK_FORK_SERVER=0`` (or a platform without ``fork``, pidfds or ``PR_SET_PDEATHSIG``'s
kin: anything but Linux) makes :func:`spawn` answer None, and the local backend starts a
fresh interpreter (docs/local-functions.md); so does a server that failed to start, with a
warning saying why.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Mapping

from flatpack import logs
from flatpack.interrupts import die_with_parent, track
from flatpack.runtime.function_env import ROLE_ENV
from flatpack.runtime.forkserver import MESSAGE_LIMIT, WORKER_MODULE, SpawnRequest, decode, program as program_of

__all__ = ["FORK_SERVER_ENV", "ForkedProcess", "ForkServer", "ForkServerUnavailable", "spawn", "start_interpreter",
           "prestart", "unavailable_reason", "close_servers", "stop_all"]

LOG = logs.get("forked")
FORK_SERVER_ENV = "FLATPACK_FORK_SERVER"
SERVER_MODULE = "flatpack.runtime.forkserver"
READY_TIMEOUT_S = 300.0        # the server's imports: seconds on a quiet host, minutes on a loaded one
REPLY_TIMEOUT_S = 60.0         # one fork and its answer
# environment variables read while the interpreter, torch and its libraries load: a function
# forked from a server started without the invoker's value would not see it
IMPORT_TIME_PREFIXES = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS", "TORCH", "PYTORCH", "CUDA", "LD_",
                        "MALLOC", "NUMEXPR")
PER_REQUEST = ("PYTHONUNBUFFERED",)   # set for every function: the server's streams are remade unbuffered


class ForkServerUnavailable(RuntimeError):
    """The fork server could not start or answer; the invoker starts a fresh interpreter."""


def unavailable_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why functions start as fresh interpreters here (None: they are forked)."""
    setting = (os.environ if env is None else env).get(FORK_SERVER_ENV, "1")
    if setting.strip().lower() in ("0", "false", "no", "off"):
        return f"{FORK_SERVER_ENV}=0"
    if not sys.platform.startswith("linux"):
        return f"no fork server on {sys.platform} (it needs Linux: pidfds, PR_SET_PDEATHSIG)"
    if not (hasattr(os, "fork") and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
            and hasattr(socket, "send_fds") and hasattr(socket, "SOCK_SEQPACKET")):
        return "this Python lacks os.pidfd_open, signal.pidfd_send_signal or socket.send_fds"
    return None


class ForkedProcess:
    """A function the fork server forked, as the invoker sees it: the ``subprocess.Popen``
    surface flatpack uses. Its exit code arrives from the server; signals go through its pidfd."""

    def __init__(self, server: ForkServer, pid: int, number: int, pidfd: int, argv: tuple[str, ...] = ()) -> None:
        self.server = server
        self.pid = pid
        self.number = number                   # the server's count of its functions: unlike a pid, never reused
        self.args = [sys.executable, "-m", program_of(server.program).module, *argv]
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd
        self._reported: int | None = None      # the exit code the server sent, not yet observed
        self.cpu_seconds: float | None = None  # its user + system CPU seconds, once it ended
        # taken around the pidfd's use and its close; reentrant, since a signal handler on the
        # main thread (interrupts.kill_children) may run while that thread holds it
        self._fd_lock = threading.RLock()

    def _exited(self, code: int, cpu_seconds: float | None) -> None:
        """The server reaped this process (called on the server's reader thread)."""
        self.cpu_seconds = cpu_seconds
        self._reported = code

    def _settle(self, code: int) -> int:
        with self._fd_lock:
            if self.returncode is None:
                self.returncode = code        # first: a signal sent after this sees it and sends nothing
                if self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
            return self.returncode

    def _pidfd_ended(self, timeout: float) -> bool:
        with self._fd_lock:
            pidfd = self._pidfd
            if pidfd is None:
                return True
            readable, _, _ = select.select([pidfd], [], [], max(timeout, 0.0))
            return bool(readable)

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._reported is not None:
            return self._settle(self._reported)
        if self.server.lost and self._pidfd_ended(0.0):
            # the server went without reporting it; PDEATHSIG killed it
            return self._settle(-signal.SIGKILL)
        return None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            step = 0.5 if remaining is None else min(remaining, 0.5)
            if self.server.lost:
                self._pidfd_ended(step)
            else:
                self.server.wait_for_event(step)
        return code

    def send_signal(self, sig: int) -> None:
        with self._fd_lock:
            if self.returncode is not None or self._pidfd is None:
                return
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass       # ended already; the server reaps it

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        pidfd, self._pidfd = self._pidfd, None
        if pidfd is not None:
            try:
                os.close(pidfd)
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"<ForkedProcess pid={self.pid} returncode={self.returncode}>"


class ForkServer:
    """One fork server process and the invoker's two sockets to it."""

    def __init__(self, env: dict[str, str], program: str = "function", cwd: str | None = None) -> None:
        self.owner = os.getpid()
        self.program = program
        self.lost = False
        self.ready = False
        self._request_lock = threading.Lock()
        self._events_changed = threading.Condition()
        # by the server's number of the function (a pid may be reused once the server reaped it)
        self._handles: weakref.WeakValueDictionary[int, ForkedProcess] = weakref.WeakValueDictionary()
        # exit codes (and CPU seconds) that arrived before their handle was made
        self._early: dict[int, tuple[int, float | None]] = {}
        self.control, control_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.events, events_there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # an anonymous file (no name in TMPDIR): the server's traceback, should it fail
        self.stderr: IO[bytes] = tempfile.TemporaryFile(prefix="flatpack-forkserver-")  # noqa: SIM115 - closed in close()
        try:
            self.process = track(subprocess.Popen(
                [sys.executable, "-m", SERVER_MODULE, str(control_there.fileno()), str(events_there.fileno()), program],
                env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self.stderr,
                pass_fds=(control_there.fileno(), events_there.fileno()), start_new_session=True,
                preexec_fn=die_with_parent()), server=True)
        except BaseException:
            for end in (self.control, self.events, self.stderr):
                end.close()
            raise
        finally:
            control_there.close()
            events_there.close()
        threading.Thread(target=self._read_events, name="flatpack-forkserver-events", daemon=True).start()

    # ---- requests ----------------------------------------------------------------------------
    def spawn(self, request: SpawnRequest) -> ForkedProcess:
        """Forks one function; ForkServerUnavailable if the server cannot."""
        with self._request_lock:
            if self.lost:
                raise ForkServerUnavailable(self.failure())
            if not self.ready:
                self._await_ready()
            try:
                self.control.settimeout(REPLY_TIMEOUT_S)
                self.control.send(request.dumps())
                raw, fds, _, _ = socket.recv_fds(self.control, MESSAGE_LIMIT, 1)
            except OSError as err:
                self._abandon()
                raise ForkServerUnavailable(f"the fork server did not answer ({err}); {self.failure()}") from err
            if not raw:
                self._lose()
                raise ForkServerUnavailable(self.failure())
            reply = decode(raw)
            if "pid" not in reply or not fds:
                for fd in fds:
                    os.close(fd)
                raise OSError(f"the fork server could not start the function: {reply.get('error', reply)}")
            handle = ForkedProcess(self, int(reply["pid"]), int(reply["id"]), fds[0], request.argv)
            with self._events_changed:
                self._handles[handle.number] = handle
                if handle.number in self._early:
                    handle._exited(*self._early.pop(handle.number))
            return handle

    def _await_ready(self) -> None:
        self.control.settimeout(READY_TIMEOUT_S)
        try:
            raw = self.control.recv(MESSAGE_LIMIT)
        except OSError as err:
            self._abandon()
            raise ForkServerUnavailable(f"the fork server did not start within {READY_TIMEOUT_S:.0f} s ({err})") \
                from err
        reply = decode(raw) if raw else {}
        if "ready" not in reply:
            self._lose()
            raise ForkServerUnavailable(reply.get("error") or self.failure())
        self.ready = True

    # ---- events --------------------------------------------------------------------------------
    def _read_events(self) -> None:
        while True:
            try:
                raw = self.events.recv(MESSAGE_LIMIT)
            except OSError:
                raw = b""
            if not raw:
                self._lose()
                return
            message = decode(raw)
            number, code, cpu_seconds = int(message["id"]), int(message["returncode"]), message.get("cpu_s")
            with self._events_changed:
                handle = self._handles.get(number)
                if handle is not None:
                    handle._exited(code, cpu_seconds)
                else:
                    self._early[number] = (code, cpu_seconds)
                self._events_changed.notify_all()

    def wait_for_event(self, timeout: float) -> None:
        with self._events_changed:
            self._events_changed.wait(timeout)

    def _lose(self) -> None:
        with self._events_changed:
            self.lost = True
            self._events_changed.notify_all()

    def _abandon(self) -> None:
        """Gives up on a server that did not answer in time: it is killed, so that nothing it
        might still fork runs beside the function started again elsewhere (its children die
        with it)."""
        self._lose()
        try:
            self.process.kill()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def failure(self) -> str:
        """What the server said before it ended, or its exit code."""
        code = self.process.poll()
        try:
            self.stderr.seek(0)
            tail = self.stderr.read()[-2000:].decode(errors="replace").strip()
        except (OSError, ValueError):
            tail = ""
        ended = f"the fork server exited with code {code}" if code is not None else "the fork server stopped answering"
        return f"{ended}{': ' + tail if tail else ''}"

    def close(self, wait_s: float = 5.0) -> None:
        """Ends the server (it SIGKILLs the functions it still runs) and reaps it."""
        self._lose()
        self.control.close()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.events.close()
        self.stderr.close()


# ---- the process's servers -----------------------------------------------------------------------

# a server by what its children import: the program's name, the directory it was started in (the
# first entry of a ``-m`` interpreter's sys.path) and the import-time environment
_ServerKey = tuple[str, str | None, tuple[tuple[str, str], ...]]
_servers: dict[_ServerKey, ForkServer] = {}
_refused: dict[_ServerKey, str] = {}
_servers_lock = threading.Lock()


def _import_time_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((name, value) for name, value in env.items()
                        if name.startswith(IMPORT_TIME_PREFIXES) and name not in PER_REQUEST))


def _key(env: dict[str, str], program: str, server_cwd: str | None) -> _ServerKey:
    return program, server_cwd, _import_time_env(env)


def _server_for(key: _ServerKey, env: dict[str, str]) -> ForkServer | None:
    """This process's fork server for ``key``, started if need be (with ``env`` less the
    role); None where one failed before (the reason was said once)."""
    with _servers_lock:
        if key in _refused:
            return None
        server = _servers.get(key)
        if server is not None and (server.owner != os.getpid() or server.lost):
            del _servers[key]
            server = None
        if server is None:
            program, server_cwd, _ = key
            server_env = {name: value for name, value in env.items() if name != ROLE_ENV}
            server = _servers[key] = ForkServer({**server_env, "PYTHONUNBUFFERED": "1"}, program, server_cwd)
        return server


def prestart(env: dict[str, str]) -> None:
    """Starts the fork server for ``env`` now, so its imports overlap the caller's other work
    (deploying); nothing where functions are not forked."""
    if unavailable_reason(env) is None:
        _server_for(_key(env, "function", None), env)


def spawn(env: dict[str, str], log: Path, cwd: str | None = None, *, program: str = "function",
          argv: tuple[str, ...] = (), server_cwd: str | None = None) -> ForkedProcess | None:
    """Forks ``program`` (``function``: ``python -m flatpack.runtime.worker``; ``rank``:
    ``python -m flatpack.runtime.distributed ARGV...``) with environment ``env``, its output to
    ``log`` and ``cwd`` as its directory, from a server started in ``server_cwd`` (None: this
    process's directory); None where runs start as fresh interpreters
    (:func:`unavailable_reason`, or the fork server failed: said once, as a warning)."""
    program_of(program)      # a name the server knows, or ValueError before anything starts
    if unavailable_reason(env) is not None:
        return None
    request = SpawnRequest(env=dict(env), log=str(log), cwd=cwd or _working_directory(),
                           cpus=tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else None,
                           argv=tuple(argv))
    key = _key(env, program, server_cwd)
    for attempt in range(2):     # a server lost since the last function is started again, once
        server = _server_for(key, env)
        if server is None:
            return None
        try:
            return server.spawn(request)
        except ForkServerUnavailable as err:
            if attempt == 0 and server.ready:
                continue
            _refuse(key, str(err))
            return None
    return None


def start_interpreter(env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """A function as a fresh ``python -m flatpack.runtime.worker``, its output to ``log_path``:
    what a platform's cold start runs, and the way where no fork server forks (:func:`spawn`
    answered None)."""
    # the child holds its own copy of the log's descriptor
    with open(log_path, "wb") as log:
        # own session: a terminal's Ctrl-C reaches the invoker only, which kills its functions;
        # and a function dies with the invoker even when that is SIGKILLed (Linux)
        return track(subprocess.Popen([sys.executable, "-m", WORKER_MODULE], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=die_with_parent()))


def close_servers(server_cwd: str) -> None:
    """Ends this process's fork servers started in ``server_cwd`` (a deployment's directory,
    at its teardown: nothing else forks from them) and the functions they still run."""
    with _servers_lock:
        keys = [key for key, server in _servers.items() if key[1] == server_cwd and server.owner == os.getpid()]
        servers = [_servers.pop(key) for key in keys]
        for key in [key for key in _refused if key[1] == server_cwd]:
            del _refused[key]
    for server in servers:
        server.close()


def _working_directory() -> str | None:
    """This process's working directory; None when it was removed (a child then stays in the
    server's, as a ``Popen`` child would inherit the removed one)."""
    try:
        return os.getcwd()
    except OSError:
        return None


def _refuse(key: _ServerKey, reason: str) -> None:
    with _servers_lock:
        _refused[key] = reason
        server = _servers.pop(key, None)
    if server is not None:
        server.close(wait_s=1.0)
    LOG.warning(f"local functions start as fresh interpreters (about a second and a half each): {reason}")


def stop_all() -> None:
    """Ends this process's fork servers (at exit; tests)."""
    with _servers_lock:
        servers = [server for server in _servers.values() if server.owner == os.getpid()]
        _servers.clear()
        _refused.clear()
    for server in servers:
        server.close()


def _forget_after_fork() -> None:
    # a process forked from the invoker shares its sockets: it must not use them, and the lock
    # may have been held by a thread the fork left behind
    global _servers_lock
    _servers_lock = threading.Lock()
    _servers.clear()


atexit.register(stop_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
