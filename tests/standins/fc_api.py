"""A local stand-in of the Function Compute 3.0 API (version 2023-03-30) a deployer uses.

:class:`LocalFunctionCompute` serves CreateFunction, GetFunction, UpdateFunction,
DeleteFunction, ListFunctions and InvokeFunction on 127.0.0.1 for the official SDK
(``alibabacloud_fc20230330``) pointed at it with ``Config(endpoint="127.0.0.1:PORT",
protocol="http")``: the SDK then sends ``http://127.0.0.1:PORT/2023-03-30/functions...``,
no account id in the host. Functions live in memory as the JSON the SDK sent plus the
fields FC adds; every request is kept in :attr:`LocalFunctionCompute.requests` for tests.

Invocations run through :mod:`~tests.standins.runner` in a fresh subprocess,
in place of the custom container's HTTP server: the handler gets the JSON-decoded event, as
from a server that decodes it (``FunctionCode.raw_event`` gives it the bytes); a function error
comes back with status 200 and ``x-fc-error-type: UnhandledInvocationError``, as FC
documents. API errors have FC 3.0's shape ``{"Code", "Message", "RequestId"}`` with its
HTTP status, so the SDK raises its ``ClientException`` (a ``TeaException``) with ``.code``.

Requests must carry the SDK's ``ACS3-HMAC-SHA256`` Authorization header; given
``access_keys`` (id -> secret), the signature is checked as FC checks it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import quote, unquote

from tests.standins.lambda_api import (InvocationRecord, InvokingService, Request, Response, Runner,
                                       dockerfile_command, image_keys)
from tests.standins.runner import FC, TEST_ACCOUNT_ID, FunctionCode, image_preload, run_invocation

FCResolver = Callable[[dict], "FunctionCode | None"]

API_VERSION = "2023-03-30"
SIGNATURE_ALGORITHM = "ACS3-HMAC-SHA256"
ERROR_TYPE_HEADER = "x-fc-error-type"
UNHANDLED_ERROR = "UnhandledInvocationError"
INVOCATION_TYPES = ("Sync", "Async")
DEFAULT_TIMEOUT_S = 3  # CreateFunctionInput's documented default
LIST_LIMIT = 20
_FUNCTIONS = f"/{API_VERSION}/functions"
_FUNCTION_PATH = re.compile(rf"{_FUNCTIONS}/(?P<name>[^/]+)(?P<invoke>/invocations)?")
# the SDK's rule: letters, digits, '_' and '-', 1-64 characters, not starting with a digit or '-'
_FUNCTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
_HANDLER_NAME = re.compile(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*")
_CREDENTIAL = re.compile(r"Credential=([^,\s]+)")
_SIGNED_HEADERS = re.compile(r"SignedHeaders=([^,\s]+)")
_SIGNATURE = re.compile(r"Signature=([0-9a-f]+)")


class FCError(Exception):
    """An FC API error: HTTP status, FC's error code, message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def fc_request_id() -> str:
    """A request id in FC's format, e.g. ``1-64e70cf1-5cbef92ea8fc8c42899cf5d1``."""
    return f"1-{int(time.time()):08x}-{uuid.uuid4().hex[:24]}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _json_object(request: Request) -> dict:
    try:
        body = request.json()
    except ValueError as exc:
        raise FCError(400, "InvalidArgument", f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise FCError(400, "InvalidArgument", "the request body must be a JSON object")
    return body


def _list_limit(value: str | None) -> int:
    """ListFunctions' ``limit``: the page size, LIST_LIMIT when not given. A bad one is the
    caller's error (400 InvalidArgument), not the service's."""
    if not value:
        return LIST_LIMIT
    try:
        limit = int(value)
    except ValueError:
        raise FCError(400, "InvalidArgument", f"limit must be a positive integer, got {value!r}") from None
    if limit < 1:
        raise FCError(400, "InvalidArgument", f"limit must be a positive integer, got {value!r}")
    return limit


def canonical_request(request: Request, signed_headers: list[str]) -> str:
    """The ACS3 canonical request, as ``alibabacloud_tea_openapi.utils.Utils.get_authorization`` builds it."""
    query = "&".join(f"{key}={quote(request.query[key], safe='~')}" for key in sorted(request.query))
    headers = "".join(f"{name}:{request.headers.get(name, '').strip()}\n" for name in signed_headers)
    return "\n".join([request.method, request.path or "/", query, headers, ";".join(signed_headers),
                      request.headers.get("x-acs-content-sha256", "")])


def acs3_signature(request: Request, signed_headers: list[str], secret: str) -> str:
    digest = hashlib.sha256(canonical_request(request, signed_headers).encode()).hexdigest()
    return hmac.new(secret.encode(), f"{SIGNATURE_ALGORITHM}\n{digest}".encode(), hashlib.sha256).hexdigest()


def context_resolver(contexts: Mapping[str, Path | str]) -> FCResolver:
    """A resolver for :class:`LocalFunctionCompute`: the function's
    ``customContainerConfig.image`` (or ``repository:tag``, see :func:`image_keys`) is
    looked up in ``contexts`` (image -> local build context, the handler module at its
    root). The handler is the Dockerfile's ``CMD`` when that names ``module.function``,
    else the function's ``handler`` field, else ``handler.handler``."""

    def resolve(function: dict) -> FunctionCode | None:
        image = (function.get("customContainerConfig") or {}).get("image")
        if not image:
            raise ValueError(f"function {function.get('functionName')!r} has no customContainerConfig.image; "
                             f"the stand-in runs custom-container functions only")
        directory = next((Path(contexts[k]) for k in image_keys(image) if k in contexts), None)
        if directory is None:
            raise LookupError(f"no local build context for image {image!r}; known: {sorted(contexts)}")
        command = dockerfile_command(directory)
        handler = next((h for h in (command, function.get("handler")) if h and _HANDLER_NAME.fullmatch(h)),
                       "handler.handler")
        # memorySize has no documented default; FunctionCode's (128 MB, FC's minimum) stands in
        options = {"memory_mb": function["memorySize"]} if function.get("memorySize") else {}
        return FunctionCode(directory=directory, handler=handler,
                            environment=function.get("environmentVariables") or {},
                            timeout_s=function.get("timeout") or DEFAULT_TIMEOUT_S,
                            name=function["functionName"], platform=FC, preload=image_preload(directory),
                            **options)

    return resolve


class LocalFunctionCompute(InvokingService):
    """FC 3.0's function API on ``host:port`` (0: a free port). ``resolve(function_json)``
    gives the code of a created function; ``access_keys`` (id -> secret) turns on
    signature checks, else any signed-looking request passes."""

    def __init__(self, resolve: FCResolver, host: str = "127.0.0.1", port: int = 0, *,
                 access_keys: Mapping[str, str] | None = None, runner: Runner = run_invocation,
                 region: str = "cn-hangzhou", account_id: str = TEST_ACCOUNT_ID) -> None:
        super().__init__(host, port, runner)
        self.resolve = resolve
        self.access_keys = dict(access_keys) if access_keys is not None else None
        self.region = region
        self.account_id = account_id
        self.functions: dict[str, dict] = {}
        self.requests: list[Request] = []
        self._functions_lock = threading.Lock()

    def handle(self, request: Request) -> Response:
        with self._lock:
            self.requests.append(request)
        request_id = fc_request_id()
        try:
            self._authenticate(request)
            return self._route(request, request_id)
        except FCError as error:
            return self._error(error.status, error.code, str(error), request_id)

    def internal_error(self, request: Request, exc: Exception) -> Response:
        return self._error(500, "InternalServerError", f"{type(exc).__name__}: {exc}", fc_request_id())

    def _route(self, request: Request, request_id: str) -> Response:
        if request.path == _FUNCTIONS and request.method == "POST":
            return self._json(self._create(_json_object(request)), request_id)
        if request.path == _FUNCTIONS and request.method == "GET":
            return self._json(self._list(request.query), request_id)
        match = _FUNCTION_PATH.fullmatch(request.path)
        if match is None:
            raise FCError(400, "PathNotSupported", f"'{request.method}' against '{request.path}' is not supported")
        name = unquote(match["name"])
        if match["invoke"] and request.method == "POST":
            return self._invoke(name, request, request_id)
        if match["invoke"]:
            raise FCError(400, "PathNotSupported", f"'{request.method}' against '{request.path}' is not supported")
        if request.method == "GET":
            return self._json(self._function(name), request_id)
        if request.method == "PUT":
            return self._json(self._update(name, _json_object(request)), request_id)
        if request.method == "DELETE":
            with self._functions_lock:
                self._function(name)
                del self.functions[name]
            return Response(204, {"x-fc-request-id": request_id})
        raise FCError(400, "PathNotSupported", f"'{request.method}' against '{request.path}' is not supported")

    def _authenticate(self, request: Request) -> None:
        authorization = request.headers.get("authorization")
        if not authorization:
            raise FCError(400, "MissingRequiredHeader", "required HTTP header Authorization was not specified")
        credential = _CREDENTIAL.search(authorization)
        if not authorization.startswith(SIGNATURE_ALGORITHM) or credential is None:
            raise FCError(403, "SignatureNotMatch", f"not an {SIGNATURE_ALGORITHM} signature: {authorization!r}")
        if self.access_keys is None:
            return
        secret = self.access_keys.get(credential[1])
        if secret is None:
            raise FCError(403, "InvalidAccessKeyID", f"invalid access key ID '{credential[1]}'")
        signed, signature = _SIGNED_HEADERS.search(authorization), _SIGNATURE.search(authorization)
        body_hash = hashlib.sha256(request.body).hexdigest()
        if (signed is None or signature is None or request.headers.get("x-acs-content-sha256") != body_hash
                or not hmac.compare_digest(acs3_signature(request, signed[1].split(";"), secret), signature[1])):
            raise FCError(403, "SignatureNotMatch", "The request signature we calculated does not match the signature "
                                                    "you provided. Check your access key and signing method")

    def _function(self, name: str) -> dict:
        function = self.functions.get(name)
        if function is None:
            raise FCError(404, "FunctionNotFound", f"function '{name}' does not exist.")
        return function

    def _create(self, body: dict) -> dict:
        name = body.get("functionName")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            raise FCError(400, "InvalidArgument", f"functionName {name!r} must be 1-64 letters, digits, '_' or '-', "
                                                  f"not starting with a digit or '-'")
        for required in ("runtime", "handler"):
            if not body.get(required):
                raise FCError(400, "InvalidArgument", f"{required} is required")
        if not body.get("code") and not body.get("customContainerConfig"):
            raise FCError(400, "InvalidArgument", "specify either code or customContainerConfig")
        now = _now()
        function = {**body, "timeout": body.get("timeout") or DEFAULT_TIMEOUT_S,
                    "functionId": str(uuid.uuid4()),
                    "functionArn": f"acs:fc:{self.region}:{self.account_id}:functions/{name}",
                    "createdTime": now, "lastModifiedTime": now, "codeSize": 0,
                    "state": "Active", "lastUpdateStatus": "Successful"}
        with self._functions_lock:
            if name in self.functions:
                raise FCError(409, "FunctionAlreadyExists", f"function '{name}' already exists")
            self.functions[name] = function
        return function

    def _update(self, name: str, body: dict) -> dict:
        if body.get("functionName", name) != name:
            raise FCError(400, "InvalidArgument", "functionName cannot be changed")
        with self._functions_lock:
            function = {**self._function(name), **body, "lastModifiedTime": _now(), "lastUpdateStatus": "Successful"}
            self.functions[name] = function
        return function

    def _list(self, query: dict[str, str]) -> dict:
        prefix, start = query.get("prefix", ""), query.get("nextToken", "")
        limit = _list_limit(query.get("limit"))
        with self._functions_lock:
            names = sorted(n for n in self.functions if n.startswith(prefix) and n >= start)
            page = [self.functions[n] for n in names[:limit]]
        return {"functions": page, "nextToken": names[limit] if len(names) > limit else ""}

    def _invoke(self, name: str, request: Request, request_id: str) -> Response:
        invocation_type = request.headers.get("x-fc-invocation-type", "Sync")
        if invocation_type not in INVOCATION_TYPES:
            raise FCError(400, "InvalidArgument", f"x-fc-invocation-type must be one of {INVOCATION_TYPES}, "
                                                  f"got {invocation_type!r}")
        function = self._function(name)
        code = self.resolve(function)
        if code is None:
            raise FCError(500, "InternalServerError", f"the stand-in has no local code for function '{name}'")
        record = InvocationRecord(function=name, invocation_type=invocation_type, status=0, duration_s=0.0,
                                  request_id=request_id, qualifier=request.query.get("qualifier"),
                                  payload=request.body)
        if invocation_type == "Async":
            self._start_event(code, record)
            return Response(202, {"x-fc-request-id": request_id})
        result = self._run(code, record)
        headers = {"x-fc-request-id": request_id}
        if result.failed:
            headers[ERROR_TYPE_HEADER] = UNHANDLED_ERROR
        if request.headers.get("x-fc-log-type") == "Tail":
            headers["x-fc-log-result"] = base64.b64encode(result.log_tail.encode()).decode()
        self._record(record, 200)
        return Response(200, headers, result.payload)

    @staticmethod
    def _json(body: Any, request_id: str) -> Response:
        return Response(200, {"Content-Type": "application/json", "x-fc-request-id": request_id},
                        json.dumps(body).encode())

    @staticmethod
    def _error(status: int, code: str, message: str, request_id: str) -> Response:
        body = {"Code": code, "Message": message, "RequestId": request_id}
        return Response(status, {"Content-Type": "application/json", "x-fc-request-id": request_id},
                        json.dumps(body).encode())
