"""Issue 19, items 2, 3 and 5: the measured terms added to FuncPipe's model, re-planning from
a run's timeline, and plan provenance. Small cases computed by hand on the cost-model tests'
three-layer chain (tests/unit/test_cost_models.py)."""

from __future__ import annotations

import dataclasses
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import flatpack
from flatpack.analysis import report
from flatpack.analysis.refit import fitted_problem, refit, replan
from flatpack.compiler import load_run
from flatpack.errors import InputError, PlanError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.collectives import scatter_reduce_seconds
from flatpack.partitioner.cost.funcpipe import Overheads, host_contention
from flatpack.partitioner.plan import Plan, PlanReuseWarning, Provenance
from flatpack.partitioner.workload import Workload
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.store import FileStore
from flatpack.runtime.timeline import Event
from flatpack.runtime.training import StageTrainer
from tests.unit.test_cost_models import LATENCY, MIB, TWO_STAGES, plan, platform, problem
from tests.unit.test_target_calibration import target_calibration

ONE_STAGE = plan((0, 2, 1024, 1))


# --- item 2: the measured terms -------------------------------------------------------------


def test_no_overheads_is_the_papers_model():
    paper = funcpipe.iteration(problem(), TWO_STAGES)
    assert dataclasses.replace(funcpipe.iteration(problem(), TWO_STAGES, Overheads()), overheads=None) == paper
    # a platform that states no polling, no host, and no calibration, and a model that returns
    # its own loss (no target key): only the marker's request (d = 2)
    assert funcpipe.predicted(problem(), TWO_STAGES, reads_target=False).iteration_s == \
        pytest.approx(paper.iteration_s + LATENCY)
    assert funcpipe.predicted(problem(), ONE_STAGE, reads_target=False).iteration_s == \
        pytest.approx(funcpipe.iteration(problem(), ONE_STAGE).iteration_s)


def test_the_last_stage_reads_its_target_as_one_more_request():
    # the runtime's last stage downloads a micro-batch's activations, then its target: a key of
    # its own (training.StageTrainer._fetch_inputs), one request more on the last boundary's t_fd
    without = funcpipe.predicted(problem(), TWO_STAGES, reads_target=False)
    with_target = funcpipe.predicted(problem(), TWO_STAGES)
    assert with_target.boundaries[-1].forward_download_s == \
        pytest.approx(without.boundaries[-1].forward_download_s + LATENCY)
    assert with_target.boundaries[-1].backward_download_s == without.boundaries[-1].backward_download_s
    assert with_target.first_forward_s == pytest.approx(without.first_forward_s + LATENCY)
    # with one stage the first stage is the last: its prefetch reads the data and the target
    one = Overheads.of(problem(), ONE_STAGE)
    assert one.target_s == pytest.approx(LATENCY)
    assert Overheads.of(problem(), ONE_STAGE, reads_target=False).target_s == 0.0


def test_each_term_enters_where_it_is_spent():
    base = funcpipe.iteration(problem(), TWO_STAGES)
    polled = funcpipe.iteration(problem(), TWO_STAGES, Overheads(poll_s=0.5))
    assert polled.boundaries[0].forward_download_s == pytest.approx(base.boundaries[0].forward_download_s + 0.5)
    assert polled.boundaries[0].backward_download_s == pytest.approx(base.boundaries[0].backward_download_s + 0.5)
    assert polled.boundaries[0].forward_upload_s == base.boundaries[0].forward_upload_s
    # one stage, d = 1: the optimizer step adds to t_iter exactly
    single = funcpipe.iteration(problem(), ONE_STAGE)
    stepped = funcpipe.iteration(problem(), ONE_STAGE, Overheads(optimizer_s=(0.25,)))
    assert stepped.iteration_s == pytest.approx(single.iteration_s + 0.25)
    # the marker precedes the sync's uploads when d > 1
    marked = funcpipe.iteration(problem(), TWO_STAGES, Overheads(marker_s=0.125))
    assert [s.sync_s for s in marked.stages] == pytest.approx([s.sync_s + 0.125 for s in base.stages])
    # the first stage's input downloads run on its prefetch lane, an iteration ahead: µ of them
    # bound the iteration from below and set the pace only when they take longer than the rest
    slow_input = funcpipe.iteration(problem(), TWO_STAGES, Overheads(input_s=100.0))
    assert slow_input.forward_lag_s == base.forward_lag_s and slow_input.first_forward_s == base.first_forward_s
    assert slow_input.iteration_s == pytest.approx(base.micro_batches_per_replica * 100.0)
    fast_input = funcpipe.iteration(problem(), TWO_STAGES, Overheads(input_s=1e-6))
    assert fast_input.iteration_s == pytest.approx(base.iteration_s)


def test_an_idle_link_s_burst_shortens_the_first_pass_s_transfers_and_each_of_the_sync_s_four():
    base = funcpipe.iteration(problem(), TWO_STAGES)
    boundary = base.boundaries[0]
    moved = [boundary.forward_upload_s - LATENCY, boundary.forward_download_s - LATENCY]   # o/W on each side
    burst = (moved[0] / 2, moved[1] / 3)
    bursting = funcpipe.iteration(problem(), TWO_STAGES, Overheads(burst_s=burst))
    # a transfer's own figure, and so the lags it may set, keep the full o/W: the transfer that
    # sets a lag keeps its link busy and banks no burst
    assert bursting.boundaries == base.boundaries
    assert bursting.forward_lag_s == base.forward_lag_s
    assert [s.backward_lag_s for s in bursting.stages] == [s.backward_lag_s for s in base.stages]
    # the first micro-batch's upload and download start on links idle since the last
    # iteration, each shortened on the link of the stage that makes it
    assert bursting.first_forward_s == pytest.approx(base.first_forward_s - burst[0] - burst[1])
    assert bursting.stages[0].backward_done_s == pytest.approx(base.stages[0].backward_done_s - burst[0] - burst[1])
    assert bursting.stages[1].backward_done_s == pytest.approx(base.stages[1].backward_done_s)   # no boundary above
    # d = 2: a replica's scatter-reduce starts four transfers on an idle link, each shortened
    for stage, before, after in zip(TWO_STAGES.stages, base.stages, bursting.stages):
        sync_moved = scatter_reduce_seconds(before.sync_bytes, stage.replicas, before.bandwidth_bytes_s, 0.0)
        saving = 4 * min(burst[before.index], sync_moved / 4)
        assert saving > 0 and after.sync_s == pytest.approx(before.sync_s - saving)
    # a burst longer than every transfer takes off each its o/W, never more
    whole = funcpipe.iteration(problem(), TWO_STAGES, Overheads(burst_s=(1e3, 1e3)))
    assert whole.first_forward_s == pytest.approx(base.first_forward_s - moved[0] - moved[1])
    assert bursting.iteration_s < base.iteration_s


def test_the_predicted_schedule_gives_a_transfer_the_burst_its_lane_s_idle_time_banked():
    """1F1B's simulation: a transfer takes at most b less than its full o/W, only as much as
    its lane idled before it, and the span shrinks."""
    cost = funcpipe.predicted(problem(), TWO_STAGES)
    burst = 1e-3
    assert cost.overheads is not None
    bursting = dataclasses.replace(cost, overheads=dataclasses.replace(cost.overheads, burst_s=(burst, burst)))
    plain_events = report._simulate(problem(), cost, "1f1b")
    events = report._simulate(problem(), bursting, "1f1b")
    plain_by_task = {(e.stage, e.replica, e.kind, e.lane, e.micro_batch): e for e in plain_events}
    shortened = 0
    lane_end: dict[tuple, float] = {}
    for event in sorted(events, key=lambda e: e.start):
        if event.lane == "compute":
            continue
        lane = (event.stage, event.replica, event.lane)
        idle = event.start - lane_end.get(lane, float("-inf"))
        lane_end[lane] = event.end
        saved = plain_by_task[(event.stage, event.replica, event.kind, event.lane, event.micro_batch)].seconds \
            - event.seconds
        assert -1e-12 <= saved <= min(burst, idle) + 1e-12
        shortened += saved > 1e-12
    assert shortened > 0
    assert max(e.end for e in events) < max(e.end for e in plain_events)


def test_contention_stretches_requests_and_only_compute_that_outgrows_its_share():
    base = funcpipe.iteration(problem(), TWO_STAGES)
    crowded = funcpipe.iteration(problem(), TWO_STAGES, Overheads(contention=2.0))
    # every test tier has one vCPU: κ·v = 2 > 1, so compute stretches by 2, and latency by 2
    assert crowded.stages[0].forward_s == pytest.approx(2 * base.stages[0].forward_s)
    bytes_ = base.boundaries[0].bytes
    assert crowded.boundaries[0].forward_upload_s == pytest.approx(bytes_ / (100 * MIB) + 2 * LATENCY)
    small = platform(tiers=((512, 50), (1024, 100), (2048, 50)))
    small = dataclasses.replace(small, tiers=tuple(dataclasses.replace(t, vcpus=0.25) for t in small.tiers))
    shared = dataclasses.replace(problem(), platform=small)
    # a quarter vCPU is already throttled to 1/4: κ = 2 leaves its compute alone
    assert funcpipe.iteration(shared, TWO_STAGES, Overheads(contention=2.0)).stages[0].forward_s == \
        pytest.approx(funcpipe.iteration(shared, TWO_STAGES).stages[0].forward_s)


def test_host_contention_counts_the_workers_and_the_store_on_the_local_host():
    local = dataclasses.replace(platform(), kind="local", host_cores=2)
    assert host_contention(dataclasses.replace(problem(), platform=local),
                           TWO_STAGES) == pytest.approx((4 * 1.0 + 1) / 2)
    assert host_contention(dataclasses.replace(problem(), platform=local), ONE_STAGE) == 1.0   # (1 + 1) / 2
    assert host_contention(problem(), TWO_STAGES) == 1.0   # a cloud function's CPU is its own


def test_the_optimizer_term_comes_from_the_calibration():
    measured = dataclasses.replace(problem(workload=Workload("train", batch=8, micro_batches=4, optimizer="adam")),
                                   calibration=target_calibration(platform="test",
                                                                  tiers={1024: target_calibration().tiers[512]}))
    overheads = Overheads.of(measured, ONE_STAGE)
    assert overheads.optimizer_s == pytest.approx((4e-9 * 350 * MIB,))   # adam s/byte × the stage's gradients
    assert overheads.burst_s == (0.008,)       # the tier's link's burst
    assert Overheads.of(problem(), ONE_STAGE).burst_s == (0.0,)     # no calibration: none


# --- item 3: re-planning from a run -----------------------------------------------------------


def _events(case, plan_, forward_factor, backward_factor, upload_overhead):
    """A synthetic timeline of 3 iterations: each stage's compute at the given multiple of the
    prediction, each activation upload bytes/W + ``upload_overhead``."""
    cost = funcpipe.predicted(case, plan_)
    events = []
    for iteration in range(3):
        clock = iteration * 100.0
        for s, stage in enumerate(cost.stages):
            for m in range(cost.micro_batches_per_replica):
                for kind, seconds in (("forward", stage.forward_s * forward_factor),
                                      ("backward", stage.backward_s * backward_factor)):
                    events.append(Event(s, 0, iteration, kind, clock, clock + seconds, micro_batch=m, lane="compute"))
                    clock += seconds
                if s < len(cost.boundaries):
                    boundary = cost.boundaries[s]
                    seconds = boundary.bytes / stage.bandwidth_bytes_s + upload_overhead
                    events.append(Event(s, 0, iteration, "upload", clock, clock + seconds, micro_batch=m,
                                        nbytes=int(boundary.bytes), lane="upload"))
    return events


def test_refit_of_a_later_epoch_leaves_out_its_first_iterations_by_position():
    """An epoch of an elastic or re-planned run starts at its own iteration number, and its
    first iterations are cold starts: the latency is fitted to the kept ones only."""
    case, ran = problem(), plan((0, 1, 1024, 1), (2, 2, 1024, 1))
    warm = _events(case, ran, 1.0, 1.0, 0.03)
    cold = _events(case, ran, 1.0, 1.0, 0.5)
    # iterations 10 and 11 slow (cold starts), 12 warm: the epoch after iteration 9
    epoch = [dataclasses.replace(event, iteration=event.iteration + 10)
             for event in [e for e in cold if e.iteration < 2] + [e for e in warm if e.iteration == 2]]
    assert refit(case, ran, epoch).storage_latency_s == pytest.approx(0.03)
    assert fitted_problem(case, refit(case, ran, epoch)).platform.storage_latency_s == pytest.approx(0.03)


def test_refit_reproduces_the_measured_stage_times_and_latency():
    case, ran = problem(), plan((0, 1, 1024, 1), (2, 2, 1024, 1))
    fitted_calibration = refit(case, ran, _events(case, ran, 2.0, 0.5, 0.03))
    fitted = dataclasses.replace(case, calibration=fitted_calibration, platform=fitted_calibration.apply(case.platform))
    before, after = funcpipe.predicted(case, ran), funcpipe.predicted(fitted, ran)
    for old, new in zip(before.stages, after.stages):
        assert new.forward_s == pytest.approx(2.0 * old.forward_s)
        assert new.backward_s == pytest.approx(0.5 * old.backward_s)
    assert fitted.platform.storage_latency_s == pytest.approx(0.03)
    assert fitted_calibration.tiers_mb == (1024,)


def test_refit_keeps_the_task_terms_and_a_one_stage_runs_latency_and_counts_each_term_once():
    # the probe pipelines measured the task terms by worker count; a run measures only its own
    # plan, so the re-fit keeps them for the plans the solver compares, and the stage times it
    # fits leave them out (else a re-predicted run would count them twice)
    terms = {1: {"forward": 0.002, "backward": 0.001, "step": 0.003, "iteration": 0.004},
             2: {"forward": 0.003, "backward": 0.002, "upload": 0.005, "download": 0.001, "step": 0.004}}
    tier = dataclasses.replace(target_calibration().tiers[512], task_overhead_s=terms)
    case = dataclasses.replace(problem(workload=Workload("train", batch=8, micro_batches=4, optimizer="adam")),
                               calibration=target_calibration(tiers={1024: tier}))
    ran = plan((0, 2, 1024, 1))
    before = funcpipe.predicted(case, ran)
    assert before.overheads is not None
    events = _events(case, ran, 1.0, 1.0, 0.0)
    for iteration in range(3):       # each update as predicted: the optimizer step and its task term
        events.append(Event(0, 0, iteration, "update", iteration * 100.0 + 50, iteration * 100.0 + 50
                            + before.overheads.step(0), lane="compute"))
    fitted_calibration = refit(case, ran, events)
    assert fitted_calibration.tiers[1024].task_overhead_s == terms
    assert fitted_calibration.storage_latency_s == pytest.approx(case.platform.storage_latency_s)
    fitted = dataclasses.replace(case, calibration=fitted_calibration, platform=fitted_calibration.apply(case.platform))
    after = funcpipe.predicted(fitted, ran)
    assert after.overheads is not None
    assert after.stages[0].forward_s == pytest.approx(before.stages[0].forward_s)
    assert after.stages[0].backward_s == pytest.approx(before.stages[0].backward_s)
    assert after.overheads.step(0) == pytest.approx(before.overheads.step(0))
    # a two-stage plan on the re-fit is priced with the 2-worker terms the probe measured
    two = funcpipe.predicted(fitted, plan((0, 1, 1024, 1), (2, 2, 1024, 1)))
    assert two.overheads is not None and two.overheads.task("upload", 0) == pytest.approx(0.005)


def test_replan_never_predicts_worse_than_the_plan_that_ran():
    case = problem(memory_mb=(1024,), replicas=(1, 2))
    ran = plan((0, 0, 1024, 1), (1, 2, 1024, 1))
    found = replan(case, ran, _events(case, ran, 1.0, 1.0, 0.0), solver="dp")
    assert found.new_predicted_s <= found.old_predicted_s and found.saving_s >= 0
    assert "old plan: layers 0-0" in found.describe()
    assert all(stage.memory_mb == 1024 for stage in found.new.stages)   # only the tier the run measured


def test_replan_keeps_the_plan_when_the_saving_is_within_the_models_error_on_the_run():
    from flatpack.runtime.timeline import summarize

    case = problem(memory_mb=(1024,), replicas=(1, 2))
    ran = plan((0, 1, 1024, 1), (2, 2, 1024, 1))
    # compute measured 5× the prediction: the model, before the re-fit, is 42 % off this run
    events = _events(case, ran, 5.0, 5.0, 0.0)
    found = replan(case, ran, events, solver="dp")
    measured = summarize(events, skip_first=2).iteration_s
    assert measured is not None
    assert found.model_error == pytest.approx(abs(funcpipe.predicted(case, ran).iteration_s / measured - 1))
    assert found.within_error is not None
    other, seconds = found.within_error
    saving = (found.old_predicted_s - seconds) / found.old_predicted_s
    assert other != ran and 0 < saving <= found.model_error
    assert found.new == ran and found.saving_s == 0.0
    assert "not distinguishable from that error: keep the run's plan" in found.describe()
    # measured as predicted (error 32 % here, the synthetic timeline's gaps): a larger saving switches
    switched = replan(case, ran, _events(case, ran, 1.0, 1.0, 0.0), solver="dp")
    assert switched.new != ran and switched.within_error is None
    assert switched.saving_s / switched.old_predicted_s > switched.model_error


def test_from_run_refuses_a_directory_that_is_not_a_finished_run(tmp_path):
    with pytest.raises(InputError, match="not a finished flatpack run: it has no events.json"):
        load_run(tmp_path)
    from flatpack import cli
    assert cli.main(["plan", "--from-run", str(tmp_path)]) == 2
    assert cli.main(["plan"]) == 2


# --- item 5: provenance ---------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_a_compiled_plan_records_what_it_was_made_for_and_round_trips():
    workload = Workload("train", batch=8, micro_batches=2)
    compiled = flatpack.compile(Small(), torch.zeros(2, 4), stages=2, workload=workload)
    provenance = compiled.plan.provenance
    assert provenance is not None, "a plan solved here records its provenance"
    assert provenance.target == "local" and provenance.calibration_digest is None
    assert provenance.workload == {"mode": "train", "batch": 8, "micro_batches": 2, "optimizer": "sgd-momentum",
                                   "sync": "pipelined"}
    assert provenance.flatpack_version == flatpack.__version__ and len(provenance.graph_hash) == 32
    assert Plan.loads(compiled.plan.dumps()).provenance == provenance
    # the same model, traced again, is the same graph: the plan is reused without a word
    with warnings.catch_warnings():
        warnings.simplefilter("error", PlanReuseWarning)
        again = flatpack.compile(Small(), torch.zeros(2, 4), plan=compiled.plan, workload=workload)
    assert again.plan == compiled.plan


def test_reusing_a_plan_for_anything_else_is_refused_or_forced():
    compiled = flatpack.compile(Small(), torch.zeros(2, 4), stages=2)
    with pytest.raises(PlanError, match="target: made for 'local', used for 'aws-lambda'.*--force"):
        flatpack.compile(Small(), torch.zeros(2, 4), plan=compiled.plan, target="aws-lambda")
    wider = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    other = flatpack.compile(wider, torch.zeros(2, 4), stages=2)
    with pytest.raises(PlanError, match="graph: made for"):
        flatpack.compile(Small(), torch.zeros(2, 4), plan=dataclasses.replace(compiled.plan,
                                                                              provenance=other.plan.provenance))
    with pytest.warns(PlanReuseWarning, match="target: made for 'local'"):
        flatpack.compile(Small(), torch.zeros(2, 4), plan=compiled.plan, target="aws-lambda", force=True)
    provenance = compiled.plan.provenance
    assert provenance is not None, "a plan solved here records its provenance"
    stale = dataclasses.replace(provenance, flatpack_version="0.0.1", calibration_digest="abc")
    assert [d.split(":")[0] for d in stale.differences(provenance)] == ["calibration", "flatpack version"]


def test_malformed_provenance_is_a_plan_error():
    data = flatpack.compile(Small(), torch.zeros(2, 4), stages=2).plan.to_json()
    with pytest.raises(PlanError, match="provenance"):
        Plan.from_json({**data, "provenance": {"target": 3}})
    assert Provenance.from_json(data["provenance"]).target == "local"


def test_compile_measured_refuses_what_it_cannot_refit(tmp_path):
    with pytest.raises(InputError, match="not a finished flatpack run"):
        flatpack.compile(Small(), torch.zeros(2, 4), measured=tmp_path)
    with pytest.raises(InputError, match="give one or the other"):
        flatpack.compile(Small(), torch.zeros(2, 4), measured=tmp_path, calibration=tmp_path / "c.json")


def test_the_predicted_schedule_gives_the_update_its_measured_step():
    from flatpack.analysis.report import predicted_schedule

    measured = dataclasses.replace(problem(workload=Workload("train", batch=8, micro_batches=4, optimizer="adam")),
                                   calibration=target_calibration(platform="test",
                                                                  tiers={1024: target_calibration().tiers[512]}))
    updates = [event for event in predicted_schedule(measured, ONE_STAGE) if event.kind == "update"]
    assert [event.seconds for event in updates] == pytest.approx([4e-9 * 350 * MIB])


def test_1f1b_is_predicted_by_simulating_the_order_the_runtime_issues():
    from flatpack.analysis.report import predicted_iteration, predicted_schedule
    from flatpack.schedules import get

    single = plan((0, 1, 1024, 1), (2, 2, 2048, 1))
    # the simulated first stage computes in the runtime's 1F1B order: one warm-up forward, then
    # alternating, then the remaining backwards
    compute = [(event.kind[0].upper(), event.micro_batch) for event in predicted_schedule(problem(), single,
                                                                                        schedule="1f1b")
               if event.stage == 0 and event.lane == "compute" and event.micro_batch is not None]
    assert compute == [(action.kind.value, action.micro_batch) for action in get("1f1b").actions(0, 2, [0, 1, 2, 3])]
    sync = predicted_iteration(problem(), single, schedule="sync")
    assert sync == funcpipe.predicted(problem(), single)
    # transfers far longer than the compute: each backward on the first stage waits for the
    # round trip through the second, and the forwards issued after it wait too, so 1F1B's
    # span exceeds FuncPipe's t_iter (the synchronous schedule's bubble)
    slow_link = dataclasses.replace(platform(), storage_latency_s=1.0)
    slow = dataclasses.replace(problem(), platform=slow_link)
    one_f_one_b = predicted_iteration(slow, single, schedule="1f1b")
    synchronous = predicted_iteration(slow, single, schedule="sync")
    assert one_f_one_b.iteration_s > synchronous.iteration_s
    assert one_f_one_b.dollars_per_iteration == pytest.approx(
        synchronous.dollars_per_iteration * one_f_one_b.iteration_s / synchronous.iteration_s)
    # the asynchronous 1F1B has no flush: it keeps FuncPipe's t_iter
    assert predicted_iteration(slow, single, schedule="1f1b-async") == synchronous


@pytest.mark.parametrize("replicas, written", [((1, 1), []), ((1, 2), ["run/marker/i000003/s000000/r000000/computed"])])
def test_markers_are_written_only_where_a_stage_has_replicas_to_watch(tmp_path, replicas, written):
    # the model charges t_mark only when d > 1; with one replica everywhere the straggler watch
    # has nothing to compare, and the runtime writes no marker (2 requests per worker and
    # iteration on the local S3 server that nobody read)
    trainer: Any = object.__new__(StageTrainer)     # only what _mark reads
    trainer.spec = SimpleNamespace(stages=[SimpleNamespace(replicas=count) for count in replicas])
    trainer.role = SimpleNamespace(stage=0, replica=0)
    trainer.store, trainer.keys = FileStore(tmp_path), RunKeys("run")
    trainer._mark(3, "computed")
    assert trainer.store.list("run/marker/") == written
