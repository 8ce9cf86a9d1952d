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

import contextlib
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
from flatpack.errors import FlatpackError, InputError
from flatpack.serve.batcher import Closed, Overloaded
from flatpack.serve.metrics import CONTENT_TYPE
from flatpack.serve.openapi import schema
from flatpack.serve.service import Service
from flatpack.runtime.request_tensors import JSON, RequestError, content_type, encode_outputs, parse_request

LOG = logs.get("serve")
DIGEST_HEADER = "x-flatpack-digest"


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


