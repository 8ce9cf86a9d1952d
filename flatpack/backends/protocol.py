"""What a backend is: the operations it offers (:class:`Capability`), the module interface
every backend exports (:class:`Backend`) and the interface of what its ``deploy`` returns
(:class:`Deployment`).

A backend that cannot do one of the operations says so in ``LIMITS`` (the reason and the
alternative), and ``flatpack.backends.check_supported`` refuses that combination when the
plan is made (``flatpack.compile`` with a workload), before anything is traced, deployed or
started.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Unpack, runtime_checkable

if TYPE_CHECKING:
    from flatpack.backends.results import TrainResult
    from flatpack.compiler import Compiled
    from flatpack.runtime.settings import RunControls, TrainOptions, TrainSettings


class Capability(str, enum.Enum):
    """An operation a backend may offer. DEPLOY, TRAIN, INFER, RESUME and TEARDOWN are the
    deployment's methods; RECOMPUTE is training a plan whose stages recompute their
    activations in the backward (``Workload.recompute``)."""

    DEPLOY = "deploy"
    TRAIN = "train"
    INFER = "infer"
    RESUME = "resume"
    TEARDOWN = "teardown"
    RECOMPUTE = "recompute"


@runtime_checkable
class Deployment(Protocol):
    """A compiled model deployed by a backend. ``resume`` is there when the backend has
    Capability.RESUME (a deployment without it has no such method)."""

    compiled: Compiled

    def train(self, batches: Any, settings: TrainSettings | None = None, controls: RunControls | None = None,
              **options: Unpack[TrainOptions]) -> TrainResult:
        """Trains on ``batches`` with ``settings`` (what the pipeline computes) and ``controls``
        (how the call is driven); ``options`` are their fields as keywords, over them
        (``runtime.settings.resolve_options``). A setting the backend does not act on is refused."""
        ...

    def infer(self, inputs: Any, settings: TrainSettings | None = None, controls: RunControls | None = None,
              **options: Unpack[TrainOptions]) -> Any:
        """The model's outputs for ``inputs``; of ``settings`` and ``controls`` only what an
        inference uses (threads, waits; the gpu-container's micro-batches and precision)."""
        ...

    def teardown(self) -> Any: ...


@runtime_checkable
class Backend(Protocol):
    """A backend module, as ``flatpack.backends.get_backend`` hands it out: ``package`` the
    compiled model for the target, ``deploy`` it (a :class:`Deployment`), ``invoke`` one of
    its workers, ``teardown`` the deployment. ``CAPABILITIES`` are the operations it offers;
    ``LIMITS`` says, for every other :class:`Capability`, why not and what to use instead."""

    NAME: str
    CAPABILITIES: frozenset[Capability]
    LIMITS: Mapping[Capability, str]

    def package(self, compiled: Compiled, *args: Any, **options: Any) -> Any: ...

    def deploy(self, compiled: Compiled, *args: Any, **options: Any) -> Any: ...

    def invoke(self, deployment: Any, role: Any, *args: Any) -> Any: ...

    def teardown(self, deployment: Any, *args: Any, **options: Any) -> Any: ...
