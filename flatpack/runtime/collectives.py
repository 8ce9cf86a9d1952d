"""Gradient synchronization among a stage's d replicas through the store (FuncPipe §3.3).

The flat gradient is cut into d chunks and replica i sums chunk i. Two schedules:

* ``lambdaml`` (Fig. 4a, eq. 1): phase 1 uploads the d − 1 chunks others sum; phase 2
  downloads the d − 1 copies of one's own chunk and sums them; phase 3 uploads the sum and
  downloads the others' sums. Uploads and downloads alternate, so the link is used one way
  at a time.
* ``pipelined`` (Fig. 4b, eq. 2): phases 1 and 2 overlap. In step k replica i uploads chunk
  i + k while it downloads chunk i uploaded by replica i − (k − 1), so the uplink and the
  downlink are busy together (the token buckets of ``throttle`` model a full-duplex link).

Both return the sum over replicas, identical on every replica: chunk sums are added in
replica order, so every replica applies bit-identical gradients.
"""

from __future__ import annotations

import contextlib

from typing import Callable

import torch

from flatpack.runtime.keys import Round, RunKeys
from flatpack.runtime.lanes import Lanes
from flatpack.runtime.store import Store
from flatpack.stage import wire
from flatpack.stage.settings import SYNC_METHODS



def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of ``parts`` nearly equal chunks of a flat vector."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for index in range(parts):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _pack(tensor: torch.Tensor) -> bytes:
    return wire.dumps({"chunk": tensor.contiguous()})


def _unpack(data: bytes) -> torch.Tensor:
    return wire.loads(data)[0]["chunk"]


def scatter_reduce(flat: torch.Tensor, *, store: Store, keys: RunKeys, iteration: int | Round, stage: int,
                   replica: int, replicas: int, method: str = "pipelined", lanes: Lanes | None = None,
                   timeout_s: float = 600.0,
                   record: Callable[[str, str, int], contextlib.AbstractContextManager[object]] | None = None
                   ) -> torch.Tensor:
    """The sum of ``flat`` over the stage's replicas, by ``method``.

    ``record(kind_lane, what, nbytes)`` is a context-manager factory for the timeline
    (``lane`` is "upload" or "download"); ``lanes`` runs the two directions concurrently
    (one is created when not given).
    """
    if method not in SYNC_METHODS:
        raise ValueError(f"sync method {method!r} is not one of {', '.join(SYNC_METHODS)}")
    if replicas == 1:
        return flat
    bounds = chunk_bounds(flat.numel(), replicas)
    chunks = [flat[start:end] for start, end in bounds]
    own = replica

    def upload(key: str, tensor: torch.Tensor) -> None:
        data = _pack(tensor)
        with _recorded(record, "upload", len(data)):
            store.put(key, data)

    def download(key: str) -> torch.Tensor:
        with _recorded(record, "download", 0):
            return _unpack(store.wait(key, timeout_s))

    peers = [(own + step) % replicas for step in range(1, replicas)]
    sources = [(own - step) % replicas for step in range(1, replicas)]
    outgoing = [(keys.sync_chunk(iteration, stage, own, peer), chunks[peer]) for peer in peers]
    incoming = [keys.sync_chunk(iteration, stage, source, own) for source in sources]

    owned = lanes is None
    lanes = lanes or Lanes(("upload", "download"))
    try:
        uploads = [lanes.submit("upload", upload, key, tensor) for key, tensor in outgoing]
        # LambdaML waits for its own uploads before downloading; the pipelined schedule
        # downloads while it uploads (step k's download is the chunk uploaded in step k − 1).
        after = uploads if method == "lambdaml" else ()
        received = [lanes.submit("download", download, key, after=after) for key in incoming]
        parts = {source: future.result() for source, future in zip(sources, received)}
        parts[own] = chunks[own]
        reduced = sum((parts[index] for index in range(1, replicas)), parts[0].clone())
        for future in uploads:
            future.result()
        publish = lanes.submit("upload", upload, keys.reduced_chunk(iteration, stage, own), reduced)
        others = [(peer, lanes.submit("download", download, keys.reduced_chunk(iteration, stage, peer),
                                      after=[publish] if method == "lambdaml" else ()))
                  for peer in range(replicas) if peer != own]
        result = torch.empty_like(flat)
        start, end = bounds[own]
        result[start:end] = reduced
        for peer, future in others:
            start, end = bounds[peer]
            result[start:end] = future.result()
        publish.result()
        return result
    finally:
        if owned:
            lanes.close()


def _recorded(record: Callable[[str, str, int], contextlib.AbstractContextManager[object]] | None, lane: str,
              nbytes: int) -> contextlib.AbstractContextManager[object]:
    if record is None:
        return contextlib.nullcontext()
    return record(lane, "sync", nbytes)
