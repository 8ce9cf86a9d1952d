"""Issue 19: the task terms that `flatpack calibrate`'s probe pipelines measure — the fit
recovers known terms from a timeline built with them, the calibration file keeps them by
worker count and reads them at a plan's, and the cost model adds each where its task is
spent. The real probe pipelines run in tests/integration/test_calibrate_local.py."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from flatpack.platform.calibration import Calibration
from flatpack.backends.task_overheads import fit
from flatpack.errors import InputError
from flatpack.partitioner.cost import funcpipe
from flatpack.partitioner.cost.funcpipe import Overheads
from flatpack.runtime.timeline import Event
from tests.unit.test_cost_models import plan, problem
from tests.unit.test_target_calibration import target_calibration

TERMS = {"forward": 0.003, "backward": 0.001, "upload": 0.002, "download": 0.0015, "step": 0.004, "iteration": 0.0025}
UPLOAD, DOWNLOAD, OPTIMIZER = 0.004, 0.006, 0.0005


def probe_cost(forward_s: float = 0.0002, backward_s: float = 0.0004) -> SimpleNamespace:
    """What ``funcpipe.iteration`` models for a two-stage probe (the fields the fit reads)."""
    stage = SimpleNamespace(forward_s=forward_s, backward_s=backward_s, sync_s=0.0)
    boundary = SimpleNamespace(forward_upload_s=UPLOAD, forward_download_s=DOWNLOAD,
                               backward_upload_s=UPLOAD, backward_download_s=DOWNLOAD)
    return SimpleNamespace(replicas=1, stages=(stage, stage), boundaries=(boundary,),
                           overheads=Overheads(optimizer_s=(OPTIMIZER, OPTIMIZER)))


def probe_timeline(cost: SimpleNamespace, iterations: int = 5, micro_batches: int = 3,
                   handoff: float = 0.0) -> list[Event]:
    """A synchronous two-stage schedule whose every task takes its modelled seconds plus
    TERMS, and whose downloads wait for their producers. ``handoff``: a task that reads
    another lane's task of its worker (a download, a forward or backward) starts that long
    after it ends, as a woken thread does."""
    h = handoff
    forward = cost.stages[0].forward_s + TERMS["forward"]
    backward = cost.stages[0].backward_s + TERMS["backward"]
    upload, download = UPLOAD + TERMS["upload"], DOWNLOAD + TERMS["download"]
    events: list[Event] = []

    def add(stage: int, iteration: int, kind: str, start: float, seconds: float, micro_batch=None, lane="compute"):
        events.append(Event(stage, 0, iteration, kind, start, start + seconds, micro_batch, 0, lane))
        return start + seconds

    clock = 100.0
    for iteration in range(iterations):
        compute0 = clock
        up0 = down1 = compute1 = 0.0
        arrived = {}
        for m in range(micro_batches):
            compute0 = add(0, iteration, "forward", compute0, forward, m)
            up0 = add(0, iteration, "upload", max(up0, compute0 + h), upload, m, "upload")
            began = max(down1, clock)
            down1 = add(1, iteration, "download", began, max(up0, began) - began + download, m, "download")
            compute1 = add(1, iteration, "forward", max(compute1, down1 + h), forward, m)
        up1 = 0.0
        for m in reversed(range(micro_batches)):
            compute1 = add(1, iteration, "backward", compute1, backward, m)
            up1 = add(1, iteration, "upload", max(up1, compute1 + h), upload, m, "upload")
            arrived[m] = up1
        last1 = add(1, iteration, "update", up1, OPTIMIZER + TERMS["step"])
        down0 = compute0
        for m in reversed(range(micro_batches)):
            down0 = add(0, iteration, "download", down0, max(arrived[m], down0) - down0 + download, m, "download")
            compute0 = add(0, iteration, "backward", max(compute0, down0 + h), backward, m)
        end0 = add(0, iteration, "update", compute0, OPTIMIZER + TERMS["step"])
        # the first stage's next forward starts o_it after its update
        clock = max(end0, last1) + TERMS["iteration"]
    return events


def test_a_task_s_term_counts_the_hand_off_from_its_input_not_only_its_own_seconds():
    """A forward, backward or upload that starts after its input arrived waited for its lane's
    thread to wake: that hand-off is part of its term (it is spent on the pipeline's path), so
    each of the three terms grows by up to the hand-off, never by more; the downloads, timed
    from their producer's upload, and the iteration gap keep theirs."""
    cost = probe_cost()
    handoff = 0.002
    found = fit(cost, probe_timeline(cost, handoff=handoff), skip=1)
    for kind in ("forward", "backward", "upload"):
        assert TERMS[kind] < found[kind] <= TERMS[kind] + handoff + 1e-12, kind
    assert found["download"] == pytest.approx(TERMS["download"])
    assert found["step"] == pytest.approx(TERMS["step"]) and found["iteration"] == pytest.approx(TERMS["iteration"])


def test_the_fit_recovers_the_terms_of_a_timeline_built_with_them():
    cost = probe_cost()
    assert fit(cost, probe_timeline(cost), skip=1) == pytest.approx(TERMS)
    # a model slower than the worker: no term goes below 0
    slow = probe_cost(0.05, 0.05)
    found = fit(slow, probe_timeline(probe_cost()), skip=1)
    assert found["forward"] == 0.0 and found["backward"] == 0.0


def one_stage_timeline(cost: SimpleNamespace, iterations: int = 5, micro_batches: int = 3,
                       late: float = 0.0, lagging: float = 0.0) -> list[Event]:
    """A one-stage schedule (one worker): forwards, then backwards, then the update, each
    taking its modelled seconds plus TERMS; its inputs are prefetched on their own lane beside
    the compute, as the runtime's first stage does. ``late``: each iteration's first input
    arrives that long after the previous update, and its first forward starts
    TERMS["iteration"] after that. ``lagging``: every later input arrives that long after the
    forward before it ended, and its forward waits for it (a prefetch lane slower than the
    compute, as in a probe whose layers take a fraction of a millisecond)."""
    forward = cost.stages[0].forward_s + TERMS["forward"]
    backward = cost.stages[0].backward_s + TERMS["backward"]
    events: list[Event] = []

    def add(iteration: int, kind: str, start: float, seconds: float, micro_batch=None, lane="compute"):
        events.append(Event(0, 0, iteration, kind, start, start + seconds, micro_batch, 0, lane))
        return start + seconds

    # a prefetch reads the input and the target: two requests, each its download term beyond
    prefetch = cost.overheads.input_s + 2 * TERMS["download"]
    update_end = 100.0 - TERMS["iteration"]
    for iteration in range(iterations):
        arrived = update_end + late
        add(iteration, "prefetch", arrived - prefetch, prefetch, 0, "download")
        for m in range(1, micro_batches if not lagging else 1):
            add(iteration, "prefetch", update_end - 0.05 + 0.01 * m, prefetch, m, "download")
        compute = max(update_end, arrived) + TERMS["iteration"]
        for m in range(micro_batches):
            if m and lagging:
                compute = add(iteration, "prefetch", compute + lagging - prefetch, prefetch, m, "download")
            compute = add(iteration, "forward", compute, forward, m)
        for m in reversed(range(micro_batches)):
            compute = add(iteration, "backward", compute, backward, m)
        update_end = add(iteration, "update", compute, OPTIMIZER + TERMS["step"])
    return events


def one_stage_cost() -> SimpleNamespace:
    return SimpleNamespace(replicas=1, stages=probe_cost().stages[:1], boundaries=(),
                           overheads=Overheads(optimizer_s=(OPTIMIZER,), input_s=DOWNLOAD + UPLOAD))


def test_the_fit_of_a_one_stage_probe_reads_its_downloads_from_its_prefetches():
    """One worker: the probe runs as one stage, with no boundary (no upload, no sync); its only
    downloads are its prefetched inputs and targets, two requests each, priced by the model's
    t_in: the download term is each request's share of a prefetch beyond t_in."""
    cost = one_stage_cost()
    found = fit(cost, one_stage_timeline(cost), skip=1)
    assert set(found) == {"forward", "backward", "download", "step", "iteration"}
    assert found == pytest.approx({kind: TERMS[kind] for kind in found})


def test_the_iteration_term_leaves_out_the_wait_for_a_late_prefetch():
    """A forward that waited for its prefetched input waited on the prefetch lane, which the
    model prices by t_in (µ·t_in bounds t_iter): the iteration term counts from when both the update and that
    input were done, or a prefetch-bound probe would charge that wait to every plan again."""
    cost = one_stage_cost()
    found = fit(cost, one_stage_timeline(cost, late=0.02), skip=1)
    assert found["iteration"] == pytest.approx(TERMS["iteration"])
    # an input that was there before the update ends: the gap counts from the update
    assert fit(cost, one_stage_timeline(cost, late=-0.01), skip=1)["iteration"] == pytest.approx(TERMS["iteration"])


def test_a_forward_s_term_leaves_out_its_wait_for_a_prefetched_input():
    """The first stage's forward reads its prefetched input as a later stage's reads its
    download: the term counts from when the input was there. A probe's layers take a fraction
    of a millisecond, its prefetch lane is the slower, and its forwards waited 1-2 ms each for
    their inputs; counted in the forward term, that wait came back on every forward of a model
    whose compute hides its prefetches (1 x 1 plans predicted 17-33 % over, issue 44)."""
    cost = one_stage_cost()
    found = fit(cost, one_stage_timeline(cost, lagging=0.004), skip=1)
    assert found["forward"] == pytest.approx(TERMS["forward"])
    assert found["download"] == pytest.approx(TERMS["download"])


def test_the_fit_refuses_a_pipeline_it_cannot_read():
    three = SimpleNamespace(replicas=1, stages=(1, 2, 3), boundaries=(), overheads=None)
    with pytest.raises(ValueError, match="one or two stages"):
        fit(three, [])


def test_the_calibration_file_keeps_the_terms_and_refuses_bad_ones(tmp_path):
    four = {**{kind: 2 * seconds for kind, seconds in TERMS.items()}, "sync": 0.01}
    tier = dataclasses.replace(target_calibration().tiers[512], task_overhead_s={2: TERMS, 4: four})
    calibration = target_calibration(tiers={512: tier})
    loaded = Calibration.load(calibration.save(tmp_path / "calibration.json"))
    assert loaded.tiers[512].task_overhead_s == {2: TERMS, 4: four}
    assert loaded.digest != target_calibration().digest
    # at a count measured, its figure; between and beyond the two, their line; at least 0
    assert loaded.task_overhead(512, "forward", 2) == TERMS["forward"]
    assert loaded.task_overhead(512, "forward", 3) == pytest.approx(1.5 * TERMS["forward"])
    assert loaded.task_overhead(512, "forward", 6) == pytest.approx(3 * TERMS["forward"])
    assert loaded.task_overhead(512, "forward", 1) == pytest.approx(0.5 * TERMS["forward"])
    shrinking = dataclasses.replace(tier, task_overhead_s={2: {"step": 0.004}, 4: {"step": 0.001}})
    assert target_calibration(tiers={512: shrinking}).task_overhead(512, "step", 10) == 0.0
    # the sync, measured with 4 workers only, is that figure at every count; nothing measured is 0
    assert loaded.task_overhead(512, "sync", 8) == 0.01 and loaded.task_overhead(1024, "forward", 2) == 0.0
    data = json.loads((tmp_path / "calibration.json").read_text())
    for bad, message in (({"2": {"forwards": 0.001}},
                          r"task_overhead_s.2 names forwards; the tasks measured are forward"),
                         ({"2": {"forward": -0.001}}, r"task_overhead_s.2.forward must be non-negative"),
                         ({"two": {"forward": 0.001}}, "must map worker counts")):
        broken = {**data, "tiers": {"512": {**data["tiers"]["512"], "task_overhead_s": bad}}}
        with pytest.raises(InputError, match=message):
            Calibration.from_json(broken)


ONE_STAGE = plan((0, 2, 1024, 1))
TWO = plan((0, 1, 1024, 1), (2, 2, 1024, 1))


def test_each_task_term_enters_where_its_task_is_spent():
    base = funcpipe.iteration(problem(), TWO)
    terms = Overheads(forward_task_s=(0.001, 0.002), backward_task_s=(0.003, 0.004), upload_task_s=(0.01, 0.02),
                      download_task_s=(0.03, 0.04), step_task_s=(0.5, 0.25), iteration_s=0.125, sync_task_s=(1.0, 1.0))
    found = funcpipe.iteration(problem(), TWO, terms)
    assert [s.forward_s for s in found.stages] == pytest.approx([s.forward_s + o
                                                                 for s, o in zip(base.stages, (0.001, 0.002))])
    assert [s.backward_s for s in found.stages] == pytest.approx([s.backward_s + o
                                                                  for s, o in zip(base.stages, (0.003, 0.004))])
    boundary, before = found.boundaries[0], base.boundaries[0]
    # activations go up from stage 0 and down into stage 1; gradients the other way
    assert boundary.forward_upload_s == pytest.approx(before.forward_upload_s + 0.01)
    assert boundary.forward_download_s == pytest.approx(before.forward_download_s + 0.04)
    assert boundary.backward_upload_s == pytest.approx(before.backward_upload_s + 0.02)
    assert boundary.backward_download_s == pytest.approx(before.backward_download_s + 0.03)
    # one stage: the step and the iteration's gap add to t_iter exactly, the forward µ times
    single = funcpipe.iteration(problem(), ONE_STAGE)
    stepped = funcpipe.iteration(problem(), ONE_STAGE, Overheads(step_task_s=(0.5,), iteration_s=0.125,
                                                                  forward_task_s=(0.01,)))
    mu = single.micro_batches_per_replica
    assert stepped.iteration_s == pytest.approx(single.iteration_s + 0.5 + 0.125 + mu * 0.01)
    # the sync's term only where there is a sync (d > 1)
    assert [s.sync_s for s in found.stages] == [0.0, 0.0]
    replicated = plan((0, 1, 1024, 2), (2, 2, 1024, 2))
    synced = funcpipe.iteration(problem(), replicated, Overheads(sync_task_s=(1.0, 2.0)))
    unsynced = funcpipe.iteration(problem(), replicated, Overheads())
    assert [s.sync_s for s in synced.stages] == pytest.approx([s.sync_s + extra
                                                               for s, extra in zip(unsynced.stages, (1.0, 2.0))])


def test_the_terms_come_from_the_calibration_at_the_plans_worker_count():
    tier = dataclasses.replace(target_calibration().tiers[512],
                               task_overhead_s={2: {"forward": 0.002, "iteration": 0.01}, 4: {"forward": 0.004}})
    base = dataclasses.replace(problem(), calibration=target_calibration())
    measured = dataclasses.replace(problem(), calibration=target_calibration(tiers={512: tier}))
    two_workers, four_workers = plan((0, 0, 512, 1), (1, 2, 512, 1)), plan((0, 0, 512, 2), (1, 2, 512, 2))
    overheads = Overheads.of(measured, two_workers)
    assert overheads.forward_task_s == (0.002, 0.002) and overheads.backward_task_s == (0.0, 0.0)
    assert overheads.iteration_s == 0.01
    assert Overheads.of(measured, four_workers).forward_task_s == (0.004, 0.004)
    before, after = funcpipe.predicted(base, two_workers), funcpipe.predicted(measured, two_workers)
    assert after.stages[0].forward_s == pytest.approx(before.stages[0].forward_s + 0.002)
    # a tier the probes did not measure has no task terms
    assert funcpipe.predicted(measured, ONE_STAGE) == funcpipe.predicted(base, ONE_STAGE)


def test_a_fork_join_request_pays_the_measured_request_and_fork_terms():
    from flatpack.partitioner.cost import gillis
    from tests.unit.test_cost_models import LAYERS

    serving = dataclasses.replace(problem(), workload=dataclasses.replace(problem().workload, mode="infer",
                                                                          micro_batches=1))
    tier = dataclasses.replace(target_calibration().tiers[512],
                               task_overhead_s={1: {"request": 0.02}, 3: {"fork": 0.01}, 5: {"fork": 0.03}})
    measured = dataclasses.replace(serving, calibration=target_calibration(tiers={512: tier}))
    alone, split = plan((0, len(LAYERS) - 1, 512, 1)), plan((0, 0, 512, 1), (1, 1, 512, 2), (2, 2, 512, 1))
    base = dataclasses.replace(serving, calibration=target_calibration())
    assert gillis.latency(measured, alone).latency_s == pytest.approx(gillis.latency(base, alone).latency_s + 0.02)
    # one split group over 2 workers: 3 functions, the fork's term read there
    assert gillis.latency(measured, split).latency_s == pytest.approx(
        gillis.latency(base, split).latency_s + 0.02 + 0.01)
