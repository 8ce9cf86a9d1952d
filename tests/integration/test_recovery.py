"""At-least-once execution with exactly-once effects: a lost function replays iterations from
its stage's last checkpoint (any ``checkpoint_every``), a deployment trains again from the
weights the last call left, inference serves them, and a failed call resumes. Each run's
final parameters must equal single-process training on the same batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from flatpack.analysis.reference import train_single_process
from flatpack.backends import local
from flatpack.errors import RunFailure
from tests.helpers import assert_same_weights, flatpack_process, stop_with_sigterm, wait_for_output
from tests.integration.test_local_training import assert_same_parameters, batches, compiled_with, make_model

pytestmark = pytest.mark.slow

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def lost(restarts: list) -> list[tuple[str, int]]:
    return [(restart.worker, restart.iteration) for restart in restarts if restart.reason == "lost"]


@pytest.mark.parametrize("schedule", ["sync", "1f1b"])
def test_a_stage_lost_after_its_backwards_replays_the_iteration(s3_server, schedule):
    """Killed at its update, stage 0 replays the iteration: its consumer's gradients are then
    already in the store, and the replayed backward must not release a micro-batch's state
    before the upload lane has read its outputs (the replay crash: KeyError in the upload)."""
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 4)
    data = batches(3)
    kill = {"stage": 0, "replica": 0, "iteration": 1, "at": "update", "action": "kill"}
    reference, _ = train_single_process(make_model(), data, 3, optimizer=SGD)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=3, optimizer=SGD, schedule=schedule, faults=[kill],
                                  wait_timeout_s=30, timeout_s=180)
    assert lost(result.restarts) == [("s0r0", 1)]
    assert_same_parameters(result, reference)


@pytest.mark.parametrize(("replicas", "victim"), [([1, 1], (1, 0)), ([2, 2], (0, 1))])
def test_a_stage_lost_between_checkpoints_replays_from_the_last_one(s3_server, replicas, victim):
    """checkpoint_every=3: checkpoints after iterations 2 and 5 (and the last); a stage lost in
    iteration 4 restarts after iteration 2 while its neighbours are already past it."""
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], replicas, 4)
    data = batches(7)
    stage, replica = victim
    kill = {"stage": stage, "replica": replica, "iteration": 4, "at": "backward", "action": "kill"}
    reference, losses = train_single_process(make_model(), data, 7, optimizer=SGD)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=7, optimizer=SGD, faults=[kill], checkpoint_every=3,
                                  wait_timeout_s=30, timeout_s=180)
        leftovers = deployment.store.list(f"{deployment.keys.run}/act/")
        checkpoints = deployment.store.list(f"{deployment.keys.run}/ckpt/")
    assert lost(result.restarts) == [(f"s{stage}r{replica}", 3)]
    assert_same_parameters(result, reference)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    # a finished run keeps no tensors and only its last checkpoint per stage
    assert leftovers == []
    assert sorted(key.rsplit("/", 2)[-2] for key in checkpoints) == ["s000000", "s000001"]


def test_a_second_train_call_continues_from_the_trained_weights_and_inference_serves_them(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 2], 2)
    data = batches(4)
    reference, losses = train_single_process(make_model(), data, 4, optimizer="adam")
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(7))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        before = deployment.infer(x)
        first = deployment.train(data[:2], optimizer="adam", wait_timeout_s=30, timeout_s=120)
        second = deployment.train(data[2:], optimizer="adam", wait_timeout_s=30, timeout_s=120)
        served = deployment.infer(x)
    torch.testing.assert_close(before, make_model()(x))
    assert first.losses + second.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)
    assert_same_parameters(second, reference)
    with torch.no_grad():
        torch.testing.assert_close(served, reference.eval()(x))


def test_a_failed_call_resumes_from_the_last_checkpoint_to_the_same_weights(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2)
    data = batches(6)
    crash = {"stage": 1, "replica": 0, "iteration": 3, "at": "forward", "action": "raise"}
    reference, losses = train_single_process(make_model(), data, 6, optimizer=SGD)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(RunFailure, match="injected failure"):
            deployment.train(data, optimizer=SGD, checkpoint_every=2, faults=[crash], wait_timeout_s=30,
                             timeout_s=120)
        assert deployment.consistent_checkpoint() == 1
        resumed = deployment.resume(data, wait_timeout_s=30, timeout_s=120)
        assert resumed is not None and len(resumed.losses) == 4
        assert deployment.resume(data) is None
        failed, resumed_call = deployment.calls()
    # the resumed call repeated the failed one's settings (checkpoints every 2, its optimizer, M)
    assert resumed_call.settings == failed.settings and failed.settings.checkpoint_every == 2
    assert (resumed_call.batch_offset, resumed_call.iterations) == (2, 4)
    assert_same_parameters(resumed, reference)
    assert resumed.losses == pytest.approx(losses[2:], rel=1e-4, abs=1e-5)


RUNNER = """
import json, sys
from flatpack.backends import local
from tests.integration.test_local_training import batches, compiled_with, make_model
arguments = json.loads(sys.argv[1])
deployment = local.deploy(compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2), run=arguments["run"],
                          store_url=arguments["url"], env=arguments["env"], workdir=arguments["workdir"])
deployment.train(batches(8), optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.9}, checkpoint_every=3,
                 faults=[{"stage": 1, "replica": 0, "iteration": 4, "at": "start", "action": "sleep", "seconds": 60}])
"""


def _start_runner(run: str, server, workdir: Path) -> subprocess.Popen:
    """RUNNER in its own session: 8 iterations, checkpoints after 2, 5 and 7, stage 1 asleep at 4."""
    arguments = {"run": run, "url": server.url(""), "env": server.env(), "workdir": str(workdir)}
    return subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps(arguments)],
                            cwd=Path(__file__).resolve().parents[2], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for_iteration_3(run: str, server, runner: subprocess.Popen) -> None:
    """Until every stage reported iteration 3 (stage 1 then sleeps at the start of iteration 4,
    and iterations 0-2 are checkpointed)."""
    with server.store() as store:
        deadline = time.time() + 120
        while not store.exists(f"{run}/progress/i000003/s000001/r000000") and time.time() < deadline:
            assert runner.poll() is None, "the runner ended before the fault could strike"
            time.sleep(0.1)


def _kill_group(runner: subprocess.Popen) -> None:
    """SIGKILL of the runner and the functions it started (its session's process group)."""
    try:
        os.killpg(runner.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    runner.wait()


def test_a_run_whose_s3_server_was_killed_resumes_on_a_new_server_over_the_same_data(tmp_path):
    """SIGKILL of the S3 server and of the process running train() (its functions with it)
    mid-call, then a new server on the same data directory and resume() from a new deployment
    object in another process: the same weights and losses as one uninterrupted call, and
    parameters() reads them. The data directory is what `flatpack run` keeps under OUT/store/.
    (This covers a killed invoker over a live server too: that resume reads the same objects
    from the same store; benchmarks/faults.py kills runners at random moments.)"""
    from flatpack.runtime.s3server import LocalS3Server

    run, data_dir = f"run-{uuid.uuid4().hex[:10]}", tmp_path / "store"
    with LocalS3Server(data_dir=data_dir) as server:
        runner = _start_runner(run, server, tmp_path)
        try:
            _wait_for_iteration_3(run, server, runner)
            assert server.pid is not None  # started by the with
            os.killpg(server.pid, signal.SIGKILL)
        finally:
            _kill_group(runner)
    data = batches(8)
    reference, losses = train_single_process(make_model(), data, 8, optimizer=SGD)
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2)
    with LocalS3Server(data_dir=data_dir) as again:
        with local.deploy(compiled, store_url=again.url(""), env=again.env(), run=run) as deployment:
            assert deployment.consistent_checkpoint() == 2   # checkpoints after iterations 2, 5 and 7
            resumed = deployment.resume(data, wait_timeout_s=30, timeout_s=120)
            parameters = deployment.parameters()
    assert resumed is not None and len(resumed.losses) == 5
    assert resumed.losses == pytest.approx(losses[-len(resumed.losses):], rel=1e-4, abs=1e-5)
    assert_same_parameters(resumed, reference)
    for name, value in parameters.items():
        torch.testing.assert_close(value, resumed.parameters[name], rtol=0, atol=0)


def test_a_flatpack_run_stopped_by_sigterm_resumes_to_the_weights_of_an_uninterrupted_run(tmp_path):
    """The command line: SIGTERM of `flatpack run` mid-training, then `flatpack resume OUT`,
    ends with the weights `flatpack run` reaches when nothing stops it, bit for bit."""
    from flatpack.cli import main

    arguments = ["run", "vgg16", "--batch", "16", "--micro-batches", "2", "--iterations", "5",
                 "--checkpoint-every", "2", "--solver", "balanced", "--no-verify"]
    assert main([*arguments, "--out", str(tmp_path / "whole")]) == 0
    stopped = tmp_path / "stopped"
    log_path = tmp_path / "stopped.log"
    with flatpack_process([*arguments, "--out", str(stopped)], log_path) as runner:
        wait_for_output(runner, log_path, "iter 3/5")
        stop_with_sigterm(runner)
    output = log_path.read_text(errors="replace")
    assert f"flatpack resume {stopped}" in output, output[-3000:]
    assert json.loads((stopped / "run.json").read_text())["state"] == "running"
    assert main(["resume", str(stopped)]) == 0
    assert json.loads((stopped / "run.json").read_text())["state"] == "done"
    assert not (stopped / "store").exists()      # a finished run keeps its weights, not its store
    assert_same_weights(tmp_path / "whole" / "trained.safetensors", stopped / "trained.safetensors")
    assert main(["resume", str(stopped)]) == 0    # nothing left to do, and it says so
