"""Bandwidth limits on a store, to emulate a serverless function's network link locally.

A function's link is full duplex (FuncPipe's pipelined scatter-reduce uploads one chunk
while it downloads another), so uploads and downloads have separate budgets; transfers in
the same direction share theirs.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from flatpack.errors import StoreError
from flatpack.runtime.store import Store, WrappedStore

# An idle link banks at most this much time's worth of bytes: small messages are not
# delayed, and a long-idle link does not let a big transfer through unthrottled.
DEFAULT_BURST_S = 0.01
# puts at least this large update the estimate of the server's own seconds per byte
_ESTIMATE_FROM_BYTES = 64 * 1024


class TokenBucket:
    """A shared rate limit: a transfer of n bytes finishes no sooner than n/rate after the
    link frees up.

    "Virtual finish time" design: each reservation of n bytes moves the time at which the
    link is free by n/rate and sleeps until its own reservation completes. Any n works with a
    small burst (no need to hold n tokens at once), and concurrent callers queue fairly in
    the order they reserved.
    """

    def __init__(self, rate_bytes_s: float, burst_bytes: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate_bytes_s or rate_bytes_s <= 0:
            raise StoreError(f"a bandwidth limit must be a positive number of bytes/s, got {rate_bytes_s!r}; "
                             "pass None for no limit")
        burst = rate_bytes_s * DEFAULT_BURST_S if burst_bytes is None else burst_bytes
        if burst < 0:
            raise StoreError(f"burst_bytes must be >= 0, got {burst_bytes!r}")
        self.rate = float(rate_bytes_s)
        self.burst = float(burst)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._free_at = float("-inf")  # when the link finishes everything reserved so far

    def reserve(self, n: int, since: float | None = None) -> float:
        """Book n bytes on the link; return how many seconds the caller must wait.
        ``since`` (this clock's time) backdates the transfer's start to when it really
        began, so that time already spent moving the bytes counts toward n/rate."""
        if n < 0:
            raise StoreError(f"cannot reserve a negative byte count ({n})")
        with self._lock:
            now = self._clock()
            began = now if since is None else min(since, now)
            # an idle link starts the transfer when it began, less the burst it banked while idle
            start = max(self._free_at, began - self.burst / self.rate)
            self._free_at = start + n / self.rate
            return max(0.0, self._free_at - now)

    def consume(self, n: int, since: float | None = None) -> float:
        """Reserve n bytes and sleep until the reservation completes; return the seconds slept."""
        wait = self.reserve(n, since)
        if wait > 0:
            self._sleep(wait)
        return wait


class Throttled(WrappedStore):
    """A store whose puts and gets are limited to given upload and download rates.

    The emulated link and the real transfer overlap, so a transfer takes about
    max(n/rate, the real time) and not their sum: a get is backdated to when it started;
    a put sleeps n/rate less the time the real put is expected to take (a running
    estimate of the server's seconds per byte), so the object appears when the emulated
    link would have delivered it. ``wait`` polls through ``get``. exists, list and delete
    are small control messages and pass untouched. A rate of None means unlimited.
    :meth:`stats`: bytes moved each way and seconds spent sleeping for the limits.
    """

    def __init__(self, store: Store, upload_bytes_s: float | None = None, download_bytes_s: float | None = None,
                 *, burst_s: float = DEFAULT_BURST_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(store, {"bytes_up": 0, "bytes_down": 0, "throttled_up_s": 0.0, "throttled_down_s": 0.0})
        self._clock, self._sleep = clock, sleep
        self.upload = _bucket(upload_bytes_s, burst_s, clock, sleep)
        self.download = _bucket(download_bytes_s, burst_s, clock, sleep)
        self._put_s_per_byte = 0.0

    def _count(self, direction: str, n: int, waited: float) -> None:
        with self._lock:
            self._stats[f"bytes_{direction}"] += n
            self._stats[f"throttled_{direction}_s"] += waited

    def put(self, key: str, data: bytes) -> None:
        n = len(data)
        waited = 0.0
        if self.upload:
            waited = max(0.0, self.upload.reserve(n) - n * self._put_s_per_byte)
            if waited > 0:
                self._sleep(waited)
        started = self._clock()
        self.inner.put(key, data)
        if n >= _ESTIMATE_FROM_BYTES:
            with self._lock:   # a running estimate; small puts are all latency and say nothing
                self._put_s_per_byte = 0.7 * self._put_s_per_byte + 0.3 * (self._clock() - started) / n
        self._count("up", n, waited)

    def get(self, key: str) -> bytes:
        started = self._clock()
        data = self.inner.get(key)
        waited = self.download.consume(len(data), since=started) if self.download else 0.0
        self._count("down", len(data), waited)
        return data

    def __repr__(self) -> str:
        up = self.upload.rate if self.upload else None
        down = self.download.rate if self.download else None
        return f"Throttled({self.inner!r}, upload_bytes_s={up}, download_bytes_s={down})"


def _bucket(rate: float | None, burst_s: float, clock: Callable[[], float],
            sleep: Callable[[float], None]) -> TokenBucket | None:
    if rate is None:
        return None
    return TokenBucket(rate, rate * burst_s, clock=clock, sleep=sleep)
