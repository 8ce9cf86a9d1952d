"""The HTTP service: a Starlette application in front of one warm deployment at a time.

Starlette rather than FastAPI: FastAPI is Starlette plus pydantic models and dependency
injection; this service has six routes, parses its two body forms itself (tensors, checked
against the model's own input specs, which a pydantic schema would only restate), and needs
no injection, so FastAPI would add a dependency tree for nothing. Starlette is small, typed,
ASGI, and what FastAPI is built on; uvicorn runs it (``serve.server``).

Routes: ``POST /v1/predict``, ``GET /healthz`` (the process answers), ``GET /readyz`` (a
version is warm and the server is not draining), ``GET /metrics`` (Prometheus),
``GET /openapi.json``, ``POST /admin/version`` (bearer token; blue/green switch). Every
predict answer names the digest of the artifact that computed it (``x-flatpack-digest``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import math
import time
from pathlib import Path
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from flatpack import logs
from flatpack.compiler import Compiled, load
from flatpack.errors import FlatpackError, InputError
from flatpack.serve.batcher import Batcher, BatchPolicy, Closed, Overloaded
from flatpack.serve.metrics import CONTENT_TYPE, ServeMetrics
from flatpack.serve.openapi import schema
from flatpack.serve.pool import Version
from flatpack.serve.replan import PlanChooser, Replan, can_replan
from flatpack.serve.scaling import Autoscaler
from flatpack.serve.settings import ServeSettings
from flatpack.serve.targets import Target
from flatpack.serve.tensors import JSON, RequestError, content_type, encode_outputs, parse_request

LOG = logs.get("serve")
DIGEST_HEADER = "x-flatpack-digest"


class Service:
    """The state behind the routes: the current version, the batcher, the metrics."""

    def __init__(self, compiled: Compiled, settings: ServeSettings, target: Target) -> None:
        self.settings = settings
        self.target = target
        self.metrics = ServeMetrics()
        self.metrics.slo.set(settings.slo_s)
        self.version = Version(compiled, target, settings.max_batch)
        self.contract = self.version.contract
        self.batcher: Batcher | None = None
        self.draining = False
        self.failed: str | None = None          # why the first version could not start
        self._switching = asyncio.Lock()
        self._warming: asyncio.Task | None = None
        self.autoscaler: Autoscaler | None = None
        self.chooser = (PlanChooser(compiled, settings.slo_s, settings.replan_solver)
                        if settings.replan and can_replan(compiled) else None)
        self._replanning: asyncio.Task | None = None
        self.last_replan: Replan | None = None

    @property
    def ready(self) -> bool:
        return self.batcher is not None and not self.draining

    # lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Deploys and warms the first version in the background: /healthz answers meanwhile."""
        self._warming = asyncio.get_running_loop().create_task(self._warm_first())

    async def _warm_first(self) -> None:
        try:
            await self.version.start(self.settings.min_replicas)
        except Exception as err:  # noqa: BLE001 - reported by /readyz and the log, the server stays up
            self.failed = f"{type(err).__name__}: {err}"
            LOG.error("the model could not be deployed: %s", self.failed)
            return
        self.batcher = Batcher(self._policy(self.version), self._run_batch, self._record_batch)
        self.batcher.start()
        self.metrics.cold_starts.inc(self.version.cold_starts)
        self.metrics.replicas.set(len(self.version.replicas))
        self._start_autoscaler()

    def _start_autoscaler(self) -> None:
        ceiling = self.settings.replica_ceiling(self.target.cpus(), self.version.functions_per_replica)
        LOG.info("a warm pool of %d to %d replicas of %d functions each, scaled down after %g s idle",
                 self.settings.min_replicas, ceiling, self.version.functions_per_replica, self.settings.idle_s)
        if ceiling <= self.settings.min_replicas:
            return
        self.autoscaler = Autoscaler(floor=self.settings.min_replicas, ceiling=ceiling, idle_s=self.settings.idle_s,
                                     demand=self._demand, policy=lambda: self._batcher().policy,
                                     size=lambda: len(self.version.replicas), grow=self._grow, shrink=self._shrink,
                                     on_event=self._scaled)
        self.autoscaler.start()

    def _batcher(self) -> Batcher:
        assert self.batcher is not None         # the autoscaler starts after the batcher
        return self.batcher

    def _demand(self) -> tuple[int, int]:
        batcher = self._batcher()
        shed, batcher.shed_since_read = batcher.shed_since_read, 0
        return batcher.queued_samples + batcher.running_samples, shed

    async def _grow(self) -> None:
        async with self._switching:             # a pool changes under one version at a time
            version = self.version
            await version.add_replica()
            self.metrics.cold_starts.inc(len(version.replicas[-1].deployment.workers))
            self._batcher().policy = dataclasses.replace(self._batcher().policy, replicas=len(version.replicas))

    async def _shrink(self) -> bool:
        async with self._switching:
            # one batch fewer at once first, so that no batch waits for the replica being removed
            self._batcher().policy = dataclasses.replace(self._batcher().policy,
                                                         replicas=max(1, len(self.version.replicas) - 1))
            removed = await self.version.remove_replica()
            self._batcher().policy = dataclasses.replace(self._batcher().policy, replicas=len(self.version.replicas))
            return removed

    def _scaled(self, direction: str, replicas: int, reason: str) -> None:
        self.metrics.scale_events.labels(direction).inc()
        self.metrics.replicas.set(replicas)
        self._refresh_gauges(self._batcher().policy)

    def _policy(self, version: Version, announce: bool = True) -> BatchPolicy:
        assert version.latency is not None      # set by Version.start
        policy = BatchPolicy.choose(version.latency, self.settings.slo_s, self.settings.max_batch)
        policy = dataclasses.replace(policy, replicas=max(1, len(version.replicas)))
        self._refresh_gauges(policy)
        if not announce:
            return policy
        if not policy.meets_slo:
            LOG.warning("one sample takes %.0f ms through this deployment, too long for an SLO of %.0f ms: serving "
                        "for throughput (no batching delay)", version.latency.seconds(1) * 1e3,
                        self.settings.slo_s * 1e3)
        LOG.info("batches of at most %d samples, at most %.1f ms of queueing, for an SLO of %.0f ms",
                 policy.max_batch, policy.max_delay_s * 1e3, self.settings.slo_s * 1e3)
        return policy

    def _refresh_gauges(self, policy: BatchPolicy) -> None:
        self.metrics.max_batch.set(policy.max_batch)
        self.metrics.max_delay.set(policy.max_delay_s)
        self.metrics.capacity.set(policy.capacity_samples_s)
        self.metrics.sized.set(policy.sized_samples_s)

    async def drain(self) -> None:
        """New requests get 503 from now on; returns when the accepted ones are answered (or
        after ``drain_timeout_s``)."""
        self.draining = True
        if self.batcher is not None:
            try:
                await asyncio.wait_for(self.batcher.drained(), self.settings.drain_timeout_s)
            except asyncio.TimeoutError:
                LOG.error("%d request(s) still running after %.0f s of draining", self.batcher.in_flight,
                          self.settings.drain_timeout_s)

    async def stop(self) -> None:
        """Drains, then stops every function of every version."""
        await self.drain()
        if self._warming is not None and not self._warming.done():
            await self._warming            # a deployment half started is torn down whole
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self._replanning is not None and not self._replanning.done():
            self._replanning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replanning
        if self.batcher is not None:
            await self.batcher.stop()
        await self.version.close()

    # batches ---------------------------------------------------------------------------------
    async def _run_batch(self, tensors: dict) -> tuple[dict, str]:
        version = self.version              # read once: a switch between batches takes the next one
        outputs = await version.infer(tensors)
        self.metrics.invocations.inc(version.invocations_per_request)
        return outputs, version.digest

    def _record_batch(self, requests: int, samples: int, seconds: float) -> None:
        self.metrics.batch_requests.observe(requests)
        self.metrics.batch_samples.observe(samples)
        self.metrics.dollars.inc(self.version.dollars(seconds))
        if self.version.observe(samples, seconds) and self.batcher is not None:
            self.batcher.policy = self._policy(self.version, announce=False)
        if self.chooser is None or self.draining or (self._replanning is not None and not self._replanning.done()):
            return
        moved = self.chooser.observe(samples)
        if moved is not None:
            self._replanning = asyncio.get_running_loop().create_task(self._replan(moved), name="flatpack-replan")

    async def _replan(self, batch: int) -> None:
        """Solves the plan for batches of ``batch`` samples (off the event loop) and switches
        to it blue/green when it differs; a failure is logged and the served plan stays."""
        assert self.chooser is not None
        chooser = self.chooser
        try:
            replan = await asyncio.get_running_loop().run_in_executor(None, chooser.choose, batch)
            if replan is None:
                return
            LOG.info("re-choosing the plan: %s", replan.reason)
            await self.switch_to(replan.compiled, f"re-plan: {replan.reason}")
        except Exception as err:  # noqa: BLE001 - a re-plan that fails leaves the served plan serving
            LOG.error("the plan for batches of %d samples could not be switched to: %s: %s", batch,
                      type(err).__name__, err)
            return
        chooser.adopt(replan)
        self.metrics.replans.inc()
        self.last_replan = replan

    # blue/green ------------------------------------------------------------------------------
    async def switch(self, directory: Path, digest: str) -> Version:
        """Starts ``directory`` (pinned to ``digest``) and switches to it (:meth:`switch_to`)."""
        compiled = await asyncio.get_running_loop().run_in_executor(None, lambda: load(directory, digest=digest))
        version = await self.switch_to(compiled, "POST /admin/version")
        if self.chooser is not None:        # an artifact read back cannot be cut again: its plan stays
            self.chooser = PlanChooser(compiled, self.settings.slo_s, self.settings.replan_solver) \
                if can_replan(compiled) else None
        return version

    async def switch_to(self, compiled: Compiled, why: str) -> Version:
        """Starts ``compiled`` with as many replicas as the served version has, warms it, swaps
        it in between two batches and tears the old version down after its last batch; no
        request is dropped (the blue/green path of a version switch and of a re-plan)."""
        async with self._switching:
            candidate = Version(compiled, self.target, self.settings.max_batch)
            if candidate.contract != self.contract:
                raise RequestError(409, f"the new artifact takes other inputs ({candidate.contract.to_json()}) than "
                                        f"the one served ({self.contract.to_json()}); serve it on its own")
            await candidate.start(max(self.settings.min_replicas, len(self.version.replicas)))
            if self.batcher is None or self.draining:
                await candidate.close()
                raise RequestError(503, "the server is not ready or is draining; no switch")
            self.metrics.cold_starts.inc(candidate.cold_starts)
            old, self.version = self.version, candidate
            self.batcher.policy = self._policy(candidate)
            self.metrics.replicas.set(len(candidate.replicas))
            await old.close()               # after the batch it may be running: its thread runs one call at a time
            LOG.info("switched from %s to %s (%s)", old.digest[:12], candidate.digest[:12], why)
            return candidate


def _error(status: int, message: str, digest: str | None = None) -> JSONResponse:
    headers = {DIGEST_HEADER: digest} if digest else None
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


SHED_MESSAGES = {
    "admission": "overloaded: this request would not finish within the SLO behind the queue",
    "deadline": "overloaded: this request queued too long to finish within the SLO",
}


def _shed(shed: Overloaded) -> JSONResponse:
    """429 with ``Retry-After`` (whole seconds, at least 1: the predicted time the work ahead
    needs): a refusal by admission control, not a failure of the server (docs/serve.md)."""
    retry_after = max(1, math.ceil(shed.retry_after_s))
    return JSONResponse({"error": f"{SHED_MESSAGES[shed.reason]}; retry after {retry_after} s", "status": 429,
                         "shed": shed.reason}, status_code=429,
                        headers={"retry-after": str(retry_after), "x-flatpack-shed": shed.reason})


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it passes ``limit`` bytes: by its Content-Length
    before reading, or while it streams in."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"the request body is {declared} bytes; the limit is {limit} (--max-body-bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(413, f"the request body is over {limit} bytes, the limit (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def predict(request: Request) -> Response:
    service: Service = request.app.state.service
    started = time.perf_counter()
    response = await _predict(service, request)
    service.metrics.requests.labels(str(response.status_code)).inc()
    if response.status_code == 200:
        service.metrics.latency.observe(time.perf_counter() - started)
    return response


async def _predict(service: Service, request: Request) -> Response:
    if service.draining:
        return _error(503, "the server is draining (shutting down or switching); retry on another replica")
    if service.batcher is None:
        return _error(503, service.failed or "the model is warming up; GET /readyz says when it is ready")
    try:
        media = content_type(request.headers.get("content-type"))
        body = await _read_body(request, service.settings.max_body_bytes)
        parsed = parse_request(body, media, service.contract, service.settings.max_request_samples)
    except RequestError as err:
        return _error(err.status, err.message)
    except ClientDisconnect:
        return _error(400, "the client went away before sending the whole body")
    service.metrics.queue_depth.inc()
    try:
        answer = await service.batcher.submit(parsed)
    except Closed:
        return _error(503, "the server is draining (shutting down or switching); retry on another replica")
    except Overloaded as shed:
        service.metrics.shed.labels(shed.reason).inc()
        return _shed(shed)
    except Exception as err:  # noqa: BLE001 - a function failure is the server's 5xx, never a crash
        LOG.error("a batch failed: %s: %s", type(err).__name__, err)
        if isinstance(err, InputError):
            return _error(422, f"inference failed: {type(err).__name__}: {err}", service.version.digest)
        service.metrics.errors.inc()
        return _error(500, f"inference failed: {type(err).__name__}: {err}", service.version.digest)
    finally:
        service.metrics.queue_depth.dec()
    body = encode_outputs(answer.outputs, parsed.form, answer.digest)
    return Response(body, media_type=parsed.form, headers={
        DIGEST_HEADER: answer.digest, "x-flatpack-batch-samples": str(answer.batch_samples),
        "x-flatpack-predicted-ms": f"{answer.predicted_s * 1e3:.2f}",
        "x-flatpack-batch-ms": f"{answer.measured_s * 1e3:.2f}"})


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def readyz(request: Request) -> Response:
    service: Service = request.app.state.service
    if service.ready:
        return JSONResponse({"ready": True, "digest": service.version.digest},
                            headers={DIGEST_HEADER: service.version.digest})
    reason = "draining" if service.draining else service.failed or "warming up"
    return JSONResponse({"ready": False, "reason": reason}, status_code=503)


async def metrics(request: Request) -> Response:
    service: Service = request.app.state.service
    return Response(service.metrics.text(), media_type=CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    service: Service = request.app.state.service
    return JSONResponse(schema(service.contract))


async def admin_version(request: Request) -> Response:
    """``{"artifact_dir": DIR, "digest": D}`` with ``Authorization: Bearer TOKEN``."""
    service: Service = request.app.state.service
    token = service.settings.admin_token
    if token is None:
        return _error(404, "the admin endpoint is off: start the server with $FLATPACK_ADMIN_TOKEN or --token-file")
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return _error(401, "a valid bearer token is required (Authorization: Bearer ...)")
    try:
        document = await request.json() if content_type(request.headers.get("content-type")) == JSON else None
    except ValueError:
        document = None
    except RequestError as err:
        return _error(err.status, err.message)
    if not (isinstance(document, dict) and isinstance(document.get("artifact_dir"), str)
            and isinstance(document.get("digest"), str)):
        return _error(400, 'the body must be {"artifact_dir": "DIR", "digest": "SHA256"} (a digest-pinned artifact)')
    try:
        version = await service.switch(Path(document["artifact_dir"]), document["digest"])
    except RequestError as err:
        return _error(err.status, err.message)
    except FlatpackError as err:
        return _error(422, f"the new version could not be loaded or started: {err}")
    return JSONResponse({"digest": version.digest}, headers={DIGEST_HEADER: version.digest})


def build_app(service: Service) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    app = Starlette(routes=[
        Route("/v1/predict", predict, methods=["POST"]), Route("/healthz", healthz), Route("/readyz", readyz),
        Route("/metrics", metrics), Route("/openapi.json", openapi),
        Route("/admin/version", admin_version, methods=["POST"])], lifespan=lifespan)
    app.state.service = service
    return app


