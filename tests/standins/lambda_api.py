"""A local stand-in of AWS Lambda's Invoke API, for boto3 clients pointed at it.

moto serves Lambda's control plane (``create_function``, ``get_function``...) but runs code
only through Docker. :class:`LocalLambdaEndpoint` is the data plane: it answers
``POST /2015-03-31/functions/{FunctionName}/invocations`` the way Lambda does and runs each
invocation in a fresh subprocess (:mod:`~tests.standins.runner`), so
``boto3.client("lambda", endpoint_url=endpoint.url).invoke(...)`` works unchanged:
RequestResponse (200, the payload; a function error as ``X-Amz-Function-Error: Unhandled``),
Event (202, run in the background and recorded), DryRun (204), ``LogType="Tail"``, an
unknown function as ``ResourceNotFoundException``. :func:`moto_resolver` finds a function's
code from its moto configuration: the image URI names a local build context.

:class:`LocalHTTPService` is the shared server half (the FC stand-in uses it too).
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from tests.standins.runner import (LAMBDA, TEST_ACCOUNT_ID, FunctionCode, InvocationResult, image_preload,
                                   run_invocation)

Resolver = Callable[[str], "FunctionCode | None"]
_Service = TypeVar("_Service", bound="LocalHTTPService")


class Runner(Protocol):
    """How a service runs one invocation: :func:`~tests.standins.runner.run_invocation`'s
    shape, the qualifier it was invoked with included (it ends the invoked ARN)."""

    def __call__(self, code: FunctionCode, payload: bytes, request_id: str | None = None, *,
                 qualifier: str | None = None) -> InvocationResult: ...


INVOCATION_TYPES = ("RequestResponse", "Event", "DryRun")
# Lambda's payload quotas (botocore's Invoke docs): 6 MB synchronous, 1 MB asynchronous
MAX_SYNC_PAYLOAD = 6 * 1024 * 1024
MAX_ASYNC_PAYLOAD = 1024 * 1024
_INVOKE_PATH = re.compile(r"/2015-03-31/functions/(?P<name>[^/]+)/invocations")
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_CAPITALIZED_MESSAGE = {"ResourceNotFoundException", "ServiceException"}


@dataclass
class Request:
    """An HTTP request as the services see it; ``headers`` keys are lower-case."""

    method: str
    path: str          # percent-decoding left to the service (a function name may be an encoded ARN)
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"{}")


@dataclass
class Response:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _NoDelayServer(ThreadingHTTPServer):
    daemon_threads = True
    service: LocalHTTPService

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        # BaseHTTPRequestHandler writes the headers and the body in separate sends: with
        # Nagle on, the body waits for the client's delayed ACK (~40 ms per call with boto3)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection, address


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: SDK clients pool their connections
    server: _NoDelayServer

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        request = Request(method=self.command, path=url.path, query=dict(parse_qsl(url.query, keep_blank_values=True)),
                          headers={k.lower(): v for k, v in self.headers.items()}, body=self._read_body())
        response = self.server.service.respond(request)
        self.send_response(response.status)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if response.body and self.command != "HEAD":
            self.wfile.write(response.body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _dispatch

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0], 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the services record requests themselves; stderr stays quiet in tests


class LocalHTTPService:
    """An HTTP service on a background thread: ``start``/``stop`` or a context manager.
    Subclasses implement :meth:`handle`; an exception there becomes :meth:`internal_error`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._server: _NoDelayServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError(f"{type(self).__name__} is not started")
        return f"http://{self.host}:{self.port}"

    def start(self: _Service) -> _Service:
        if self._server is not None:
            return self
        server = _NoDelayServer((self.host, self.port), _Handler)
        server.service = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"{type(self).__name__}:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()
        self._server = self._thread = None

    def __enter__(self: _Service) -> _Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def respond(self, request: Request) -> Response:
        try:
            return self.handle(request)
        except Exception as exc:  # a bug or a failing resolver must reach the client, not kill the connection
            return self.internal_error(request, exc)

    def handle(self, request: Request) -> Response:
        raise NotImplementedError

    def internal_error(self, request: Request, exc: Exception) -> Response:
        return Response(500, {"Content-Type": "text/plain"}, f"{type(exc).__name__}: {exc}".encode())


@dataclass
class InvocationRecord:
    """One Invoke call: what came in and how it ended. Event invocations are recorded when
    their background run ends (``status`` stays 202; ``result`` tells how it went)."""

    function: str
    invocation_type: str
    status: int
    duration_s: float
    request_id: str
    qualifier: str | None = None
    payload: bytes = b""
    result: InvocationResult | None = None
    error: str | None = None   # the stand-in's own failure to run it (a resolver or runner exception)


def parse_function_name(value: str) -> tuple[str, str | None]:
    """(name, qualifier) from a function name, a full ARN or a partial ARN, each with an
    optional ``:qualifier``; ValueError for anything else."""
    parts = value.split(":")
    if parts[0] == "arn" and len(parts) in (7, 8) and parts[2] == "lambda" and parts[5] == "function":
        name, qualifier = parts[6], parts[7] if len(parts) == 8 else None
    elif len(parts) in (3, 4) and parts[1] == "function":
        name, qualifier = parts[2], parts[3] if len(parts) == 4 else None
    elif len(parts) in (1, 2):
        name, qualifier = parts[0], parts[1] if len(parts) == 2 else None
    else:
        raise ValueError(f"not a function name or ARN: {value!r}")
    if not _FUNCTION_NAME.fullmatch(name) or qualifier == "":
        raise ValueError(f"not a function name or ARN: {value!r}")
    return name, qualifier


class InvokingService(LocalHTTPService):
    """A service that runs invocations: synchronously, or in the background (recorded when
    they end; :meth:`wait_for_events` waits for them, :meth:`stop` too)."""

    def __init__(self, host: str, port: int, runner: Runner) -> None:
        super().__init__(host, port)
        self.runner = runner
        self.invocations: list[InvocationRecord] = []
        self._lock = threading.Lock()
        self._pending: set[threading.Thread] = set()

    def stop(self) -> None:
        super().stop()
        self.wait_for_events()  # their subprocesses end by their own timeouts

    def wait_for_events(self, timeout_s: float | None = None) -> bool:
        """Waits for the background invocations under way; whether all finished in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            pending = list(self._pending)
        for thread in pending:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._pending

    def _run(self, code: FunctionCode, record: InvocationRecord) -> InvocationResult:
        start = time.monotonic()
        record.result = self.runner(code, record.payload, record.request_id, qualifier=record.qualifier)
        record.duration_s = time.monotonic() - start
        return record.result

    def _start_event(self, code: FunctionCode, record: InvocationRecord) -> None:
        def run() -> None:
            try:
                self._run(code, record)
            except Exception as exc:  # nobody waits for an Event: keep the failure on the record
                record.error = f"{type(exc).__name__}: {exc}"
            finally:
                self._record(record, 202)
                with self._lock:
                    self._pending.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=f"event:{record.request_id}", daemon=True)
        with self._lock:
            self._pending.add(thread)
        thread.start()

    def _record(self, record: InvocationRecord, status: int) -> None:
        record.status = status
        with self._lock:
            self.invocations.append(record)


class LocalLambdaEndpoint(InvokingService):
    """Lambda's Invoke API on ``host:port`` (0: a free port). ``resolve(name)`` gives the
    code of function ``name`` (a plain name; ARNs and qualifiers are parsed off) or None for
    an unknown function; ``runner`` runs one invocation (a subprocess by default)."""

    def __init__(self, resolve: Resolver, host: str = "127.0.0.1", port: int = 0, *,
                 runner: Runner = run_invocation, region: str = "us-east-1",
                 account_id: str = TEST_ACCOUNT_ID) -> None:
        super().__init__(host, port, runner)
        self.resolve = resolve
        self.region = region
        self.account_id = account_id

    def handle(self, request: Request) -> Response:
        request_id = str(uuid.uuid4())
        match = _INVOKE_PATH.fullmatch(request.path)
        if request.method != "POST" or match is None:
            return self._error(404, "UnknownOperationException", f"{request.method} {request.path} is not served here",
                               request_id)
        try:
            name, path_qualifier = parse_function_name(unquote(match["name"]))
        except ValueError as exc:
            return self._error(400, "ValidationException", str(exc), request_id)
        qualifier = request.query.get("Qualifier") or path_qualifier
        invocation_type = request.headers.get("x-amz-invocation-type", "RequestResponse")
        if invocation_type not in INVOCATION_TYPES:
            return self._error(400, "ValidationException",
                               f"1 validation error detected: Value '{invocation_type}' at 'invocationType' failed to "
                               f"satisfy constraint: Member must satisfy enum value set: {list(INVOCATION_TYPES)}",
                               request_id)
        code = self.resolve(name)
        if code is None:
            arn = f"arn:aws:lambda:{self.region}:{self.account_id}:function:{name}"
            return self._error(404, "ResourceNotFoundException",
                               f"Function not found: {arn}:{qualifier}" if qualifier else f"Function not found: {arn}",
                               request_id)
        record = InvocationRecord(function=name, invocation_type=invocation_type, status=0, duration_s=0.0,
                                  request_id=request_id, qualifier=qualifier, payload=request.body)
        if invocation_type == "DryRun":
            self._record(record, 204)
            return Response(204, {"x-amzn-RequestId": request_id})

        limit = MAX_ASYNC_PAYLOAD if invocation_type == "Event" else MAX_SYNC_PAYLOAD
        if len(request.body) > limit:
            message = f"Request must be smaller than {limit} bytes for the InvokeFunction operation"
            return self._error(413, "RequestTooLargeException", message, request_id)
        try:
            json.loads(request.body or b"{}")
        except ValueError as exc:
            return self._error(400, "InvalidRequestContentException", f"Could not parse request body into json: {exc}",
                               request_id)
        if invocation_type == "Event":
            self._start_event(code, record)
            return Response(202, {"x-amzn-RequestId": request_id})

        result = self._run(code, record)
        headers = {"Content-Type": "application/json", "X-Amz-Executed-Version": "$LATEST",
                   "x-amzn-RequestId": request_id}
        payload = result.payload
        if len(payload) > MAX_SYNC_PAYLOAD:
            payload = json.dumps({"errorMessage": f"Response payload size ({len(payload)} bytes) exceeded maximum "
                                                  f"allowed payload size ({MAX_SYNC_PAYLOAD} bytes).",
                                  "errorType": "Function.ResponseSizeTooLarge"}).encode()
            headers["X-Amz-Function-Error"] = "Unhandled"
        elif result.failed:
            headers["X-Amz-Function-Error"] = "Unhandled"
        if request.headers.get("x-amz-log-type") == "Tail":
            headers["X-Amz-Log-Result"] = base64.b64encode(result.log_tail.encode()).decode()
        self._record(record, 200)
        return Response(200, headers, payload)

    def internal_error(self, request: Request, exc: Exception) -> Response:
        return self._error(500, "ServiceException", f"{type(exc).__name__}: {exc}", str(uuid.uuid4()))

    @staticmethod
    def _error(status: int, code: str, message: str, request_id: str) -> Response:
        # botocore takes the error code from x-amzn-ErrorType and the message from the body,
        # under the member name Lambda's model gives each error
        message_key = "Message" if code in _CAPITALIZED_MESSAGE else "message"
        body = {"Type": "User" if status < 500 else "Service", message_key: message}
        return Response(status, {"Content-Type": "application/json", "x-amzn-ErrorType": code,
                                 "x-amzn-RequestId": request_id}, json.dumps(body).encode())


def image_keys(image_uri: str) -> list[str]:
    """The names an image URI may be known by in a contexts map, most specific first:
    the URI, the repository with its tag or digest (no registry host), the last path part."""
    keys = [image_uri]
    first, _, rest = image_uri.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):  # Docker's rule for a registry host
        keys.append(rest)
    keys.append(image_uri.rsplit("/", 1)[-1])
    return list(dict.fromkeys(keys))


def dockerfile_command(context: Path) -> str | None:
    """The first word of the last ``CMD`` in the context's Dockerfile (Lambda's Python base
    images take the handler there: ``CMD ["handler.handler"]``), or None."""
    dockerfile = context / "Dockerfile"
    if not dockerfile.is_file():
        return None
    command = None
    for line in dockerfile.read_text().splitlines():
        keyword, _, argument = line.strip().partition(" ")
        if keyword.upper() != "CMD" or not argument.strip():
            continue
        argument = argument.strip()
        try:
            words = json.loads(argument) if argument.startswith("[") else shlex.split(argument)
        except ValueError:
            continue
        command = words[0] if words else None
    return command


def _arn_account(arn: str) -> str | None:
    parts = arn.split(":")
    return parts[4] if len(parts) > 4 else None


def moto_resolver(lambda_client: Any, contexts: Mapping[str, Path | str]) -> Resolver:
    """A resolver for :class:`LocalLambdaEndpoint` that reads functions from a Lambda
    control plane (a boto3 client pointed at moto): ``get_function`` gives the environment,
    memory, timeout and image; the image URI (or ``repository:tag``, see :func:`image_keys`)
    is looked up in ``contexts``, image -> its local build context, whose root holds the
    handler module. The handler is the function's ``ImageConfig`` command, else the
    Dockerfile's ``CMD``, else ``handler.handler``."""
    region = lambda_client.meta.region_name

    def resolve(name: str) -> FunctionCode | None:
        try:
            function = lambda_client.get_function(FunctionName=name)
        except lambda_client.exceptions.ResourceNotFoundException:
            return None
        config = function["Configuration"]
        image_uri = function.get("Code", {}).get("ImageUri")
        if not image_uri:
            raise ValueError(f"function {name!r} is not an image function; the stand-in runs image functions only")
        directory = next((Path(contexts[k]) for k in image_keys(image_uri) if k in contexts), None)
        if directory is None:
            raise LookupError(f"no local build context for image {image_uri!r} of function {name!r}; "
                              f"known: {sorted(contexts)}")
        command = config.get("ImageConfigResponse", {}).get("ImageConfig", {}).get("Command") or []
        return FunctionCode(
            directory=directory,
            handler=command[0] if command else dockerfile_command(directory) or "handler.handler",
            environment=config.get("Environment", {}).get("Variables", {}),
            timeout_s=config.get("Timeout", 3), memory_mb=config.get("MemorySize", 128),
            name=config.get("FunctionName", name), platform=LAMBDA, region=region,
            account_id=_arn_account(config.get("FunctionArn", "")) or TEST_ACCOUNT_ID,
            preload=image_preload(directory))

    return resolve
