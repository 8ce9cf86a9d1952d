"""Timing on each of the usable CPUs flatpack.cpus picks: the host profile and the calibration probes
share their runs among the CPUs a process may use, because each vCPU's speed moves on its
own, and give the process its CPUs back afterwards."""

from __future__ import annotations

import contextlib
import os
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import flatpack
from flatpack import cpus, measure, profiler
from flatpack.codegen.emit import emit_stages
from flatpack.partitioner.plan import Plan
from flatpack.runtime import calibrate_function
from flatpack.stage.artifact import build_module
from tests.unit.narrowing import graph_of

pinnable = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs os.sched_setaffinity (Linux)")


@given(repeats=st.integers(1, 40), count=st.integers(1, 8))
def test_runs_are_shared_evenly_and_every_cpu_gets_one(repeats, count):
    shares = cpus.runs_per_cpu(repeats, count)
    assert len(shares) == count and min(shares) >= 1
    assert sum(shares) == max(repeats, count)
    assert max(shares) - min(shares) <= 1


def test_a_bad_share_is_refused():
    with pytest.raises(ValueError, match="repeats >= 1"):
        cpus.runs_per_cpu(0, 2)


@pinnable
def test_each_measurement_runs_on_its_cpu_and_the_process_gets_its_cpus_back():
    before = os.sched_getaffinity(0)
    seen = cpus.on_each_cpu(lambda: os.sched_getaffinity(0), cpus.usable_cpus())
    assert seen == [{cpu} for cpu in cpus.usable_cpus()]
    assert os.sched_getaffinity(0) == before


@pinnable
def test_the_cpus_come_back_when_the_measurement_raises():
    before = os.sched_getaffinity(0)
    with pytest.raises(RuntimeError):
        with cpus.pinned(min(before)):
            raise RuntimeError("a failed probe")
    assert os.sched_getaffinity(0) == before


def test_none_leaves_the_process_where_it_is():
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    assert cpus.on_each_cpu(lambda: 7, cpus=(None,)) == [7]
    if before is not None:
        assert os.sched_getaffinity(0) == before


def test_the_profile_schedule_warms_each_cpu_then_times_its_share():
    assert measure.run_schedule((0, 1), warmup=1, repeats=5) == [
        (0, False), (0, True), (0, True), (0, True), (1, False), (1, True), (1, True)]
    assert measure.run_schedule((None,), warmup=2, repeats=3) == [(None, False)] * 2 + [(None, True)] * 3
    assert measure.run_schedule((0, 1), warmup=0, repeats=2) == [(0, True), (1, True)]


@contextlib.contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def test_a_one_thread_cpu_profile_is_shared_among_the_cpus_and_a_threaded_one_is_not(monkeypatch):
    monkeypatch.setattr(cpus, "usable_cpus", lambda: (0, 1))
    with torch_threads(1):
        assert profiler.measurement_cpus(torch.device("cpu")) == (0, 1)
    with torch_threads(2):
        assert profiler.measurement_cpus(torch.device("cpu")) == (None,)


def test_a_layer_s_figure_is_the_mean_of_its_per_cpu_medians(monkeypatch):
    """Each run through the chain is pinned to its CPU; a fake clock makes CPU 1 twice as
    slow as CPU 0, and the layer's figure is halfway."""
    current: list[int | None] = [None]
    entered: list[int | None] = []

    @contextlib.contextmanager
    def pinned(cpu):
        current[0] = cpu
        entered.append(cpu)
        yield
        current[0] = None

    ticks = [0.0]

    def clock() -> float:
        return ticks[0]

    def execute(compute):
        assert current[0] in (0, 1), "a timed computation ran unpinned"
        ticks[0] += 1.0 if current[0] == 0 else 2.0
        return compute()

    monkeypatch.setattr(measure, "pinned", pinned)
    layer = torch.nn.Linear(4, 4)
    compiled = _one_layer_chain(layer)
    training, served = measure.time_chain(compiled.modules, compiled.env, compiled.grad_values, repeats=4,
                                          warmup=1, execute=execute, clock=clock, cpus=(0, 1))
    assert training == [(1.5, 1.5)] and served == [1.5]
    # each CPU's pin is held over all its runs (given back between them, the thread could move
    # and return to cold caches before a timed run), and given back at the end
    assert entered == [0, 1] and current[0] is None


class _Chain:
    def __init__(self, modules, env, grad_values):
        self.modules, self.env, self.grad_values = modules, env, grad_values


def _one_layer_chain(layer: torch.nn.Module) -> _Chain:
    """A one-layer chain as the profiler builds it (a stage module per layer)."""
    graph = graph_of(flatpack.compile(torch.nn.Sequential(layer), (torch.zeros(2, 4),), stages=1))
    artifact = emit_stages(graph, Plan.from_ranges([(0, len(graph.layers) - 1)], len(graph.layers)))[0]
    module = build_module(artifact, "<test chain>")
    names = [node.name for node in graph.gm.graph.nodes if node.op == "placeholder"]
    env = profiler._reference_values([module], names, [torch.zeros(2, 4)])
    return _Chain([module], env, graph.analysis.param_dependent)


@pinnable
def test_the_calibration_probes_time_each_cpu_at_one_thread_and_pin_nothing_at_more(monkeypatch):
    """time_op_classes and time_optimizer_steps run their rounds on each CPU usable_cpus picks
    at one thread, each CPU's median entering the mean; at two threads they pin nothing, as
    the host profile does not: torch's pool threads started under a pin would keep its CPU."""
    visited = []
    real = calibrate_function.on_each_cpu

    def spy(measure, where):
        visited.append(tuple(where))
        return real(measure, where)

    monkeypatch.setattr(calibrate_function, "on_each_cpu", spy)
    with torch_threads(1):
        seconds = calibrate_function.time_op_classes(2, time.thread_time)
        calibrate_function.time_optimizer_steps(1 << 10, 2, time.thread_time)
    assert visited == [cpus.usable_cpus()] * 4      # the op classes, then three optimizers
    assert set(seconds) == {"conv", "matmul", "elementwise"} and min(seconds.values()) > 0
    visited.clear()
    with torch_threads(2):
        calibrate_function.time_op_classes(2, time.thread_time)
    assert visited == [(None,)]


def test_a_large_host_measures_two_cpus_spread_over_its_set(monkeypatch):
    """Each measured CPU after the first costs a warm-up run: a 64-CPU host times 2, the
    first and the middle one, not 64."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: None, raising=False)
    assert cpus.usable_cpus() == (0, 32)
    assert cpus.usable_cpus(limit=4) == (0, 16, 32, 48)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert cpus.usable_cpus() == (3,)


@pinnable
def test_a_cpu_that_cannot_be_pinned_is_measured_where_the_thread_runs(caplog):
    """A CPU outside the process's set (taken offline, a changed cpuset): the measurement
    still happens, unpinned, and says why."""
    before = os.sched_getaffinity(0)
    missing = max(before) + 4096
    with caplog.at_level("INFO", logger="flatpack.cpus"):
        assert cpus.on_each_cpu(lambda: os.sched_getaffinity(0), cpus=(missing,)) == [before]
    assert os.sched_getaffinity(0) == before
    assert f"could not pin the measurement to CPU {missing}" in caplog.text


@pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(os, "wait4"), reason="forks its probes")
def test_busy_processes_get_some_cores_and_never_more_than_the_host_has():
    # issue 44: the cores a run's processes get beside other work (RequestCpu.cores_obtained)
    cores = cpus.cores_obtained(2, 0.2)
    assert cores is not None and 0 < cores <= (os.cpu_count() or 1) + 0.05
    with pytest.raises(ValueError):
        cpus.cores_obtained(0, 0.2)
