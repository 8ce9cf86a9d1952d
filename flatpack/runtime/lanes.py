"""A worker's task DAG (FuncPipe §4): compute, upload and download are separate lanes that
run at the same time, each one task at a time in the order tasks were submitted, and a task
starts once the tasks it depends on have finished. Downloads for later micro-batches so
overlap the current computation, and uploads overlap the next one."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable

# "prefetch" downloads the next iteration's data while this one runs, beside "download"
# so that it never delays this iteration's gradients or synchronization; "report" sends
# checkpoints, progress and timelines without delaying the next iteration's activations
LANE_NAMES = ("compute", "upload", "download", "prefetch", "report")


class Lanes:
    """One single-thread executor per lane. ``submit`` returns a Future; a failed dependency
    fails its dependents with the same error, so the first failure surfaces once."""

    def __init__(self, names: Iterable[str] = LANE_NAMES, *,
                 on_compute_thread: Callable[[], None] | None = None) -> None:
        self._pools = {name: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flatpack-{name}")
                       for name in names}
        self._closed = threading.Event()
        if on_compute_thread is not None and "compute" in self._pools:
            self._pools["compute"].submit(on_compute_thread).result()

    def submit(self, lane: str, fn: Callable[..., Any], *args: Any,
               after: Iterable[Future | None] = ()) -> Future:
        """Runs ``fn(*args)`` on ``lane`` once the futures ``after`` are done (None entries: nothing to wait for)."""
        if lane not in self._pools:
            raise ValueError(f"unknown lane {lane!r}; lanes are {', '.join(self._pools)}")
        dependencies = [dep for dep in after if dep is not None]

        def run() -> Any:
            for dependency in dependencies:
                dependency.result()
            return fn(*args)

        return self._pools[lane].submit(run)

    def close(self, *, cancel: bool = False) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=not cancel, cancel_futures=cancel)

    def __enter__(self) -> Lanes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=exc[0] is not None)
