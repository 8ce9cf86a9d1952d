"""The serving master on Lambda: a function URL's HTTP request answered through the warm
fork-join functions (``backends.lambda_endpoint`` deploys it).

The event is Lambda's function-URL event (payload format 2.0: ``requestContext.http.method``,
``rawPath``, ``body``, ``isBase64Encoded``); the answer is the HTTP response Lambda sends
back (``statusCode``, ``headers``, ``body``). Routes: ``GET /healthz``; ``POST /v1/predict``
with ``{"inputs": {"NAME": [[...]], ...}}`` (``Content-Type: application/json``, the default)
or a safetensors file (``application/safetensors``), answered in the request's form as
``flatpack serve`` answers (``{"outputs": {...}, "dtypes": {...}, "digest": D}``). A request is
read by the same parser and checked against the same input contract as ``flatpack serve``'s
(:mod:`flatpack.runtime.request_tensors`: shapes, dtypes, the plan's fewest and the
endpoint's most samples), so a bad request is a 4xx before any function starts.

Each request is one fork-join **session**, as in Gillis (§III: a request invokes the master,
which forks the workers): the fork-join spec the deploy wrote (``SERVE_ENV``'s ``spec``),
re-keyed under a run of its own (``<run>-serve-<id>``); its master and workers invoked
asynchronously (``Event``); the request put where the master waits for it, the response read
back, and a stop message to every function, which then ends. Nothing outlives the request,
so nothing is billed between requests and no state is lost when Lambda recycles an
environment; what stays warm is what Lambda keeps warm: the stage functions' environments
(reused by the next session, torch already imported) and, with provisioned concurrency, the
serving master's. Concurrent requests run in concurrent environments, each its own group.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import uuid
from typing import Any

import torch

from flatpack.runtime import forkjoin
from flatpack.runtime.function_env import STORE_ENV
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.request_tensors import (JSON, InputContract, Request, RequestError, content_type, encode_outputs,
                                              parse_request)
from flatpack.runtime.store import Store, open_plain_store
from flatpack.stage.wire import pack_values, unpack_values

# JSON: spec, digest, functions (by stage), contract (InputContract.dumps), max_samples, outputs (response
# name: graph output), invoke_endpoint
SERVE_ENV = "FLATPACK_SERVE"
RESPONSE_TIMEOUT_S = 240.0      # under the serving master's own 300 s timeout


def is_url_event(event: Any) -> bool:
    """Whether ``event`` is a function URL's (an HTTP request), not a flatpack role."""
    return isinstance(event, dict) and "requestContext" in event and "role" not in event


class _Session:
    """One request's fork-join functions, keyed under a run of their own."""

    def __init__(self, store: Store, config: dict[str, Any]) -> None:
        template = forkjoin.ForkJoinSpec.loads(store.get(config["spec"]))
        self.keys = RunKeys(f"{template.run}-serve-{uuid.uuid4().hex[:12]}")
        self.spec = dataclasses.replace(template, run=self.keys.run)
        spec_key = self.keys.inference_spec()
        store.put(spec_key, self.spec.dumps())
        client = _lambda_client(config)
        for role in forkjoin.roles(self.spec, spec_key, config["digest"]):
            client.invoke(FunctionName=config["functions"][str(role.stage)], InvocationType="Event",
                          Payload=json.dumps({"role": role.dumps()}).encode())

    def infer(self, store: Store, values: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Runs the session's one request, then ends its functions (whatever happened)."""
        try:
            store.put(self.keys.infer("0", 0, 0, "request"), pack_values(values))
            return unpack_values(store.wait(self.keys.infer("0", 0, 0, "response"), RESPONSE_TIMEOUT_S))
        finally:
            for key, message in forkjoin.stop_messages(self.spec, self.keys, 1).items():
                store.put(key, message)


def _lambda_client(config: dict[str, Any]) -> Any:
    import boto3    # start-up time: only a session's start invokes functions

    endpoint = config.get("invoke_endpoint")
    return boto3.client("lambda", **({"endpoint_url": endpoint} if endpoint else {}))


def _response(status: int, document: dict[str, Any], digest: str | None = None) -> dict[str, Any]:
    headers = {"content-type": JSON}
    if digest:
        headers["x-flatpack-digest"] = digest
    return {"statusCode": status, "headers": headers, "body": json.dumps(document)}


def _error(status: int, message: str) -> dict[str, Any]:
    return _response(status, {"error": message, "status": status})


def _request(event: dict[str, Any], config: dict[str, Any]) -> Request:
    """The request's tensors, checked against the model's input contract; a RequestError
    (4xx) otherwise. No ``Content-Type`` is JSON (``curl -d`` sends a form type: named)."""
    headers = {str(name).lower(): value for name, value in (event.get("headers") or {}).items()}
    media = content_type(headers["content-type"]) if "content-type" in headers else JSON
    body = event.get("body") or ""
    try:
        raw = base64.b64decode(body, validate=True) if event.get("isBase64Encoded") else body.encode()
    except (ValueError, TypeError) as err:
        raise RequestError(400, f"the request body is marked base64 but is not ({err})") from None
    contract = InputContract.loads(config["contract"])
    return parse_request(raw, media, contract, int(config["max_samples"]),
                         raise_limit="split it; the endpoint's cap is Endpoint.max_request_samples at deploy")


def _answer(request: Request, outputs: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The outputs under their response names, in the request's form."""
    digest = config["digest"]
    named = config.get("outputs") or {name: name for name in outputs}
    body = encode_outputs({name: outputs[graph] for name, graph in named.items()}, request.form, digest)
    headers = {"content-type": request.form, "x-flatpack-digest": digest}
    if request.form == JSON:
        return {"statusCode": 200, "headers": headers, "body": body.decode()}
    # a function URL carries binary bodies base64-encoded, and says so
    return {"statusCode": 200, "headers": headers, "body": base64.b64encode(body).decode(), "isBase64Encoded": True}


def handle(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """One HTTP request to the serving master (see the module docstring)."""
    http = event.get("requestContext", {}).get("http", {})
    method, path = http.get("method", "GET"), event.get("rawPath", "/")
    if method == "GET" and path == "/healthz":
        return _response(200, {"status": "ok"})
    if (method, path) != ("POST", "/v1/predict"):
        return _error(404, f"no route {method} {path}; POST /v1/predict or GET /healthz")
    config = json.loads(os.environ[SERVE_ENV])
    try:
        request = _request(event, config)
    except RequestError as err:
        return _error(err.status, err.message)
    store = open_plain_store(os.environ[STORE_ENV])
    try:
        outputs = _Session(store, config).infer(store, request.tensors)
    except Exception as err:  # noqa: BLE001 - a failed request is the endpoint's 500, never a crashed handler
        return _error(500, f"inference failed: {type(err).__name__}: {err}")
    return _answer(request, outputs, config)
