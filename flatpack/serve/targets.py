"""Where a served version's functions run: :class:`Target`, opened once per server.

``local``: every function is a process on this machine (``backends.local``). ``ray``: every
function is a Ray task on the cluster at ``address`` (``backends.ray``), started once and kept
warm, as local's: the fork-join master and workers are long-running tasks that serve request
after request until the version closes.

The Ray connection is opened here, on the thread that builds the server (the main one for
``flatpack serve``), before a model is compiled (its plan then sees the cluster's nodes,
``backends.ray.connect``) and before any version deploys from its own thread: ``ray.init``
wants the main thread for its signal handler, and every version of one server shares the one
connection. :meth:`Target.close` disconnects only a connection opened here; one the caller
had (``ray.init`` in a notebook, a test's cluster) stays.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flatpack.backends import get_backend
from flatpack.compiler import Compiled
from flatpack.serve.settings import ServeSettings


@dataclass
class Target:
    """The backend a server deploys its versions on, and the Ray connection it opened, if any."""

    name: str
    address: str | None = None
    connection: Any = None          # backends.ray.Connection for the ray target

    @classmethod
    def open(cls, settings: ServeSettings) -> Target:
        if settings.target != "ray":
            return cls(settings.target)
        # optional dependency: the ray backend's module imports ray only when it connects
        from flatpack.backends import ray as ray_backend

        return cls("ray", settings.address, ray_backend.connect(settings.address))

    def deploy(self, compiled: Compiled, alongside: Any = None) -> Any:
        """``compiled`` deployed as functions on this target (pinned to its digest); they start
        warm at the first request (``FunctionDeployment.infer``). ``alongside``: a deployment
        whose store this one shares, under a run prefix of its own (another replica of a
        served version: no second store server)."""
        # on ray, through the connection opened above: deploy neither reconnects nor closes it
        if alongside is None:
            return get_backend(self.name).deploy(compiled, digest=compiled.digest)
        return get_backend(self.name).deploy(compiled, digest=compiled.digest, store_url=alongside.store_url,
                                             env=dict(alongside.env))

    def cpus(self) -> float:
        """The CPUs functions of this target run on: this machine's (local), the cluster's (ray)."""
        if self.connection is not None:
            return sum(node.cpus for node in self.connection.cluster.nodes)
        return float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)

    def close(self) -> None:
        connection, self.connection = self.connection, None
        if connection is not None and connection.opened_here:
            # optional dependency: only a ray target has a connection to close
            import ray

            ray.shutdown()
