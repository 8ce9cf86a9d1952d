"""flatpack: cut PyTorch models into pipeline stages that fit serverless functions, and run them.

The public names that need the compiler load on first use (PEP 562, start-up time): a stage
worker imports ``flatpack.stage`` and ``flatpack.runtime``, and this ``__init__`` runs first;
importing the compiler here would put every flatpack module and the libraries they use into
the cold start of each function, and into every image (the layering: docs/architecture.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flatpack.errors import ArtifactError, CodegenError, FlatpackError, InputError, PassError, PlanError, TraceError
from flatpack.version import __version__

if TYPE_CHECKING:
    from flatpack.api import compile
    from flatpack.compiler import Compiled, StagedModule, load, sign
    from flatpack.partitioner.plan import Plan, StagePlan
    from flatpack.serve import serve
    from flatpack.weights import load_state_dict, save_state_dict

# public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "Compiled": "flatpack.compiler", "StagedModule": "flatpack.compiler", "compile": "flatpack.api",
    "load": "flatpack.compiler", "sign": "flatpack.compiler", "Plan": "flatpack.partitioner.plan",
    "StagePlan": "flatpack.partitioner.plan",
    "load_state_dict": "flatpack.weights", "save_state_dict": "flatpack.weights",
}

__all__ = [
    "ArtifactError", "CodegenError", "Compiled", "FlatpackError", "InputError", "PassError", "Plan",
    "PlanError", "StagePlan", "StagedModule", "TraceError", "__version__", "compile", "load",
    "load_state_dict", "save_state_dict", "serve", "sign",
]


def __getattr__(name: str) -> Any:
    if name == "serve":
        # the package itself: importing it binds flatpack.serve to the module, which is callable
        # (flatpack/serve/__init__.py), so flatpack.serve(...) and flatpack.serve.server both work
        return importlib.import_module("flatpack.serve")
    if name not in _LAZY:
        raise AttributeError(f"module 'flatpack' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value   # later reads find it without calling this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
