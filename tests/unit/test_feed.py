"""The invoker's data feed: an iteration's micro-batches go up several puts at a time, every
key lands with its micro-batch, and a put that fails is raised once every other put is done."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import flatpack
from flatpack.backends.functions import FunctionDeployment
from flatpack.errors import StoreError
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import FileStore, WrappedStore
from flatpack.runtime.training import TARGET
from flatpack.stage import wire
from flatpack.stage.wire import unpack_values

MICRO_BATCHES = 4


class _Puts(WrappedStore):
    """A file store whose puts can wait for each other (``together``: that many must be in
    flight before any finishes) or fail (``failing``: that key)."""

    def __init__(self, root, *, together: int = 1, failing: str | None = None) -> None:
        super().__init__(FileStore(root), {})
        self.barrier = threading.Barrier(together) if together > 1 else None
        self.failing = failing
        self.finished: list[str] = []

    def put(self, key: str, data: bytes) -> None:
        if self.barrier is not None:
            self.barrier.wait(timeout=10)     # one put at a time breaks it: BrokenBarrierError
        if key == self.failing:
            raise StoreError(f"the store refused {key}")
        super().put(key, data)
        with self._lock:
            self.finished.append(key)


def _deployment(tmp_path, store) -> tuple[FunctionDeployment, RunKeys]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    compiled = flatpack.compile(model, (torch.randn(2, 6),), stages=2)
    keys = RunKeys("run-feed")
    return FunctionDeployment(compiled, store.url, {}, keys, tmp_path / "work", store=store), keys


def test_an_iteration_s_data_goes_up_several_puts_at_a_time_and_each_key_holds_its_micro_batch(tmp_path):
    store = _Puts(tmp_path / "store", together=2)   # two in flight at once: sequential puts never get there
    deployment, keys = _deployment(tmp_path, store)
    inputs, target = torch.randn(8, 6), torch.arange(8) % 3
    assert deployment._upload_batch(3, (inputs, target), MICRO_BATCHES) == 8
    assert len(store.finished) == 2 * MICRO_BATCHES
    for m in range(MICRO_BATCHES):
        (value,) = unpack_values(store.get(keys.data(3, m))).values()
        torch.testing.assert_close(value, inputs[2 * m:2 * m + 2])
        torch.testing.assert_close(wire.loads(store.get(keys.target(3, m)))[0][TARGET], target[2 * m:2 * m + 2])


def test_a_put_the_store_refuses_is_raised_after_every_other_put_of_the_iteration_finished(tmp_path):
    store = _Puts(tmp_path / "store", failing=RunKeys("run-feed").data(0, 1))
    deployment, keys = _deployment(tmp_path, store)
    with pytest.raises(StoreError, match="refused"):
        deployment._upload_batch(0, (torch.randn(8, 6), torch.arange(8) % 3), MICRO_BATCHES)
    # nothing is still writing when the error reaches the caller: the rest all landed
    assert sorted(store.finished) == sorted({keys.data(0, m) for m in (0, 2, 3)}
                                            | {keys.target(0, m) for m in range(MICRO_BATCHES)})
