"""What train() checks on a real deployment: bad data is refused before any function starts,
and an iteration whose loss is not finite warns once or stops the call, as asked."""

from __future__ import annotations

import warnings

import pytest
import torch

from flatpack.backends import local
from flatpack.errors import InputError, RunFailure
from tests.integration.test_local_training import batches, compiled_with, make_model

pytestmark = pytest.mark.slow

# plain SGD at this rate overflows float32 within two steps: the third loss is NaN
DIVERGING = {"name": "sgd", "lr": 1e38}


@pytest.fixture(scope="module")
def deployment(s3_server):
    compiled = compiled_with(make_model(), [(0, 50), (50, 100)], [1, 1], 2)
    with local.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployed:
        yield deployed


@pytest.mark.parametrize("bad, words", [
    (lambda data: [(data[0][0][:, :5], data[0][1])], "has shape"),
    (lambda data: [(data[0][0].double(), data[0][1])], "dtype float64"),
    (lambda data: [data[0], (data[1][0][:8], data[1][1][:8])], "batch 1 has 8 samples"),
], ids=["shape", "dtype", "varying-batch"])
def test_bad_batches_are_refused_before_any_function_starts(deployment, bad, words):
    calls = deployment.calls()
    with pytest.raises(InputError, match=words):
        deployment.train(bad(batches(2)), optimizer="sgd", wait_timeout_s=30, timeout_s=60)
    # nothing was launched or recorded: no function, no call record
    assert deployment.workers == {}
    assert deployment.calls() == calls


def test_a_non_finite_loss_stops_the_call_when_asked(deployment):
    with pytest.raises(RunFailure, match=r"has loss (nan|inf).*Lower the learning rate"):
        deployment.train(batches(4), optimizer=DIVERGING, non_finite="error", wait_timeout_s=30, timeout_s=120)


def test_a_non_finite_loss_warns_once_and_trains_on(deployment):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = deployment.train(batches(4), optimizer=DIVERGING, wait_timeout_s=30, timeout_s=120)
    said = [w for w in caught if "the weights are no longer finite" in str(w.message)]
    assert len(said) == 1
    assert len(result.losses) == 4 and not all(torch.isfinite(torch.tensor(result.losses)))


@pytest.mark.parametrize("bad, words", [
    (lambda x: x.double(), r"input '\w+' has dtype float64, but the model was compiled for float32"),
    (lambda x: x.unsqueeze(-1), r"input '\w+' has shape \(\d+, 8, 1\), 3 dimensions, but the model was compiled "
                                r"for 2: \(\d+, 8\)"),
], ids=["dtype", "rank"])
def test_a_stage_given_a_wrong_input_stops_naming_it(deployment, bad, words):
    # a batch function's first batch is checked before launch; a wrong later one reaches the
    # stage worker, whose own check refuses it before the generated stage runs
    good = batches(2)

    def batch(iteration: int):
        inputs, target = good[iteration]
        return (bad(inputs), target) if iteration == 1 else (inputs, target)

    with pytest.raises(RunFailure, match=r"stage 0, replica 0\) stopped before running its stage on a wrong input: "
                                         r"stage 0, iteration \d+, micro-batch 0: " + words) as caught:
        deployment.train(batch, iterations=2, optimizer="sgd", wait_timeout_s=30, timeout_s=60)
    assert "Traceback" not in str(caught.value)
