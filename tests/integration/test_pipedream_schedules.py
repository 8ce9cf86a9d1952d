"""``flatpack run`` trains under PipeDream's asynchronous schedules with replicated stages
(1F1B-RR, ``--schedule 1f1b-async``; PipeDream-2BW, ``--schedule 2bw``) on plans whose
stages have their own replica degrees (``--stage-replicas``), with dropout on, and its
verdict compares the run exactly with the single-process simulation of the same version
rule (``reference.train_async_single_process``); a simulation whose rule is one step off
on one stage fails it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from flatpack import verdict
from flatpack.cli import main
from flatpack.schedules import AsynchronousOneForwardOneBackward, Layout

MODEL = f"{Path(__file__).with_name('dropout_model.py')}:mlp_with_dropout"


def run(tmp_path: Path, capsys, stages: int, degrees: str, schedule: str, *extra: str, status: int = 0) -> str:
    assert main(["run", MODEL, "--stages", str(stages), "--stage-replicas", degrees, "--batch", "16",
                 "--micro-batches", "4", "--iterations", "3", "--optimizer", "adam", "--schedule", schedule,
                 "--out", str(tmp_path / "run"), *extra]) == status
    return capsys.readouterr().out


@pytest.mark.parametrize("schedule", ["1f1b-async", "2bw"])
@pytest.mark.parametrize(("stages", "degrees"), [(2, "1,2"), (3, "2,1,2")])
def test_replicated_stages_train_equivalent_to_the_simulation_of_their_schedule(tmp_path, capsys, schedule, stages,
                                                                                 degrees):
    printed = run(tmp_path, capsys, stages, degrees, schedule)
    assert (f"passed: equivalent ({stages} stages, replicas {degrees}, 4 micro-batches, 3 iterations"
            in printed), printed[-3000:]
    assert "dropout on (p > 0 in 2 modules)" in printed


def test_2bw_clips_to_the_global_norm_over_the_stages_and_stays_equivalent(tmp_path, capsys):
    printed = run(tmp_path, capsys, 3, "2,1,2", "2bw", "--clip-grad-norm", "0.05")
    assert "passed: equivalent (3 stages, replicas 2,1,2, 4 micro-batches, 3 iterations" in printed, printed[-3000:]
    assert "gradients clipped to norm 0.05" in printed


@dataclass(frozen=True)
class OneStepStaleOnStage1(AsynchronousOneForwardOneBackward):
    """1F1B-RR's rule with stage 1 one version behind the run's (a wrong reference)."""

    def weight_version(self, sequence: int, stage: int, layout: Layout) -> int:
        version = super().weight_version(sequence, stage, layout)
        return max(0, version - 1) if stage == 1 else version


def test_a_reference_whose_version_rule_is_off_by_one_on_one_stage_fails_the_verdict(tmp_path, capsys, monkeypatch):
    simulate = verdict.train_async_single_process

    def off_by_one(*args, **kwargs):
        return simulate(*args, **{**kwargs, "schedule": OneStepStaleOnStage1()})

    # the verdict runs in this process; the workers, processes of their own, keep the true rule
    monkeypatch.setattr(verdict, "train_async_single_process", off_by_one)
    printed = run(tmp_path, capsys, 2, "1,2", "1f1b-async", status=1)
    assert "FAILED: not equivalent (2 stages, replicas 1,2, 4 micro-batches, 3 iterations" in printed, printed[-3000:]


@pytest.mark.parametrize(("schedule", "vertical_sync", "accumulate"), [("2bw", False, 2), ("1f1b-async", True, 1)])
def test_a_weight_tied_across_stages_steps_on_the_holders_summed_gradient(s3_server, schedule, vertical_sync,
                                                                          accumulate):
    """The tied weight lives on both stages; 2BW steps every stage at the same round, and
    1F1B under vertical sync steps every stage on micro-batch g on one version, so each holder
    adds the other's gradient of the round (and the clipping counts it once), as the single
    process's one parameter does."""
    import torch

    from flatpack.analysis.reference import train_async_single_process
    from flatpack.backends import local
    from flatpack.runtime.optim import OptimizerSpec
    from flatpack.verdict import parameter_stages
    from flatpack.weights import with_aliases
    from tests.integration.test_training_knobs import BATCH, TiedNet, assert_same_parameters, compiled_with

    torch.manual_seed(0)
    model = TiedNet()
    generator = torch.Generator().manual_seed(6)
    data = [(torch.randint(0, 32, (BATCH, 5), generator=generator), torch.randint(0, 32, (BATCH,), generator=generator))
            for _ in range(4)]
    compiled = compiled_with(model, data[0][0], [1, 1], micro_batches=2)
    assert any(entry.shared_with for artifact in compiled.artifacts for entry in artifact.manifest.parameters)
    spec = OptimizerSpec("sgd", lr=0.5, clip_grad_norm=0.05, accumulate=accumulate)
    reference, _ = train_async_single_process(model, data, 4, schedule=schedule, stage_of=parameter_stages(compiled),
                                              stages=2, micro_batches=2, optimizer=spec, vertical_sync=vertical_sync)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(data, iterations=4, optimizer=spec, schedule=schedule, vertical_sync=vertical_sync)
    assert_same_parameters(dataclasses.replace(result, parameters=with_aliases(compiled, result.parameters)),
                           reference)


def test_1f1b_async_clips_to_the_global_norm_under_vertical_sync(tmp_path, capsys):
    """Under vertical sync no stage steps on micro-batch g before the first stage's backward
    of g has run, so every stage can wait for the global norm of g's gradient without a wait
    cycle (docs/training.md); the run equals the simulation that clips each step."""
    assert main(["run", MODEL, "--stages", "3", "--batch", "16", "--micro-batches", "4", "--iterations", "3",
                 "--optimizer", "adam", "--schedule", "1f1b-async", "--vertical-sync", "--clip-grad-norm", "0.05",
                 "--replicas", "1", "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "passed: equivalent (3 stages, replicas 1,1,1, 4 micro-batches, 3 iterations" in printed, printed[-3000:]
    assert "gradients clipped to norm 0.05" in printed
