"""The asynchronous 1F1B's pieces (issue 22, item 6): its task order and weight versions,
the stash's bookkeeping, and the options it refuses before anything starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flatpack import cli
from flatpack.errors import InputError
from flatpack.job import JobOptions
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.spec import DATA_SOURCE, RunSpec, StageSpec
from flatpack.runtime.stashing import WeightStash
from flatpack.schedules import Layout, get

ASYNC = get("1f1b-async")


def async_chunks(first: int, end: int, micro_batches: int, stage: int, stages: int) -> list[list[tuple]]:
    """The schedule's slices of a call of iterations ``first``..``end - 1`` as (kind, the
    micro-batch's number in the call, its iteration, its micro-batch) tuples."""
    return [[(action.kind.value, action.iteration * micro_batches + action.micro_batch, first + action.iteration,
              action.micro_batch) for action in chunk]
            for chunk in ASYNC.call_actions(stage, Layout.single(stages, micro_batches), list(range(micro_batches)),
                                             end - first)]


def test_the_order_is_one_1f1b_sequence_over_the_call_sliced_by_iteration():
    chunks = async_chunks(5, 8, 2, 0, 3)      # iterations 5..7, two micro-batches, first of three stages
    assert [[t[:2] for t in chunk] for chunk in chunks] == [
        [("F", 0), ("F", 1)],
        [("F", 2), ("B", 0), ("F", 3), ("B", 1)],
        [("F", 4), ("B", 2), ("F", 5), ("B", 3), ("B", 4), ("B", 5)]]
    assert chunks[1][1][2:] == (5, 0)   # an earlier iteration's backward
    last_stage = async_chunks(0, 2, 2, 2, 3)
    assert [[t[:2] for t in chunk] for chunk in last_stage] == [
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 2), ("B", 2), ("F", 3), ("B", 3)]]
    # every stage forwards and backwards each micro-batch exactly once
    for stage in range(4):
        tasks = [t[:2] for chunk in async_chunks(0, 3, 2, stage, 4) for t in chunk]
        assert sorted(tasks) == sorted([(kind, g) for g in range(6) for kind in "FB"])


def test_versions_lag_by_the_stages_in_flight_and_vertical_sync_takes_the_first_stages():
    # stage s has taken g - (S - s - 1) steps before the forward of micro-batch g
    layout = Layout.single(3, 2)
    assert [ASYNC.weight_version(5, stage, layout) for stage in range(3)] == [3, 4, 5]
    assert [ASYNC.weight_version(5, stage, Layout.single(3, 2, True)) for stage in range(3)] == [3, 3, 3]
    assert ASYNC.weight_version(1, 0, layout) == 0     # the pipeline filling: no step yet


def test_the_stash_gives_each_micro_batch_its_own_leaves_and_copies_only_a_held_version_before_a_step():
    weight = torch.nn.Parameter(torch.ones(2))
    stash = WeightStash({"w": weight})
    stash.snapshot(0)
    assert stash.versions[0]["w"].data_ptr() == weight.data_ptr()    # no copy while the weights stand still
    first, second = stash.acquire(0), stash.acquire(0)
    (first["w"] * 2).sum().backward()
    assert second["w"].grad is None and first["w"].grad is not None and first["w"].grad.tolist() == [2.0, 2.0]
    stash.before_step(0)
    with torch.no_grad():
        weight.add_(1.0)                       # the optimizer's in-place step
    assert stash.versions[0]["w"].data_ptr() != weight.data_ptr()
    assert first["w"].tolist() == second["w"].tolist() == [1.0, 1.0]    # what they computed with
    stash.release(0)
    stash.prune(keep_from=2)
    assert stash.held() == 1                   # version 0 is still held by the second micro-batch
    stash.release(0)
    stash.prune(keep_from=0)
    assert stash.held() == 1                   # nobody holds it, but a later forward may still ask for it
    stash.prune(keep_from=2)
    assert stash.held() == 0
    pointer = weight.data_ptr()
    stash.before_step(1)                       # version 1 is not stashed: the step needs no copy
    assert weight.data_ptr() == pointer
    with pytest.raises(RuntimeError, match="weight version 0 is not stashed"):
        stash.acquire(0)


def spec(replicas: int = 1, **changes) -> RunSpec:
    stage = StageSpec(0, replicas, None, None, None, ("x",), ("y",), {"x": DATA_SOURCE}, ())
    return RunSpec("run", (stage,), 4, 8, changes.pop("optimizer", OptimizerSpec("adam", lr=0.1)), "mse", "y",
                   schedule=changes.pop("schedule", "1f1b-async"), **changes)


@pytest.mark.parametrize(("make", "words"), [
    (lambda: spec(replicas=3), r"1F1B-RR gives micro-batch g .* degrees \[3\] do not all divide the 4 micro-batches"),
    (lambda: spec(optimizer=OptimizerSpec("adam", lr=0.1, clip_grad_norm=1.0)), "--clip-grad-norm 1.0 needs every"),
    (lambda: spec(optimizer=OptimizerSpec("adam", lr=0.1, accumulate=2)), "--accumulate 2: 1f1b-async steps after"),
    (lambda: spec(shared={"w": (0, 1)}), r"tied weights \['w'\] .* untie them, or use --schedule 2bw or 1f1b"),
    (lambda: spec(time_limit_s=880.0), r"a function time limit \(880.0 s\) .* time_limit_s=None"),
    (lambda: spec(schedule="1f1b", vertical_sync=True), "vertical sync applies to the 1f1b-async schedule, not '1f1b'"),
    (lambda: spec(schedule="2f2b"), "unknown schedule '2f2b'; known schedules: 1f1b, 1f1b-async, 2bw, sync"),
])
def test_combinations_the_asynchronous_schedule_does_not_run_are_refused(make, words):
    with pytest.raises(InputError, match=words):
        make()


def test_the_run_spec_carries_vertical_sync_and_checkpoints_only_where_the_pipeline_drains():
    async_spec = spec(vertical_sync=True, checkpoint_every=1)
    assert RunSpec.loads(async_spec.dumps()) == async_spec
    assert [async_spec.checkpoints_after(i, 3) for i in range(3)] == [False, False, True]
    flushed = dataclasses.replace(async_spec, schedule="1f1b", vertical_sync=False)
    assert [flushed.checkpoints_after(i, 3) for i in range(3)] == [True, True, True]


def test_job_options_count_a_step_per_micro_batch_and_refuse_replicas_before_compiling():
    options = JobOptions.of(schedule="1f1b-async", replicas=(1,), micro_batches=4, iterations=3, schedule_lr="cosine")
    options.check()
    assert options.optimizer_steps(3) == 12
    schedule = options.optimizer_spec().schedule
    assert schedule is not None and schedule.options["T_max"] == 12
    # 1F1B-RR: a stage of d replicas steps once per round of d micro-batches
    replicated = JobOptions.of(schedule="1f1b-async", stages=2, stage_replicas=(1, 2), micro_batches=4, iterations=3)
    replicated.check()
    assert get("1f1b-async").optimizer_steps(4, 2) == 2
    with pytest.raises(InputError, match=r"degrees \[1, 3\] do not all divide the 4 micro-batches"):
        replicated.with_changes(stage_replicas=(1, 3)).check()


@pytest.mark.parametrize(("args", "words"), [
    (["--schedule", "2bw", "--vertical-sync"], "2bw's version is the iteration's on every stage already"),
    (["--schedule", "1f1b-async", "--stage-replicas", "1,2"], "give --stages 2 (or --split-points) with it"),
    (["--schedule", "1f1b-async", "--replicas", "1", "--clip-grad-norm", "1"], "--clip-grad-norm 1.0 needs every"),
    (["--vertical-sync"], "vertical sync applies to the 1f1b-async schedule, not 'sync'"),
])
def test_the_command_line_refuses_before_the_model_is_built(args, words, capsys, monkeypatch, tmp_path):
    def never(*_a, **_k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "load_factory", never)
    code = cli.main(["run", "mlp", "--out", str(tmp_path / "out"), *args])
    error = capsys.readouterr().err
    assert code == 2 and words in error, error


def test_gpu_containers_refuse_the_asynchronous_schedule():
    from flatpack.backends.gpu_container import build_run
    from flatpack.compiler import compile as compile_model
    from flatpack.examples import mlp

    model, example = mlp()
    compiled = compile_model(model, example, stages=2)
    with pytest.raises(InputError, match="GPU-container ranks run sync or 1f1b: use --schedule 1f1b"):
        build_run(compiled, iterations=1, batch=8, schedule="1f1b-async")
