"""Errors flatpack raises on bad input. Each message names the cause and the fix."""

from __future__ import annotations


class FlatpackError(Exception):
    """Base class of every error flatpack raises on purpose."""


class InputError(FlatpackError, ValueError):
    """The model or the example inputs handed to flatpack are not usable as given."""


class TraceError(FlatpackError):
    """Neither torch.fx nor torch.export could capture the model."""


class PassError(FlatpackError, ValueError):
    """A pass pipeline string or a pass option is malformed."""


class PlanError(FlatpackError, ValueError):
    """A plan does not fit the layer chain it is applied to."""


class CodegenError(FlatpackError):
    """A stage could not be emitted as self-contained source."""


class ArtifactError(FlatpackError):
    """A stage artifact or a compiled directory on disk is missing, foreign or tampered with."""
