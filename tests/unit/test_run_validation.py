"""flatpack run/demo refuse bad options with exit 2 and one paragraph, before loading the model
or starting anything; train() refuses bad batches and optimizer specs before launching."""

from __future__ import annotations

import io

import pytest
import torch

from flatpack import cli
from flatpack.errors import InputError
from flatpack.runtime.optim import OptimizerSpec


@pytest.mark.parametrize("args, words", [
    (["--batch", "-4"], "--batch must be a positive"),
    (["--iterations", "0"], "--iterations must be at least 1"),
    (["--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--batch", "4", "--micro-batches", "8"], "more than the 4 samples"),
    (["--batch", "10", "--micro-batches", "4"], "does not divide into 4"),
    (["--optimizer", "adma"], "did you mean 'adam'"),
    (["--lr", "-1"], "--lr must be a positive"),
    (["--solver", "balancd"], "did you mean 'balanced'"),
    (["--replicas", "0"], "--replicas lists"),
    (["--epoch-iterations", "3"], "applies to --replan"),
    (["--replan", "--epoch-iterations", "2", "--iterations", "8"], "--epoch-iterations 3 or more"),
    (["--replan", "--epoch-iterations", "4", "--iterations", "4"], "no epoch boundary"),
    (["--replan", "--epoch-iterations", "3", "--iterations", "8", "--replan-threshold", "1.5"], "share in [0, 1)"),
    (["--replan", "--epoch-iterations", "3", "--iterations", "8", "--schedule", "1f1b-async", "--replicas", "1"],
     "1f1b-async"),
    (["--replan", "--epoch-iterations", "3", "--iterations", "8", "--precision", "bf16"], "--precision fp32"),
    (["--elastic-objective", "dollars"], "apply to --elastic auto"),
    (["--elastic", "auto", "--replan", "--epoch-iterations", "3", "--iterations", "8"], "give one of them"),
    (["--elastic", "auto", "--epoch-iterations", "2", "--iterations", "8"], "--elastic auto re-fits"),
    (["--elastic", "auto", "--epoch-iterations", "3", "--iterations", "8", "--elastic-replicas", "0,2"],
     "--elastic-replicas gives the least"),
    (["--elastic", "auto", "--epoch-iterations", "3", "--iterations", "8", "--schedule", "1f1b-async",
      "--replicas", "1"], "elastic re-scaling changes replica degrees"),
])
def test_bad_run_options_exit_2_before_the_model_is_built(args, words, capsys, monkeypatch, tmp_path):
    def never(*_a, **_k):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "load_factory", never)
    code = cli.main(["run", "mlp", "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_demo_refuses_zero_iterations(capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_factory", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    assert cli.main(["demo", "--iterations", "0"]) == 2
    assert "--iterations must be at least 1" in capsys.readouterr().err


def test_a_model_without_trainable_parameters_is_refused_before_compiling(tmp_path):
    from flatpack.job import JobOptions, run_training

    model = torch.nn.Sequential(torch.nn.ReLU())
    with pytest.raises(InputError, match="no trainable parameters"):
        run_training(model, (torch.randn(8, 4),), JobOptions.of(batch=8, out=tmp_path), stream=io.StringIO())


def test_optimizer_option_typos_name_the_key_and_the_valid_ones():
    with pytest.raises(InputError, match=r"'lrr' \(did you mean 'lr'\?\).*its options are: lr, betas"):
        OptimizerSpec.of({"name": "adam", "lrr": 0.1})
    with pytest.raises(InputError, match="did you mean 'adam'"):
        OptimizerSpec.of({"name": "adamm"})


def _compiled():
    import flatpack
    from flatpack.examples import mlp

    model, example = mlp()
    return flatpack.compile(model, example, solver="balanced")


def test_batches_are_checked_against_the_compiled_example():
    from flatpack.backends.batch_checks import check_batch, check_training_call

    compiled = _compiled()
    good = ((torch.randn(16, 64),), torch.randint(0, 10, (16,)))
    assert check_training_call(compiled, [good, good], iterations=2, micro_batches=4) == 16
    with pytest.raises(InputError, match=r"batch 0: input 'input_1' has shape \(16, 32\).*dimension 0 may differ.*dim "
                                         r"1 must be 64, got 32"):
        check_batch(compiled, ((torch.randn(16, 32),), good[1]), 0)
    with pytest.raises(InputError, match="dtype float64"):
        check_batch(compiled, ((torch.randn(16, 64, dtype=torch.float64),), good[1]), 0)
    short = ((torch.randn(12, 64),), torch.randint(0, 10, (12,)))
    with pytest.raises(InputError, match="batch 1 has 12 samples but the run's batches have 16"):
        check_training_call(compiled, [good, short], iterations=2, micro_batches=4)
    with pytest.raises(InputError, match="batch 0 has 12 samples"):
        check_training_call(compiled, [short], iterations=1, micro_batches=4, previous_batch_size=16)
    bad = torch.randn(16, 64)
    bad[3, 5] = float("nan")
    with pytest.warns(RuntimeWarning, match="NaN"):
        check_batch(compiled, ((bad,), good[1]), 0)
    with pytest.raises(InputError, match="NaN"):
        check_batch(compiled, ((bad,), good[1]), 0, non_finite="error")
    check_batch(compiled, ((bad,), good[1]), 0, non_finite="ignore")
    with pytest.raises(InputError, match="beta"):
        check_training_call(compiled, [good], iterations=1, micro_batches=4, optimizer={"name": "adam", "beta": 1})
