"""What one store request costs a host's CPU when the client and the store server share it:
``flatpack calibrate --target local``'s figure for the host bound (issue 19, tenth pass).

A local run's four workers, its invoker and its S3 server share the host's cores. The demo's
2 x 2 vgg16 plan kept both cores of the 2-core VM 98 % busy: 595 core-ms an iteration, of
which the server took 174, the four workers 82-100 each and the invoker 59, while its
iteration measured 307 ms, 595 / 2 = 298 (BENCHMARKS.md, issue 19's tenth pass). It made
about 175 store requests an iteration, 61 of them polls that missed; its layers' compute was
about 54 core-ms. Such an iteration is bounded by the host's throughput, not by the
critical path FuncPipe's equations follow (``analysis.host_load``).

How: ``ROUNDS`` rounds of ``SMALL_REQUESTS`` puts of ``SMALL_BYTES``, as many gets of them
and as many gets of absent keys (a poll's miss), then ``LARGE_REQUESTS`` puts and gets of
``LARGE_BYTES``; each timed by this process's CPU (``time.process_time``: the boto3 client)
plus the server process's (``cpus.process_cpu_seconds``), per request. The mean over
rounds of the small figures is each request's fixed part; the large ones' excess over it, per
byte, its part per byte moved.

The mean, over six rounds (2.5-3.3 s on the 2-core VM), not the median of three (1.3-1.6 s): the
VM's interpreter runs at half speed in bursts of 0.2-2 s that cover a quarter to nine tenths
of the time (``benchmarks/host_speed.py``; the store's requests are the interpreter's work:
the boto3 client, the server's handlers), so the median of three rounds snapped to one speed
or the other, and calibrations minutes apart read a put at 3.45 or 5.5 ms. The mean over
the longer window reads the host's average speed, which is what a run's many requests pay:
``benchmarks/request_cpu_spread.py --repeats 8`` (the two methods alternated on that VM) read
the coefficient of variation of a put, a get and a miss at 23, 29 and 34 % with the median of
three rounds and at 14, 15 and 16 % with the mean of six.

Then the host's cores a run gets (issue 44): ``CORE_PROBE_PROCESSES`` busy processes at a
time, as many as a one-worker plan and a 2 x 2 one run (workers, invoker, store), each in its
own session and for ``CORE_PROBE_S`` (``cpus.cores_obtained``). On a quiet host they read its
cores; on one that other work shares, less, and ``flatpack calibrate`` says so. The host bound
does not divide by it: on the 2-core VM at a load average of 15-41 the calibration read
0.19-0.29 cores while the fidelity benchmark's runs, minutes later, got 0.30-0.76
(``analysis.host_load``).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

from flatpack.cpus import cores_obtained, process_cpu_seconds
from flatpack.errors import StoreKeyError
from flatpack.platform.catalog import RequestCpu
from flatpack.runtime.store import Store

ROUNDS = 6
SMALL_REQUESTS = 40
SMALL_BYTES = 1024
LARGE_REQUESTS = 6
LARGE_BYTES = 1 << 20
CORE_PROBE_PROCESSES = (3, 6)
CORE_PROBE_S = 1.0


def measure_request_cpu(store: Store, server_pid: int, prefix: str, *, rounds: int = ROUNDS,
                        statistic: Callable[[list[float]], float] = statistics.fmean,
                        cores: bool = True) -> RequestCpu | None:
    """Times requests of ``store`` to the server process ``server_pid`` under keys below
    ``prefix`` (deleted after); None where the server's CPU cannot be read (no procfs).
    ``rounds`` and ``statistic`` (over the rounds' figures) are calibrate's; other values are
    for ``benchmarks/request_cpu_spread.py``, which sets them beside each other. ``cores``:
    also measure the cores a run gets (``cores_obtained``; empty without)."""
    if process_cpu_seconds(server_pid) is None:
        return None

    def host_cpu() -> float:
        server = process_cpu_seconds(server_pid)
        if server is None:
            raise RuntimeError(f"the store server (pid {server_pid}) exited while its request CPU was measured")
        return time.process_time() + server

    def per_request(count: int, request: Callable[[int], object]) -> float:
        before = host_cpu()
        for index in range(count):
            request(index)
        return (host_cpu() - before) / count

    def missing(key: str) -> None:
        try:
            store.get(key)
        except StoreKeyError:
            return
        raise RuntimeError(f"{key!r} was expected absent from the store while timing a poll's miss")

    figures: dict[str, list[float]] = {name: [] for name in ("put", "get", "miss", "put_large", "get_large")}
    small, large = os.urandom(SMALL_BYTES), os.urandom(LARGE_BYTES)
    keys: list[str] = []
    try:
        for round_number in range(rounds):
            base = f"{prefix}/r{round_number}"
            keys += [f"{base}/s{index}" for index in range(SMALL_REQUESTS)]
            keys += [f"{base}/l{index}" for index in range(LARGE_REQUESTS)]
            figures["put"].append(per_request(SMALL_REQUESTS, lambda i: store.put(f"{base}/s{i}", small)))
            figures["get"].append(per_request(SMALL_REQUESTS, lambda i: store.get(f"{base}/s{i}")))
            figures["miss"].append(per_request(SMALL_REQUESTS, lambda i: missing(f"{base}/absent{i}")))
            figures["put_large"].append(per_request(LARGE_REQUESTS, lambda i: store.put(f"{base}/l{i}", large)))
            figures["get_large"].append(per_request(LARGE_REQUESTS, lambda i: store.get(f"{base}/l{i}")))
    finally:
        store.delete_keys(keys)
    per_round = {name: statistic(values) for name, values in figures.items()}
    moved = LARGE_BYTES - SMALL_BYTES
    return RequestCpu(put_s=per_round["put"], get_s=per_round["get"], miss_s=per_round["miss"],
                      put_s_per_byte=max(0.0, per_round["put_large"] - per_round["put"]) / moved,
                      get_s_per_byte=max(0.0, per_round["get_large"] - per_round["get"]) / moved,
                      cores_obtained=measure_cores_obtained() if cores else ())


def measure_cores_obtained(counts: tuple[int, ...] = CORE_PROBE_PROCESSES,
                           seconds: float = CORE_PROBE_S) -> tuple[tuple[int, float], ...]:
    """(processes, cores they got) for each of ``counts`` (``cpus.cores_obtained``); empty
    where this host cannot fork."""
    pairs = []
    for processes in counts:
        cores = cores_obtained(processes, seconds)
        if cores is None:
            return ()
        pairs.append((processes, max(cores, 1e-3)))
    return tuple(pairs)
