"""What one ``flatpack serve`` runs with, parsed once at the edge (:class:`ServeSettings`).

The admin token is read here from an environment variable or a file and is never logged: its
``repr`` is hidden, and an error about it names where it came from, never its value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flatpack import safeio
from flatpack.errors import InputError

TARGETS = ("local", "ray")     # the backends whose functions stay resident between requests
DEFAULT_MAX_BODY_BYTES = 16 * safeio.MiB
DEFAULT_MAX_REQUEST_SAMPLES = 256
DEFAULT_MAX_BATCH = 64          # the batcher's cap, whatever the latency model would allow
TOKEN_ENV = "FLATPACK_ADMIN_TOKEN"
# the warm floor: one fork-join group always warm, so that no request after a quiet spell pays
# the functions' cold start (seconds, beyond any SLO worth serving); 0 would be scale-to-zero
DEFAULT_MIN_REPLICAS = 1
# how long the pool must want fewer replicas before one is removed: Knative's default stable
# window (60 s), long enough that the pauses between a load's bursts do not tear a group down
# only to cold-start it again seconds later
DEFAULT_IDLE_S = 60.0
# the solver that re-chooses the plan when the batch sizes move (serve.replan): the exact one
# that prices fork-join groups with Gillis's model (solvers.dp)
DEFAULT_REPLAN_SOLVER = "dp"
MAX_TOKEN_FILE_BYTES = 4096


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """``slo_s``: the latency bound every request should meet (queueing + inference);
    ``max_body_bytes``: a larger request body is refused (413) before it is read whole;
    ``max_request_samples``: a request with more samples is refused (413); ``max_batch``:
    the most samples one batch may hold; ``admin_token``: the bearer token ``POST
    /admin/version`` requires (None: the endpoint is off); ``drain_timeout_s``: how long a
    SIGTERM waits for the requests in flight; ``drain_grace_s``: how long it then keeps
    answering new requests with 503 before it stops listening; ``address``: the Ray cluster
    of the ``ray`` target (``backends.ray.connect``: ``auto``, ``HOST:PORT``, ``ray://HOST:10001``
    or ``local``; None: the connection this process has, else ``auto``); ``min_replicas``,
    ``max_replicas`` (None: as many as the target's CPUs hold, :meth:`replica_ceiling`) and
    ``idle_s``: the warm pool's bounds and how long it must want fewer replicas before one
    goes (``serve.scaling``); ``replan``: re-choose the plan when the batch sizes move, with
    ``replan_solver`` (a solver name or a ``Problem -> Plan`` callable; ``serve.replan``)."""

    slo_s: float
    target: str = "local"
    address: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_request_samples: int = DEFAULT_MAX_REQUEST_SAMPLES
    max_batch: int = DEFAULT_MAX_BATCH
    drain_timeout_s: float = 60.0
    drain_grace_s: float = 1.0
    admin_token: str | None = field(default=None, repr=False)
    min_replicas: int = DEFAULT_MIN_REPLICAS
    max_replicas: int | None = None
    idle_s: float = DEFAULT_IDLE_S
    replan: bool = True
    replan_solver: Any = DEFAULT_REPLAN_SOLVER

    def __post_init__(self) -> None:
        if not (isinstance(self.slo_s, (int, float)) and math.isfinite(self.slo_s) and self.slo_s > 0):
            raise InputError(f"the SLO must be a positive number of seconds, got {self.slo_s!r} "
                             "(--slo-ms 200 is 0.2 s)")
        if self.target not in TARGETS:
            raise InputError(f"flatpack serve runs on {' or '.join(TARGETS)} so far, not {self.target!r}; "
                             "use --target local or --target ray")
        if self.address is not None and self.target != "ray":
            raise InputError("--address names the Ray cluster to serve on; give --target ray with it, or leave it out")
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise InputError(f"port must be 0..65535 (0: any free port), got {self.port!r}")
        for name in ("max_body_bytes", "max_request_samples", "max_batch"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise InputError(f"{name} must be a positive integer, got {value!r}")
        self._check_scaling()
        if not self.drain_timeout_s > 0 or not self.drain_grace_s >= 0:
            raise InputError(f"drain_timeout_s must be positive and drain_grace_s at least 0, got "
                             f"{self.drain_timeout_s!r} and {self.drain_grace_s!r}")


    def _check_scaling(self) -> None:
        if not (isinstance(self.min_replicas, int) and self.min_replicas >= 1):
            raise InputError(f"--min-replicas must be an integer of at least 1 (the warm floor), got "
                             f"{self.min_replicas!r}")
        if self.max_replicas is not None and not (isinstance(self.max_replicas, int)
                                                  and self.max_replicas >= self.min_replicas):
            raise InputError(f"--max-replicas must be an integer of at least --min-replicas ({self.min_replicas}), "
                             f"got {self.max_replicas!r}")
        if not (isinstance(self.idle_s, (int, float)) and math.isfinite(self.idle_s) and self.idle_s >= 0):
            raise InputError(f"--idle-s must be a number of seconds of at least 0, got {self.idle_s!r}")

    def replica_ceiling(self, cpus: float, functions_per_replica: int) -> int:
        """``max_replicas``, or by default as many groups as the target's CPUs hold (a group
        beyond them only contends for the same cores), never under ``min_replicas``."""
        if self.max_replicas is not None:
            return self.max_replicas
        return max(self.min_replicas, int(cpus // max(functions_per_replica, 1)))


def read_admin_token(token_file: str | os.PathLike | None = None, env_name: str = TOKEN_ENV) -> str | None:
    """The admin bearer token: from ``token_file`` (its first line) when given, else from the
    environment variable ``env_name``; None when neither is set (the admin endpoint is off)."""
    if token_file is not None:
        path = Path(token_file)
        raw = safeio.read_bounded(path, limit=MAX_TOKEN_FILE_BYTES, what="the admin token file")
        token = raw.decode("utf-8", "replace").strip().splitlines()[0] if raw.strip() else ""
        if len(token) < 16:
            raise InputError(f"the admin token file {path} must hold one token of 16 to {MAX_TOKEN_FILE_BYTES} "
                             "characters on its first line")
        return token
    token = os.environ.get(env_name)
    if token is None or not token.strip():
        return None
    if len(token.strip()) < 16:
        raise InputError(f"the admin token in ${env_name} is shorter than 16 characters; use a random one "
                         "(python -c 'import secrets; print(secrets.token_urlsafe())')")
    return token.strip()
