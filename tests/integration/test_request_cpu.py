"""The host CPU of a store request on the local S3 server, as `flatpack calibrate --target
local` measures it for the host bound (analysis.host_load): client and server together, each
verb's fixed part and its part per byte, and nothing left in the store."""

from __future__ import annotations

import os

import pytest

from flatpack.backends.request_cpu import CORE_PROBE_PROCESSES, measure_request_cpu
from flatpack.cpus import process_cpu_seconds


def test_a_request_s_host_cpu_is_measured_on_both_sides_and_its_keys_are_deleted(s3_server, s3_store):
    pid = s3_server.pid
    if pid is None or process_cpu_seconds(pid) is None:
        pytest.skip("no procfs: the server's CPU cannot be read")
    server_before = process_cpu_seconds(pid)
    cpu = measure_request_cpu(s3_store, pid, "request-cpu")
    server_after = process_cpu_seconds(pid)
    assert cpu is not None and server_before is not None and server_after is not None
    # every request costs the server CPU as well as the client: the server's own counter moved
    assert server_after > server_before
    assert min(cpu.put_s, cpu.get_s, cpu.miss_s) > 0
    # a megabyte put costs more than a kilobyte one (the server writes it to its volume)
    assert cpu.put_s_per_byte > 0 and cpu.put(1 << 20) > cpu.put_s
    assert s3_store.list("request-cpu/") == []
    cpu_count = os.cpu_count() or 1
    # and the cores as many busy processes as a run has got, at most the host's (issue 44)
    assert [processes for processes, _ in cpu.cores_obtained] == list(CORE_PROBE_PROCESSES)
    assert all(0 < cores <= cpu_count + 0.05 for _, cores in cpu.cores_obtained)


def test_a_process_that_is_gone_has_no_cpu_to_read():
    assert process_cpu_seconds(2**22 + 7) is None


def test_each_figure_is_the_given_statistic_of_as_many_rounds_as_asked(s3_server, s3_store):
    """calibrate's method is a parameter so that benchmarks/request_cpu_spread.py can set the
    methods side by side: the statistic sees one value per round, and nothing else is timed."""
    pid = s3_server.pid
    if pid is None or process_cpu_seconds(pid) is None:
        pytest.skip("no procfs: the server's CPU cannot be read")
    seen: list[list[float]] = []

    def first_round(values: list[float]) -> float:
        seen.append(list(values))
        return values[0]

    cpu = measure_request_cpu(s3_store, pid, "request-cpu-rounds", rounds=2, statistic=first_round, cores=False)
    assert cpu is not None and cpu.cores_obtained == ()
    # five figures (put, get, miss and the large put and get), each over the two rounds
    assert len(seen) == 5 and all(len(values) == 2 for values in seen)
    assert cpu.put_s == seen[0][0] and cpu.get_s == seen[1][0] and cpu.miss_s == seen[2][0]
    assert s3_store.list("request-cpu-rounds/") == []
