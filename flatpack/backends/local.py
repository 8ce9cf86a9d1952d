"""The ``local`` backend: every stage replica is its own OS process (a "function") that
shares nothing with the others but an S3 store — a real S3 server on 127.0.0.1 that the
backend starts and stops itself (SeaweedFS, ``runtime.s3server``).

Like every backend module it exports ``package``, ``deploy``, ``invoke`` and ``teardown``;
``deploy`` returns a :class:`LocalDeployment` whose ``train`` and ``infer`` run the model
(the invoker they use is :mod:`flatpack.backends.functions`, shared with the cloud backends).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from flatpack.backends.functions import FunctionDeployment, Restart, TrainResult, oom_error, read_status
from flatpack.codegen.artifact import serialize
from flatpack.compiler import Compiled
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.spec import Role
from flatpack.runtime.worker import ROLE_ENV, STORE_ENV

__all__ = ["NAME", "package", "deploy", "invoke", "teardown", "LocalDeployment", "Restart", "TrainResult",
           "read_status", "oom_error"]

NAME = "local"


def package(compiled: Compiled) -> dict[str, bytes]:
    """The deployment's files, by store key below the run prefix: each stage's artifact."""
    files = {}
    for artifact in compiled.artifacts:
        for name, data in serialize(artifact).items():
            files[f"artifacts/stage_{artifact.index:03d}/{name}"] = data
    return files


def deploy(compiled: Compiled, *, store_url: str | None = None, env: dict[str, str] | None = None,
           workdir: str | os.PathLike | None = None, run: str | None = None) -> "LocalDeployment":
    """Starts the local S3 server (unless ``store_url`` names a store to use, with ``env``
    holding its credentials) and uploads the stage artifacts under a fresh run prefix."""
    server = None
    if store_url is None:
        from flatpack.runtime.s3server import LocalS3Server
        server = LocalS3Server().start()
        store_url, env = server.url(""), server.env()
    run = run or f"run-{uuid.uuid4().hex[:10]}"
    deployment = LocalDeployment(compiled, store_url, dict(env or {}), RunKeys(run),
                                 Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="flatpack-local-")),
                                 store=server.store() if server is not None else None)
    deployment.server = server
    try:
        for key, data in package(compiled).items():
            deployment.store.put(f"{run}/{key}", data)
    except BaseException:
        deployment.teardown()
        raise
    return deployment


def invoke(deployment: "LocalDeployment", role: Role) -> subprocess.Popen:
    """Starts one function: a fresh interpreter given only its role and the store's address."""
    env = {**os.environ, **deployment.env, ROLE_ENV: role.dumps(), STORE_ENV: deployment.store_url,
           "PYTHONUNBUFFERED": "1"}
    log = open(deployment.workdir / f"{role.kind}-{role.worker}-a{role.attempt}.log", "wb")
    try:
        return subprocess.Popen([sys.executable, "-m", "flatpack.runtime.worker"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        log.close()


def teardown(deployment: "LocalDeployment") -> None:
    deployment.teardown()


class LocalDeployment(FunctionDeployment):
    """Functions are processes on this machine, held to their tiers by the worker itself."""

    platform = NAME
    emulate_tiers = True
    server: Any = None      # the S3 server deploy started, stopped at teardown

    def launch(self, role: Role) -> subprocess.Popen:
        return invoke(self, role)

    def teardown(self) -> None:
        """Stops every function, deletes the run's objects and stops the server deploy started."""
        super().teardown()
        if self.server is not None:
            self.server.stop()
            self.server = None


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
