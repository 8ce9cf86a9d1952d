"""PipeDream's asynchronous 1F1B with weight stashing (issue 22, item 6) on local functions:
each micro-batch's backward computes on exactly the weights its forward used (versions
recorded in process), and a run's weights equal the single-process simulation of the same
asynchronous schedule (``train_async_single_process``), with and without vertical sync, on a
conv model and a transformer, across calls, under a replay, and refused where it does not
combine, before any function starts."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import flatpack
from flatpack import cli
from flatpack.analysis.reference import train_async_single_process, train_single_process
from flatpack.backends import local
from flatpack.errors import InputError
from flatpack.partitioner.cost import pipedream
from flatpack.runtime.function import Role
from flatpack.runtime.keys import RunKeys
from flatpack.runtime.lanes import Lanes
from flatpack.runtime.optim import OptimizerSpec
from flatpack.runtime.spec import RunSpec, split_value, stage_specs
from flatpack.schedules import Layout
from flatpack.schedules import get as schedule_named
from flatpack.runtime.store import FileStore
from flatpack.runtime.timeline import Recorder
from flatpack.runtime.training import TARGET, StageTrainer
from flatpack.stage.wire import pack_values
from flatpack.stage import wire
from flatpack.stage.artifact import build_module
from flatpack.verdict import parameter_stages, pipeline_optimizer_state
from tests.integration.test_training_knobs import assert_same_parameters, compiled_with, conv_case, transformer_case

pytestmark = pytest.mark.slow

ADAM = OptimizerSpec("adam", lr=0.02)
# 4 iterations of 4 micro-batches: 16 steps per stage, micro-batches in flight across every
# iteration boundary of a 2- or 3-stage pipeline (the stashing the tests are about)
ITERATIONS = 4
ASYNC = "1f1b-async"
SGD = OptimizerSpec("sgd", lr=0.05, options={"momentum": 0.9})


@pytest.mark.parametrize(("case", "stages", "vertical_sync"), [
    (conv_case, 2, False),
    (transformer_case, 3, False),
    (transformer_case, 3, True),
])
def test_async_run_equals_the_single_process_simulation_of_the_same_schedule(s3_server, case, stages, vertical_sync):
    model, data = case()
    compiled = compiled_with(model, data[0][0], [1] * stages, micro_batches=4)
    assert len(compiled.plan.stages) == stages
    simulated, losses = train_async_single_process(model, data, ITERATIONS, stage_of=parameter_stages(compiled),
                                                   schedule=ASYNC, stages=stages, micro_batches=4, optimizer=ADAM,
                                                   vertical_sync=vertical_sync)
    # the schedule matters: flushed training on the same batches ends elsewhere
    flushed, _ = train_single_process(model, data, ITERATIONS, optimizer=ADAM, micro_batches=4)
    assert any(not torch.allclose(a, b, atol=1e-3) for a, b in zip(simulated.parameters(), flushed.parameters()))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=ITERATIONS, optimizer=ADAM, schedule="1f1b-async",
                                  vertical_sync=vertical_sync)
    assert_same_parameters(result, simulated)
    assert result.losses == pytest.approx(losses, rel=1e-4, abs=1e-5)


def test_a_recomputing_stage_recomputes_with_its_stashed_version(s3_server):
    """A stage that recomputes its activations (plan choice) runs the forward again in the
    backward: with the micro-batch's stashed weights, so the run still equals the simulation."""
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=4)
    plan = dataclasses.replace(compiled.plan, stages=tuple(dataclasses.replace(stage, recompute=True)
                                                           for stage in compiled.plan.stages))
    compiled = flatpack.compile(model, (data[0][0],), plan=plan)
    assert all(stage.recompute for stage in compiled.plan.stages)
    simulated, _ = train_async_single_process(model, data, 3, stage_of=parameter_stages(compiled), stages=2,
                                              schedule=ASYNC, micro_batches=4, optimizer=ADAM)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=3, optimizer=ADAM, schedule="1f1b-async")
    assert_same_parameters(result, simulated)


def test_bf16_asynchronous_run_equals_the_simulation_computed_as_the_stages_compute(s3_server):
    """bf16 (autocast, bfloat16 between stages) with the asynchronous schedule equals the
    simulation under the same autocast computed as the stages compute (through the compiled
    stages, with the workers' one intra-op thread: ``verdict.py``), with float32 master
    weights and momentum."""
    model, data = transformer_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=4)
    simulated, losses = train_async_single_process(model, data, 2, stage_of=parameter_stages(compiled), stages=2,
                                                   schedule=ASYNC, micro_batches=4, optimizer=SGD, precision="bf16",
                                                   pipeline=compiled, threads=1)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=2, optimizer=SGD, schedule="1f1b-async", precision="bf16")
        state = pipeline_optimizer_state(deployment, compiled)
    assert_same_parameters(result, simulated)
    assert result.losses == pytest.approx(losses, rel=1e-6)
    assert all(tensor.dtype == torch.float32 for tensor in result.parameters.values() if tensor.is_floating_point())
    assert all(entries["momentum_buffer"].dtype == torch.float32 for entries in state.values())


def run_in_process(compiled: flatpack.Compiled, data: list, iterations: int, micro_batches: int, tmp_path,
                   vertical_sync: bool = False) -> tuple[list[tuple], list[StageTrainer], dict[int, int]]:
    """Every stage's StageTrainer in a thread of this process over a file store (what the
    functions run, without their processes), recording each task's weight version and a
    fingerprint of the weights it computes with: (stage, kind, sequence, version, step, sum),
    and by stage the most copies of its weights held at once."""
    from flatpack.backends.batch_checks import batch_values
    from flatpack.backends.functions import loss_output

    store = FileStore(tmp_path / "store")
    keys = RunKeys("versions")
    manifests = [artifact.manifest for artifact in compiled.artifacts]
    stages = stage_specs(manifests, compiled.info.input_names, [1] * len(manifests), [None] * len(manifests))
    spec = RunSpec(run="versions", stages=stages, micro_batches=micro_batches, batch=len(data[0][1]),
                   optimizer=ADAM, loss="cross_entropy", loss_output=loss_output(compiled), schedule="1f1b-async",
                   wait_timeout_s=60, vertical_sync=vertical_sync)
    for iteration in range(iterations):
        values, target, size = batch_values(compiled, data[iteration], iteration)
        for m in range(micro_batches):
            store.put(keys.data(iteration, m),
                      pack_values({name: split_value(value, size, micro_batches)[m] for name, value in values.items()}))
            store.put(keys.target(iteration, m), wire.dumps({TARGET: split_value(target, size, micro_batches)[m]}))
    log: list[tuple[int, str, int, int, int, float]] = []
    lock = threading.Lock()
    trainers = []
    peak_copies: dict[int, int] = {}  # by stage: the most copies of its weights held at once
    for artifact in compiled.artifacts:
        role = Role("spec", artifact.index, 0, 0, iterations)
        trainer = StageTrainer(spec, role, store, build_module(artifact), Recorder(artifact.index, 0))

        def observe(kind, iteration, micro_batch, version, weights, trainer=trainer):
            # copies of the stage's weights held now: the stash's, and the live ones where no
            # stashed version shares their storage
            stash = trainer.stash
            assert stash is not None  # the asynchronous schedule stashes weights
            copies = stash.held() + (trainer.call_steps not in stash.versions)
            peak_copies[trainer.role.stage] = max(peak_copies.get(trainer.role.stage, 0), copies)
            with lock:
                log.append((trainer.role.stage, kind, iteration * micro_batches + micro_batch, version,
                            trainer.call_steps, float(sum(w.detach().double().sum() for w in weights.values()))))

        trainer.observe_weights = observe
        trainers.append(trainer)

    def run(trainer: StageTrainer) -> None:
        with Lanes() as lanes:
            for iteration in range(iterations):
                trainer.run_iteration(iteration, lanes)

    threads = [threading.Thread(target=run, args=(trainer,)) for trainer in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads)
    return log, trainers, peak_copies


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_each_backward_computes_on_the_weights_its_forward_used(tmp_path, vertical_sync):
    """The versions recorded: every micro-batch's backward on every stage uses the version
    (and the very values) its forward used, though the stage has stepped in between; the
    versions are PipeDream's (a stage's own steps, or under vertical sync the first
    stage's); the pipeline is not flushed between iterations (a stage forwards the next
    iteration's micro-batches before backwarding this one's); a stash holds no version once
    the call has drained."""
    model, data = transformer_case()
    stages, micro_batches, iterations = 3, 2, 3
    compiled = compiled_with(model, data[0][0], [1] * stages, micro_batches=micro_batches)
    log, trainers, peak_copies = run_in_process(compiled, data, iterations, micro_batches, tmp_path, vertical_sync)
    total = iterations * micro_batches
    forwards = {(stage, seq): (version, steps, fingerprint) for stage, kind, seq, version, steps, fingerprint in log
                if kind == "F"}
    backwards = {(stage, seq): (version, steps, fingerprint) for stage, kind, seq, version, steps, fingerprint in log
                 if kind == "B"}
    assert set(forwards) == set(backwards) == {(s, g) for s in range(stages) for g in range(total)}
    stale = 0
    for key, (version, steps, fingerprint) in backwards.items():
        forward_version_used, _, forward_fingerprint = forwards[key]
        assert version == forward_version_used, key
        assert fingerprint == forward_fingerprint, key     # the same values, not only the same number
        stage, sequence = key
        layout = Layout.single(stages, micro_batches, vertical_sync)
        assert version == schedule_named("1f1b-async").weight_version(sequence, stage, layout)
        stale += steps > version        # the stage stepped between this forward and its backward
    assert stale > 0
    # no flush: stage 0 forwards iteration 1's first micro-batch before iteration 0's last backward
    order = [(kind, seq) for stage, kind, seq, *_ in log if stage == 0]
    assert order.index(("F", micro_batches)) < order.index(("B", micro_batches - 1))
    for trainer in trainers:
        assert trainer.call_steps == total
        assert trainer.stash is not None
        assert all(count == 0 for count in trainer.stash.users.values())
    # weight stashing's memory: S - s copies on stage s, what the pipedream cost model counts
    # (its in_flight weight versions); under vertical sync too, since a stage applies a step
    # only when a forward first asks for its version (its in-flight micro-batches hold S - s)
    modelled = [pipedream.versions_in_flight(compiled.plan, stage) for stage in range(stages)]
    assert modelled == [stages - s for s in range(stages)]
    peaks = [peak_copies[trainer.role.stage] for trainer in trainers]
    assert peaks == modelled


def test_calls_drain_the_pipeline_and_a_second_call_continues_from_the_first(s3_server):
    """Two calls of 3 iterations equal the simulation of calls of 3 (each starts with an
    empty pipeline from the weights and Adam moments the last left), not one call of 6."""
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    stages_of = parameter_stages(compiled)
    in_calls, _ = train_async_single_process(model, data, 6, stage_of=stages_of, stages=2, micro_batches=2,
                                             schedule=ASYNC, optimizer=ADAM, call_iterations=3)
    one_call, _ = train_async_single_process(model, data, 6, stage_of=stages_of, stages=2, micro_batches=2,
                                             schedule=ASYNC, optimizer=ADAM)
    assert any(not torch.allclose(a, b, atol=1e-4) for a, b in zip(in_calls.parameters(), one_call.parameters()))
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        deployment.train(data[:3], iterations=3, optimizer=ADAM, schedule="1f1b-async")
        result = deployment.train(data[3:], iterations=3, optimizer=ADAM, schedule="1f1b-async", batch_offset=3)
    assert_same_parameters(result, in_calls)


def test_a_lost_stage_replays_the_call_to_the_same_weights(s3_server):
    """Killed after a backward in iteration 2 (its weights stepped, micro-batches in flight),
    stage 0 restarts from the call's start (1f1b-async checkpoints only where the pipeline
    drains) and replays it with the same versions, its neighbours' tensors still in the store."""
    model, data = transformer_case()
    compiled = compiled_with(model, data[0][0], [1, 1, 1], micro_batches=4)
    simulated, _ = train_async_single_process(model, data, ITERATIONS, stage_of=parameter_stages(compiled), stages=3,
                                              schedule=ASYNC, micro_batches=4, optimizer=ADAM)
    kill = {"stage": 0, "replica": 0, "iteration": 2, "at": "backward", "action": "kill"}
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=ITERATIONS, optimizer=ADAM, schedule="1f1b-async", faults=[kill])
    assert [(r.worker, r.iteration) for r in result.restarts if r.reason == "lost"] == [("s0r0", 0)]
    assert_same_parameters(result, simulated)


def test_an_elastic_asynchronous_run_is_refused_before_any_function_starts(s3_server):
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        with pytest.raises(InputError, match="1f1b-async has micro-batches in flight with stashed weights across them"):
            deployment.train(data, iterations=2, optimizer=ADAM, schedule="1f1b-async",
                             elastic=lambda epoch, degrees: None, epoch_iterations=1)
        assert not deployment.workers


def test_flatpack_run_trains_asynchronously_and_holds_the_run_to_the_simulation(tmp_path, capsys, caplog):
    """The command line end to end, with evaluation calls (each drains the pipeline): the
    verdict compares the run with the simulation of the same asynchronous schedule."""
    code = cli.main(["run", "mlp", "--schedule", "1f1b-async", "--vertical-sync", "--replicas", "1", "--stages", "2",
                     "--batch", "8", "--micro-batches", "2", "--iterations", "4", "--eval-every", "2",
                     "--optimizer", "adamw", "--schedule-lr", "cosine", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1f1b-async checkpoints only where its pipeline drains" in caplog.text
    assert "after 8 steps" in out       # 4 iterations of 2 micro-batches, a step each
    assert "equivalence with single-process training: passed" in out


def test_a_replicated_asynchronous_run_leaves_no_round_in_the_store(s3_server):
    """PipeDream's 1F1B-RR reduces a replicated stage's gradients on the store once per round
    of micro-batches. Each call ends at a checkpoint, and the invoker deletes what a checkpoint
    covers: no round's chunk outlives its call (keyed by the run's micro-batch number they had
    outlived every checkpoint, and a long run's store grew by twice the stage's gradient a
    round)."""
    model, data = conv_case()
    compiled = compiled_with(model, data[0][0], [2, 1], micro_batches=4)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        deployment.train(data[:2], iterations=2, optimizer=ADAM, schedule=ASYNC)
        deployment.train(data[2:4], iterations=2, optimizer=ADAM, schedule=ASYNC, batch_offset=2)
        run = deployment.keys.run
        left = [key for kind in ("sync", "reduced") for key in deployment.store.list(f"{run}/{kind}/")]
    assert not left, f"{len(left)} round keys outlived their calls, e.g. {left[:2]}"
