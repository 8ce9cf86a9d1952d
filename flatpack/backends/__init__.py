"""Targets flatpack compiles for, and the backends that deploy to them.

Every backend module exports the same small set of functions — ``package(compiled)``,
``deploy(compiled, **options) -> deployment``, ``invoke(deployment, role)`` and
``teardown(deployment)`` — and is looked up by target name in :data:`BACKENDS` (a registry
that refuses duplicate names). ``local`` runs every stage replica as its own process
sharing only a local S3 server (issue 6); the cloud targets arrive with issue 7 and until
then compile to the same stage artifacts. The platform data behind each target (tiers,
bandwidth, prices, limits, with sources) is in :mod:`flatpack.backends.catalog`.
"""

from types import ModuleType

from flatpack.backends.catalog import BUILTIN_PLATFORMS
from flatpack.errors import InputError
from flatpack.registry import Registry

# The built-in platform names, in the catalog's order: local, aws-lambda, alibaba-fc, gpu-container.
TARGETS = tuple(BUILTIN_PLATFORMS)
BACKEND_FUNCTIONS = ("package", "deploy", "invoke", "teardown")

BACKENDS: Registry[ModuleType] = Registry("backend", InputError, {"local": "flatpack.backends.local:backend"})


def get_backend(name: str) -> ModuleType:
    """The backend module for target ``name``; the error lists the targets that deploy."""
    return BACKENDS.factory(name)()
