"""uvicorn running the service: in the foreground with SIGTERM/SIGINT draining
(:meth:`Server.run`, what ``flatpack serve`` and ``flatpack.serve`` do), or on a thread
(:meth:`Server.start`, for tests and notebooks).

A signal first drains (new requests get 503, the accepted ones finish: ``Service.drain``),
keeps answering 503 for ``drain_grace_s``, then uvicorn stops listening and the lifespan's
end stops every function; a second signal exits without waiting
(``tests/integration/test_serve.py`` sends SIGTERM under load).
"""

from __future__ import annotations

import asyncio
import math
import contextlib
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import uvicorn

from flatpack import logs
from flatpack.api import compile as compile_model
from flatpack.compiler import Compiled, load
from flatpack.errors import InputError
from flatpack.partitioner.workload import Workload
from flatpack.serve.app import build_app
from flatpack.serve.batcher import HEADROOM
from flatpack.serve.service import Service
from flatpack.serve.settings import ServeSettings
from flatpack.serve.targets import Target
from flatpack.stage.integrity import check_digest

LOG = logs.get("serve")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def resolve(model: Any, example_inputs: Any = None, *, digest: str | None = None, settings: ServeSettings) -> Compiled:
    """What to serve: a :class:`Compiled`, an artifact directory (loaded pinned to
    ``digest`` when given), or an ``nn.Module`` with ``example_inputs`` (compiled here for
    inference: with ``settings.replan``, profiled and planned by ``replan_solver`` as the
    cheapest plan whose batch of the example's size fits a batch's share of the SLO, the plan
    ``serve.replan`` re-chooses as the batch sizes move; else with the default solver)."""
    if isinstance(model, Compiled):
        if digest is not None:
            check_digest(model.index.raw, digest, "the compiled model to serve")
        return model
    if isinstance(model, (str, os.PathLike)):
        if not Path(model).is_dir():
            raise InputError(f"{model} is not a directory; give an artifact directory written by flatpack compile")
        return load(model, digest=digest)
    if example_inputs is None:
        raise InputError("serving a model needs example_inputs (a batch of the inputs it takes), or give a "
                         "compiled artifact directory")
    first = example_inputs if not isinstance(example_inputs, (tuple, list)) else example_inputs[0]
    batch = int(first.shape[0]) if hasattr(first, "shape") and len(first.shape) else 1
    if not settings.replan:
        workload = Workload(mode="infer", batch=batch, slo_s=settings.slo_s)
        return compile_model(model, example_inputs, target=settings.target, workload=workload)
    workload = Workload(mode="infer", batch=batch, slo_s=HEADROOM * settings.slo_s / 2)
    return compile_model(model, example_inputs, target=settings.target, workload=workload,
                         solver=settings.replan_solver, profile=True)


class _Uvicorn(uvicorn.Server):
    """uvicorn whose signals drain the service before it stops listening."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service
        self._draining: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()     # where another thread's stop() schedules the drain
        await super().serve(sockets)

    def begin_shutdown(self) -> None:
        """Drain, then exit (on the server's loop); a second call exits now."""
        if self._draining is not None:
            self.force_exit = True
            return
        self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.service.drain()
        # still listening for a moment: a request already on its way gets a 503 naming the
        # drain, not a refused connection (a load balancer has seen /readyz fail by then)
        await asyncio.sleep(self.service.settings.drain_grace_s)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        previous = {sig: signal.signal(sig, lambda *_: loop.call_soon_threadsafe(self.begin_shutdown))
                    for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Server:
    """The service on ``settings.host:settings.port`` (port 0: a free one, see :attr:`url`),
    deploying on ``target`` (opened here from ``settings`` when not given; the server closes
    it when it stops)."""

    def __init__(self, compiled: Compiled, settings: ServeSettings, target: Target | None = None) -> None:
        self.settings = settings
        self.target = target if target is not None else Target.open(settings)
        self.service = Service(compiled, settings, self.target)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((settings.host, settings.port))
        except OSError as err:
            self.socket.close()
            self.target.close()
            raise InputError(f"cannot listen on {settings.host}:{settings.port} ({err.strerror}); choose another "
                             "--port") from None
        config = uvicorn.Config(build_app(self.service), log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s), access_log=False)
        self._uvicorn = _Uvicorn(config, self.service)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def run(self) -> None:
        """Serves until SIGTERM or SIGINT (then drains and stops every function)."""
        LOG.info("serving %s on %s", self.service.version.digest[:12], self.url)
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self.target.close()

    def start(self) -> Server:
        """Serves on a thread; :meth:`stop` drains and stops it."""
        self._thread = threading.Thread(target=self.run, name="flatpack-serve", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        loop = self._uvicorn.loop
        if loop is None:
            self._uvicorn.should_exit = True
        else:
            loop.call_soon_threadsafe(self._uvicorn.begin_shutdown)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(model: Any, example_inputs: Any = None, *, slo_ms: float, digest: str | None = None, target: str = "local",
          host: str = "127.0.0.1", port: int = 8000, admin_token: str | None = None, **options: Any) -> None:
    """Serves ``model`` (a Compiled, an artifact directory or an ``nn.Module`` with its
    ``example_inputs``) over HTTP until SIGTERM: ``flatpack serve`` in Python. ``options``:
    the other :class:`ServeSettings` fields (``address``, ``max_body_bytes``, ``max_batch``, ...)."""
    settings = ServeSettings(slo_s=slo_ms / 1e3, target=target, host=host, port=port, admin_token=admin_token,
                             **options)
    serve_with(settings, lambda: resolve(model, example_inputs, digest=digest, settings=settings))


def serve_with(settings: ServeSettings, compiled: Callable[[], Compiled]) -> None:
    """Opens the target (a Ray cluster's connection: before compiling, so that the plan sees
    its nodes), gets what to serve from ``compiled`` and serves it until SIGTERM."""
    target = Target.open(settings)
    try:
        server = Server(compiled(), settings, target)
    except BaseException:
        target.close()
        raise
    print(f"serving {server.service.version.digest} on {server.url}", flush=True)
    server.run()
