"""One rank of the ``gpu-container`` calibration: times the two ways a stage replica moves
bytes to another, exactly as the rank program (:mod:`flatpack.runtime.distributed`) moves
them, at several message sizes.

* **Point to point** — rank 0 sends a tensor to rank 1, which sends it back (a ping-pong);
  half the round trip is one message, as a stage's activations go to the next stage: the
  tensor is moved to the backend's transport device before the send and back to the compute
  device after the receive (``Messenger.send``/``recv``; with gloo on a GPU both copies go
  through the host).
* **All-reduce** — among ranks 0..k−1 for every k from 2 to the world size, each rank sums
  its gradients with the others as a stage's replicas do
  (``distributed.all_reduce_gradients``, which ``StageRank._all_reduce`` calls: flattened
  into one buffer, through the host with gloo, and copied back into each gradient). A round
  is timed from a barrier to the rank's end, and the round's time is that of the rank that
  reached the all-reduce last, the least of the ranks' times: the others' include waiting
  for it (ranks leave a barrier at different moments), and Hydrozoa's T^(D) starts when the
  last replica has its gradients. A real run's all-reduce is read the same way
  (``benchmarks/collective_fidelity.py``).

Rank 0 writes the medians (seconds per size) as JSON; ``backends.collective_calibration``
starts the ranks and fits the link's latency and bandwidth and Hydrozoa's all-reduce α, β to
them (``partitioner.cost.collectives.fit_ring``).

Run it under ``torchrun`` (or with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT
set), in a cluster as on one machine::

    torchrun --nnodes 2 --nproc-per-node 1 ... -m flatpack.runtime.collective_probe \\
        --backend nccl --device cuda --out probe.json
    flatpack calibrate --target gpu-container --from-probe probe.json --out gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from flatpack.atomic import write_atomic
from flatpack.errors import InputError
from flatpack.runtime.distributed import all_reduce_gradients, rank_device, transport_device

RESULT_FORMAT = "flatpack-collective-probe"
# 4 KB to 64 MB: a small activation to a large stage's gradients; the smallest sizes fix the
# per-message and per-round terms, the largest the per-byte ones
DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26)
DEFAULT_REPEATS = 7
# a stage's gradients are several tensors: the probe's buffer is split into this many
PARAMETERS = 8
WARMUP_ROUNDS = 2      # the first rounds pay the connection set-up and the allocator's first blocks
TIMEOUT_S = 300.0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_point_to_point(nbytes: int, backend: str, device: torch.device, rounds: int) -> list[float]:
    """Seconds of one message of ``nbytes`` from rank 0 to rank 1, per round (half a ping-pong);
    ranks beyond 1 take no part and return an empty list."""
    rank = dist.get_rank()
    if rank > 1:
        return []
    transport = transport_device(backend, device)
    elements = max(1, nbytes // 4)
    payload = torch.ones(elements, device=device)
    seconds = []
    for _ in range(rounds):
        _synchronize(device)
        began = time.perf_counter()
        if rank == 0:
            dist.send(payload.to(transport), 1)
            back = torch.empty(elements, device=transport)
            dist.recv(back, 1)
            back.to(device)
        else:
            arrived = torch.empty(elements, device=transport)
            dist.recv(arrived, 0)
            dist.send(arrived.to(device).to(transport), 0)
        _synchronize(device)
        seconds.append((time.perf_counter() - began) / 2)
    return seconds


def time_all_reduce(nbytes: int, backend: str, device: torch.device, rounds: int, group: Any) -> list[float]:
    """Seconds of this rank's part of one gradient all-reduce (sum) of ``nbytes`` among
    ``group``, per round, each round started at a barrier of every rank; a rank outside the
    group takes no part and returns an empty list. The rank program's ``_all_reduce`` step
    for step: the gradients of ``PARAMETERS`` parameters flattened into one buffer, moved to
    the host for gloo, summed, and copied back into each gradient (``all_reduce_gradients``,
    which the rank program calls)."""
    member = group is not None and dist.get_rank() in dist.get_process_group_ranks(group)
    elements = max(PARAMETERS, nbytes // 4)
    counts = [elements // PARAMETERS + (index < elements % PARAMETERS) for index in range(PARAMETERS)]
    parameters = [torch.nn.Parameter(torch.ones(count, device=device)) for count in counts]
    for parameter in parameters:
        parameter.grad = torch.ones_like(parameter)
    seconds = []
    for _ in range(rounds):
        _synchronize(device)
        dist.barrier()
        if not member:
            continue
        began = time.perf_counter()
        all_reduce_gradients(parameters, backend, device, group)
        _synchronize(device)
        seconds.append(time.perf_counter() - began)
    return seconds


def _last_arrival_median(own: list[float], world: int) -> float:
    """The median over rounds of the seconds of the rank that arrived last in each round, the
    least of the ranks' (ranks that took no part send an empty list)."""
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, own)
    taking_part = [values for values in gathered if values]
    return statistics.median(min(values[index] for values in taking_part) for index in range(len(taking_part[0])))


def measure(backend: str, device: torch.device, sizes: Sequence[int], repeats: int) -> dict[str, Any]:
    """Both probes at every size — the all-reduce among ranks 0..k−1 for every k from 2 to
    the world size (a plan's stage may have any number of replicas, and the terms that do
    not grow with it are told apart only so) — on a process group already joined; the same
    dict on every rank."""
    world = dist.get_world_size()
    # every rank creates every group, in the same order (new_group is collective)
    groups = {count: dist.new_group(list(range(count))) for count in range(2, world + 1)}
    point_to_point: list[float] = []
    all_reduce: dict[int, list[float]] = {count: [] for count in groups}
    for nbytes in sizes:
        time_point_to_point(nbytes, backend, device, WARMUP_ROUNDS)
        sent = time_point_to_point(nbytes, backend, device, repeats)
        # rank 0 times the whole ping-pong; rank 1's view of it starts late by its wait
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, sent)
        point_to_point.append(statistics.median(gathered[0]))
        for count, group in groups.items():
            time_all_reduce(nbytes, backend, device, WARMUP_ROUNDS, group)
            all_reduce[count].append(_last_arrival_median(time_all_reduce(nbytes, backend, device, repeats, group),
                                                          world))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"format": RESULT_FORMAT, "backend": backend, "device": device.type, "device_name": name,
            "ranks": world, "repeats": repeats, "sizes_bytes": list(sizes),
            "point_to_point_s": point_to_point, "all_reduce_s": {str(count): all_reduce[count] for count in groups},
            "torch": torch.__version__}


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise InputError(f"--sizes {text!r} must be byte counts separated by commas") from error
    if len(set(sizes)) < 2 or any(size < 4 for size in sizes):
        raise InputError(f"--sizes {text!r}: give at least two different sizes of 4 bytes or more (the fit is a line)")
    return tuple(sorted(set(sizes)))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m flatpack.runtime.collective_probe",
                                     description="One rank of the gpu-container calibration (start it with "
                                                 "torchrun, two ranks or more).")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes")
    parser.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed rounds per size")
    parser.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if world < 2:
        raise InputError(f"WORLD_SIZE is {world}: the probe times messages between ranks, start two or more")
    if args.repeats < 1:
        raise InputError(f"--repeats {args.repeats}: time at least one round per size")
    sizes = _sizes(args.sizes)
    device = rank_device(args.backend, args.device, local_rank)
    kwargs: dict[str, Any] = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S), **kwargs)
    try:
        result = measure(args.backend, device, sizes, args.repeats)
        if rank == 0:
            write_atomic(args.out, json.dumps(result, indent=2) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
