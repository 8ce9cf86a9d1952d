"""The OpenAPI 3.1 schema of the service (``GET /openapi.json``), written out by hand from the
model's input contract: six routes need no schema generator."""

from __future__ import annotations

from typing import Any

from flatpack.runtime.request_tensors import JSON, SAFETENSORS, InputContract
from flatpack.version import __version__


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _nested(depth: int, leaf: dict[str, Any]) -> dict[str, Any]:
    schema = leaf
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def schema(contract: InputContract) -> dict[str, Any]:
    number = {"type": "number"}
    inputs = {name: {**_nested(len(spec.shape), {"type": "integer"} if "int" in spec.dtype else number),
                     "description": f"{spec.dtype}, shape (batch, {', '.join(map(str, spec.shape[1:]))})"}
              for name, spec in zip(contract.names, contract.specs)}
    digest_header = {"x-flatpack-digest": {"description": "sha256 of the artifact index that computed the answer",
                                           "schema": {"type": "string"}}}
    predict = {
        "summary": "Run the model on a batch of samples (dimension 0 of every input)",
        "requestBody": {"required": True, "content": {
            JSON: {"schema": {"type": "object", "required": ["inputs"], "properties": {"inputs": {
                "type": "object", "required": list(contract.names), "additionalProperties": False,
                "properties": inputs}}}},
            SAFETENSORS: {"schema": {"type": "string", "format": "binary",
                                     "description": "a safetensors file with one tensor per input name"}}}},
        "responses": {
            "200": {"description": "the outputs, split back to this request's samples", "headers": digest_header,
                    "content": {JSON: {"schema": {"type": "object", "properties": {
                        "outputs": {"type": "object"}, "dtypes": {"type": "object"},
                        "digest": {"type": "string"}}}},
                        SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}},
            "400": _error_response("malformed body"), "413": _error_response("body or batch over the limit"),
            "415": _error_response("unsupported Content-Type"),
            "422": _error_response("an input of the wrong name, shape or dtype"),
            "429": {**_error_response("shed: the request would miss the SLO (on arrival, or after queueing)"),
                    "headers": {"Retry-After": {"schema": {"type": "integer"},
                                                "description": "seconds the work ahead is predicted to need"}}},
            "500": _error_response("a function failed"),
            "503": _error_response("warming up or draining")}}
    plain = {"200": {"description": "ok"}, "503": {"description": "not ready"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "flatpack serve", "version": __version__},
        "paths": {
            "/v1/predict": {"post": predict},
            "/healthz": {"get": {"summary": "the process answers", "responses": {"200": {"description": "ok"}}}},
            "/readyz": {"get": {"summary": "a warm version serves and the server is not draining",
                                "responses": plain}},
            "/metrics": {"get": {"summary": "Prometheus text format", "responses": {"200": {"description": "ok"}}}},
            "/admin/version": {"post": {
                "summary": "switch blue/green to a digest-pinned artifact directory",
                "security": [{"bearer": []}],
                "requestBody": {"required": True, "content": {JSON: {"schema": {
                    "type": "object", "required": ["artifact_dir", "digest"],
                    "properties": {"artifact_dir": {"type": "string"}, "digest": {"type": "string"}}}}}},
                "responses": {"200": {"description": "switched", "headers": digest_header},
                              "401": _error_response("missing or wrong token"),
                              "409": _error_response("the new artifact takes other inputs"),
                              "422": _error_response("the artifact could not be loaded or started")}}}},
        "components": {
            "schemas": {"Error": {"type": "object", "required": ["error", "status"],
                                  "properties": {"error": {"type": "string"}, "status": {"type": "integer"}}}},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
