"""The fork server: ``python -m flatpack.runtime.forkserver CONTROL_FD EVENTS_FD [PROGRAM]``, a
resident process that has torch and one program's modules imported and forks each run of that
program from itself, so that it starts in tens of milliseconds instead of the second and a half
a fresh interpreter spends importing torch (``benchmarks/function_start.py``). The program
(:data:`PROGRAMS`) is ``function``, a local function (``flatpack.runtime.worker``, the
default), or ``rank``, a rank of a gpu-container run on this machine
(``flatpack.runtime.distributed``, with its command line in each request).

It imports, and runs nothing: no torch operation runs before a fork, so no OpenMP or intra-op
thread pool exists in it (a fork copies only the forking thread: a pool's threads would be
missing in the child while its state says they exist). It checks that the imports started no
thread of their own beyond those ``import torch`` starts (numpy's BLAS pool, which stops
itself around a fork) and refuses to serve otherwise.

What a forked function gets is what a fresh ``python -m flatpack.runtime.worker`` gets
(``flatpack.runtime.forked`` sends it): its own session (``setsid``), the environment of its
role, its log as stdout and stderr (unbuffered), /dev/null as stdin, the invoker's working
directory and CPU set, and ``PR_SET_PDEATHSIG``: it dies with the fork server, as the server
dies with its invoker. Then it runs the worker's ``main``, which holds the function to its
tier (memory and CPU) as in a fresh interpreter; its peak memory starts from its own resident
set (Linux copies the high-water mark at fork to the child's current size).

The protocol, over two Unix SOCK_SEQPACKET sockets the invoker made (one JSON object a
message, no pickle):

* ``CONTROL_FD``: the server says ``{"ready": pid}`` once imported; then each request
  (:class:`SpawnRequest`) is answered by ``{"pid": pid, "id": n}`` (``n`` counts the server's
  functions, never reused as a pid may be) with a pidfd of the function
  attached (``SCM_RIGHTS``), through which the invoker signals it without a pid-reuse race,
  or by ``{"error": text}``. End of file: the invoker is gone, and the server SIGKILLs every
  function still running and exits.
* ``EVENTS_FD``: ``{"id": n, "returncode": code, "cpu_s": seconds}`` when a function
  ended and was reaped (``code`` as ``subprocess.Popen.returncode``: negative for a signal;
  ``cpu_s`` its user and system CPU seconds).

Linux only (pidfds, ``PR_SET_PDEATHSIG``); elsewhere the local backend starts fresh
interpreters (docs/local-functions.md).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import io
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from dataclasses import asdict, dataclass
from typing import Any, Callable, NoReturn

from flatpack.interrupts import die_with_parent

WORKER_MODULE = "flatpack.runtime.worker"
RANK_MODULE = "flatpack.runtime.distributed"
MESSAGE_LIMIT = 1 << 20          # bytes one message may hold: an environment and a role fit many times over
# the modules a function's roles load (the worker imports them per role, for a fresh
# interpreter's start-up time); the fork server loads them all once
ROLE_MODULES = ("flatpack.runtime.timeline", "flatpack.runtime.lanes", "flatpack.runtime.training",
                "flatpack.runtime.spec", "flatpack.runtime.chaos", "flatpack.runtime.forkjoin",
                "flatpack.runtime.profile_function", "flatpack.runtime.calibrate_function",
                "flatpack.runtime.throttle")


@dataclass(frozen=True)
class Program:
    """What a server forks: ``python -m MODULE``, with ``loads`` imported beside it (the
    modules it loads later, per role)."""

    module: str
    loads: tuple[str, ...] = ()


# the programs a server forks, by the name its command line gives (not the module's: a process
# found by ``flatpack.runtime.worker`` in its command line must be a function, never a server):
# a local function or a gpu-container rank
PROGRAMS = {"function": Program(WORKER_MODULE, ROLE_MODULES), "rank": Program(RANK_MODULE)}


def program(name: str) -> Program:
    """The program ``name`` names; ValueError naming the ones there are otherwise."""
    if name not in PROGRAMS:
        raise ValueError(f"the fork server runs one of {', '.join(PROGRAMS)}, not {name!r}")
    return PROGRAMS[name]


@dataclass(frozen=True)
class SpawnRequest:
    """One function to fork: its whole environment, the file its output goes to, the
    invoker's working directory and CPU set at the time (what a fresh process would inherit),
    and the arguments after ``python -m ENTRY``."""

    env: dict[str, str]
    log: str
    cwd: str | None
    cpus: tuple[int, ...] | None = None
    argv: tuple[str, ...] = ()

    def dumps(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def loads(cls, raw: bytes) -> SpawnRequest:
        data = json.loads(raw)
        cpus = data.pop("cpus", None)
        argv = data.pop("argv", ())
        if not all(isinstance(argument, str) for argument in argv):
            raise TypeError(f"argv holds a non-string: {argv!r}")
        return cls(**data, cpus=tuple(cpus) if cpus is not None else None, argv=tuple(argv))


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


def decode(raw: bytes) -> dict[str, Any]:
    return json.loads(raw)


def thread_count() -> int:
    """Threads of this process, native ones included (``threading`` sees only Python's)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def preload(name: str = "function") -> None:
    """Imports what the program ``name`` runs, and nothing runs: torch, its module and the
    modules it loads (:data:`PROGRAMS`), torch's dynamo (which its optimizers import) and, for
    a function, S3's service model parsed into the store's shared loader (its store client is
    then made in milliseconds). Raises RuntimeError if an import started a thread."""
    runs = program(name)
    # start-up time: torch, loaded once here for every function (the second a fork saves each);
    # not at module level, where it would load into every process that only speaks the protocol
    # (``runtime.forked``: a Ray task's worker)
    import torch

    baseline = thread_count()      # torch's own
    for module in (runs.module, *runs.loads):
        importlib.import_module(module)
    # start-up time (of every function forked from here): a torch optimizer's first call
    # imports torch._dynamo (its methods are wrapped to keep dynamo out), about 1.2 s of CPU
    # that each training function would pay again at its tier's CPU share (docs/training.md,
    # "The first demo")
    import torch._dynamo  # noqa: F401
    if runs.module == WORKER_MODULE:
        # start-up time: a function's store client, which a rank's server never loads (a rank
        # has no store, and its image no boto3)
        from flatpack.runtime.store import preload_s3_model

        preload_s3_model()
    if thread_count() > baseline:
        raise RuntimeError(f"the fork server's imports started {thread_count() - baseline} thread(s) beyond "
                           "torch's own; forking now could copy a thread pool's state without its threads")


# ---- the child: from the fork to the worker's main -------------------------------------------

def set_process_title(title: str) -> None:
    """Shows ``title`` as this process's command line (``ps``, /proc/PID/cmdline) by writing it
    over the argument area the kernel reports (its bounds in /proc/self/stat), as far as it
    fits: a forked function reads as ``python -m flatpack.runtime.worker``, not as the server."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        # fields counted from the state (field 3 in proc(5)): arg_start and arg_end are 48, 49
        start, end = int(fields[45]), int(fields[46])
    except (OSError, IndexError, ValueError):
        return
    area = end - start
    if area <= 0:
        return
    data = title.replace(" ", "\0").encode()[:area - 1]
    ctypes.memmove(start, data + b"\0" * (area - len(data)), area)


def _redirect(log_path: str) -> None:
    """The log as stdout and stderr, /dev/null as stdin, and Python's streams over them
    unbuffered (``PYTHONUNBUFFERED``, as the invoker asks of a fresh interpreter)."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    encoding = sys.stdout.encoding if sys.stdout is not None else "utf-8"
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=encoding,
                                                   errors="strict", write_through=True)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=encoding,
                                                   errors="backslashreplace", write_through=True)


def become_function(request: SpawnRequest, close_inherited: Callable[[], None],
                    die_with_server: Callable[[], None] | None, run: Callable[[], object],
                    entry: str = WORKER_MODULE) -> NoReturn:
    """In the forked child: becomes the run of ``entry`` that ``request`` describes, runs
    ``run`` (its main: the worker's ends the process itself, a rank's returns its exit code)
    and never returns into the server."""
    code = 1
    try:
        os.setsid()
        if die_with_server is not None:
            die_with_server()
        close_inherited()
        _redirect(request.log)
        os.environ.clear()
        os.environ.update(request.env)
        if request.cwd is not None:
            os.chdir(request.cwd)
        if request.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, request.cpus)
        numpy_random = sys.modules.get("numpy.random")
        if numpy_random is not None:
            numpy_random.seed()   # as a fresh interpreter: its own stream (Python's random reseeds itself at fork)
        module = sys.modules[entry]
        sys.argv = [module.__file__ or entry, *request.argv]
        set_process_title(" ".join([sys.executable, "-m", entry, *request.argv]))
        returned = run()
        code = returned if isinstance(returned, int) else 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the function's log, as an interpreter would
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed log must not keep the child from ending
                pass
        os._exit(code)


# ---- the server loop -------------------------------------------------------------------------

class Server:
    """The fork server's state: the invoker's two sockets and the functions still running."""

    def __init__(self, control: socket.socket, events: socket.socket, entry: str = WORKER_MODULE) -> None:
        self.control, self.events, self.entry = control, events, entry
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, int]] = {}       # pidfd -> (pid, the spawn's number)
        self.spawned = 0
        self.die_with_server = die_with_parent()   # resolved here, run in each child

    def close_in_child(self) -> None:
        """Closes, in a forked child, every descriptor of the server: its sockets (the invoker
        must see the server's end close when the server goes), its selector, other pidfds."""
        for pidfd in self.children:
            os.close(pidfd)
        self.selector.close()
        self.control.close()
        self.events.close()

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.control:
                    raw = self.control.recv(MESSAGE_LIMIT)
                    if not raw:
                        self.stop_all()
                        return
                    try:
                        request = SpawnRequest.loads(raw)
                    except (ValueError, TypeError) as err:
                        self.control.send(encode({"error": f"not a spawn request: {err}"}))
                        continue
                    self.spawn(request)
                else:
                    self.reap(int(key.fd))

    def spawn(self, request: SpawnRequest) -> None:
        entry_main = sys.modules[self.entry].main
        try:
            pid = os.fork()
        except OSError as err:
            self.control.send(encode({"error": f"fork failed: {err}"}))
            return
        if pid == 0:
            become_function(request, self.close_in_child, self.die_with_server, entry_main, self.entry)
        self.spawned += 1
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, self.spawned)
        self.selector.register(pidfd, selectors.EVENT_READ)
        socket.send_fds(self.control, [encode({"pid": pid, "id": self.spawned})], [pidfd])

    def reap(self, pidfd: int) -> None:
        pid, number = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status, usage = os.wait4(pid, 0)
        self.events.send(encode({"id": number, "returncode": os.waitstatus_to_exitcode(status),
                                 "cpu_s": usage.ru_utime + usage.ru_stime}))

    def stop_all(self) -> None:
        """The invoker is gone: every function goes with it, as a fresh one would (PDEATHSIG)."""
        for pidfd in list(self.children):
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pidfd, (pid, _) in list(self.children.items()):
            os.waitpid(pid, 0)
            os.close(pidfd)
        self.children.clear()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    control = socket.socket(fileno=int(args[0]))
    events = socket.socket(fileno=int(args[1]))
    try:
        name = args[2] if len(args) > 2 else "function"
        preload(name)
    except BaseException as err:  # noqa: BLE001 - the invoker falls back to fresh interpreters and says why
        control.send(encode({"error": f"{type(err).__name__}: {err}"}))
        raise SystemExit(1) from err
    # what the imports allocated stays shared with every child: out of the collector's sight,
    # a child's collections do not touch (and so copy) those pages
    gc.collect()
    gc.freeze()
    control.send(encode({"ready": os.getpid()}))
    Server(control, events, program(name).module).serve()


if __name__ == "__main__":
    main()
