"""Tensors and small documents as bytes, with no pickle anywhere.

Tensors travel as one safetensors buffer: a JSON header (dtype, shape, byte offsets) and the
raw bytes. Metadata rides in the header as one JSON string, because safetensors metadata is
a flat str -> str map. A receiver decodes with nothing but safetensors and json, after
checking the header length against the payload, so decoding runs no code from the payload
(``tests/integration/test_stores.py::test_wire_rejects_bad_input_and_bad_bytes``,
``tests/security/test_no_import_from_data.py``). Decoding is not authentication: whoever can
write the store can still change the tensors' values (docs/security.md).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
from safetensors.torch import load as _st_load
from safetensors.torch import save as _st_save

from flatpack.errors import WireError

META_KEY = "flatpack.meta"
_HEADER_LEN = struct.Struct("<Q")
# safetensors itself refuses headers above 100 MB; a larger claim means the bytes are not ours.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def dumps(tensors: dict[str, torch.Tensor], meta: dict | None = None) -> bytes:
    """Encode named tensors (and an optional JSON-able ``meta`` dict) as safetensors bytes."""
    if not isinstance(tensors, dict):
        raise WireError(f"dumps() takes a dict of name -> tensor, got {type(tensors).__name__}; wrap a single tensor "
                        f"as {{'x': t}}")
    if meta is not None and not isinstance(meta, dict):
        raise WireError(f"dumps(meta=...) takes a dict or None, got {type(meta).__name__}")
    metadata = {META_KEY: _meta_json(meta or {})}
    try:
        return _st_save(_storable(tensors), metadata=metadata)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise WireError(f"safetensors could not encode the tensors ({exc}); use a dtype safetensors supports "
                        "(float/bfloat16/int/bool) and dense tensors") from exc


def loads(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """Decode bytes from :func:`dumps` into (tensors, meta)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"loads() takes bytes, got {type(data).__name__}")
    data = bytes(data)
    meta = _read_meta(data)
    try:
        tensors = _st_load(data)
    except Exception as exc:  # safetensors raises its own SafetensorError (not importable by a stable name)
        raise WireError(f"the payload is not valid safetensors ({type(exc).__name__}: {exc}); it is truncated or "
                        "was not written by flatpack.stage.wire.dumps") from exc
    return tensors, meta


def dumps_json(obj: Any) -> bytes:
    """Encode a JSON document as UTF-8 bytes, keys sorted so equal documents are equal bytes."""
    try:
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise WireError(f"cannot encode as JSON ({exc}); pass plain dicts, lists, str, int, float, bool or "
                        "None") from exc


def loads_json(data: bytes) -> Any:
    """Decode bytes from :func:`dumps_json`."""
    try:
        return json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"the payload is not UTF-8 JSON ({exc}); it was not written by dumps_json") from exc


def _meta_json(meta: dict) -> str:
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise WireError(f"meta must be JSON-serializable ({exc}); convert tensors and numpy values to lists or "
                        "numbers") from exc


def _storable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Dense, contiguous CPU tensors with no two sharing storage (safetensors refuses both)."""
    out: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for name, tensor in tensors.items():
        _check_entry(name, tensor)
        t = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
        ptr = t.untyped_storage().data_ptr()
        # empty tensors have no storage (ptr 0) and never count as shared
        if ptr and ptr in seen_storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen_storages.add(ptr)
        out[name] = t
    return out


def _check_entry(name: object, tensor: object) -> None:
    if not isinstance(name, str):
        raise WireError(f"tensor names must be str, got {type(name).__name__} {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise WireError(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor; put non-tensor values in meta")
    if tensor.layout != torch.strided:
        raise WireError(f"{name!r} has layout {tensor.layout}; call .to_dense() before sending it")


# -- a stage's named values: tensors in the body, the rest (sizes, flags) in the header --------

def split_values(values: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors go into the safetensors body; other values (sizes, flags) into its JSON header."""
    tensors = {name: value.detach() for name, value in values.items() if isinstance(value, torch.Tensor)}
    others = {name: value for name, value in values.items() if not isinstance(value, torch.Tensor)}
    return tensors, others


def pack_values(values: dict[str, Any]) -> bytes:
    """Named values (tensors and JSON-able others) as one message; :func:`unpack_values` reads it."""
    tensors, others = split_values(values)
    return dumps(tensors, {"values": others})


def unpack_values(data: bytes) -> dict[str, Any]:
    """The named values :func:`pack_values` wrote."""
    tensors, meta = loads(data)
    return {**meta.get("values", {}), **tensors}


def _read_meta(data: bytes) -> dict:
    """The ``meta`` dict from a safetensors header, parsed with json (safetensors.load drops it)."""
    if len(data) < _HEADER_LEN.size:
        raise WireError(f"the payload is {len(data)} bytes, shorter than a safetensors header; it was truncated")
    (n,) = _HEADER_LEN.unpack_from(data)
    if n > _MAX_HEADER_BYTES or _HEADER_LEN.size + n > len(data):
        raise WireError(f"the payload claims a {n}-byte header but has {len(data)} bytes; it is truncated or not "
                        "safetensors")
    try:
        header = json.loads(data[_HEADER_LEN.size:_HEADER_LEN.size + n])
    except ValueError as exc:
        raise WireError(f"the safetensors header is not JSON ({exc}); the payload is corrupt") from exc
    raw = (header.get("__metadata__") or {}).get(META_KEY)
    if raw is None:
        return {}
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise WireError(f"the flatpack metadata in the header is not JSON ({exc}); the payload is corrupt") from exc
    if not isinstance(meta, dict):
        raise WireError(f"the flatpack metadata is a {type(meta).__name__}, expected a dict; the payload is corrupt")
    return meta
