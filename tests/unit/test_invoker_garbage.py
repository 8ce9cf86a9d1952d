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

from flatpack.backends import functions
from flatpack.backends.functions import _Run
from flatpack.errors import StoreError
from flatpack.runtime.keys import Round, RunKeys
from flatpack.runtime.store import FileStore


class HeldDeletes(FileStore):
    """A file store whose deletions wait for ``release`` (a slow server), or fail; it counts
    its lists."""

    def __init__(self, root, fail: bool = False) -> None:
        super().__init__(root)
        self.release = threading.Event()
        self.fail = fail
        self.lists: list[str] = []

    def list(self, prefix: str) -> list[str]:
        self.lists.append(prefix)
        return super().list(prefix)

    def delete_keys(self, keys) -> None:
        if not self.release.wait(10):
            raise TimeoutError("the test never released the deletions")
        if self.fail:
            raise StoreError(f"refused to delete {keys[0]}")
        super().delete_keys(keys)


def invoker(store: FileStore, collected: int) -> _Run:
    """The invoker's garbage state for a one-stage run that checkpoints after every
    iteration, with ``collected`` iterations reported by every worker."""
    run = object.__new__(_Run)
    run.store, run.keys = store, RunKeys("run")
    # a stand-in with only what the garbage collection reads of the spec
    run.spec = SimpleNamespace(stages=[SimpleNamespace(index=0)],  # pyright: ignore[reportAttributeAccessIssue]
                               checkpoints_after=lambda iteration, end: True)
    run.released, run.collected = -1, collected
    run.garbage = ThreadPoolExecutor(max_workers=1)
    run.deleting = None
    run.next_release_at = 0.0
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


def test_a_deletion_lists_each_kind_of_key_once_however_many_iterations_it_covers(tmp_path):
    store = HeldDeletes(tmp_path)
    store.release.set()
    keys = RunKeys("run")
    for iteration in range(6):
        store.put(keys.activation(iteration, 0, 0), b"tensor")
        store.put(keys.gradient(iteration, 0, 0), b"tensor")
        store.put(keys.data(iteration, 0), b"input")
        store.put(keys.checkpoint(0, iteration), b"state")
    run = invoker(store, collected=4)
    try:
        run._release_now(end=6)
        assert sorted(store.lists) == sorted([*keys.intermediate_prefixes(), keys.checkpoints(0)])
        # iterations 0-4 are covered by the checkpoint after 4; 5 is still in flight, and the
        # checkpoint a lost function restarts from stays
        assert store.list("run/act/") == [keys.activation(5, 0, 0)]
        assert store.list("run/grad/") == [keys.gradient(5, 0, 0)]
        assert store.list("run/data/") == [keys.data(5, 0)]
        assert store.list(keys.checkpoints(0)) == [keys.checkpoint(0, 4), keys.checkpoint(0, 5)]
        # the directories the deleted keys left are gone too (a FileStore's)
        assert sorted(path.name for path in (tmp_path / "run" / "act").iterdir()) == ["i000005"]
    finally:
        run.garbage.shutdown(wait=True)


def test_deletions_wait_for_the_release_interval_but_a_segments_end_does_not(tmp_path, monkeypatch):
    store = HeldDeletes(tmp_path)
    store.release.set()
    keys = RunKeys("run")
    for iteration in range(3):
        store.put(keys.activation(iteration, 0, 0), b"tensor")
    monkeypatch.setattr(functions, "RELEASE_EVERY_S", 3600.0)
    run = invoker(store, collected=0)
    try:
        run._release(end=3)
        run._finish_deletion()
        assert run.released == 0
        run.collected = 2
        run._release(end=3)                   # within the interval: nothing more is deleted
        run._finish_deletion()
        assert run.released == 0 and store.list("run/act/") == [keys.activation(i, 0, 0) for i in (1, 2)]
        run._release_now(end=3)               # a segment's end deletes what its checkpoints cover
        assert run.released == 2 and store.list("run/act/") == []
    finally:
        run.garbage.shutdown(wait=True)


def test_the_iteration_of_a_key_is_read_only_from_a_per_iteration_key():
    keys = RunKeys("run")
    assert keys.iteration_of(keys.activation(12, 1, 3)) == 12
    assert keys.iteration_of(keys.marker(7, 0, 1, "computed")) == 7
    assert keys.iteration_of(keys.sync_chunk(9, 0, 1, 2)) == 9
    assert all(keys.iteration_of(key) is None for key in (keys.checkpoint(0, 4), keys.progress(3, 0, 0),
                                                          "other/act/i000001/s000000/m000000", "run/act/latest/x"))
    assert [keys.iteration_of(f"{prefix}i000005/x") for prefix in keys.intermediate_prefixes()] == [5] * 8


def test_a_round_s_keys_name_the_iteration_of_its_first_micro_batch():
    """PipeDream's 1F1B-RR reduces per round of micro-batches: micro-batch 37 of a run of 8
    per iteration is position 5 of iteration 4, and its round's keys read as iteration 4's."""
    keys = RunKeys("run")
    assert Round.of(37, 8) == Round(4, 5) and Round.of(8, 8) == Round(1, 0)
    round_keys = [keys.sync_chunk(Round(4, 5), 0, 1, 0), keys.reduced_chunk(Round(4, 5), 0, 1),
                  keys.shared_gradient(Round(4, 5), 1, "w"), keys.grad_norm(Round(4, 5), 0)]
    assert [keys.iteration_of(key) for key in round_keys] == [4] * 4
    # two rounds of one iteration, and a round beside the iteration's own key, never share a key
    assert keys.sync_chunk(Round(4, 5), 0, 1, 0) != keys.sync_chunk(Round(4, 6), 0, 1, 0) != keys.sync_chunk(
        4, 0, 1, 0)
    assert keys.iteration_of("run/sync/i000004q/s000000/r000001/c000000") is None
    assert keys.iteration_of("run/sync/i000004x000005/s000000/r000001/c000000") is None


def test_a_checkpoint_frees_the_rounds_of_the_iterations_it_covers(tmp_path):
    """An asynchronous schedule's round keys go with their iterations (they were keyed by the
    run's micro-batch number, which outran every checkpoint: the store kept them all)."""
    store = HeldDeletes(tmp_path)
    store.release.set()
    keys = RunKeys("run")
    micro_batches = 4
    for sequence in range(0, 6 * micro_batches, 2):          # rounds of 2 micro-batches, iterations 0-5
        store.put(keys.sync_chunk(Round.of(sequence, micro_batches), 0, 0, 1), b"chunk")
        store.put(keys.reduced_chunk(Round.of(sequence, micro_batches), 0, 0), b"chunk")
    run = invoker(store, collected=4)
    try:
        run._release_now(end=6)
        left = store.list("run/sync/") + store.list("run/reduced/")
        assert {keys.iteration_of(key) for key in left} == {5} and len(left) == 4
    finally:
        run.garbage.shutdown(wait=True)
