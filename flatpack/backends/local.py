"""The ``local`` backend: every stage replica is its own OS process (a "function") that
shares nothing with the others but an S3 store — a real S3 server on 127.0.0.1 that the
backend starts and stops itself (SeaweedFS, ``runtime.s3server``).

Like every backend module it exports ``package``, ``deploy``, ``invoke`` and ``teardown``;
``deploy`` returns a :class:`LocalDeployment` whose ``train`` and ``infer`` run the model
(the invoker they use is :mod:`flatpack.backends.functions`, shared with the cloud backends).

Nothing of a deployment lands in the system temp directory for longer than the deployment:
the server's data lives in ``data_dir`` (kept at teardown, for a resumed run) or in a
temporary directory removed at teardown, and the functions' logs in ``workdir`` (default: the
server's directory's ``logs/``, or a temporary directory when the store is someone else's).
Each function runs in its own session (a terminal's Ctrl-C reaches only the invoker, which
stops them) and dies with the invoker (``flatpack.interrupts``). It is forked from this
process's fork server, which has torch imported (``runtime.forked``), or started as a fresh
interpreter where there is none (``FLATPACK_FORK_SERVER=0``, not Linux); a calibration's
cold invocation always starts fresh (:meth:`LocalDeployment.launch_cold`;
docs/local-functions.md).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, TypeVar

from flatpack.runtime import forked
from flatpack.backends.functions import (FUNCTION_CAPABILITIES, FunctionDeployment, Invocation, oom_error,
                                         read_status)
from flatpack.backends.results import Restart, TrainResult
from flatpack.backends.protocol import Capability
from flatpack.backends.store_files import package
from flatpack.compiler import Compiled
from flatpack.errors import InputError
from flatpack.interrupts import stopping, track
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.s3server import LocalS3Server
from flatpack.stage.integrity import check_digest

__all__ = ["NAME", "CAPABILITIES", "LIMITS", "package", "deploy", "invoke", "teardown", "LocalDeployment", "Restart",
           "TrainResult", "read_status", "oom_error"]

NAME = "local"
CAPABILITIES = FUNCTION_CAPABILITIES
LIMITS: dict[Capability, str] = {}   # a function backend offers every operation
D = TypeVar("D", bound="LocalDeployment")


def deploy(compiled: Compiled, *, store_url: str | None = None, env: dict[str, str] | None = None,
           workdir: str | os.PathLike | None = None, run: str | None = None,
           data_dir: str | os.PathLike | None = None, digest: str | None = None) -> LocalDeployment:
    """Starts the local S3 server (unless ``store_url`` names a store to use, with ``env``
    holding its credentials) and uploads the stage artifacts under a fresh run prefix.

    ``data_dir``: the server's directory (a run directory's ``store/``); it survives a crash
    and teardown keeps it unless ``teardown(clean=True)``. Without it the server's data, and
    the logs unless ``workdir`` says where, go to a temporary directory removed at teardown.
    ``digest``: refuse to deploy unless ``compiled.digest`` is this (the digest ``compile``
    printed). Either way every function verifies its stage against ``compiled.digest``,
    which it receives in its invocation (``tests/security/test_worker.py``).
    """
    check_deploy_request(compiled, store_url=store_url, data_dir=data_dir, digest=digest)
    # the fork server's imports overlap the store's start and the upload
    forked.prestart({**os.environ, **(env or {})})
    return open_deployment(LocalDeployment, compiled, store_url=store_url, env=env, workdir=workdir, run=run,
                           data_dir=data_dir)


def check_deploy_request(compiled: Compiled, *, store_url: str | None, data_dir: str | os.PathLike | None,
                         digest: str | None) -> None:
    """What deploy refuses before any process starts: an artifact that is not ``digest``, and
    a store given twice."""
    if digest is not None:
        check_digest(compiled.index.raw, digest, "the artifact to deploy")
    if data_dir is not None and store_url is not None:
        raise InputError("data_dir is where deploy's own S3 server keeps its data; with store_url there is none "
                         "(give one or the other)")


def open_deployment(kind: type[D], compiled: Compiled, *, store_url: str | None,
                    env: dict[str, str] | None, workdir: str | os.PathLike | None, run: str | None,
                    data_dir: str | os.PathLike | None) -> D:
    """A ``kind`` deployment (local, or a subclass whose functions run elsewhere: ``ray``) of
    ``compiled`` on ``store_url``, or on an S3 server started here, with the stage artifacts
    uploaded under ``run`` (a fresh run prefix by default); see :func:`deploy`."""
    server = None
    temporary: Path | None = None
    try:
        if store_url is None:
            server = LocalS3Server(data_dir=data_dir).start()
            store_url, env = server.url(""), server.env()
        if workdir is None:
            if server is not None and server.directory is not None:  # a started server has its directory
                workdir = server.directory / "logs"
            else:
                workdir = temporary = Path(tempfile.mkdtemp(prefix="flatpack-local-"))
        run = run or f"run-{uuid.uuid4().hex[:10]}"
        deployment = kind(compiled, store_url, dict(env or {}), RunKeys(run), Path(workdir),
                          store=server.store() if server is not None else None)
    except BaseException:
        if server is not None:
            server.stop()
        if temporary is not None:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    deployment.server = server
    deployment.temporary_workdir = temporary
    try:
        for key, data in package(compiled).items():
            deployment.store.put(f"{run}/{key}", data)
    except BaseException:
        deployment.teardown()
        raise
    return deployment


def invoke(deployment: LocalDeployment, role: Role) -> Invocation:
    """Starts one function, given only its role and the store's address: forked from this
    process's fork server (torch already imported: ``runtime.forked``), or a fresh
    interpreter where there is none (``FLATPACK_FORK_SERVER=0``, not Linux; docs/local-functions.md)."""
    if stopping():
        raise KeyboardInterrupt("flatpack is stopping: no new function starts")
    env = {**function_env(deployment), ROLE_ENV: role.dumps()}
    log_path = deployment.log_path(role)
    forked_function = forked.spawn(env, log_path)
    if forked_function is not None:
        return track(forked_function)
    return forked.start_interpreter(env, log_path)


def function_env(deployment: LocalDeployment) -> dict[str, str]:
    """What every function of ``deployment`` finds in its environment, but its role."""
    return {**os.environ, **deployment.env, STORE_ENV: deployment.store_url, "PYTHONUNBUFFERED": "1"}


def teardown(deployment: LocalDeployment, clean: bool | None = None) -> None:
    deployment.teardown(clean=clean)


class LocalDeployment(FunctionDeployment):
    """Functions are processes on this machine, held to their tiers by the worker itself."""

    platform = NAME
    emulate_tiers = True
    server: Any = None      # the S3 server deploy started, stopped at teardown
    temporary_workdir: Path | None = None   # a log directory deploy made, removed at teardown

    def launch(self, role: Role) -> Invocation:
        return invoke(self, role)

    def launch_cold(self, role: Role) -> Invocation:
        """Starts ``role`` as a platform's cold start does, in a fresh interpreter that imports
        torch, never forked: what ``flatpack calibrate`` times as a tier's cold start. A
        subclass that starts its functions elsewhere (``ray``) starts them its own way."""
        if type(self).launch is not LocalDeployment.launch:
            return self.launch(role)
        if stopping():
            raise KeyboardInterrupt("flatpack is stopping: no new function starts")
        return forked.start_interpreter({**function_env(self), ROLE_ENV: role.dumps()}, self.log_path(role))

    def log_path(self, role: Role) -> Path:
        return self.workdir / f"{role.kind}-{role.worker}-a{role.attempt}.log"

    def teardown(self, clean: bool | None = None) -> None:
        """Stops every function and the server deploy started; safe to call twice.

        ``clean``: also delete the run's data. By default a deployment whose server keeps its
        data in a caller's ``data_dir`` keeps it (and the run's objects), so the run can be
        resumed; every other deployment is cleaned: its temporary directories are removed,
        and on a store it does not own, the run's objects are deleted.
        """
        server = self.server
        if clean is None:
            clean = not (server is not None and server.keeps_data)
        try:
            if server is None and clean:
                super().teardown()          # someone else's store: delete this run's objects from it
            else:
                # the server's data is either kept whole or removed with its directory: no
                # deletes through it (a dead server would make them wait out the retries)
                self.stop_workers()
                self._inference = None
        finally:
            if server is not None:
                self.server = None
                server.stop(clean=clean)
            if self.temporary_workdir is not None:
                shutil.rmtree(self.temporary_workdir, ignore_errors=True)
                self.temporary_workdir = None


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
