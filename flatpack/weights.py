"""Trained weights out: the original model's ``state_dict`` from a pipelined run, saved as
safetensors and loaded back so that ``model.load_state_dict(flatpack.load_state_dict(path))``
works (``tests/unit/test_weights.py``, ``tests/integration/test_data_run.py``).

A safetensors file cannot hold two names for one tensor, so tied weights (BERT's decoder and
word embeddings) are stored once, under their first name, and the file's metadata maps every
other name to it; :func:`load_state_dict` gives each name its tensor again (the same tensor
object, as the model's own ``state_dict`` does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flatpack.errors import InputError

ALIASES_KEY = "flatpack.aliases"


def state_dict_of(compiled: Any, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every key of the original model's ``state_dict`` (``compiled.info.state_dict_keys``,
    recorded at compile time) from a run's ``parameters`` (weights and buffers by original
    name, a tied weight under one of its names): the manifests' aliases fill in the other
    names, and buffers the model does not persist (``persistent=False``) are left out, so
    ``model.load_state_dict`` accepts the result with ``strict=True``. Artifacts compiled
    before the keys were recorded get every name the manifests know."""
    found = with_aliases(compiled, parameters)
    keys = compiled.info.state_dict_keys
    if keys is None:
        return found
    missing = [key for key in keys if key not in found]
    if missing:
        raise InputError(f"the run's weights lack {len(missing)} of the model's state_dict keys "
                         f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}); the checkpoints are "
                         "incomplete: resume the run (flatpack resume) before saving")
    return {key: found[key] for key in keys}


def with_aliases(compiled: Any, parameters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``parameters`` with every name the manifests give a tied weight (its aliases)."""
    found = dict(parameters)
    for artifact in compiled.artifacts:
        for entry in artifact.manifest.parameters:
            names = [entry.name, *entry.aliases]
            tensor = next((found[name] for name in names if name in found), None)
            if tensor is None:
                continue
            for name in names:
                found.setdefault(name, tensor)
    return found


def save_state_dict(state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Writes ``state`` as safetensors, each tensor once: a name whose tensor is the same
    object (or storage and view) as an earlier name's is recorded as its alias in the metadata."""
    path = Path(path)
    if path.suffix != ".safetensors":
        raise InputError(f"--save {path}: the weights are written as safetensors; name the file *.safetensors")
    if path.exists() and path.is_dir():
        raise InputError(f"--save {path} is a directory; give a file name ending in .safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()), tensor.dtype) if tensor.numel() else (id(tensor),)
        if identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        tensors[name] = tensor.contiguous().clone() if not tensor.is_contiguous() else tensor
    save_file(tensors, str(path), metadata={ALIASES_KEY: json.dumps(aliases), "format": "pt"})
    return path


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict a ``.safetensors`` file from ``flatpack run --save`` (or
    :func:`save_state_dict`, ``RUN/trained.safetensors``) holds, tied names restored:
    ``model.load_state_dict(flatpack.load_state_dict(path))``."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no weights file {path}; `flatpack run --save PATH.safetensors` writes one")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            # a safetensors handle has keys() but is not iterable itself
            state = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say which
        raise InputError(f"{path} is not a readable safetensors file ({err})") from None
    aliases = json.loads(metadata.get(ALIASES_KEY, "{}"))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state
