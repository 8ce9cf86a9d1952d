"""A function process ends when the process that invoked it is gone, whichever thread started it.

``PR_SET_PDEATHSIG`` (``flatpack.interrupts.die_with_parent``) ties a child to the *thread*
that forked it, so the invoker sets it only from its main thread; a function started from
any other thread (``flatpack serve`` deploys from a version's own thread) would outlive a
SIGKILLed invoker. So the function watches its invoker itself: :func:`watch_invoker` opens a
pidfd on the invoker's pid (``os.pidfd_open``, Linux 5.3+; it names that process and no later
one with the same pid) and a daemon thread blocks in ``poll`` on it, which wakes when the
invoker exits however it exits, and then kills this process. Where pidfds are missing it
polls instead (every :data:`POLL_S`): the parent changed (the kernel re-parents an orphan),
or the given pid is gone.

Which pid: ``$FLATPACK_INVOKER_PID`` (:data:`INVOKER_PID_ENV`) when the invoker put it in the
function's environment (a fork server between them: the function's parent is then not the
invoker), else the parent at the moment of the call, which is why ``runtime.worker`` calls it
before it loads torch (seconds on a busy host: an invoker killed meanwhile is seen too). An
invoker that is pid 1 is watched like any other (``flatpack serve`` as a container's entry
point is pid 1 of its namespace), so a function orphaned in the instant between its start
and the watch, and re-parented to init, is not told apart from one init started; the window
is the interpreter's start-up, before any of flatpack's heavy imports. A process with no
parent at all (pid 1 itself) has no invoker to watch. The Lambda and container handlers run
``worker.run_role`` in their own process, without this watch.

Stdlib only: it runs before anything heavy is imported.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Callable

__all__ = ["INVOKER_PID_ENV", "POLL_S", "invoker_pid", "watch_invoker"]

INVOKER_PID_ENV = "FLATPACK_INVOKER_PID"
POLL_S = 0.25        # the fallback's period (no pidfd): the most an orphan runs on after its invoker


def invoker_pid() -> int:
    """``$FLATPACK_INVOKER_PID`` when set to a pid, else this process's parent."""
    given = os.environ.get(INVOKER_PID_ENV, "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else os.getppid()


def _die() -> None:
    # nothing to report to: the invoker that would read a status record or an exit code is gone
    os.kill(os.getpid(), signal.SIGKILL)


def watch_invoker(pid: int | None = None, on_gone: Callable[[], None] = _die) -> threading.Thread | None:
    """Calls ``on_gone`` (default: SIGKILL of this process) once the invoker ``pid`` (default:
    :func:`invoker_pid`) has exited; returns the daemon thread that waits for it, or None when
    ``on_gone`` ran already (the invoker was gone before the watch began)."""
    is_parent = pid is None and not os.environ.get(INVOKER_PID_ENV, "").strip().isdigit()
    pid = invoker_pid() if pid is None else pid
    if pid <= 0:
        return None         # pid 1 of a namespace: nobody invoked it
    handle = _pidfd(pid)
    if (is_parent and os.getppid() != pid) or (handle is None and not _exists(pid)):
        if handle is not None:
            os.close(handle)
        on_gone()           # exited between reading its pid and opening the pidfd
        return None
    watch = _wait_pidfd if handle is not None else _poll
    thread = threading.Thread(target=watch, args=(pid if handle is None else handle, is_parent, on_gone),
                              name="flatpack-invoker-watch", daemon=True)
    thread.start()
    return thread


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; None where the call is missing or refused, or the pid is gone
    (the caller's existence check then tells which)."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:     # gone (ESRCH), a kernel before 5.3 (ENOSYS), a sandbox that forbids the call
        return None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # alive, someone else's (a pid given in the environment)
        return True
    return True


def _wait_pidfd(handle: int, is_parent: bool, on_gone: Callable[[], None]) -> None:
    poller = select.poll()
    poller.register(handle, select.POLLIN)
    while not poller.poll():    # readable once the process has exited; no timeout, no busy loop
        pass
    os.close(handle)
    on_gone()


def _poll(pid: int, is_parent: bool, on_gone: Callable[[], None]) -> None:
    while (os.getppid() == pid) if is_parent else _exists(pid):
        time.sleep(POLL_S)
    on_gone()
