"""The serving master on Lambda: a function URL's HTTP request answered through the warm
fork-join functions (``backends.lambda_endpoint`` deploys it).

The event is Lambda's function-URL event (payload format 2.0: ``requestContext.http.method``,
``rawPath``, ``body``, ``isBase64Encoded``); the answer is the HTTP response Lambda sends
back (``statusCode``, ``headers``, ``body``). Routes: ``GET /healthz``; ``POST /v1/predict``
with ``{"inputs": {"NAME": [[...]], ...}}``, answered ``{"outputs": {...}, "digest": D}``.

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

from flatpack import safeio
from flatpack.errors import InputError
from flatpack.runtime import forkjoin
from flatpack.runtime.function import STORE_ENV
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store, open_plain_store
from flatpack.stage.wire import pack_values, unpack_values

# JSON: spec, digest, functions (by stage), dtypes (by input), outputs (response name: graph output), invoke_endpoint
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
    headers = {"content-type": "application/json"}
    if digest:
        headers["x-flatpack-digest"] = digest
    return {"statusCode": status, "headers": headers, "body": json.dumps(document)}


def _error(status: int, message: str) -> dict[str, Any]:
    return _response(status, {"error": message, "status": status})


def _inputs(event: dict[str, Any], dtypes: dict[str, str]) -> dict[str, torch.Tensor] | dict[str, Any]:
    """The request's tensors by input name, or an error response (a dict with ``statusCode``)."""
    body = event.get("body") or ""
    raw = base64.b64decode(body) if event.get("isBase64Encoded") else body.encode()
    try:
        # the project's strict parser, as `flatpack serve` reads a body: json.loads would let a
        # deeply nested body raise RecursionError out of the handler, and take NaN
        document = safeio.parse_json(raw, what="the request body")
    except InputError as err:
        return _error(400, str(err))
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), dict):
        return _error(400, 'the request body must be a JSON object {"inputs": {"NAME": [[...]], ...}}')
    given = document["inputs"]
    if set(given) != set(dtypes):
        return _error(422, f"the model takes the inputs {sorted(dtypes)}, got {sorted(given)}")
    tensors = {}
    for name, dtype in dtypes.items():
        try:
            tensors[name] = torch.tensor(given[name], dtype=getattr(torch, dtype))
        except (TypeError, ValueError, RuntimeError, OverflowError) as err:
            return _error(422, f"input {name!r} is not a rectangular list of {dtype} numbers ({err})")
    return tensors


def handle(event: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """One HTTP request to the serving master (see the module docstring)."""
    http = event.get("requestContext", {}).get("http", {})
    method, path = http.get("method", "GET"), event.get("rawPath", "/")
    if method == "GET" and path == "/healthz":
        return _response(200, {"status": "ok"})
    if (method, path) != ("POST", "/v1/predict"):
        return _error(404, f"no route {method} {path}; POST /v1/predict or GET /healthz")
    config = json.loads(os.environ[SERVE_ENV])
    inputs = _inputs(event, config["dtypes"])
    if "statusCode" in inputs:
        return inputs
    store = open_plain_store(os.environ[STORE_ENV])
    try:
        outputs = _Session(store, config).infer(store, inputs)
    except Exception as err:  # noqa: BLE001 - a failed request is the endpoint's 500, never a crashed handler
        return _error(500, f"inference failed: {type(err).__name__}: {err}")
    named = config.get("outputs") or {name: name for name in outputs}
    return _response(200, {"outputs": {name: outputs[graph].tolist() for name, graph in named.items()},
                           "digest": config["digest"]}, config["digest"])
