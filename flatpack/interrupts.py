"""How flatpack stops every process it started: on Ctrl-C, on SIGTERM and when it is killed.

Three layers, each covering what the one before cannot:

1. **Clean path** (:func:`clean_shutdown`, installed by ``flatpack.cli.main`` around every
   command). SIGINT, SIGTERM and SIGHUP all become :class:`Interrupted` (a
   ``KeyboardInterrupt``), so the ``with``/``finally`` blocks that tear a deployment down run
   the same way for a signal as for Ctrl-C. The first signal also SIGKILLs every worker
   process started through :func:`track` at once (they hold no state a resumed run needs:
   the store and checkpoints do), so a runner cannot relaunch one while it unwinds.
   Further signals during the shutdown are shielded (noted once, never raised into the
   teardown), and if the teardown takes longer than ``force_after_s`` the process exits
   hard: layer 2 then still takes the children down.
2. **Killed parent** (:func:`die_with_parent`). SIGKILL of flatpack runs no handler at all.
   On Linux every child (the SeaweedFS server, each worker) is started with
   ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` set between fork and exec, so the kernel kills it
   when its parent goes. The kernel's "parent" is the *thread* that started the child, so
   only a child started from a thread that lives as long as the process gets it (one started
   from a short-lived thread would die with that thread: a warm inference function, say):
   the main thread, or the one thread :func:`on_lasting_thread` keeps for the rest of the
   process, which starts a child for a caller on any other thread (``flatpack serve``
   deploys from a version's own thread; ``runtime.s3server`` starts the store through it).
   A function process watches its invoker itself as well (``runtime.invoker_watch``: a
   pidfd it polls), which covers every thread and a fork server between them; weed, a Go
   binary, cannot watch, hence the lasting thread. Local functions forked by the fork server
   (``runtime.forked``) are the server's children, not the invoker's: the server has
   PDEATHSIG towards the invoker and also reads end of file on its control socket when the
   invoker goes (from any thread), and SIGKILLs them; each of them has PDEATHSIG towards the
   server. :func:`kill_children` signals them through their pidfds. Elsewhere (macOS,
   Windows) there is no such call: only layers 1 and 3, and the functions' own watch, apply.
3. **Interpreter exit**: ``runtime.s3server`` stops every server still running at exit.

Stdlib only: ``runtime`` and ``backends`` both import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from typing import IO, Callable, Iterator, Protocol, TypeVar

__all__ = ["Interrupted", "clean_shutdown", "die_with_parent", "on_lasting_thread", "track", "kill_children",
           "stopping", "FORCE_AFTER_S"]

FORCE_AFTER_S = 20.0        # a teardown that takes longer than this after the first signal is cut short
PR_SET_PDEATHSIG = 1        # <linux/prctl.h>



class Child(Protocol):
    """A started process as this module signals it: ``subprocess.Popen``, or a function forked
    by the fork server (``runtime.forked.ForkedProcess``, signalled through its pidfd)."""

    pid: int
    returncode: int | None

    def send_signal(self, sig: int) -> None: ...


C = TypeVar("C", bound=Child)
_workers: weakref.WeakSet[Child] = weakref.WeakSet()
_servers: weakref.WeakSet[Child] = weakref.WeakSet()
_stopping = threading.Event()
T = TypeVar("T")


class Interrupted(KeyboardInterrupt):
    """A stop request by signal: SIGINT (Ctrl-C), SIGTERM or SIGHUP; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# ---- layer 2: children die with their parent ------------------------------------------------

_prctl: Callable[..., int] | None = None
_prctl_loaded = False


def _load_prctl() -> Callable[..., int] | None:
    global _prctl, _prctl_loaded
    if not _prctl_loaded:
        _prctl_loaded = True
        if sys.platform.startswith("linux"):
            try:
                function = ctypes.CDLL(None, use_errno=True).prctl
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
                _prctl = function
            except (OSError, AttributeError):
                _prctl = None
    return _prctl


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child receive ``sig`` when this
    process exits, however it exits (SIGKILL included); ``None`` where the OS has no such
    call (anything but Linux) and on a thread that may end before the process (any but the
    main thread and :func:`on_lasting_thread`'s; see the module's note).

    Everything the child runs is resolved here, in the parent: between fork and exec the
    child imports nothing and allocates almost nothing. If the parent died before the call
    took effect, the child kills itself instead of running as an orphan.
    """
    prctl = _load_prctl()
    if prctl is None or not _lasting():
        return None
    parent = os.getpid()
    getppid, kill, getpid = os.getppid, os.kill, os.getpid

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if getppid() != parent:
            kill(getpid(), signal.SIGKILL)

    return preexec


class _LastingThread:
    """One daemon thread that runs what it is given and never returns: a child forked on it
    has a "parent" (for PR_SET_PDEATHSIG) that lives until the process does. Not a
    ThreadPoolExecutor: the interpreter joins those at exit, before the atexit handlers
    stop the servers in order."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="flatpack-lasting", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            call, result = self.calls.get()
            if result.set_running_or_notify_cancel():
                try:
                    result.set_result(call())
                except BaseException as err:  # noqa: BLE001 - handed to the caller, raised on its thread
                    result.set_exception(err)


_lasting_thread: _LastingThread | None = None
_lasting_lock = threading.Lock()


def _lasting() -> bool:
    current = threading.current_thread()
    return current is threading.main_thread() or (_lasting_thread is not None and current is _lasting_thread.thread)


def on_lasting_thread(start: Callable[[], T]) -> T:
    """``start()`` on a thread that lives as long as this process (this one, if it is the main
    thread), so that a child it starts with :func:`die_with_parent` dies with the process,
    not with the caller's thread; its result or its exception comes back to the caller."""
    global _lasting_thread
    if _lasting():
        return start()
    with _lasting_lock:
        if _lasting_thread is None:
            _lasting_thread = _LastingThread()
    result: Future[T] = Future()
    _lasting_thread.calls.put((start, result))
    return result.result()


# ---- registry of children ---------------------------------------------------------------------

def track(process: C, *, server: bool = False) -> C:
    """Registers a child: a worker is SIGKILLed on the first stop signal; a ``server`` (a
    process group) is left to its owner's orderly stop and killed only on a forced exit."""
    (_servers if server else _workers).add(process)
    return process


def stopping() -> bool:
    """True once a stop signal arrived: nothing new should be started."""
    return _stopping.is_set()


def kill_children(*, servers: bool = False) -> None:
    """SIGKILLs every tracked worker still running (and with ``servers``, every server's
    process group). Safe in a signal handler: only ``os.kill`` of children not yet reaped."""
    for process in list(_workers):
        _kill(process, group=False)
    if servers:
        for process in list(_servers):
            _kill(process, group=True)


def _kill(process: Child, *, group: bool) -> None:
    # a process whose returncode is still None has not been reaped, so its pid is still ours
    if process.returncode is not None:
        return
    try:
        if group:
            os.killpg(process.pid, signal.SIGKILL)
        elif isinstance(process, subprocess.Popen):
            os.kill(process.pid, signal.SIGKILL)
        else:
            # not this process's child: its pid is signalled through the handle (a pidfd), which
            # stays right after another process reaped it
            process.send_signal(signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ---- layer 1: signals become one clean path ------------------------------------------------------

class _Shutdown:
    def __init__(self, stream: IO[str], force_after_s: float) -> None:
        self.stream = stream
        self.force_after_s = force_after_s
        self.signum: int | None = None
        self.noted = False
        self.timer: threading.Timer | None = None

    def handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
            _stopping.set()
            kill_children()
            self._say(f"flatpack: {signal.Signals(signum).name} received; stopping every process it started")
            self.timer = threading.Timer(self.force_after_s, self.force)
            self.timer.daemon = True
            self.timer.start()
            raise Interrupted(signum)
        # a second Ctrl-C (or a SIGTERM after it) must not break the teardown half-way
        kill_children()
        if not self.noted:
            self.noted = True
            self._say(f"flatpack: still stopping (at most {self.force_after_s:.0f} s); "
                      f"{signal.Signals(signum).name} ignored until it is done")

    def force(self) -> None:
        self._say(f"flatpack: stopping took longer than {self.force_after_s:.0f} s; exiting now")
        kill_children(servers=True)
        os._exit(128 + (self.signum or signal.SIGTERM))

    def _say(self, text: str) -> None:
        # print, not the flatpack logger: this runs in a signal handler, and a logging handler's
        # lock may be held by the very code the signal interrupted
        try:
            print(text, file=self.stream, flush=True)
        except Exception:  # noqa: BLE001 - a closed or broken stream must not stop the shutdown
            pass


@contextlib.contextmanager
def clean_shutdown(*, stream: IO[str] | None = None, force_after_s: float = FORCE_AFTER_S,
                   signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Turns SIGINT/SIGTERM/SIGHUP into :class:`Interrupted` inside the block (main thread
    only; elsewhere it does nothing).

    The previous handlers come back when the block ends, unless a signal arrived: then these
    signals stay ignored (the process is on its way out: a Ctrl-C must neither interrupt the
    at-exit stop of the servers nor, once the interpreter has reset its handlers while it
    finalizes, kill it with the wrong exit status); the force timer still bounds the exit.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    shutdown = _Shutdown(stream if stream is not None else sys.stderr, force_after_s)
    previous = {}
    for sig in signals:
        try:
            previous[sig] = signal.signal(sig, shutdown.handle)
        except (ValueError, OSError):  # a signal this OS lacks
            pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if shutdown.signum is None else signal.SIG_IGN)
