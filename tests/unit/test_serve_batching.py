"""The serve batcher without a server: the SLO-bounded policy's formula, admission, and the
queue that concatenates requests along dimension 0 and splits the outputs back."""

from __future__ import annotations

import asyncio

import pytest
import torch

from flatpack.serve.batcher import Batcher, BatchPolicy, Closed, LatencyModel, Overloaded
from flatpack.runtime.request_tensors import InputContract, RequestError, parse_request
from flatpack.stage.tensor_check import TensorSpec

LINE = LatencyModel(0.010, 0.001, "test")       # 10 ms + 1 ms per sample


def test_latency_model_fit_recovers_a_line_and_never_slopes_down():
    fitted = LatencyModel.fit([(1, 0.011), (16, 0.026), (16, 0.026)], "measured")
    assert fitted.fixed_s == pytest.approx(0.010) and fitted.per_sample_s == pytest.approx(0.001)
    flat = LatencyModel.fit([(1, 0.030), (16, 0.020)], "measured")
    assert flat.per_sample_s == 0.0 and flat.fixed_s == pytest.approx(0.025)


def test_policy_is_the_largest_batch_with_twice_its_latency_in_the_slo_and_the_delay_left():
    # S = 100 ms, h = 0.8: 2·(10 + b) ≤ 80 → B = 30, t(B) = 40 ms, D = min(80 − 80, 40) = 0
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)
    assert (policy.max_batch, policy.meets_slo) == (30, True)
    assert policy.max_delay_s == pytest.approx(0.0)
    # S = 200 ms: B = the cap 64, t(B) = 74 ms, D = min(160 − 148, 74) = 12 ms
    policy = BatchPolicy.choose(LINE, 0.200, cap=64)
    assert policy.max_batch == 64 and policy.max_delay_s == pytest.approx(0.012)
    # S = 1 s: D is capped at one batch's time, t(64) = 74 ms
    assert BatchPolicy.choose(LINE, 1.0, cap=64).max_delay_s == pytest.approx(0.074)


def test_an_slo_no_batch_meets_serves_for_throughput():
    policy = BatchPolicy.choose(LatencyModel(0.3, 0.0, "test"), 0.5, cap=16)
    assert (policy.max_batch, policy.max_delay_s, policy.meets_slo) == (16, 0.0, False)


def test_admission_sheds_what_the_model_says_would_miss_the_slo():
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)      # B = 30, t(b) = 10 ms + b ms
    assert policy.admits(0, 30, running_samples=30)       # an empty queue always admits
    assert policy.admits(25, 10, running_samples=30)      # t(30) + t(5) + in service t(30) = 95 ms
    assert not policy.admits(40, 10, running_samples=30)  # t(30) + t(20) + t(30) = 110 ms
    assert policy.admits(40, 10, running_samples=0)       # t(30) + t(20) = 70 ms
    assert not policy.admits(80, 10, running_samples=0)   # 3·t(30) = 120 ms


def _request(contract: InputContract, x: torch.Tensor):
    return parse_request(f'{{"inputs": {{"x": {x.tolist()}}}}}'.encode(), "application/json", contract, 64)


CONTRACT = InputContract.of(["x"], [TensorSpec((2, 3), "float32", (0,))])


def test_requests_are_concatenated_into_one_batch_and_split_back():
    calls = []

    async def run_batch(tensors):
        calls.append(tensors["x"].shape[0])
        return {"output": tensors["x"] * 2}, "digest"

    async def scenario():
        batcher = Batcher(BatchPolicy(16, 0.5, 1.0, LINE, True), run_batch)
        batcher.start()
        inputs = [torch.randn(size, 3) for size in (1, 2, 3, 4)]
        answers = await asyncio.gather(*(batcher.submit(_request(CONTRACT, x)) for x in inputs))
        await batcher.stop()
        return inputs, answers

    inputs, answers = asyncio.run(scenario())
    assert calls == [10]          # 1 + 2 + 3 + 4 samples, one batch
    for x, answer in zip(inputs, answers):
        torch.testing.assert_close(answer.outputs["output"], x * 2)
        assert answer.digest == "digest" and answer.batch_samples == 10


def test_a_failed_batch_fails_its_requests_and_the_next_batch_runs():
    failures = [True]

    async def run_batch(tensors):
        if failures.pop(0) if failures else False:
            raise RuntimeError("function lost")
        return {"output": tensors["x"]}, "digest"

    async def scenario():
        batcher = Batcher(BatchPolicy(16, 0.0, 1.0, LINE, True), run_batch)
        batcher.start()
        with pytest.raises(RuntimeError, match="function lost"):
            await batcher.submit(_request(CONTRACT, torch.ones(1, 3)))
        answer = await batcher.submit(_request(CONTRACT, torch.ones(2, 3)))
        await batcher.stop()
        return answer

    assert asyncio.run(scenario()).outputs["output"].shape == (2, 3)


def test_a_full_queue_sheds_and_a_closed_batcher_refuses():
    # seconds, not milliseconds: on a loaded host the event loop stalls for tens of ms, and a
    # 100 ms SLO shed the admitted requests on their deadline
    async def slow(tensors):
        await asyncio.sleep(0.5)
        return {"output": tensors["x"]}, "digest"

    async def scenario():
        policy = BatchPolicy.choose(LatencyModel(0.400, 0.0, "test"), 1.000, cap=2)   # 2·400 ms ≤ 800 ms: B = 2
        batcher = Batcher(policy, slow)
        batcher.start()
        first = asyncio.create_task(batcher.submit(_request(CONTRACT, torch.ones(2, 3))))
        await asyncio.sleep(0)
        second = asyncio.create_task(batcher.submit(_request(CONTRACT, torch.ones(2, 3))))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as shed:     # behind 2 or 4 queued samples (and a batch): ≥ 1.2 s
            await batcher.submit(_request(CONTRACT, torch.ones(2, 3)))
        assert shed.value.reason == "admission"
        assert shed.value.retry_after_s == pytest.approx(policy.backlog_seconds(2, 2)) or \
            shed.value.retry_after_s == pytest.approx(policy.backlog_seconds(4, 0))
        await asyncio.gather(first, second)
        await batcher.stop()
        with pytest.raises(Closed):
            await batcher.submit(_request(CONTRACT, torch.ones(2, 3)))

    asyncio.run(scenario())


def test_a_request_queued_past_what_the_slo_allows_is_shed_on_deadline_and_the_rest_run():
    """The model says 10 ms + 1 ms/sample, the batches really take 150 ms: a request queued
    behind one has waited longer than the 100 ms SLO allows by the time its batch forms."""
    ran = []

    async def slower_than_predicted(tensors):
        ran.append(tensors["x"].shape[0])
        await asyncio.sleep(0.15)
        return {"output": tensors["x"]}, "digest"

    async def scenario():
        policy = BatchPolicy(1, 0.0, 0.100, LINE, True)       # one sample per batch
        batcher = Batcher(policy, slower_than_predicted)
        batcher.start()
        first = asyncio.create_task(batcher.submit(_request(CONTRACT, torch.ones(1, 3))))
        await asyncio.sleep(0.01)                              # the first batch is running
        second = asyncio.create_task(batcher.submit(_request(CONTRACT, torch.ones(1, 3))))
        answered = await first
        with pytest.raises(Overloaded) as shed:
            await second
        later = await batcher.submit(_request(CONTRACT, torch.ones(1, 3)))   # an empty queue: admitted, run
        await batcher.stop()
        return answered, shed.value, later

    answered, shed, later = asyncio.run(scenario())
    assert answered.batch_samples == 1 and later.batch_samples == 1
    assert shed.reason == "deadline" and ran == [1, 1]        # the shed request never ran


def test_capacity_and_the_sized_load_follow_the_policy():
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)          # B = 30, t(30) = 40 ms
    assert policy.capacity_samples_s == pytest.approx(30 / 0.040)
    assert policy.sized_samples_s == pytest.approx(0.8 * 30 / 0.040)
    assert policy.backlog_seconds(40, 30) == pytest.approx(0.040 + 0.020 + 0.040)
    assert not BatchPolicy.choose(LatencyModel(0.3, 0.0, "test"), 0.5, cap=16).expired(10.0, 1)  # for throughput


def test_requests_with_other_free_sizes_are_batched_apart():
    contract = InputContract.of(["x"], [TensorSpec((2, 3), "float32", (0, 1))])
    sizes = []

    async def run_batch(tensors):
        sizes.append(tuple(tensors["x"].shape))
        return {"output": tensors["x"]}, "digest"

    async def scenario():
        batcher = Batcher(BatchPolicy(16, 0.05, 1.0, LINE, True), run_batch)
        batcher.start()
        await asyncio.gather(*(batcher.submit(_request(contract, torch.ones(1, width))) for width in (3, 4, 3)))
        await batcher.stop()

    asyncio.run(scenario())
    assert sorted(sizes) == [(1, 4), (2, 3)]


def test_a_fraction_for_an_integer_input_is_refused():
    contract = InputContract.of(["ids"], [TensorSpec((2, 5), "int64", (0,))])
    with pytest.raises(RequestError, match="holds fractions, but the model takes int64"):
        parse_request(b'{"inputs": {"ids": [[1.5, 2, 3, 4, 5]]}}', "application/json", contract, 64)


def test_flatpack_serve_is_the_package_and_callable_and_the_verb_is_registered():
    import flatpack
    import flatpack.serve.server
    from flatpack.cli import build_parser

    assert callable(flatpack.serve) and flatpack.serve.server.Server is not None
    args = build_parser().parse_args(["serve", "art", "--digest", "d" * 64, "--slo-ms", "250", "--port", "0"])
    assert (args.model, args.slo_ms, args.port, args.target) == ("art", 250.0, 0, "local")


def test_settings_refuse_bad_values_and_never_show_the_token(tmp_path, monkeypatch):
    from flatpack.errors import InputError
    from flatpack.serve.settings import ServeSettings, read_admin_token

    with pytest.raises(InputError, match="runs on local or ray so far, not 'aws-lambda'"):
        ServeSettings(slo_s=0.2, target="aws-lambda")
    with pytest.raises(InputError, match="--address names the Ray cluster"):
        ServeSettings(slo_s=0.2, address="auto")
    with pytest.raises(InputError, match="positive number of seconds"):
        ServeSettings(slo_s=0.0)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    token = read_admin_token(token_file)
    assert token == "s3cret-token-0123456789"
    assert token not in repr(ServeSettings(slo_s=0.2, admin_token=token))
    monkeypatch.setenv("FLATPACK_ADMIN_TOKEN", "short")
    with pytest.raises(InputError, match="shorter than 16 characters") as refused:
        read_admin_token()
    assert "short" not in str(refused.value).replace("shorter", "")


def test_refit_moves_the_fixed_part_to_the_batches_served_and_keeps_the_warm_up_slope():
    warm = LatencyModel(0.100, 0.002, "measured at warm-up")
    refitted = warm.refit([(4, 0.308), (8, 0.316), (2, 0.504), (6, 0.312)])
    assert refitted.per_sample_s == 0.002 and refitted.fixed_s == pytest.approx(0.300)
    assert refitted.source == "measured while serving"
