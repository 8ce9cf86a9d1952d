"""The warm pool's sizing (serve.scaling) and the policy and batcher with several replicas,
without a server: the decision from the latency model, the idle window, one batch per replica."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from flatpack.serve.batcher import Batcher, BatchPolicy, LatencyModel
from flatpack.serve.scaling import Autoscaler, quiet, wanted_replicas
from flatpack.runtime.request_tensors import InputContract, parse_request
from flatpack.stage.tensor_check import TensorSpec

LINE = LatencyModel(0.010, 0.001, "test")       # 10 ms + 1 ms per sample
CONTRACT = InputContract.of(["x"], [TensorSpec((2, 3), "float32", (0,))])


def test_replicas_share_the_queue_and_multiply_the_capacity():
    one = BatchPolicy.choose(LINE, 0.100, cap=64)          # B = 30, t(30) = 40 ms
    three = dataclasses.replace(one, replicas=3)
    assert three.capacity_samples_s == pytest.approx(3 * one.capacity_samples_s)
    assert one.queue_seconds(90) == pytest.approx(0.120)    # three batches one after another
    assert three.queue_seconds(90) == pytest.approx(0.040)  # side by side
    assert three.queue_seconds(100) == pytest.approx(0.040 + 0.020)   # then the rest of 10
    assert three.queue_seconds(70) == pytest.approx(0.040)  # 2 full and the rest in one round
    # one replica finishes 30 samples per 40 ms: within h·S = 80 ms, two batches
    assert one.samples_within(0.080) == 60


def test_the_pool_wants_what_the_latency_model_says_the_in_flight_samples_need():
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)        # one replica serves 60 samples within 80 ms
    assert wanted_replicas(policy, 0, 0, 1, 1, 4).wanted == 1            # the floor
    assert wanted_replicas(policy, 60, 0, 1, 1, 4).wanted == 1
    assert wanted_replicas(policy, 61, 0, 1, 1, 4).wanted == 2
    assert wanted_replicas(policy, 500, 0, 1, 1, 4).wanted == 4          # the ceiling
    shed = wanted_replicas(policy, 10, 3, 2, 1, 4)
    assert shed.wanted == 3 and "3 request(s) shed with 2" in shed.reason       # a shed asks for one more


def test_only_a_quiet_pool_counts_towards_scaling_down():
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)        # one replica serves 60 samples within 80 ms
    decision = wanted_replicas(policy, 50, 0, 2, 1, 4)
    assert decision.wanted == 1                              # one replica would do...
    assert not quiet(decision, 50, 0, 2)                     # ...but 50 > half of 60: no step towards shrinking
    assert quiet(decision, 30, 0, 2) and not quiet(decision, 30, 1, 2)


def test_autoscaler_grows_one_at_a_time_and_shrinks_to_the_floor_after_the_idle_window():
    now = [0.0]
    pool = {"replicas": 1, "demand": 200}
    events = []
    policy = BatchPolicy.choose(LINE, 0.100, cap=64)

    async def grow():
        pool["replicas"] += 1

    async def shrink():
        pool["replicas"] -= 1
        return True

    scaler = Autoscaler(floor=1, ceiling=3, idle_s=5.0, demand=lambda: (pool["demand"], 0), policy=lambda: policy,
                        size=lambda: pool["replicas"], grow=grow, shrink=shrink,
                        on_event=lambda direction, size, reason: events.append((direction, size)),
                        clock=lambda: now[0])

    async def ticks(count: int, step: float) -> None:
        for _ in range(count):
            now[0] += step
            await scaler.tick()

    asyncio.run(ticks(5, 0.2))
    assert pool["replicas"] == 3 and events == [("up", 2), ("up", 3)]     # 200 samples want 4, capped at 3
    pool["demand"] = 0
    asyncio.run(ticks(20, 0.2))                  # 4 s idle: under the window, nothing goes
    assert pool["replicas"] == 3
    asyncio.run(ticks(6, 0.2))                   # past 5 s: one goes, and the window starts again
    assert pool["replicas"] == 2 and events[-1] == ("down", 2)
    asyncio.run(ticks(30, 0.2))
    assert pool["replicas"] == 1 and events[-1] == ("down", 1)
    asyncio.run(ticks(60, 0.2))
    assert pool["replicas"] == 1                 # never under the floor


def _request(x: torch.Tensor):
    return parse_request(f'{{"inputs": {{"x": {x.tolist()}}}}}'.encode(), "application/json", CONTRACT, 64)


def test_the_batcher_runs_one_batch_per_replica_at_once():
    running, peak = [0], [0]

    async def run_batch(tensors):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return {"output": tensors["x"] * 2}, "digest"

    async def scenario(replicas: int) -> int:
        running[0] = peak[0] = 0
        policy = BatchPolicy(2, 0.0, 10.0, LINE, True, replicas=replicas)
        batcher = Batcher(policy, run_batch)
        batcher.start()
        inputs = [torch.randn(2, 3) for _ in range(8)]
        answers = await asyncio.gather(*(batcher.submit(_request(x)) for x in inputs))
        await batcher.stop()
        for x, answer in zip(inputs, answers):
            torch.testing.assert_close(answer.outputs["output"], x * 2)
        return peak[0]

    assert asyncio.run(scenario(1)) == 1
    assert asyncio.run(scenario(3)) == 3
