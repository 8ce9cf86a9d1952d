"""A toy backend, the whole of it: what adding a backend to flatpack takes is a module like
this one (``NAME``, ``CAPABILITIES``, ``LIMITS``, ``package``, ``deploy``, ``invoke``,
``teardown``: the :class:`~flatpack.backends.protocol.Backend` protocol) plus its
registration in ``flatpack.backends.BACKENDS`` and a platform of the same name
(``test_extending.py`` registers both; docs/extending.md).

It runs the local backend's functions through a launcher of its own: each function is the
same worker (``python -m flatpack.runtime.worker``) on the same local S3 server, started
without the local backend's die-with-parent hook, with :data:`MARKER_ENV` in its
environment, and recorded in the deployment's ``launched``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from flatpack.backends.functions import FUNCTION_CAPABILITIES
from flatpack.backends.local import LocalDeployment, open_deployment
from flatpack.backends.protocol import Capability
from flatpack.backends.store_files import package as package
from flatpack.compiler import Compiled
from flatpack.interrupts import track
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV

NAME = "local-marked"
CAPABILITIES = FUNCTION_CAPABILITIES   # a function backend offers every operation
LIMITS: dict[Capability, str] = {}
MARKER_ENV = "FLATPACK_TOY_BACKEND"


def deploy(compiled: Compiled, *, workdir: str | os.PathLike | None = None) -> MarkedDeployment:
    """Starts a local S3 server and uploads the stage artifacts, as the local backend does."""
    return open_deployment(MarkedDeployment, compiled, store_url=None, env=None, workdir=workdir, run=None,
                           data_dir=None)


def invoke(deployment: MarkedDeployment, role: Role) -> subprocess.Popen:
    """Starts one function: the local backend's worker, marked, in its own session."""
    env = {**os.environ, **deployment.env, ROLE_ENV: role.dumps(), STORE_ENV: deployment.store_url,
           MARKER_ENV: deployment.keys.run, "PYTHONUNBUFFERED": "1"}
    with open(Path(deployment.workdir) / f"marked-{role.kind}-{role.worker}-a{role.attempt}.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "flatpack.runtime.worker"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    deployment.launched.append((role.kind, role.worker, env[MARKER_ENV]))
    return track(process)


def teardown(deployment: MarkedDeployment, clean: bool | None = None) -> None:
    deployment.teardown(clean=clean)


class MarkedDeployment(LocalDeployment):
    """The local deployment, its functions started by :func:`invoke` on the toy platform."""

    platform = NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.launched: list[tuple[str, str, str]] = []   # (role kind, worker, marker) per function started

    def launch(self, role: Role) -> subprocess.Popen:
        return invoke(self, role)


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
