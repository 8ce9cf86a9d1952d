"""What a Ray task of the ``ray`` backend runs on its node: one function, the same
``python -m flatpack.runtime.worker`` process the local backend starts, given its role and
the store's address in its environment; the task returns the process's exit code and the
tail of its output.

A process of its own per function, not the Ray worker process itself, because the function
is held to its tier by its own process's figures (peak resident memory, thread CPU time),
kills itself for an injected ``kill`` fault and ends with ``os._exit``: a Ray worker is
reused across tasks and carries Ray's own memory. It is forked from the Ray worker's fork
server (``runtime.forked``; torch imported once per Ray worker, which Ray reuses across the
tasks of a driver), or started as a fresh interpreter where functions are not forked
(``FLATPACK_FORK_SERVER=0``, not Linux). Either way it dies with the task's process
(``PR_SET_PDEATHSIG``, through the server when forked: ``ray.cancel(force=True)`` or a lost
node takes it down too); Ray runs a task on its worker's main thread, which that needs
(``flatpack.interrupts``).

No torch in the Ray worker itself: ``runtime.forked`` speaks to the server without it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from flatpack.runtime import forked

LOG_LIMIT_BYTES = 1 << 20     # the tail of a function's output that travels back with its exit code


def run_function(env: dict[str, str], log_limit_bytes: int = LOG_LIMIT_BYTES) -> tuple[int, bytes, str]:
    """Runs one function with ``env`` added to this process's environment; returns its exit
    code (negative: the signal that ended it), the last ``log_limit_bytes`` of its output and
    the id of the node it ran on."""
    # optional dependency: this runs inside a Ray task, where ray is installed; importing the
    # module elsewhere (the invoker pickles this function by reference) must not need it
    import ray

    node = ray.get_runtime_context().get_node_id()
    environment = {**os.environ, **env}
    # an anonymous file (nothing left behind if the task is killed); the function opens it
    # through this process's descriptor
    with tempfile.TemporaryFile(prefix="flatpack-function-") as log:
        log_path = Path(f"/proc/{os.getpid()}/fd/{log.fileno()}")
        process = forked.spawn(environment, log_path) or forked.start_interpreter(environment, log_path)
        code = process.wait()
        size = log.seek(0, os.SEEK_END)
        log.seek(max(0, size - log_limit_bytes))
        return code, log.read(), node
