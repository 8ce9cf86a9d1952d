"""Issue 19, tenth pass: the host bound. On the local backend the workers, the invoker and the
S3 server share the host's cores, and an iteration takes at least the CPU it asks of them over
those cores (analysis.host_load); the demo's 2 x 2 plan ran at that bound, 98 % of both cores
busy, 64 ms past its critical path."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest

from flatpack.analysis import host_load as host_load_module
from flatpack.analysis import report
from flatpack.analysis.host_load import INVOKER_POLL_S, host_load
from flatpack.cpus import HostCpuSampler
from flatpack.errors import InputError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.common import layer_times
from flatpack.platform.calibration import Calibration
from flatpack.platform.catalog import RequestCpu
from flatpack.runtime.store import FileStore, StoreKeyError, wait_misses
from flatpack.runtime.timeline import Event
from tests.unit.test_cost_models import TWO_STAGES, plan, platform, problem
from tests.unit.test_target_calibration import target_calibration

ONE_STAGE = plan((0, 2, 1024, 1))


def shared_host(request_cpu: RequestCpu | None, cores: int = 2):
    """The cost-model tests' chain on a platform whose workers share ``cores`` cores."""
    return problem(target=dataclasses.replace(platform(), kind="local", host_cores=cores, request_cpu=request_cpu))


@pytest.mark.parametrize("request_s", [0.0, 0.003])
def test_a_wait_makes_as_many_missing_gets_as_wait_misses_counts(tmp_path, request_s):
    # the formula the host bound counts polls by, against Store.wait itself in simulated time:
    # each get takes request_s, then the wait sleeps its back-off
    for appears_after in (0.0, 0.0005, 0.001, 0.0015, 0.006, 0.0071, 0.05, 0.2):
        clock = [0.0]
        misses = [0]

        class Appearing(FileStore):
            def get(self, key: str) -> bytes:
                clock[0] += request_s
                if clock[0] >= appears_after:
                    return b"x"
                misses[0] += 1
                raise StoreKeyError(key)

        store = Appearing(tmp_path)
        store._clock = lambda: clock[0]
        store._sleep = lambda seconds: clock.__setitem__(0, clock[0] + seconds)
        assert store.wait("k", 10.0) == b"x"
        assert misses[0] == wait_misses(appears_after, request_s), appears_after


def test_no_host_bound_where_the_cores_are_not_shared_or_the_request_cpu_was_not_measured():
    cost = funcpipe.predicted(problem(), ONE_STAGE)
    events = report.predicted_schedule(problem(), ONE_STAGE)
    assert host_load(problem(), ONE_STAGE, cost, events) is None          # a cloud function's CPU is its own
    assert host_load(shared_host(None), ONE_STAGE, cost, events) is None  # not calibrated: nothing to bound by
    assert report.predicted_iteration(problem(), ONE_STAGE).host_bound_s is None


def test_the_host_bound_is_the_iteration_s_cpu_over_the_cores_counted_request_by_request():
    # one stage, one replica, µ = 4: every request at 10 ms of CPU, no polls, 1-vCPU tiers
    each = 0.01
    shared = shared_host(RequestCpu(put_s=each, get_s=each, miss_s=0.0))
    cost = funcpipe.predicted(shared, ONE_STAGE)
    load = host_load(shared, ONE_STAGE, cost, report.predicted_schedule(shared, ONE_STAGE))
    assert load is not None
    forward, backward = layer_times(shared, 0, 2, shared.platform.tier(1024), shared.workload.micro_batch_size)
    assert load.compute_s == pytest.approx(4 * (forward + backward))
    # the worker: 4 inputs and 4 targets, its report and timeline; the invoker: 4 data and 4
    # target puts, the last stage's report
    assert load.requests == 4 + 4 + 2 + 4 + 4 + 1
    assert load.request_s == pytest.approx(load.requests * each)
    # and a progress list every INVOKER_POLL_S (no replicas: no markers' list) of the iteration
    iteration_s = max(cost.iteration_s, load.bound_s)
    assert load.lists == pytest.approx(iteration_s / INVOKER_POLL_S)
    assert load.list_s == pytest.approx(load.lists * each)
    assert load.bound_s == pytest.approx((load.compute_s + load.request_s + load.list_s) / 2)
    predicted = report.predicted_iteration(shared, ONE_STAGE)
    assert predicted.host_bound_s == pytest.approx(load.bound_s)
    assert predicted.iteration_s == pytest.approx(max(cost.iteration_s, load.bound_s))
    # dollars follow the time the run is predicted to take
    assert predicted.dollars_per_iteration == pytest.approx(
        cost.dollars_per_iteration * predicted.iteration_s / cost.iteration_s)


def test_where_the_bound_passes_the_critical_path_the_invoker_s_lists_follow_it():
    # puts that cost seconds of CPU: the bound is far past the critical path, and the lists,
    # one every INVOKER_POLL_S of the iteration, are counted at the bound's own length
    cpu = RequestCpu(put_s=50.0, get_s=0.01, miss_s=0.0)
    shared = shared_host(cpu)
    cost = funcpipe.predicted(shared, ONE_STAGE)
    load = host_load(shared, ONE_STAGE, cost, report.predicted_schedule(shared, ONE_STAGE))
    assert load is not None and load.bound_s > cost.iteration_s
    assert load.lists == pytest.approx(load.bound_s / INVOKER_POLL_S)
    assert load.list_s == pytest.approx(load.lists * cpu.get_s)


def test_the_prediction_is_the_longer_of_the_critical_path_and_the_host_bound():
    critical_path = funcpipe.predicted(shared_host(None), TWO_STAGES).iteration_s
    cheap = report.predicted_iteration(shared_host(RequestCpu(put_s=1e-4, get_s=1e-4, miss_s=1e-4)), TWO_STAGES)
    assert cheap.host_bound_s is not None and cheap.host_bound_s < critical_path
    assert cheap.iteration_s == pytest.approx(critical_path)
    # puts that cost seconds of CPU each: the host, not the critical path, sets the pace
    costly = report.predicted_iteration(shared_host(RequestCpu(put_s=5.0, get_s=1e-4, miss_s=1e-4)), TWO_STAGES)
    assert costly.host_bound_s is not None and costly.host_bound_s > critical_path
    assert costly.iteration_s == pytest.approx(costly.host_bound_s)


def test_a_download_s_polls_follow_its_lane_s_idle_time_each_get_taking_a_request_s_time():
    # 64 cores: κ = 1, a request takes t_lat = 10 ms
    shared = shared_host(RequestCpu(put_s=0.0, get_s=0.0, miss_s=0.001), cores=64)
    cost = funcpipe.predicted(shared, TWO_STAGES)
    assert cost.overheads is not None
    request_s = shared.platform.storage_latency_s * cost.overheads.contention
    assert request_s == pytest.approx(0.010)
    # one lane: idle 50 ms, then back to back, then idle 50 ms again; another idles 0
    events = [Event(1, 0, 0, "download", 0.050, 0.052, micro_batch=0, lane="download"),
              Event(1, 0, 0, "download", 0.052, 0.060, micro_batch=1, lane="download"),
              Event(1, 0, 0, "download", 0.110, 0.111, micro_batch=2, lane="download"),
              Event(0, 0, 0, "download", 0.0, 0.5, micro_batch=0, lane="download")]
    load = host_load(shared, TWO_STAGES, cost, events)
    assert load is not None
    assert wait_misses(0.050, request_s) == 4 and wait_misses(0.0, request_s) == 0
    assert load.misses == 2 * 4
    assert load.miss_s == pytest.approx(load.misses * 0.001)
    # a host whose polls cost far more CPU: the bound passes the critical path, and the count
    # of misses holds (the waits, the gets and the sleeps between them all stretch alike)
    slow = host_load(shared_host(RequestCpu(put_s=0.0, get_s=0.0, miss_s=10_000.0), cores=64), TWO_STAGES,
                     cost, events)
    assert slow is not None and slow.bound_s > cost.iteration_s
    assert slow.misses == load.misses


def test_a_synchronization_s_gets_poll_for_their_peers_uploads_and_for_a_late_peer():
    # one stage of two replicas on 64 cores (κ = 1): each replica's sync makes 2(d − 1) = 2
    # gets (the peer's chunk, then its reduced chunk), each polling for the peer's upload of a
    # chunk; a replica that starts 30 ms before its peer also polls for those
    shared = shared_host(RequestCpu(put_s=0.0, get_s=0.0, miss_s=0.001), cores=64)
    replicated = plan((0, 2, 1024, 2))
    cost = funcpipe.predicted(shared, replicated)
    assert cost.overheads is not None
    # an upload's measured term o_u (serialization, the request beyond t_lat): 4 ms
    cost = dataclasses.replace(cost, overheads=dataclasses.replace(cost.overheads, upload_task_s=(0.004,)))
    stage = cost.stages[0]
    request_s = shared.platform.storage_latency_s
    chunk_upload_s = request_s + stage.sync_bytes / 2 / stage.bandwidth_bytes_s + 0.004
    events = [Event(0, 0, 0, "sync", 0.0, stage.sync_s, lane="compute"),
              Event(0, 1, 0, "sync", 0.030, 0.030 + stage.sync_s, lane="compute")]
    load = host_load(shared, replicated, cost, events)
    assert load is not None
    early, late = wait_misses(0.030 + chunk_upload_s, request_s), wait_misses(chunk_upload_s, request_s)
    assert early > late > 0
    assert load.misses == early + 3 * late
    assert load.miss_s == pytest.approx(load.misses * 0.001)
    # the simulated schedule's own syncs are counted: the bound counts more polls with them
    simulated = host_load(shared, replicated, cost, report.predicted_schedule(shared, replicated))
    assert simulated is not None and simulated.misses >= 4 * late
    # one replica does not synchronize: no sync's polls
    alone = plan((0, 2, 1024, 1))
    single = host_load(shared, alone, funcpipe.predicted(shared, alone), events)
    assert single is not None and single.misses == 0


def test_the_request_cpu_round_trips_through_the_calibration_file_and_reaches_the_platform():
    cpu = RequestCpu(put_s=0.004, get_s=0.0025, miss_s=0.0018, put_s_per_byte=1e-8, get_s_per_byte=2e-9)
    calibration = dataclasses.replace(target_calibration(), request_cpu=cpu)
    again = Calibration.from_json(calibration.to_json())
    assert again.request_cpu == cpu
    assert again.digest == calibration.digest
    applied = again.apply(platform_for(again))
    assert applied.request_cpu == cpu
    assert "measured" in applied.sources["request_cpu"]
    assert "request_cpu" not in applied.missing_sources()
    assert cpu.put(1000) == pytest.approx(0.004 + 1e-5)


def platform_for(calibration: Calibration):
    return platform()       # the cost-model tests' platform, named "test" as the calibration is


@pytest.mark.parametrize("bad, named", [
    ({"put": 0.004, "get": 0.002}, "miss"),
    ({"put": -1.0, "get": 0.002, "miss": 0.001}, "non-negative"),
    ({"put": 0.004, "get": "fast", "miss": 0.001}, "get"),
    ({"put": 0.004, "get": 0.002, "miss": 0.001, "post": 0.1}, "post"),
])
def test_a_calibration_file_s_bad_request_cpu_is_refused_naming_the_entry(bad, named):
    document = target_calibration().to_json()
    document["request_cpu_s"] = bad
    with pytest.raises(InputError, match=named):
        Calibration.from_json(document)


def test_the_invoker_s_poll_period_is_the_one_the_bound_counts():
    from flatpack.backends import functions

    assert functions.POLL_S == host_load_module.INVOKER_POLL_S


def test_the_host_cpu_sampler_reads_busy_seconds_over_a_window_from_its_samples():
    sampler = HostCpuSampler()
    # (time, busy CPU seconds so far): 1.5 busy seconds a second between t = 10 and t = 12
    sampler.samples = [(9.0, 0.0), (10.0, 1.0), (11.0, 2.5), (12.0, 4.0), (13.0, 4.0)]
    assert sampler.busy_s(10.0, 12.0) == pytest.approx(3.0)
    assert sampler.busy_s(10.0, 11.5) == pytest.approx(1.5 * 1.5)
    assert sampler.busy_s(10.2, 10.8) is None      # no two samples inside: nothing measured


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no procfs: the sampler samples nothing")
def test_the_host_cpu_sampler_sees_this_process_spin():
    with HostCpuSampler(period_s=0.01) as sampler:
        started = time.time()
        spun = time.process_time()
        while time.process_time() - spun < 0.3:
            pass
        ended = time.time()
    busy = sampler.busy_s(started, ended)
    assert busy is not None and busy >= 0.15     # at least most of the spin, whatever else ran


def test_the_load_s_terms_add_up_to_its_cpu():
    shared = shared_host(RequestCpu(put_s=0.002, get_s=0.002, miss_s=0.001))
    load = report.predicted_host_load(shared, TWO_STAGES)
    assert load is not None
    assert sum(load.terms().values()) == pytest.approx(load.cpu_s)
    assert report.predicted_host_load(problem(), TWO_STAGES) is None


def test_a_shared_host_s_share_is_recorded_but_the_bound_divides_by_its_cores():
    # issue 44: a share read by calibrate minutes before a run did not predict the run's
    each = RequestCpu(put_s=0.01, get_s=0.01, miss_s=0.0)
    busy = dataclasses.replace(each, cores_obtained=((3, 0.3), (6, 0.5)))
    quiet_load = report.predicted_host_load(shared_host(each), ONE_STAGE)
    busy_load = report.predicted_host_load(shared_host(busy), ONE_STAGE)
    assert quiet_load is not None and busy_load is not None
    assert busy_load.cores == quiet_load.cores == 2
    assert busy_load.bound_s == pytest.approx(quiet_load.bound_s)


def test_the_cores_obtained_round_trip_through_the_calibration_file_and_bad_ones_are_refused():
    cpu = RequestCpu(put_s=0.001, get_s=0.002, miss_s=0.003, cores_obtained=((3, 1.9), (6, 1.8)))
    assert RequestCpu.from_json(cpu.to_json()) == cpu
    assert "cores_obtained" not in RequestCpu(put_s=0.0, get_s=0.0, miss_s=0.0).to_json()
    for bad in ({"x": 1.0}, {"3": -1.0}, {"3": True}, [1, 2]):
        with pytest.raises(InputError, match="cores_obtained"):
            RequestCpu.from_json({**cpu.to_json(), "cores_obtained": bad})
    with pytest.raises(InputError, match="cores_obtained"):
        RequestCpu(put_s=0.0, get_s=0.0, miss_s=0.0, cores_obtained=((6, 1.0), (3, 1.0)))
