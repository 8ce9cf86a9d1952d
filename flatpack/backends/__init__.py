"""Targets flatpack compiles for, and the backends that deploy to them.

Every backend module exports the same small set of functions — ``package(compiled)``,
``deploy(compiled, **options) -> deployment``, ``invoke(deployment, role)`` and
``teardown(deployment)`` — and the operations it offers (``CAPABILITIES``, and ``LIMITS`` for
the rest), the :class:`~flatpack.backends.protocol.Backend` protocol; it is looked up by
target name in :data:`BACKENDS` (a registry that refuses duplicate names). ``local`` runs
every stage replica as its own process sharing only a local S3 server; ``aws-lambda`` and
``alibaba-fc`` deploy the same functions as container images (``images``, ``cloud``) and share
the local backend's invoker (``functions``); ``gpu-container`` runs stages as containers that
talk to each other with ``torch.distributed``; ``ray`` runs the local backend's functions as
Ray tasks on a cluster. The platform data behind each target (tiers, bandwidth, prices,
limits, with sources) is in :mod:`flatpack.platform.catalog`.
"""

from flatpack.backends.protocol import Backend, Capability
from flatpack.errors import InputError
from flatpack.platform.catalog import BUILTIN_PLATFORMS
from flatpack.registry import Registry

# The built-in platform names, in the catalog's order: local, aws-lambda, alibaba-fc, gpu-container, ray.
TARGETS = tuple(BUILTIN_PLATFORMS)
# where flatpack run and resume train the local backend's processes, or the same functions as
# Ray tasks on a cluster (a run directory records it: rundir.RunRecord.target); the other
# targets deploy (flatpack deploy) and train from Python
RUN_TARGETS = ("local", "ray")
BACKEND_FUNCTIONS = ("package", "deploy", "invoke", "teardown")

BACKENDS: Registry[Backend] = Registry("backend", InputError, {
    "local": "flatpack.backends.local:backend",
    "aws-lambda": "flatpack.backends.aws_lambda:backend",
    "alibaba-fc": "flatpack.backends.alibaba_fc:backend",
    "gpu-container": "flatpack.backends.gpu_container:backend",
    "ray": "flatpack.backends.ray:backend",
})


def get_backend(name: str) -> Backend:
    """The backend module for target ``name``; the error lists the targets that deploy."""
    return BACKENDS.make(name)


def check_supported(target: str, needed: Capability) -> None:
    """InputError naming the backend, the operation and the targets that can, when
    ``target``'s backend lacks ``needed``; a target no backend deploys (a platform registered
    to plan for) passes: nothing will run there."""
    if target not in BACKENDS.names():
        return
    backend = get_backend(target)
    if needed in backend.CAPABILITIES:
        return
    others = [name for name in BACKENDS.names() if needed in get_backend(name).CAPABILITIES]
    instead = f"; targets that can: {', '.join(others)}" if others else ""
    raise InputError(f"the {target} backend cannot {needed.value}: {backend.LIMITS[needed]}{instead}")


def check_workload(target: str, mode: str, recompute: str) -> None:
    """What a workload (``partitioner.workload.Workload``'s mode and recompute) needs of
    ``target``'s backend, checked when the plan is made."""
    check_supported(target, Capability(mode))
    if mode == Capability.TRAIN.value and recompute != "never":
        check_supported(target, Capability.RECOMPUTE)
