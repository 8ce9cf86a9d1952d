"""Targets flatpack compiles for, and the backends that deploy to them.

Every backend module exports the same small set of functions — ``package(compiled)``,
``deploy(compiled, **options) -> deployment``, ``invoke(deployment, role)`` and
``teardown(deployment)`` — and is looked up by target name in :data:`BACKENDS` (a registry
that refuses duplicate names). ``local`` runs every stage replica as its own process
sharing only a local S3 server; ``aws-lambda`` and ``alibaba-fc`` deploy the same functions
as container images (``images``, ``cloud``) and share the local backend's invoker
(``functions``); ``gpu-container`` runs stages as containers that talk to each other with
``torch.distributed``. The platform data behind each target (tiers,
bandwidth, prices, limits, with sources) is in :mod:`flatpack.platform.catalog`.
"""

from types import ModuleType

from flatpack.errors import InputError
from flatpack.platform.catalog import BUILTIN_PLATFORMS
from flatpack.registry import Registry

# The built-in platform names, in the catalog's order: local, aws-lambda, alibaba-fc, gpu-container.
TARGETS = tuple(BUILTIN_PLATFORMS)
BACKEND_FUNCTIONS = ("package", "deploy", "invoke", "teardown")

BACKENDS: Registry[ModuleType] = Registry("backend", InputError, {
    "local": "flatpack.backends.local:backend",
    "aws-lambda": "flatpack.backends.aws_lambda:backend",
    "alibaba-fc": "flatpack.backends.alibaba_fc:backend",
    "gpu-container": "flatpack.backends.gpu_container:backend",
})


def get_backend(name: str) -> ModuleType:
    """The backend module for target ``name``; the error lists the targets that deploy."""
    return BACKENDS.factory(name)()
