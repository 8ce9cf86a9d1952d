"""A predict request's body as tensors, checked against the model's input contract before any
function runs, and the outputs written back in the request's form.

Two forms (chosen by ``Content-Type``): ``application/json`` with ``{"inputs": {"x": [[...]]}}``
(nested lists; a float input accepts integers, an integer input refuses fractions), answered
with ``{"outputs": {...}, "digest": ...}``; and ``application/safetensors`` (a safetensors file
whose tensors are named as the inputs, dtypes exact), answered with a safetensors file. The
digest travels in the ``x-flatpack-digest`` header either way.

Serving reads dimension 0 of every input and output as the batch: requests are concatenated
along it and the outputs split back (``serve.batcher``). The other dimensions must be the
compiled example's, except those the trace left free (``TensorSpec.free_dims``); requests
whose free sizes differ are batched apart (:attr:`Request.shape_key`).

It lives in the runtime because both serving masters read requests with it: ``flatpack serve``
(:mod:`flatpack.serve.app`) and the Lambda function URL's (:mod:`flatpack.runtime.url_handler`),
which finds its :class:`InputContract` in its configuration (:meth:`InputContract.dumps`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from flatpack import safeio
from flatpack.errors import InputError
from flatpack.stage.tensor_check import TensorSpec, check_tensor, dtype_name

JSON = "application/json"
SAFETENSORS = "application/safetensors"
CONTENT_TYPES = (JSON, SAFETENSORS)
MAX_JSON_DEPTH = 34           # the deepest tensor a JSON body may nest (32 dimensions and the wrapping)
RAISE_SAMPLES = "split it, or raise --max-request-samples"


class RequestError(Exception):
    """A request refused before any function runs: ``status`` (4xx) and one clear message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class InputContract:
    """What a predict request must hold: per input name, the compiled example's spec."""

    names: tuple[str, ...]
    specs: tuple[TensorSpec, ...]
    min_samples: int = 1            # a group split by batch needs one sample per partition

    @classmethod
    def of(cls, names: Sequence[str], specs: Sequence[TensorSpec] | None, min_samples: int = 1) -> InputContract:
        if specs is None or len(specs) != len(names):
            raise InputError("the artifact records no input specs (shape and dtype per input), which serving checks "
                             "requests against; recompile it with this flatpack")
        for name, spec in zip(names, specs):
            if not spec.shape:
                raise InputError(f"input {name!r} is a scalar; serving batches along dimension 0 of every input")
        return cls(tuple(names), tuple(specs), min_samples)

    def dumps(self) -> str:
        """The contract as JSON, for a serving master that has no compiled model to read it
        from (the Lambda endpoint's configuration); :meth:`loads` reads it back."""
        return json.dumps({"inputs": {name: spec.to_json() for name, spec in zip(self.names, self.specs)},
                           "min_samples": self.min_samples}, separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> InputContract:
        data = json.loads(text)
        inputs = data["inputs"]
        return cls.of(tuple(inputs), [TensorSpec.from_json(entry) for entry in inputs.values()],
                      int(data["min_samples"]))

    def to_json(self) -> dict[str, Any]:
        return {name: {"dtype": spec.dtype, "shape": ["batch", *spec.shape[1:]],
                       "free_dims": None if spec.free_dims is None else list(spec.free_dims)}
                for name, spec in zip(self.names, self.specs)}


@dataclass(frozen=True)
class Request:
    """One checked request: its tensors by input name, its sample count, and the key of the
    requests it may share a batch with (the same sizes beyond dimension 0)."""

    tensors: dict[str, torch.Tensor]
    samples: int
    shape_key: tuple[tuple[int, ...], ...]
    form: str                       # JSON or SAFETENSORS: how to answer


def content_type(header: str | None) -> str:
    """The media type of a ``Content-Type`` header, or a 415 naming the two accepted."""
    media = (header or "").split(";")[0].strip().lower()
    if media not in CONTENT_TYPES:
        raise RequestError(415, f"Content-Type must be {JSON} or {SAFETENSORS}, got {header or 'none'!r}")
    return media


def parse_request(body: bytes, media: str, contract: InputContract, max_samples: int,
                  raise_limit: str = RAISE_SAMPLES) -> Request:
    """The body's tensors, each checked against ``contract``; a RequestError (4xx) otherwise.
    ``raise_limit``: what the 413 of a request over ``max_samples`` tells its sender to do."""
    tensors = _json_tensors(body, contract) if media == JSON else _safetensors_tensors(body)
    unknown = sorted(set(tensors) - set(contract.names))
    if unknown:
        raise RequestError(422, f"unknown input {unknown[0]!r}; the model takes {', '.join(map(repr, contract.names))}")
    missing = [name for name in contract.names if name not in tensors]
    if missing:
        raise RequestError(422, f"input {missing[0]!r} is missing; the model takes "
                                f"{', '.join(map(repr, contract.names))}")
    samples = _check_shapes(tensors, contract, max_samples, raise_limit)
    key = tuple(tuple(tensors[name].shape[1:]) for name in contract.names)
    return Request({name: tensors[name] for name in contract.names}, samples, key, media)


def _check_shapes(tensors: Mapping[str, torch.Tensor], contract: InputContract, max_samples: int,
                  raise_limit: str) -> int:
    samples = None
    for name, spec in zip(contract.names, contract.specs):
        tensor = tensors[name]
        # every size beyond the batch is the example's unless the trace left it free
        free = tuple(sorted({0, *(spec.free_dims if spec.free_dims is not None else ())}))
        try:
            check_tensor(name, tensor, TensorSpec(spec.shape, spec.dtype, free), expected_by="the model takes",
                         fix="Dimension 0 is the batch.", exact_dtype=False)
        except InputError as err:
            raise RequestError(422, str(err)) from None
        if samples is not None and tensor.shape[0] != samples:
            raise RequestError(422, f"input {name!r} has {tensor.shape[0]} samples (dimension 0) but the request's "
                                    f"other inputs have {samples}; every input needs the same batch")
        samples = int(tensor.shape[0])
    assert samples is not None      # InputContract.of refuses a model without inputs' specs
    if samples < contract.min_samples:
        raise RequestError(422, f"the request has {samples} sample(s); this plan splits a group by batch over "
                                f"{contract.min_samples} partitions, so a request needs at least "
                                f"{contract.min_samples}")
    if samples > max_samples:
        raise RequestError(413, f"the request has {samples} samples; the limit is {max_samples} per request "
                                f"({raise_limit})")
    return samples


def _json_tensors(body: bytes, contract: InputContract) -> dict[str, torch.Tensor]:
    try:
        document = safeio.parse_json(body, what="the request body", max_depth=MAX_JSON_DEPTH)
    except InputError as err:
        raise RequestError(400, str(err)) from None
    if not isinstance(document, dict) or not isinstance(document.get("inputs"), dict):
        raise RequestError(400, 'the request body must be a JSON object {"inputs": {"NAME": [[...]], ...}}')
    specs = dict(zip(contract.names, contract.specs))
    tensors = {}
    for name, value in document["inputs"].items():
        if name not in specs:
            raise RequestError(422, f"unknown input {name!r}; the model takes {', '.join(map(repr, contract.names))}")
        tensors[name] = _json_tensor(name, value, specs[name])
    return tensors


def _json_tensor(name: str, value: Any, spec: TensorSpec) -> torch.Tensor:
    want = getattr(torch, spec.dtype)
    if not isinstance(value, list):
        raise RequestError(422, f"input {name!r} must be a nested list (a {spec.dtype} tensor), got "
                                f"{type(value).__name__}")
    try:
        tensor = torch.tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise RequestError(422, f"input {name!r} is not a rectangular list of numbers ({err})") from None
    if tensor.dtype == torch.bool and want != torch.bool:
        raise RequestError(422, f"input {name!r} holds booleans, but the model takes {spec.dtype}")
    if tensor.is_floating_point() and not want.is_floating_point:
        raise RequestError(422, f"input {name!r} holds fractions, but the model takes {spec.dtype} (whole numbers)")
    return tensor.to(want)


def _safetensors_tensors(body: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(body)
    except (SafetensorError, ValueError, RuntimeError, TypeError) as err:
        raise RequestError(400, f"the request body is not a safetensors file ({err})") from None


def flat_outputs(outputs: Any) -> dict[str, torch.Tensor]:
    """The model's outputs by name: ``output`` for one tensor, ``output_0``... for a tuple, the
    keys of a dict (HF models' ``ModelOutput`` included)."""
    if isinstance(outputs, torch.Tensor):
        return {"output": outputs}
    if isinstance(outputs, Mapping):
        return {str(key): value for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    if isinstance(outputs, (tuple, list)):
        return {f"output_{index}": value for index, value in enumerate(outputs) if isinstance(value, torch.Tensor)}
    raise TypeError(f"the model returned {type(outputs).__name__}; serving answers with tensors only")


def encode_outputs(outputs: Mapping[str, torch.Tensor], form: str, digest: str) -> bytes:
    """The response body in the request's form (the digest is in the JSON body and, for both
    forms, in the response header)."""
    if form == SAFETENSORS:
        return save_safetensors({name: tensor.contiguous() for name, tensor in outputs.items()},
                                metadata={"digest": digest})

    return json.dumps({"outputs": {name: tensor.tolist() for name, tensor in outputs.items()},
                       "dtypes": {name: dtype_name(tensor.dtype) for name, tensor in outputs.items()},
                       "digest": digest}).encode()
