"""The process tree, read from /proc (Linux): who a process started, and which of them still run.

A process is named by its pid and its start time, so that a pid the kernel hands to a new
process after the old one ended is not mistaken for the old one; a zombie has finished.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a process, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (to tell a reused pid apart)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = stat(int(entry))
            if info is not None and info[0] != "Z":
                children.setdefault(info[1], []).append(int(entry))
                starts[int(entry)] = info[2]
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = starts[child]
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(processes: dict[int, int]) -> dict[int, str]:
    """Those of ``processes`` still running (a zombie has finished), with their command lines."""
    running = {}
    for pid, start in processes.items():
        info = stat(pid)
        if info is not None and info[2] == start and info[0] != "Z":
            running[pid] = cmdline(pid)[:200] or "?"
    return running


def wait_gone(processes: dict[int, int], timeout_s: float) -> dict[int, str]:
    """Waits up to ``timeout_s`` for every one of ``processes`` to end; returns those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = alive(processes)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def kill_all(processes: dict[int, int]) -> None:
    """SIGKILLs those of ``processes`` still running (a test's own, whatever it found)."""
    for pid in alive(processes):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
