"""Store fault injection for chaos runs and the fault benchmark.

:class:`FaultyStore` wraps any :class:`~flatpack.runtime.store.Store` and makes a fraction
of its requests fail or stall, the way a busy object store does:

* an **error** raises :class:`InjectedStoreError` (a ``ConnectionResetError``, which
  :func:`~flatpack.runtime.store.is_transient` classifies as transient) *inside* the call
  that :func:`~flatpack.runtime.store.retrying` retries, so what recovers is the real retry
  path: the same classifier, backoff and time budget as a real S3 error. Reads fail before
  the request; writes and deletes fail before it or, half of the time, after the store has
  applied them (the reply was lost), which a retry must tolerate: writes are idempotent.
* a **stall** sleeps ``stall_s`` inside the call: a put stalls before its request, a get
  after the data came (a stalled body). A stall longer than the read timeout
  (``read_timeout_s``, default the wrapped store's own, e.g. S3Store's 10 s) is cut there and
  raises :class:`InjectedStall` (a ``TimeoutError``), as the client's read timeout cuts a
  real one; the retry then goes through. A shorter one is waited out, as it would be.

Every decision is drawn from a hash of (seed, operation, key, how many times this store has
done that operation on that key), never from a shared stream, so a trial with a given seed
injects the same faults whatever the threads' interleaving (polls of a key that does not
exist yet are the only calls whose count depends on timing).

Plain data turns it on, so a worker process can (``RunSpec.store_faults``)::

    {"error_rate": 0.10, "stall_rate": 0.05, "stall_s": 2.0, "seed": 7}

:func:`wrap` builds one from that dict, :func:`for_role` seeds it per worker role, and
``open_store(url, faults={...})`` opens a store already wrapped (an invoker's own store).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from flatpack.errors import StoreError
from flatpack.runtime.store import Store, WrappedStore, default_retry_s, retrying

T = TypeVar("T")

FAULT_KEYS = ("error_rate", "stall_rate", "stall_s", "seed", "read_timeout_s", "retry_s")
_DATA_VERBS = ("put", "get")   # the requests that move a body, and so can stall


class InjectedStoreError(ConnectionResetError):
    """A transient store failure injected by :class:`FaultyStore` (a reset connection)."""


class InjectedStall(TimeoutError):
    """An injected stall cut by the read timeout, as a client's read timeout cuts a real one."""


class FaultyStore(WrappedStore):
    """``base`` with injected transient errors (``error_rate``) and stalls (``stall_rate``
    of ``stall_s`` seconds each), drawn deterministically from ``seed``; retried under
    ``retry_s`` (default: the base store's budget, else ``$FLATPACK_STORE_RETRY_S``).
    ``sleep`` and ``clock`` are injectable for tests. :meth:`stats` counts calls, errors and stalls."""

    def __init__(self, base: Store, error_rate: float = 0.0, stall_rate: float = 0.0, stall_s: float = 2.0,
                 seed: int = 0, *, read_timeout_s: float | None = None, retry_s: float | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(base, {"calls": 0, "errors": 0, "stalls": 0, "stalled_s": 0.0})
        for name, rate in (("error_rate", error_rate), ("stall_rate", stall_rate)):
            if not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
                raise StoreError(f"store fault {name}={rate!r} must be a probability between 0 and 1")
        if not isinstance(stall_s, (int, float)) or not 0.0 <= stall_s < float("inf"):
            raise StoreError(f"store fault stall_s={stall_s!r} must be a number of seconds >= 0")
        if read_timeout_s is not None and not read_timeout_s > 0:
            raise StoreError(f"store fault read_timeout_s={read_timeout_s!r} must be > 0 seconds (None: the wrapped "
                             "store's own, if it has one)")
        self.error_rate, self.stall_rate, self.stall_s = float(error_rate), float(stall_rate), float(stall_s)
        self.seed = int(seed)
        self.read_timeout_s = read_timeout_s if read_timeout_s is not None else getattr(base, "read_timeout_s", None)
        inner_budget = getattr(base, "retry_s", None)
        self.retry_s = (retry_s if retry_s is not None else inner_budget if inner_budget is not None
                        else default_retry_s())
        self._sleep, self._clock = sleep, clock
        self._counts: dict[tuple[str, str], int] = {}

    # ------------------------------------------------------------------ the draws
    def _draw(self, verb: str, key: str) -> random.Random:
        with self._lock:
            n = self._counts.get((verb, key), 0)
            self._counts[(verb, key)] = n + 1
        digest = hashlib.blake2b(f"{self.seed}\0{verb}\0{key}\0{n}".encode(), digest_size=8).digest()
        return random.Random(int.from_bytes(digest, "big"))

    def _count(self, name: str, amount: float = 1) -> None:
        with self._lock:
            self._stats[name] += amount

    def _stall(self, verb: str, key: str) -> None:
        self._count("stalls")
        if self.read_timeout_s is not None and self.stall_s > self.read_timeout_s:
            self._sleep(self.read_timeout_s)
            self._count("stalled_s", self.read_timeout_s)
            raise InjectedStall(f"injected stall of {self.stall_s:g} s on {verb} {key!r}, cut by the "
                                f"{self.read_timeout_s:g} s read timeout")
        self._sleep(self.stall_s)
        self._count("stalled_s", self.stall_s)

    def _attempt(self, verb: str, key: str, call: Callable[[], T]) -> T:
        """One attempt of a request, with the faults drawn for it."""
        draw = self._draw(verb, key)
        self._count("calls")
        fail = draw.random() < self.error_rate
        after = verb in ("put", "delete") and draw.random() < 0.5
        stall = verb in _DATA_VERBS and draw.random() < self.stall_rate
        if fail and not after:
            self._count("errors")
            raise InjectedStoreError(f"injected transient error on {verb} {key!r} (seed {self.seed})")
        if stall and verb == "put":
            self._stall(verb, key)
        result = call()
        if stall and verb == "get":
            self._stall(verb, key)
        if fail:
            self._count("errors")
            raise InjectedStoreError(f"injected transient error after {verb} {key!r} was applied; the reply was lost "
                                     f"(seed {self.seed})")
        return result

    def _retried(self, verb: str, key: str, call: Callable[[], T]) -> T:
        return retrying(lambda: self._attempt(verb, key, call), what=f"{verb} {key!r} in {self.url} (faults injected)",
                        budget_s=self.retry_s, sleep=self._sleep, clock=self._clock)

    # ------------------------------------------------------------------ Store
    def put(self, key: str, data: bytes) -> None:
        self._retried("put", key, lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        return self._retried("get", key, lambda: self.inner.get(key))

    def exists(self, key: str) -> bool:
        return self._retried("exists", key, lambda: self.inner.exists(key))

    def delete(self, key: str) -> None:
        self._retried("delete", key, lambda: self.inner.delete(key))

    def list(self, prefix: str) -> list[str]:
        return self._retried("list", prefix, lambda: self.inner.list(prefix))

    def delete_prefix(self, prefix: str) -> int:
        return self._retried("delete-prefix", prefix, lambda: self.inner.delete_prefix(prefix))

    def delete_keys(self, keys: Sequence[str]) -> None:
        if keys:
            self._retried("delete", keys[0], lambda: self.inner.delete_keys(keys))

    def __repr__(self) -> str:
        return (f"FaultyStore({self.inner!r}, error_rate={self.error_rate:g}, stall_rate={self.stall_rate:g}, "
                f"stall_s={self.stall_s:g}, seed={self.seed})")


def check_faults(faults: Mapping[str, Any]) -> dict[str, Any]:
    """``faults`` as FaultyStore's keyword arguments; a StoreError names an unknown key."""
    if not isinstance(faults, Mapping):
        raise StoreError(f"store faults must be a dict like {{'error_rate': 0.1, 'seed': 1}}, got "
                         f"{type(faults).__name__}")
    unknown = sorted(set(faults) - set(FAULT_KEYS))
    if unknown:
        raise StoreError(f"unknown store fault option(s) {unknown}; known: {', '.join(FAULT_KEYS)}")
    return dict(faults)


def wrap(store: Store, faults: Mapping[str, Any] | None, *, salt: str = "") -> Store:
    """``store`` with the faults a plain dict asks for (see :data:`FAULT_KEYS`); ``store``
    itself when ``faults`` is empty or None. ``salt`` varies the seed per process (a role,
    "invoker"), so that processes sharing one seed do not fail in lockstep."""
    if not faults:
        return store
    options = check_faults(faults)
    seed = int(options.pop("seed", 0))
    if salt:
        seed = int.from_bytes(hashlib.blake2b(f"{seed}\0{salt}".encode(), digest_size=4).digest(), "big")
    return FaultyStore(store, seed=seed, **options)


def for_role(store: Store, faults: Mapping[str, Any] | None, role: Any) -> Store:
    """A worker's store with the run's faults, seeded per role: stage, replica, attempt and
    start iteration, so a relaunched worker draws new faults and a trial stays reproducible."""
    salt = f"s{role.stage}r{role.replica}a{role.attempt}i{role.start_iteration}:{role.kind}"
    return wrap(store, faults, salt=salt)
