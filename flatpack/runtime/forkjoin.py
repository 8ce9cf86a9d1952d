"""Gillis's fork-join inference (§III-B): a master function walks the layer groups in order;
for a group split over n workers it sends each worker its partition, computes one
partition itself when the plan says so, joins the results and goes on to the next group.

A group splits as its plan says (``GroupSpec.split``, the plan's ``StagePlan.split``):

* ``"channel"`` (Gillis §II-C Fig. 2b): every partition gets the group's whole inputs and
  runs its stage module cut to a slice of the filters (``runtime/channel_split.py``, rules
  in ``stage/channels.py``); the master concatenates the sliced outputs, sums the partial
  ones and takes the whole ones from partition 0. A one-sample request splits this way.
* ``"batch"``: every partition holds the group's whole weights and a slice of the
  request's samples, which is exact for any stage whose code does not fix the batch (the
  export frontend's attention reshapes by the example's batch and cannot); the request
  needs at least as many samples as partitions (``deployment.infer`` checks).

``cost/gillis.py`` models the same two splits, term by term.

Workers are warm: they start with the deployment and wait for their next partition key,
as provisioned functions would, so a request pays the store round trips but no cold start.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from flatpack.batching import has_batch_dimension
from flatpack.runtime import channel_split, timeline
from flatpack.runtime.function import Role, load_module
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import Store
from flatpack.stage.artifact import load_weights
from flatpack.stage.wire import pack_values, unpack_values

STOP = "stop"


@dataclass(frozen=True)
class GroupSpec:
    index: int
    workers: int                # functions a group forks (0: the master runs it alone)
    on_master: bool             # the master computes one partition itself
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    split: str = "batch"        # "channel" or "batch" (StagePlan.split)
    joins: tuple[str, ...] = ()  # channel split: how the master joins each output (channel_split.joins)

    @property
    def partitions(self) -> int:
        return self.workers + (1 if self.on_master else 0)


@dataclass(frozen=True)
class ForkJoinSpec:
    run: str
    groups: tuple[GroupSpec, ...]
    memory_mb: int | None
    vcpus: float | None
    bandwidth_bytes_s: float | None
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    threads: int = 1
    wait_timeout_s: float = 300.0
    # the iteration whose checkpoints hold the weights to serve (the latest training every
    # stage finished); None: the compiled weights
    checkpoint: int | None = None

    def dumps(self) -> bytes:
        return json.dumps({"kind": "forkjoin", **asdict(self)}).encode()

    @classmethod
    def loads(cls, raw: bytes) -> ForkJoinSpec:
        data = json.loads(raw)
        data.pop("kind")
        groups = tuple(GroupSpec(**{**g, "inputs": tuple(g["inputs"]), "outputs": tuple(g["outputs"]),
                                    "joins": tuple(g.get("joins", ()))})
                       for g in data.pop("groups"))
        return cls(groups=groups, input_names=tuple(data.pop("input_names")),
                   output_names=tuple(data.pop("output_names")), **data)


def roles(spec: ForkJoinSpec, spec_key: str, digest: str) -> list[Role]:
    """The functions that serve ``spec`` (stored at ``spec_key``): the master, then each
    group's workers (stage = group, replica = partition), each carrying ``digest``."""
    found = [Role(spec_key, 0, 0, 0, 0, kind="infer-master", digest=digest)]
    found += [Role(spec_key, group.index, partition, 0, 0, kind="infer-worker", digest=digest)
              for group in spec.groups for partition in range(group.workers)]
    return found


def stop_messages(spec: ForkJoinSpec, keys: RunKeys, request: int) -> dict[str, bytes]:
    """What ends the functions serving ``spec`` when their next request is ``request``: a
    stop message under the key each of them waits on."""
    messages = {keys.infer(str(request), group.index, partition, "in"): stop_message()
                for group in spec.groups for partition in range(group.workers)}
    messages[keys.infer(str(request), 0, 0, "request")] = stop_message()
    return messages


def split_batch(values: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Cuts every tensor that has the request's batch dimension into ``parts`` slices;
    values without it (sizes, shared tables) go whole to every partition."""
    batch = request_batch(values)
    pieces: list[dict[str, Any]] = [{} for _ in range(parts)]
    for name, value in values.items():
        if has_batch_dimension(value, batch):
            for piece, chunk in zip(pieces, torch.tensor_split(value, parts)):
                piece[name] = chunk.contiguous()
        else:
            for piece in pieces:
                piece[name] = value
    return pieces


def join_batch(parts: list[dict[str, Any]], batch_sizes: list[int]) -> dict[str, Any]:
    joined = {}
    for name, first in parts[0].items():
        if all(has_batch_dimension(p[name], size) for p, size in zip(parts, batch_sizes)):
            joined[name] = torch.cat([p[name] for p in parts])
        else:
            joined[name] = first
    return joined


def request_batch(values: dict[str, Any]) -> int:
    """The request's samples: the longest leading dimension among its tensors."""
    return max((v.shape[0] for v in values.values() if isinstance(v, torch.Tensor) and v.dim()), default=0)


def serve(store: Store, raw_spec: bytes, role: Role, *, after_task: Any = None, throttled: Store | None = None,
          throttle_compute: Any = None) -> int:
    """The loop of an inference function: the master (``infer-master``) or a group's
    worker (``infer-worker``, stage = group, replica = partition)."""
    spec = ForkJoinSpec.loads(raw_spec)
    keys = RunKeys(spec.run)
    link = throttled or store
    after_task = after_task or (lambda kind, request, part: None)
    run_compute = throttle_compute or (lambda fn: fn())
    recorder = timeline.Recorder(role.stage, role.replica, role.attempt)
    if role.kind == "infer-worker":
        groups = [spec.groups[role.stage]]
    else:
        groups = [g for g in spec.groups if g.workers == 0 or g.on_master]
    modules = {g.index: load_module(store, keys, g.index, role.digest).eval() for g in groups}
    if spec.checkpoint is not None:
        for index, module in modules.items():
            load_weights(module, store.wait(keys.checkpoint(index, spec.checkpoint), spec.wait_timeout_s))
    for group in groups:
        if group.split == "channel" and group.workers:
            # a worker keeps its partition's slice of the weights; the master the last partition's
            part = role.replica if role.kind == "infer-worker" else group.partitions - 1
            modules[group.index] = channel_split.partition_module(modules[group.index], group.partitions, part,
                                                                  f"group {group.index}")
    after_task("load", 0, None)
    request = 0
    while True:
        if role.kind == "infer-worker":
            key = keys.infer(str(request), role.stage, role.replica, "in")
        else:
            key = keys.infer(str(request), 0, 0, "request")
        raw = link.wait(key, spec.wait_timeout_s * 100)
        values = unpack_values(raw)
        if values.get(STOP):
            return 0
        started = time.time()
        if role.kind == "infer-worker":
            group = spec.groups[role.stage]
            outputs = _compute(modules[group.index], group, values, run_compute)
            if group.split == "channel":
                outputs = {name: outputs[name]
                           for name in channel_split.needed_outputs(group.outputs, group.joins, role.replica)}
            recorder.add(timeline.Event(role.stage, role.replica, request, "forward", started, time.time(),
                                        micro_batch=role.replica, attempt=role.attempt))
            after_task("forward", request, role.replica)
            link.put(keys.infer(str(request), role.stage, role.replica, "out"), pack_values(outputs))
        else:
            env = dict(values)
            for group in spec.groups:
                env.update(_run_group(link, keys, request, group, modules.get(group.index), env, run_compute,
                                      recorder, spec.wait_timeout_s))
                after_task("forward", request, group.index)
            response = {name: env[name] for name in spec.output_names}
            link.put(keys.infer(str(request), 0, 0, "response"), pack_values(response))
        store.put(keys.timeline(role.stage, role.replica, request, role.attempt), timeline.dumps(recorder.drain()))
        request += 1


def _compute(module: torch.nn.Module | None, group: GroupSpec, values: dict[str, Any],
             run_compute: Any) -> dict[str, Any]:
    if module is None:
        raise RuntimeError(f"group {group.index} computes on the master, which loaded no module for it")
    result: dict[str, Any] = {}

    def run() -> None:
        with torch.no_grad():
            outputs = module(*(values[name] for name in group.inputs))
        result.update(zip(group.outputs, outputs))

    run_compute(run)
    return result


def _run_group(store: Store, keys: RunKeys, request: int, group: GroupSpec, module: torch.nn.Module | None,
               env: dict[str, Any], run_compute: Any, recorder: timeline.Recorder, timeout_s: float) -> dict[str, Any]:
    inputs = {name: env[name] for name in group.inputs}
    if group.workers == 0:
        started = time.time()
        outputs = _compute(module, group, inputs, run_compute)
        recorder.add(timeline.Event(0, 0, request, "forward", started, time.time(), micro_batch=group.index))
        return outputs
    if group.split == "channel":
        pieces = [inputs] * group.partitions   # broadcast: every partition reads the whole input
    else:
        pieces = split_batch(inputs, group.partitions)
    sizes = [request_batch(piece) for piece in pieces]
    started = time.time()
    # a broadcast is packed once and uploaded to each worker, as Gillis invokes each with the input
    packed = [pack_values(pieces[0])] * group.workers if group.split == "channel" else \
        [pack_values(pieces[partition]) for partition in range(group.workers)]
    for partition in range(group.workers):
        store.put(keys.infer(str(request), group.index, partition, "in"), packed[partition])
    recorder.add(timeline.Event(0, 0, request, "upload", started, time.time(), lane="upload", micro_batch=group.index))
    results: list[dict[str, Any] | None] = [None] * group.partitions
    if group.on_master:
        started = time.time()
        results[-1] = _compute(module, group, pieces[-1], run_compute)
        recorder.add(timeline.Event(0, 0, request, "forward", started, time.time(), micro_batch=group.index))
    started = time.time()
    for partition in range(group.workers):
        key = keys.infer(str(request), group.index, partition, "out")
        results[partition] = unpack_values(store.wait(key, timeout_s))
        store.delete(key)
    recorder.add(timeline.Event(0, 0, request, "download", started, time.time(), lane="download",
                                micro_batch=group.index))
    parts = [part for part in results if part is not None]
    if len(parts) != len(results):
        raise RuntimeError(f"group {group.index}: {len(results) - len(parts)} of its {len(results)} partitions "
                           "returned nothing (its workers and the master cover them all)")
    if group.split == "channel":
        return channel_split.join_outputs(parts, group.outputs, group.joins)
    return join_batch(parts, sizes)


def stop_message() -> bytes:
    return pack_values({STOP: True})

