"""The invoker deletes finished iterations' tensors on its garbage thread, beside the poll
loop: a slow deletion (0.5 s for three iterations' keys on the local S3 server) no longer
holds up the data feed and the progress reads, which starved the first stage's prefetch for
0.1-0.4 s (BENCHMARKS.md, "Issue 19, fifth pass"). A store error of a deletion still reaches
the run, and a segment ends with everything its checkpoints cover deleted."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from flatpack.backends.functions import _Run
from flatpack.errors import StoreError
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import FileStore


class HeldDeletes(FileStore):
    """A file store whose prefix deletions wait for ``release`` (a slow server), or fail."""

    def __init__(self, root, fail: bool = False) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.fail = fail

    def delete_prefix(self, prefix: str) -> int:
        if not self.release.wait(10):
            raise TimeoutError("the test never released the deletions")
        if self.fail:
            raise StoreError(f"refused to delete {prefix}")
        return super().delete_prefix(prefix)


def invoker(store: FileStore, collected: int) -> _Run:
    """The invoker's garbage state for a one-stage run that checkpoints after every
    iteration, with ``collected`` iterations reported by every worker."""
    run = object.__new__(_Run)
    run.store, run.keys = store, RunKeys("run")
    run.spec = SimpleNamespace(stages=[SimpleNamespace(index=0)],
                               checkpoints_after=lambda iteration, end: True)
    run.released, run.collected = -1, collected
    run.garbage = ThreadPoolExecutor(max_workers=1)
    run.deleting = None
    return run


def test_a_slow_deletion_does_not_hold_up_the_poll_loop(tmp_path):
    store = HeldDeletes(tmp_path)
    keys = RunKeys("run")
    for iteration in range(3):
        store.put(keys.activation(iteration, 0, 0), b"tensor")
    run = invoker(store, collected=1)
    try:
        run._release(end=3)                   # returns with the deletion still held
        assert run.released == 1 and run.deleting is not None and not run.deleting.done()
        run.collected = 2
        run._release(end=3)                   # one deletion at a time: the next waits for it
        assert run.released == 1
        store.release.set()
        run._release_now(end=3)
        assert run.released == 2 and run.deleting is None
        assert store.list("run/act/") == []
    finally:
        run.garbage.shutdown(wait=True)


def test_a_deletion_the_store_refuses_fails_the_run(tmp_path):
    store = HeldDeletes(tmp_path, fail=True)
    store.put(RunKeys("run").activation(0, 0, 0), b"tensor")
    run = invoker(store, collected=0)
    try:
        run._release(end=1)
        store.release.set()
        with pytest.raises(StoreError, match="refused to delete"):
            run._release_now(end=1)
    finally:
        run.garbage.shutdown(wait=True)
