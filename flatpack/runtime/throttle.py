"""Bandwidth limits on a store, to emulate a serverless function's network link locally.

A function's link is full duplex (FuncPipe's pipelined scatter-reduce uploads one chunk
while it downloads another), so uploads and downloads have separate budgets; transfers in
the same direction share theirs.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from flatpack.errors import StoreError
from flatpack.runtime.store import Store

# An idle link banks at most this much time's worth of bytes: small messages are not
# delayed, and a long-idle link does not let a big transfer through unthrottled.
DEFAULT_BURST_S = 0.01


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

    def reserve(self, n: int) -> float:
        """Book n bytes on the link; return how many seconds the caller must wait."""
        if n < 0:
            raise StoreError(f"cannot reserve a negative byte count ({n})")
        with self._lock:
            now = self._clock()
            # an idle link starts the transfer now, less the burst it banked while idle
            start = max(self._free_at, now - self.burst / self.rate)
            self._free_at = start + n / self.rate
            return max(0.0, self._free_at - now)

    def consume(self, n: int) -> float:
        """Reserve n bytes and sleep until the reservation completes; return the seconds slept."""
        wait = self.reserve(n)
        if wait > 0:
            self._sleep(wait)
        return wait


class Throttled(Store):
    """A store whose puts and gets are limited to given upload and download rates.

    put throttles the upload by len(data) before it is sent; get and wait throttle the
    download by len(data) after the bytes arrive. exists, list and delete are small
    control messages and pass untouched. A rate of None means unlimited.
    """

    def __init__(self, store: Store, upload_bytes_s: float | None = None, download_bytes_s: float | None = None,
                 *, burst_s: float = DEFAULT_BURST_S) -> None:
        if not isinstance(store, Store):
            raise StoreError(f"Throttled wraps a Store, got {type(store).__name__}")
        self.inner = store
        # the inner url: a child process opens the same data and sets its own limits
        self.url = store.url
        self.upload = _bucket(upload_bytes_s, burst_s)
        self.download = _bucket(download_bytes_s, burst_s)
        self._lock = threading.Lock()
        self._stats = {"bytes_up": 0, "bytes_down": 0, "throttled_up_s": 0.0, "throttled_down_s": 0.0}

    def _count(self, direction: str, n: int, waited: float) -> None:
        with self._lock:
            self._stats[f"bytes_{direction}"] += n
            self._stats[f"throttled_{direction}_s"] += waited

    def put(self, key: str, data: bytes) -> None:
        waited = self.upload.consume(len(data)) if self.upload else 0.0
        self.inner.put(key, data)
        self._count("up", len(data), waited)

    def get(self, key: str) -> bytes:
        return self._downloaded(self.inner.get(key))

    def wait(self, key: str, timeout_s: float) -> bytes:
        return self._downloaded(self.inner.wait(key, timeout_s))

    def _downloaded(self, data: bytes) -> bytes:
        waited = self.download.consume(len(data)) if self.download else 0.0
        self._count("down", len(data), waited)
        return data

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def _list(self, prefix: str) -> Iterable[str]:
        return self.inner.list(prefix)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict[str, float]:
        """Bytes moved each way and seconds spent sleeping for the limits."""
        with self._lock:
            return dict(self._stats)

    def __repr__(self) -> str:
        up = self.upload.rate if self.upload else None
        down = self.download.rate if self.download else None
        return f"Throttled({self.inner!r}, upload_bytes_s={up}, download_bytes_s={down})"


def _bucket(rate: float | None, burst_s: float) -> TokenBucket | None:
    if rate is None:
        return None
    return TokenBucket(rate, rate * burst_s)
