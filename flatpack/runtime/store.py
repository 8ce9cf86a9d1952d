"""One store interface over S3, Alibaba OSS, Redis and a local directory.

Stage workers share nothing but a store: activations, gradients, checkpoints and status
objects pass through it. Every backend keeps the same contract:

- ``put`` publishes atomically: a reader sees the whole new object or the previous state,
  never a torn or short one (S3/OSS PUT and Redis SET are atomic; files are written to a
  temporary name and renamed).
- ``get`` of an absent key raises :class:`StoreKeyError` naming the key.
- ``list``/``delete_prefix`` take a non-empty prefix ending in ``/`` and never list a whole
  bucket, so a run only ever touches its own prefix (see :mod:`flatpack.runtime.keys`).
- ``url`` is what another process passes to :func:`flatpack.runtime.store_url.open_store`; it never holds a secret.
  Credentials come from each platform's own chain (env vars, profiles, instance roles).

Every network call goes through :func:`retrying`: transient failures (connection errors,
read timeouts and stalled reads, 5xx, throttling; see :func:`is_transient`) back off
exponentially with full jitter for a budget in *time* (``retry_s``: the store's argument,
the url's ``?retry_s=``, else the ``FLATPACK_STORE_RETRY_S`` env var, else
:data:`DEFAULT_RETRY_S`); anything else (a 4xx other than throttling: access denied, no such
bucket, bad credentials, a bad request) is translated at once into a :class:`StoreError`
that names the bucket or key and the fix. A budget spent on transient failures raises
:class:`StoreUnavailable`, which a worker reports as a transient failure (the invoker
relaunches it) rather than as an error of the user's code.
"""

from __future__ import annotations

import abc
import http.client
import ipaddress
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar, cast
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit
from urllib.request import url2pathname

from flatpack.atomic import write_atomic
from flatpack.errors import StoreError, StoreKeyError, StoreTimeout

T = TypeVar("T")

SCHEMES = ("file", "s3", "redis", "oss")

# wait() polls: start fast (a key often lands within milliseconds), then back off so that
# many waiting workers do not hammer the server.
_WAIT_FIRST_S = 0.001
_WAIT_MAX_S = 0.005   # polling, as FuncPipe does: a key that appears is seen within 5 ms


def wait_misses(seconds: float, request_s: float = 0.0) -> int:
    """The gets :meth:`Store.wait` makes that find no key, when the key appears ``seconds``
    after the wait began and each get takes ``request_s``: one at once, then one after each
    back-off sleep (1, 2, 4, then every 5 ms) that ends before the key appears. What a poll
    asks of the store's CPU (``analysis.host_load``)."""
    misses, elapsed, delay = 0, 0.0, _WAIT_FIRST_S
    while elapsed + request_s < seconds:
        misses += 1
        elapsed += request_s + delay
        delay = min(delay * 2, _WAIT_MAX_S)
    return misses

# S3 DeleteObjects and Redis DEL take at most this many keys per call.
_DELETE_BATCH = 1000

# The retry budget of one store call, in seconds from its first attempt. 120 s rides out what
# object stores really do: S3's 60-second stragglers (slsML; cut by the read timeout and
# retried), throttling bursts while S3 repartitions a hot prefix (503 SlowDown for tens of
# seconds), and a local or regional server restarting; yet a store that is down for good
# is reported within about two minutes, and a Lambda function (900 s) keeps most of its time.
# A worker that spends its budget reports a transient failure and is relaunched.
RETRY_ENV = "FLATPACK_STORE_RETRY_S"
DEFAULT_RETRY_S = 120.0
MAX_RETRY_S = 86_400.0    # a day: the longest retry budget a store accepts
# Exponential backoff with full jitter: sleep U(0, min(cap, base * 2**attempt)). The first
# retries come within 50-100 ms (a dropped connection), the cap keeps a caller from sleeping
# long past the end of an outage (at most 5 s, 2.5 s on average) while a fleet of throttled
# workers still spreads its retries out (AWS architecture blog, "Exponential backoff and jitter").
RETRY_BASE_S = 0.05
RETRY_CAP_S = 5.0
# A read (S3, OSS) or socket (Redis) timeout: the longest silence tolerated between bytes of
# a response (botocore's read_timeout is a per-recv socket timeout, not a total). 10 s is far
# above any healthy gap (S3's first byte comes in 10-100 ms, a loaded local server answers a
# large PUT within a second or two), so a 2 s stall is simply waited out and never costs a
# retry; and it is 6x below S3's 60 s stragglers, which it cuts and retries on a fresh
# connection (the retry usually answers at once).
READ_TIMEOUT_S = 10.0

# S3 (and other AWS-style) error codes worth retrying whatever their HTTP status; any code
# containing "Throttl" is retried too. Anything else from the server is final, except a 5xx
# other than 501/505 (not implemented, HTTP version) and a 429.
_S3_TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "RequestTimeoutException", "InternalError", "InternalFailure",
    "ServiceUnavailable", "ServiceUnavailableException", "Throttling", "ThrottlingException",
    "ThrottledException", "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "ProvisionedThroughputExceededException",
    "EC2ThrottledException", "PriorRequestNotComplete", "OperationAborted", "RequestTimeTooSkewed",
    "IDPCommunicationError",
    # Alibaba OSS's names for the same conditions
    "QpsLimitExceeded", "ServerBusy", "TooManyRequests",
})
_HTTP_FINAL_5XX = frozenset({501, 505})   # a retry cannot make the server implement something
_S3_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_S3_AUTH_CODES = frozenset({
    "AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch",
    "ExpiredToken", "InvalidToken", "TokenRefreshRequired", "AuthorizationHeaderMalformed",
})

_AWS_CHAIN = (
    "boto3 searched its standard credential chain: the env vars AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (plus AWS_SESSION_TOKEN for temporary keys), the profile in "
    "~/.aws/credentials or ~/.aws/config (AWS_PROFILE picks one), and the container or "
    "EC2 instance role"
)


# --------------------------------------------------------------------------- keys


def check_key(key: str) -> str:
    """Return ``key`` if it is a relative, '/'-separated name with no empty, '.' or '..' segment."""
    if not isinstance(key, str) or not key:
        raise StoreError(f"a store key must be a non-empty str, got {key!r}")
    if key.startswith("/"):
        raise StoreError(f"store key {key!r} is absolute; keys are relative names like "
                         "'run/act/i000001/s000000/m000000'")
    _check_segments(key.split("/"), key)
    return key


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid key prefix ending in '/' (never the whole store)."""
    if not isinstance(prefix, str) or not prefix:
        raise StoreError("an empty prefix would list the whole store or bucket; pass a run's prefix such as 'run-1/'")
    if not prefix.endswith("/"):
        raise StoreError(f"prefix {prefix!r} must end with '/' so that 'run-1' does not also match 'run-10'; "
                         f"pass {prefix + '/'!r}")
    check_key(prefix[:-1])
    return prefix


def _check_segments(segments: list[str], key: str) -> None:
    for segment in segments:
        if segment in ("", ".", ".."):
            raise StoreError(f"store key {key!r} has an empty, '.' or '..' segment; use plain names separated by "
                             "single '/'")
        if any(ord(c) < 32 or c == "\x7f" for c in segment):
            raise StoreError(f"store key {key!r} contains a control character; use printable names")


def _normalize_root_prefix(prefix: str) -> str:
    """A store's own prefix: '' or 'a/b/' (a missing trailing '/' is added)."""
    prefix = (prefix or "").strip("/")
    if not prefix:
        return ""
    check_key(prefix)
    return prefix + "/"


# --------------------------------------------------------------------------- retries


class StoreUnavailable(StoreError):
    """A store call failed with transient errors only (throttling, 5xx, timeouts, stalled
    reads, dropped or refused connections) until its retry budget ran out. The same call may
    well succeed later: a worker that dies of this reports ``{"status": "transient"}`` and
    its invoker relaunches it, where any other error is fatal. Never retried again by an
    outer :func:`retrying` (it is a StoreError), so budgets do not multiply."""

    def __init__(self, message: str, *, what: str = "", attempts: int = 0, elapsed_s: float = 0.0,
                 budget_s: float = 0.0, last: BaseException | None = None) -> None:
        super().__init__(message)
        self.what, self.attempts, self.elapsed_s, self.budget_s = what, attempts, elapsed_s, budget_s
        self.last = last


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry can cure, which :func:`retrying` retries:

    - throttling: S3 ``SlowDown``/503, HTTP 429, ``RequestLimitExceeded``, any
      ``Throttl*`` code, OSS ``QpsLimitExceeded``/``ServerBusy``; Redis ``BUSY``/``LOADING``/
      ``TRYAGAIN``;
    - server errors: any 5xx but 501 and 505, S3 ``InternalError``/``RequestTimeout``;
    - timeouts and stalled reads: connect and read timeouts (a response that goes silent for
      the read timeout), a body cut short (``IncompleteRead``, ``ResponseStreamingError``);
    - connections reset, refused, aborted or closed (a server restarting).

    False for everything else, and at once: a 4xx other than throttling (AccessDenied, 403,
    NoSuchBucket, NoSuchKey, bad credentials, InvalidArgument/bad request, 412), a missing
    SDK, a bad key, and any :class:`StoreError` (already translated, including
    :class:`StoreUnavailable`: its budget is spent).
    """
    if isinstance(exc, StoreError):
        return False  # already translated: final
    if _is_botocore_transient(exc) or _is_redis_transient(exc) or _is_oss_transient(exc):
        return True
    if _is_urllib3_transient(exc):
        return True
    return isinstance(exc, (ConnectionError, TimeoutError, http.client.IncompleteRead))


def is_transient_failure(exc: BaseException) -> bool:
    """Whether a failed worker died of a transient cause (relaunch it) rather than of a
    fatal one (a code error in the user's model, bad input, a refused request): its error or
    an error it was explicitly raised ``from`` is a :class:`StoreUnavailable` or a
    transient error that escaped the retry layer."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, StoreUnavailable) or is_transient(current):
            return True
        current = current.__cause__
    return False


def _is_throttling_code(code: str) -> bool:
    return code in _S3_TRANSIENT_CODES or "throttl" in code.lower()


def _is_transient_status(status: int) -> bool:
    return status == 429 or (500 <= status <= 599 and status not in _HTTP_FINAL_5XX)


def _is_botocore_transient(exc: BaseException) -> bool:
    botocore_exceptions = sys.modules.get("botocore.exceptions")
    if botocore_exceptions is None:
        return False  # botocore not imported: exc cannot be one of its errors
    # ConnectionError covers EndpointConnectionError (refused, unreachable), ConnectionClosedError
    # (reset), ConnectTimeoutError and ReadTimeoutError (a stalled response or body read)
    streaming = tuple(getattr(botocore_exceptions, name) for name in ("ResponseStreamingError",)
                      if hasattr(botocore_exceptions, name))
    if isinstance(exc, (botocore_exceptions.ConnectionError, botocore_exceptions.HTTPClientError,
                        botocore_exceptions.IncompleteReadError, *streaming)):
        return True
    if isinstance(exc, botocore_exceptions.ClientError):
        response = cast(Any, exc).response  # botocore is looked up at run time: pyright knows no ClientError here
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return _is_throttling_code(code) or _is_transient_status(int(status))
    return False


def _is_urllib3_transient(exc: BaseException) -> bool:
    """urllib3's own errors, should one escape the SDK (a body read outside botocore's wrapper)."""
    urllib3_exceptions = sys.modules.get("urllib3.exceptions")
    if urllib3_exceptions is None:
        return False
    return isinstance(exc, (urllib3_exceptions.ProtocolError, urllib3_exceptions.TimeoutError,
                            urllib3_exceptions.NewConnectionError))


def _is_redis_transient(exc: BaseException) -> bool:
    redis_exceptions = sys.modules.get("redis.exceptions")
    if redis_exceptions is None:
        return False
    fatal = tuple(getattr(redis_exceptions, name) for name in ("AuthenticationError", "AuthorizationError")
                  if hasattr(redis_exceptions, name))
    if fatal and isinstance(exc, fatal):
        return False  # redis-py files these under ConnectionError, but a retry cannot fix a wrong password
    # BusyLoadingError (LOADING) is a ConnectionError; TRYAGAIN, CLUSTERDOWN, MASTERDOWN and
    # READONLY (a replica during failover) clear by themselves
    retryable = tuple(getattr(redis_exceptions, name) for name in (
        "ConnectionError", "TimeoutError", "BusyLoadingError", "TryAgainError", "ClusterDownError",
        "MasterDownError", "ReadOnlyError") if hasattr(redis_exceptions, name))
    if isinstance(exc, retryable):
        return True
    response_error = getattr(redis_exceptions, "ResponseError", None)
    return response_error is not None and isinstance(exc, response_error) and str(exc).startswith("BUSY ")


def _is_oss_transient(exc: BaseException) -> bool:
    oss_exceptions = sys.modules.get("oss2.exceptions")
    if oss_exceptions is None:
        return False
    retryable = tuple(getattr(oss_exceptions, name) for name in ("RequestError", "InconsistentError")
                      if hasattr(oss_exceptions, name))
    if isinstance(exc, retryable):
        return True  # oss2's wrappers for connection errors, timeouts and CRC mismatches of a download
    server_error = getattr(oss_exceptions, "ServerError", None)
    if server_error is None or not isinstance(exc, server_error):
        return False
    return (_is_throttling_code(str(getattr(exc, "code", "") or ""))
            or _is_transient_status(int(getattr(exc, "status", 0) or 0)))


def _as_bytes(data: object, what: str) -> bytes:
    """An object's contents as a client returned them: bytes, since the clients are made
    without response decoding (a str would mean a client configured to decode)."""
    if not isinstance(data, bytes):
        raise StoreError(f"{what} returned {type(data).__name__}, not bytes; the client must not decode responses")
    return data


def check_retry_s(value: Any, source: str = "retry_s") -> float:
    """A retry budget in seconds: a finite number in [0, :data:`MAX_RETRY_S`] (0: a single
    attempt). A day at most: a larger budget is a hang, not a retry policy."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise StoreError(f"{source}={value!r} is not a number of seconds; give it in seconds, "
                         f"e.g. {source}=300") from None
    if not 0.0 <= seconds <= MAX_RETRY_S:
        raise StoreError(f"{source}={value!r} must be a finite number of seconds from 0 (0 retries nothing) to "
                         f"{MAX_RETRY_S:g} (a day); the default is {DEFAULT_RETRY_S:g}")
    return seconds


def default_retry_s() -> float:
    """The retry budget of a store given none: ``$FLATPACK_STORE_RETRY_S``, else :data:`DEFAULT_RETRY_S`."""
    raw = os.environ.get(RETRY_ENV, "").strip()
    return check_retry_s(raw, RETRY_ENV) if raw else DEFAULT_RETRY_S


def retrying(
    call: Callable[[], T],
    what: str,
    attempts: int | None = None,
    base_s: float = RETRY_BASE_S,
    cap_s: float = RETRY_CAP_S,
    *,
    budget_s: float | None = None,
    translate: Callable[[BaseException], BaseException] | None = None,
    transient: Callable[[BaseException], bool] = is_transient,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    jitter: Callable[[float, float], float] = random.uniform,
) -> T:
    """Run ``call``; retry transient errors with exponential backoff and full jitter until
    ``budget_s`` seconds have passed since the first attempt (None: :func:`default_retry_s`).

    ``what`` names the operation and key for messages ("S3 get s3://b/p/k"). A non-transient
    error is passed to ``translate`` (which returns the StoreError to raise) and raised at
    once. Sleep ``n`` is ``jitter(0, min(cap_s, base_s * 2**n))``, cut to what is left of the
    budget, so the last attempt comes at the deadline (an attempt in flight may overrun it
    by up to its own timeout). ``attempts``, if given, also caps the number of attempts.
    When the budget or the attempts run out, :class:`StoreUnavailable` says that every
    failure was transient, how long and how often it retried, the last error, and how to
    raise the budget. ``sleep``, ``clock`` and ``jitter`` are injectable for tests.
    """
    if attempts is not None and attempts < 1:
        raise StoreError(f"retrying({what}) needs attempts >= 1, got {attempts}")
    budget = default_retry_s() if budget_s is None else check_retry_s(budget_s)
    start = clock()
    tried = 0
    while True:
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - classified right below
            if not transient(exc):
                if translate is None or isinstance(exc, StoreError):
                    raise
                raise translate(exc) from exc
            last = exc
        tried += 1
        elapsed = clock() - start
        out_of_attempts = attempts is not None and tried >= attempts
        if out_of_attempts or elapsed >= budget:
            break
        # full jitter (AWS architecture blog): spreads retries of many workers apart
        sleep(min(jitter(0.0, min(cap_s, base_s * 2 ** min(tried - 1, 60))), budget - elapsed))
    limit = (f"the {attempts}-attempt limit" if out_of_attempts and elapsed < budget
             else f"its {budget:g} s budget")
    raise StoreUnavailable(
        f"{what} failed after {tried} attempts; last error: {type(last).__name__}: {last}. Every failure was "
        f"transient (throttling, a 5xx, a timeout or stalled read, a dropped or refused connection) and flatpack "
        f"retried for {elapsed:.1f} s, until {limit} ran out: the store was unreachable or overloaded all that "
        f"time. Check that it is up and reachable; to wait longer, raise the budget with {RETRY_ENV}=<seconds> in "
        "the environment (or retry_s= on the store, ?retry_s= in its url)",
        what=what, attempts=tried, elapsed_s=elapsed, budget_s=budget, last=last,
    ) from last


# --------------------------------------------------------------------------- interface


class Store(abc.ABC):
    """Bytes under string keys, shared by processes that open the same :attr:`url`."""

    url: str
    # the clock and sleep of retries and of wait(): tests replace them on an instance, so that
    # budgets and backoff run in simulated time
    _clock: Callable[[], float] = staticmethod(time.monotonic)
    _sleep: Callable[[float], None] = staticmethod(time.sleep)

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Publish ``data`` under ``key`` atomically (whole object or nothing)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The bytes under ``key``; StoreKeyError naming the key if absent."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is present."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; deleting an absent key is fine."""

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterable[str]:
        """Keys under a checked prefix, in any order."""

    def _delete_many(self, keys: list[str]) -> None:
        """Remove listed keys; backends override with a batched call."""
        for key in keys:
            self.delete(key)

    def wait(self, key: str, timeout_s: float) -> bytes:
        """Poll until ``key`` is present and return its bytes; StoreTimeout after ``timeout_s``.

        Only an absent key (StoreKeyError) means "not there yet, poll again". A transient
        error of a poll is retried inside ``get`` under the retry budget (a StoreUnavailable
        if it outlasts it); any other error is raised at once.
        """
        check_key(key)
        deadline = self._clock() + max(0.0, timeout_s)
        delay = _WAIT_FIRST_S
        while True:
            try:
                return self.get(key)
            except StoreKeyError:
                pass
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise StoreTimeout(f"{key!r} did not appear in {self.url} within {timeout_s:g} s; the producer "
                                   "failed or is slower than expected: check its status, or raise timeout_s")
            self._sleep(min(delay, remaining))
            delay = min(delay * 2, _WAIT_MAX_S)

    def list(self, prefix: str) -> list[str]:
        """Sorted keys under ``prefix`` (non-empty, ending in '/')."""
        check_prefix(prefix)
        return sorted(self._list(prefix))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix`` (same rule as :meth:`list`); return how many."""
        keys = self.list(prefix)
        self._delete_many(keys)
        return len(keys)

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Delete each of ``keys`` (absent ones are fine) in as few requests as the backend
        allows (S3 and OSS: 1,000 keys a request; Redis: one command)."""
        self._delete_many([check_key(key) for key in keys])

    def close(self) -> None:  # noqa: B027 - a default stores override only when they hold connections
        """Release connections; the default holds none."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


class WrappedStore(Store):
    """A store that adds behaviour around another (``throttle.Throttled``, ``chaos.FaultyStore``):
    it has the inner store's :attr:`url` (a child process opens the same data and sets up its
    own wrapper), passes through whatever a subclass does not override, closes the inner
    store, and counts what it did under a lock (:meth:`stats`)."""

    def __init__(self, inner: Store, stats: dict[str, float]) -> None:
        if not isinstance(inner, Store):
            raise StoreError(f"{type(self).__name__} wraps a Store, got {type(inner).__name__}")
        self.inner = inner
        self.url = inner.url
        self._lock = threading.Lock()
        self._stats = stats

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def _list(self, prefix: str) -> Iterable[str]:
        return self.list(prefix)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def delete_keys(self, keys: Sequence[str]) -> None:
        self.inner.delete_keys(keys)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, float]:
        """What the wrapper counted (see the subclass)."""
        with self._lock:
            return dict(self._stats)


# --------------------------------------------------------------------------- local files

_TMP_MARK = ".fp-tmp-"


class FileStore(Store):
    """A directory on a shared filesystem; keys are relative paths under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create the store directory {self.root} ({exc}); pick a writable path") from exc
        self.url = self.root.as_uri()

    def _path(self, key: str) -> Path:
        check_key(key)
        if any(segment.startswith(_TMP_MARK) for segment in key.split("/")):
            raise StoreError(f"store key {key!r} has a segment starting with {_TMP_MARK!r}, which FileStore uses for "
                             "temporary files; rename the key")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        # A concurrent delete_prefix may prune the directory between mkdir and the temporary's
        # creation; retry once.
        for attempt in range(2):
            try:
                self._write_then_rename(path, data)
                return
            except FileNotFoundError:
                if attempt:
                    raise
            except (NotADirectoryError, IsADirectoryError, FileExistsError) as exc:
                raise StoreError(f"cannot put {key!r} in {self.url}: a file and a directory would share a name "
                                 f"({exc}); a key cannot also be the prefix of another key in a FileStore") from exc

    def _write_then_rename(self, path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # readers see the old object or the new one; the mark keeps the temporary out of listings;
        # objects (weights, activations) readable by their owner alone, as mkstemp made them before
        write_atomic(path, data, prefix=_TMP_MARK + path.name + ".", mode=0o600)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise StoreKeyError(f"no object {key!r} in {self.url}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except (NotADirectoryError, IsADirectoryError):
            pass  # not an object, so nothing to delete

    def _list(self, prefix: str) -> Iterable[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _dirs, files in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            keys.extend(f"{rel}/{name}" for name in files if not name.startswith(_TMP_MARK))
        return keys

    def delete_prefix(self, prefix: str) -> int:
        count = super().delete_prefix(prefix)
        _prune_empty_dirs(self.root / prefix)
        return count

    def delete_keys(self, keys: Sequence[str]) -> None:
        super().delete_keys(keys)
        # the directories the keys leave empty, deepest first, up to (not including) the root
        parents = {parent for key in keys for parent in (self.root / key).parents if self.root in parent.parents}
        for directory in sorted(parents, key=lambda path: len(path.parts), reverse=True):
            try:
                directory.rmdir()
            except OSError:
                pass  # not empty (other keys, a concurrent put), or already gone: keep it


def _prune_empty_dirs(base: Path) -> None:
    """Remove empty directories under and including ``base`` (left behind by deleted keys)."""
    if not base.is_dir():
        return
    for dirpath, _dirs, _files in os.walk(base, topdown=False):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass  # not empty (a concurrent put): keep it


# --------------------------------------------------------------------------- S3


class S3Store(Store):
    """An S3 bucket (AWS or any S3-compatible server), under an optional key prefix.

    Credentials come from boto3's standard chain, or in-process from the explicit
    ``aws_access_key_id``/``aws_secret_access_key`` arguments; they never enter :attr:`url`.
    Retries are done by :func:`retrying` (botocore's own are switched off so they do not
    multiply). A read that stalls past ``read_timeout_s`` (silence between bytes; see
    :data:`READ_TIMEOUT_S`) raises ReadTimeoutError and is retried: slsML measured 60-second
    S3 outliers that a fresh request avoids. ``retry_s`` is the retry budget of each call
    (None: ``$FLATPACK_STORE_RETRY_S`` or :data:`DEFAULT_RETRY_S`); ``attempts`` optionally
    caps the attempts too. An explicit ``retry_s`` or ``read_timeout_s`` travels in :attr:`url`.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        *,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        max_pool_connections: int = 16,
        attempts: int | None = None,
        retry_s: float | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise StoreError(f"S3 bucket name {bucket!r} is empty or has a '/'; put key prefixes in prefix=")
        self.bucket = bucket
        self.prefix = _normalize_root_prefix(prefix)
        self.endpoint_url = endpoint_url
        self.attempts = attempts
        self.retry_s = default_retry_s() if retry_s is None else check_retry_s(retry_s)
        self.read_timeout_s = READ_TIMEOUT_S if read_timeout_s is None else float(read_timeout_s)
        self._client = _s3_client(
            endpoint_url, region, aws_access_key_id, aws_secret_access_key, aws_session_token,
            connect_timeout_s, self.read_timeout_s, max_pool_connections, self._where(),
        )
        self.region = self._client.meta.region_name
        self.url = _s3_url("s3", bucket, self.prefix, {
            "endpoint_url": endpoint_url, "region": region, **_retry_query(retry_s),
            "read_timeout_s": None if read_timeout_s is None else f"{float(read_timeout_s):g}"})

    def _where(self) -> str:
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{at}"

    def _call(self, verb: str, key: str | None, call: Callable[[], T]) -> T:
        name = f"s3://{self.bucket}/{self.prefix}{key or ''}"
        return retrying(call, what=f"S3 {verb} {name}", attempts=self.attempts, budget_s=self.retry_s,
                        sleep=self._sleep, clock=self._clock, translate=lambda exc: self._translate(exc, verb, key))

    def _translate(self, exc: BaseException, verb: str, key: str | None) -> BaseException:
        # start-up time: boto3 takes ~0.2 s to load, and only an S3 store needs it
        from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

        if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
            return _aws_credentials_error(self._where(), exc)
        if not isinstance(exc, ClientError):
            return StoreError(f"S3 {verb} of {key!r} in {self._where()} failed: {type(exc).__name__}: {exc}")
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return _s3_error(code, status, str(error.get("Message", "")), verb, key, self.bucket, self._where())

    def put(self, key: str, data: bytes) -> None:
        full = self.prefix + check_key(key)
        self._call("put", key, lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=bytes(data)))

    def get(self, key: str) -> bytes:
        full = self.prefix + check_key(key)
        # the body is read inside the retried call: a stalled or cut stream is retried as a whole
        return self._call("get", key, lambda: self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read())

    def exists(self, key: str) -> bool:
        full = self.prefix + check_key(key)
        try:
            self._call("head", key, lambda: self._client.head_object(Bucket=self.bucket, Key=full))
        except StoreKeyError:
            return False
        return True

    def delete(self, key: str) -> None:
        full = self.prefix + check_key(key)
        self._call("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=full))

    def _list(self, prefix: str) -> Iterable[str]:
        full = self.prefix + prefix
        return self._call("list", prefix, lambda: self._list_once(full))

    def _list_once(self, full_prefix: str) -> list[str]:
        paginator = self._client.get_paginator("list_objects_v2")
        start = len(self.prefix)
        keys: list[str] = []
        for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
            keys.extend(item["Key"][start:] for item in page.get("Contents", ()))
        return keys

    def objects(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every key under ``prefix`` with its size and ETag, from the listing alone (what a
        run's data fingerprint records of s3:// shards; nothing is downloaded)."""
        full = self.prefix + prefix
        start = len(self.prefix)

        def listing() -> dict[str, dict[str, Any]]:
            found: dict[str, dict[str, Any]] = {}
            for page in self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=full):
                for item in page.get("Contents", ()):
                    found[item["Key"][start:]] = {"size": int(item.get("Size", 0)),
                                                  "etag": str(item.get("ETag", "")).strip('"')}
            return found

        return self._call("list", prefix, listing)

    def _delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": self.prefix + key} for key in keys[i:i + _DELETE_BATCH]]
            response = self._call("delete-objects", keys[i], lambda: self._client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))
            errors = response.get("Errors") or []
            if errors:
                first = errors[0]
                raise StoreError(f"S3 refused to delete {len(errors)} objects in {self._where()}, e.g. "
                                 f"{first.get('Key')!r}: {first.get('Code')} {first.get('Message')}; "
                                 "check that the credentials allow s3:DeleteObject")

    def close(self) -> None:
        self._client.close()


def s3_addressing_style(endpoint_url: str | None) -> str:
    """Path-style for a server addressed by IP or as localhost (local S3 servers have no
    per-bucket host names); virtual-hosted otherwise: AWS's default, and the only style
    OSS's S3-compatible endpoint accepts."""
    host = urlsplit(endpoint_url).hostname if endpoint_url else None
    if host is None:
        return "virtual"
    if host == "localhost":
        return "path"
    try:
        ipaddress.ip_address(host)
        return "path"
    except ValueError:
        return "virtual"


def _s3_client(endpoint_url: str | None, region: str | None, key_id: str | None, secret: str | None,
               token: str | None, connect_timeout_s: float, read_timeout_s: float, max_pool_connections: int,
               where: str) -> Any:
    # start-up time: boto3 takes ~0.2 s to load, and only an S3 store needs it
    import boto3.session
    from botocore.config import Config

    session = boto3.session.Session(botocore_session=_botocore_session(), aws_access_key_id=key_id,
                                    aws_secret_access_key=secret, aws_session_token=token, region_name=region)
    if session.get_credentials() is None:
        raise _aws_credentials_error(where, None)
    config = Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        max_pool_connections=max_pool_connections,
        retries={"total_max_attempts": 1, "mode": "standard"},  # retrying() is the one retry layer
        s3={"addressing_style": s3_addressing_style(endpoint_url)},
        # local S3 servers reject the CRC checksums newer botocore adds to every request
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return session.client("s3", endpoint_url=endpoint_url, region_name=session.region_name or "us-east-1",
                          config=config)


_LOADER_LOCK = threading.Lock()
_loader: Any = None


def _botocore_session() -> Any:
    """A fresh botocore session (own credentials and env) sharing one model loader.

    Parsing the S3 service model costs ~0.1 s per session; the loader caches it, and
    sharing the loader (not the session) keeps each store's credentials its own.
    """
    # start-up time: boto3 takes ~0.2 s to load, and only an S3 store needs it
    import botocore.session

    global _loader
    with _LOADER_LOCK:
        session = botocore.session.Session()
        if _loader is None:
            _loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _loader)
    return session


def preload_s3_model() -> None:
    """Parses S3's service model, endpoints and rules into the shared loader by making a
    client that never connects (``runtime.forkserver``: each function forked after this
    makes its own client in milliseconds). Its placeholder credentials go nowhere."""
    _s3_client("http://127.0.0.1:9", "us-east-1", "preload", "preload", None, 1.0, 1.0, 1, "preload")


def _aws_credentials_error(where: str, exc: BaseException | None) -> StoreError:
    detail = f" ({exc})" if exc else ""
    return StoreError(
        f"no usable AWS credentials for {where}{detail}. {_AWS_CHAIN}. Set AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY in the environment, or run `aws configure`, or attach a role to the machine"
    )


def _s3_error(code: str, status: int | None, message: str, verb: str, key: str | None, bucket: str,
              where: str) -> StoreError:
    if code in _S3_MISSING_CODES and key is not None and verb in ("get", "head"):
        return StoreKeyError(f"no object {key!r} in {where}")
    if code == "NoSuchBucket" or (code == "404" and key is None):
        return StoreError(f"bucket {bucket!r} does not exist ({where}); create it (aws s3 mb s3://{bucket}) "
                          "or fix the bucket in the store url")
    if code in _S3_AUTH_CODES or status == 403:
        missing = (" (S3 also answers 403 instead of 404 for a missing key when the credentials lack "
                   "s3:ListBucket on the bucket)" if verb in ("get", "head") else "")
        return StoreError(
            f"S3 denied {verb} of {key!r} in {where}: {code or status} {message}. The credentials are wrong or "
            "lack permission: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the profile) and the bucket policy"
            + missing
        )
    return StoreError(f"S3 {verb} of {key!r} in {where} failed: {code} (HTTP {status}) {message}")


def _s3_url(scheme: str, bucket: str, prefix: str, query: dict[str, str | None]) -> str:
    params = {k: v for k, v in query.items() if v}
    tail = "?" + urlencode(params, quote_via=quote, safe="/") if params else ""
    return f"{scheme}://{bucket}/{quote(prefix, safe='/')}{tail}"


def _retry_query(retry_s: float | None) -> dict[str, str]:
    """An explicit retry budget goes into a store's url, so a worker opening it retries as long."""
    return {} if retry_s is None else {"retry_s": f"{check_retry_s(retry_s):g}"}


# --------------------------------------------------------------------------- Redis


def _escape_glob(text: str) -> str:
    """Escape Redis MATCH glob characters so a prefix matches only itself."""
    return "".join("\\" + c if c in "\\*?[]^" else c for c in text)


class RedisStore(Store):
    """A Redis database, keys under an optional prefix (the KNIX-style fast store).

    The password, if any, comes from the ``password`` argument or the REDIS_PASSWORD env var,
    never from the url. ``retry_s``/``attempts`` as for :class:`S3Store`; a socket silent
    for ``socket_timeout_s`` (default :data:`READ_TIMEOUT_S`) is cut and retried.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0, prefix: str = "", *,
                 password: str | None = None, socket_timeout_s: float = READ_TIMEOUT_S,
                 connect_timeout_s: float = 5.0, attempts: int | None = None,
                 retry_s: float | None = None) -> None:
        try:   # optional dependency: pip install 'flatpack[redis]'
            import redis
        except ImportError as exc:
            raise StoreError("RedisStore needs the redis client: pip install redis (or pip install "
                             "'flatpack[redis]')") from exc
        self.host, self.port, self.db = host, int(port), int(db)
        self.prefix = _normalize_root_prefix(prefix)
        self.attempts = attempts
        self.retry_s = default_retry_s() if retry_s is None else check_retry_s(retry_s)
        self._client = redis.Redis(host=host, port=self.port, db=self.db,
                                   password=password or os.environ.get("REDIS_PASSWORD"),
                                   socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s)
        params = {**({"prefix": self.prefix} if self.prefix else {}), **_retry_query(retry_s)}
        query = "?" + urlencode(params, quote_via=quote, safe="/") if params else ""
        self.url = f"redis://{host}:{self.port}/{self.db}{query}"

    def _call(self, verb: str, key: str, call: Callable[[], T]) -> T:
        return retrying(call, what=f"Redis {verb} {self.url} key {key!r}", attempts=self.attempts,
                        budget_s=self.retry_s, sleep=self._sleep, clock=self._clock, translate=lambda exc: StoreError(
                            f"Redis {verb} of {key!r} at {self.url} failed: {type(exc).__name__}: {exc}; "
                            "check the password (REDIS_PASSWORD) and that the server accepts this command"))

    def put(self, key: str, data: bytes) -> None:
        full = self.prefix + check_key(key)
        self._call("set", key, lambda: self._client.set(full, bytes(data)))

    def get(self, key: str) -> bytes:
        full = self.prefix + check_key(key)
        data = self._call("get", key, lambda: self._client.get(full))
        if data is None:
            raise StoreKeyError(f"no object {key!r} in {self.url}")
        return _as_bytes(data, f"Redis get of {key!r} at {self.url}")

    def exists(self, key: str) -> bool:
        full = self.prefix + check_key(key)
        return bool(self._call("exists", key, lambda: self._client.exists(full)))

    def delete(self, key: str) -> None:
        full = self.prefix + check_key(key)
        self._call("del", key, lambda: self._client.delete(full))

    def _list(self, prefix: str) -> Iterable[str]:
        pattern = _escape_glob(self.prefix + prefix) + "*"
        start = len(self.prefix)
        raw = self._call("scan", prefix, lambda: set(self._client.scan_iter(match=pattern, count=1000)))
        return [k.decode("utf-8")[start:] for k in raw]

    def _delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [self.prefix + key for key in keys[i:i + _DELETE_BATCH]]
            self._call("del", keys[i], lambda: self._client.delete(*batch))

    def close(self) -> None:
        self._client.close()


# --------------------------------------------------------------------------- Alibaba OSS


class OssStore(Store):
    """An Alibaba Cloud OSS bucket under an optional prefix, through oss2.

    Credentials come from OSS_ACCESS_KEY_ID / OSS_ACCESS_KEY_SECRET (or the explicit
    arguments in-process), never from the url. ``endpoint`` is e.g.
    ``https://oss-cn-hangzhou.aliyuncs.com``. ``timeout_s`` is oss2's connect and read
    timeout (default :data:`READ_TIMEOUT_S`); ``retry_s``/``attempts`` as for :class:`S3Store`.
    """

    def __init__(self, bucket: str, prefix: str = "", endpoint: str | None = None, *,
                 access_key_id: str | None = None, access_key_secret: str | None = None,
                 timeout_s: float = READ_TIMEOUT_S, attempts: int | None = None,
                 retry_s: float | None = None) -> None:
        try:   # optional dependency: pip install 'flatpack[oss]'
            import oss2
        except ImportError as exc:
            raise StoreError("OssStore needs Alibaba's oss2 SDK: pip install oss2 (or pip install "
                             "'flatpack[oss]')") from exc
        if not endpoint:
            raise StoreError("OssStore needs endpoint=, e.g. https://oss-cn-hangzhou.aliyuncs.com (url: oss://bucket/prefix?endpoint=...)")
        key_id = access_key_id or os.environ.get("OSS_ACCESS_KEY_ID")
        secret = access_key_secret or os.environ.get("OSS_ACCESS_KEY_SECRET")
        if not key_id or not secret:
            raise StoreError(f"no OSS credentials for oss://{bucket}: set the env vars OSS_ACCESS_KEY_ID and "
                             "OSS_ACCESS_KEY_SECRET (a RAM user's AccessKey pair)")
        self.bucket, self.endpoint, self.attempts = bucket, endpoint, attempts
        self.retry_s = default_retry_s() if retry_s is None else check_retry_s(retry_s)
        self.prefix = _normalize_root_prefix(prefix)
        self._oss2 = oss2
        self._bucket = oss2.Bucket(oss2.Auth(key_id, secret), endpoint, bucket, connect_timeout=timeout_s)
        self.url = _s3_url("oss", bucket, self.prefix, {"endpoint": endpoint, **_retry_query(retry_s)})

    def _call(self, verb: str, key: str, call: Callable[[], T]) -> T:
        return retrying(call, what=f"OSS {verb} oss://{self.bucket}/{self.prefix}{key}", attempts=self.attempts,
                        budget_s=self.retry_s, sleep=self._sleep, clock=self._clock,
                        translate=lambda exc: self._translate(exc, verb, key))

    def _translate(self, exc: BaseException, verb: str, key: str) -> BaseException:
        errors = self._oss2.exceptions
        where = f"oss://{self.bucket}/{self.prefix} at {self.endpoint}"
        if isinstance(exc, errors.NoSuchKey):
            return StoreKeyError(f"no object {key!r} in {where}")
        if isinstance(exc, errors.NoSuchBucket):
            return StoreError(f"OSS bucket {self.bucket!r} does not exist at {self.endpoint}; create it or fix the url")
        if isinstance(exc, errors.ServerError) and exc.status == 403:
            return StoreError(f"OSS denied {verb} of {key!r} in {where}: {exc.code} {exc.message}; check "
                              "OSS_ACCESS_KEY_ID/OSS_ACCESS_KEY_SECRET and the RAM policy")
        return StoreError(f"OSS {verb} of {key!r} in {where} failed: {type(exc).__name__}: {exc}")

    def put(self, key: str, data: bytes) -> None:
        full = self.prefix + check_key(key)
        self._call("put", key, lambda: self._bucket.put_object(full, bytes(data)))

    def get(self, key: str) -> bytes:
        full = self.prefix + check_key(key)
        return _as_bytes(self._call("get", key, lambda: self._bucket.get_object(full).read()),
                         f"OSS get of {key!r} in oss://{self.bucket}/{self.prefix}")

    def exists(self, key: str) -> bool:
        full = self.prefix + check_key(key)
        return bool(self._call("head", key, lambda: self._bucket.object_exists(full)))

    def delete(self, key: str) -> None:
        full = self.prefix + check_key(key)
        self._call("delete", key, lambda: self._bucket.delete_object(full))

    def _list(self, prefix: str) -> Iterable[str]:
        full, start = self.prefix + prefix, len(self.prefix)
        return self._call("list", prefix, lambda: [
            obj.key[start:] for obj in self._oss2.ObjectIteratorV2(self._bucket, prefix=full, max_keys=1000)])

    def _delete_many(self, keys: list[str]) -> None:
        for i in range(0, len(keys), _DELETE_BATCH):
            batch = [self.prefix + key for key in keys[i:i + _DELETE_BATCH]]
            self._call("batch-delete", keys[i], lambda: self._bucket.batch_delete_objects(batch))


# --------------------------------------------------------------------------- opening a store by url


def open_plain_store(url: str, **options: Any) -> Store:
    """The store a :attr:`Store.url` names, without the wrappers :func:`flatpack.runtime.store_url.open_store`
    adds (bandwidth, faults); ``options`` go to the backend's constructor."""
    if not isinstance(url, str) or "://" not in url:
        raise StoreError(f"store url {url!r} has no scheme; use one of {', '.join(s + '://' for s in SCHEMES)}")
    parts = urlsplit(url)
    if parts.username or parts.password:
        raise StoreError(f"store urls never carry credentials ({parts.scheme}://<user:secret>@...); "
                         "pass them through the environment (AWS_*, OSS_*, REDIS_PASSWORD)")
    opener = _OPENERS.get(parts.scheme)
    if opener is None:
        raise StoreError(f"unknown store scheme {parts.scheme!r} in {url!r}; known schemes: {', '.join(SCHEMES)}")
    return opener(parts, options)


def _query(parts: Any, allowed: tuple[str, ...]) -> dict[str, str]:
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(query) - set(allowed))
    if unknown:
        raise StoreError(f"unknown parameter(s) {unknown} in a {parts.scheme}:// url; allowed: {list(allowed)}")
    return query


def _url_options(query: dict[str, str], options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """Numeric options a url carries (``retry_s``, ``read_timeout_s``), under explicit ones."""
    merged = dict(options)
    for name in names:
        if query.get(name) and name not in merged:
            merged[name] = check_retry_s(query[name], name)
            if name == "read_timeout_s" and merged[name] <= 0:
                raise StoreError(f"read_timeout_s={query[name]!r} in the url must be > 0 seconds "
                                 f"(the default is {READ_TIMEOUT_S:g})")
    return merged


def _open_file(parts: Any, options: dict[str, Any]) -> Store:
    if parts.netloc not in ("", "localhost"):
        raise StoreError(f"file:// urls name a local path (file:///abs/path), got host {parts.netloc!r}")
    _query(parts, ())
    return FileStore(url2pathname(unquote(parts.path)), **options)


def _open_s3(parts: Any, options: dict[str, Any]) -> Store:
    query = _query(parts, ("endpoint_url", "region", "retry_s", "read_timeout_s"))
    return S3Store(parts.netloc, unquote(parts.path.lstrip("/")), query.get("endpoint_url") or None,
                   query.get("region") or None, **_url_options(query, options, ("retry_s", "read_timeout_s")))


def _open_redis(parts: Any, options: dict[str, Any]) -> Store:
    query = _query(parts, ("prefix", "retry_s"))
    options = _url_options(query, options, ("retry_s",))
    db_text = parts.path.strip("/") or "0"
    if not db_text.isdigit():
        raise StoreError(f"redis url path must be a database number (redis://host:port/0), got {parts.path!r}")
    return RedisStore(parts.hostname or "127.0.0.1", parts.port or 6379, int(db_text), query.get("prefix", ""),
                      **options)


def _open_oss(parts: Any, options: dict[str, Any]) -> Store:
    query = _query(parts, ("endpoint", "retry_s"))
    return OssStore(parts.netloc, unquote(parts.path.lstrip("/")), query.get("endpoint"),
                    **_url_options(query, options, ("retry_s",)))


_OPENERS: dict[str, Callable[[Any, dict[str, Any]], Store]] = {
    "file": _open_file, "s3": _open_s3, "redis": _open_redis, "oss": _open_oss,
}
