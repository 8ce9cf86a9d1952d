"""flatpack: cut PyTorch models into pipeline stages that fit serverless functions, and run them."""

from flatpack.compiler import Compiled, StagedModule, compile, load
from flatpack.errors import (ArtifactError, CodegenError, FlatpackError, InputError, PassError, PlanError,
                             TraceError)
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.version import __version__
from flatpack.weights import load_state_dict, save_state_dict

__all__ = [
    "ArtifactError", "CodegenError", "Compiled", "FlatpackError", "InputError", "PassError", "Plan",
    "PlanError", "StagePlan", "StagedModule", "TraceError", "__version__", "compile", "load",
    "load_state_dict", "save_state_dict",
]
