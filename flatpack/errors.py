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
    """An artifact (a compiled directory, a stage, the files a worker fetched) is missing or
    foreign, or does not match its index, the pinned digest or its signature, or names code
    in its data. Raised before any code of the artifact runs, naming the file
    (``tests/security/test_tampering.py``). Without a pinned digest or a signature key only
    the index in the artifact itself vouches for the files (docs/security.md)."""


class RunFailure(FlatpackError):
    """A deployed run could not finish: a function failed for good (the message says which
    stage and replica, why, and what to change). The run's checkpoints stay in the store until
    the deployment is torn down, and a local deployment given a ``data_dir`` (a ``flatpack run``
    directory's ``store/``) keeps them through teardown: ``deployment.resume(batches)`` and
    ``flatpack resume RUN_DIR`` continue the call (``tests/integration/test_recovery.py``)."""


class ArtifactRefused(RunFailure, ArtifactError):
    """A function refused its stage artifact: the files it fetched do not match the digest the
    deployment gave it (``tests/security/test_worker.py``). No code of that stage ran."""


class FunctionOutOfMemory(RunFailure):
    """A function's peak memory passed its memory tier, as an out-of-memory function fails."""

    def __init__(self, message: str, *, stage: int, replica: int, peak_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.stage, self.replica = stage, replica
        self.peak_bytes, self.limit_bytes = peak_bytes, limit_bytes

    @property
    def over_bytes(self) -> int:
        return self.peak_bytes - self.limit_bytes


class StoreError(FlatpackError):
    """A store (S3, OSS, Redis, local files) refused or failed an operation."""


class StoreKeyError(StoreError, KeyError):
    """A key the caller asked for is not in the store."""

    def __str__(self) -> str:
        # KeyError's own __str__ shows repr(message), quotes and escapes included; show the message.
        return str(self.args[0]) if self.args else ""


class StoreTimeout(StoreError, TimeoutError):
    """A key did not appear in the store before the deadline."""


class WireError(FlatpackError, ValueError):
    """Tensors or metadata cannot be encoded for the wire, or received bytes are not a valid payload."""


class DeployError(FlatpackError):
    """A cloud deployment could not be created (credentials, region, a refused API call) or
    torn down. The message names the cause and the fix, and says what was rolled back: a
    failed deploy leaves nothing behind in the account."""

    def __init__(self, message: str, *, rolled_back: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.rolled_back = rolled_back


def first_line(err: BaseException) -> str:
    """An error as one short line for a note: its type and the first line of its message
    (at most 300 characters; torch's messages run to pages)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
