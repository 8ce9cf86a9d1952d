"""``flatpack serve`` whose pool and plan follow the load, with a real uvicorn server and a
real httpx client: replicas of the fork-join group scale up under a burst and back down to the
floor when it stops (serve.scaling), and the plan is re-chosen, blue/green, when the batch
sizes move (serve.replan); no request fails either way."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest
import torch

import flatpack
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.serve.server import Server
from flatpack.serve.settings import ServeSettings
from tests.integration.test_serve import SAMPLE, _metric, _output, _predict, _wait_ready
from tests.models import ConvBlocks

pytestmark = pytest.mark.timeout(600)
SPLIT = (StagePlan(0, 1, None, 2, split="channel"), StagePlan(2, 4))     # a master and two workers
SMALL = (StagePlan(0, 4, 1769),)        # the master alone on one vCPU's tier
LARGE = (StagePlan(0, 4, 3008),)        # ... on a larger tier (1.7 vCPUs), for larger batches


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ConvBlocks().eval()


def _count(pattern: str, metrics: str) -> float:
    found = re.search(pattern, metrics, re.M)
    return float(found.group(1)) if found else 0.0


def _wait_metric(url: str, pattern: str, wanted: float, timeout_s: float = 120) -> str:
    """/metrics once the value ``pattern`` matches is ``wanted`` (the test fails naming it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        if _count(pattern, metrics) == wanted:
            return metrics
        time.sleep(0.2)
    raise AssertionError(f"{pattern} never read {wanted} within {timeout_s} s")


def test_replicas_scale_up_under_a_burst_and_down_to_the_floor_when_it_stops(model):
    """A tight SLO (50 ms) and batches of at most 2 samples: one replica serves a handful of
    samples within the SLO, so bursts of 48 requests want more; the pool grows to its ceiling
    of 2 while the bursts last and shrinks to the floor of 1 after 1 s idle. Every answer is
    the model's or a 429 (shed by admission control), never a 5xx."""
    compiled = flatpack.compile(model, (torch.randn(2, *SAMPLE),), plan=Plan(SPLIT, 5))
    settings = ServeSettings(slo_s=0.05, port=0, max_batch=2, min_replicas=1, max_replicas=2, idle_s=1.0)
    running = Server(compiled, settings).start()
    responses: list[tuple[torch.Tensor, httpx.Response]] = []
    try:
        _wait_ready(running.url)
        assert _count(r"^flatpack_serve_replicas (\S+)$", httpx.get(f"{running.url}/metrics").text) == 1

        async def bursts() -> None:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                for _ in range(100):
                    inputs = [torch.randn(1, *SAMPLE) for _ in range(48)]
                    answers = await asyncio.gather(*(_predict(client, running.url, x, False) for x in inputs))
                    responses.extend(zip(inputs, answers))
                    metrics = (await client.get(f"{running.url}/metrics")).text
                    if _count(r"^flatpack_serve_replicas (\S+)$", metrics) == 2:
                        return

        asyncio.run(bursts())
        grown = httpx.get(f"{running.url}/metrics").text
        assert _count(r'^flatpack_serve_scale_events_total\{direction="up"\} (\S+)$', grown) == 1
        assert _count(r"^flatpack_serve_cold_starts_total (\S+)$", grown) == 6     # two groups of 3 functions
        shrunk = _wait_metric(running.url, r"^flatpack_serve_replicas (\S+)$", 1)
        assert _count(r'^flatpack_serve_scale_events_total\{direction="down"\} (\S+)$', shrunk) == 1
        assert _count(r"^flatpack_serve_errors_total (\S+)$", shrunk) == 0
        assert len(running.service.version.replicas) == 1
    finally:
        running.stop()
    served = [(x, response) for x, response in responses if response.status_code == 200]
    assert served, "no request of the bursts was served"
    with torch.no_grad():
        for x, response in served:
            torch.testing.assert_close(_output(response), model(x))
    assert {response.status_code for _, response in responses} <= {200, 429}


def test_the_plan_is_re_chosen_blue_green_when_the_batch_sizes_move(model, monkeypatch):
    """Served on the 1,769 MB tier, first with requests one at a time (batches of 1), then with
    32 requests of 4 samples at once (batches of 4 and more). The solver here stands in for dp
    with the choice known in advance: the 1,769 MB tier for batches under 4, the 3,008 MB one
    from 4 up (one function each: the switch's warm-up stays short). The batch sizes moving
    from 1 makes the server solve again, switch blue/green to the larger tier, and say why;
    every request is answered, by the model's outputs, before, during and after the switch."""
    from flatpack.serve import replan

    monkeypatch.setattr(replan, "LOOK_EVERY", 8)
    chosen: list[int] = []

    def by_batch(problem):
        chosen.append(problem.workload.batch)
        return Plan(LARGE if problem.workload.batch >= 4 else SMALL, 5)

    compiled = flatpack.compile(model, (torch.randn(2, *SAMPLE),), plan=Plan(SMALL, 5))
    settings = ServeSettings(slo_s=60.0, port=0, replan_solver=by_batch)
    running = Server(compiled, settings).start()
    results: list[tuple[torch.Tensor, httpx.Response]] = []
    try:
        _wait_ready(running.url)

        async def load() -> None:
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                for _ in range(12):                                 # batches of 1: the plan stays
                    x = torch.randn(1, *SAMPLE)
                    results.append((x, await _predict(client, running.url, x, False)))
                for _ in range(30):                                 # batches of 4 and more
                    inputs = [torch.randn(4, *SAMPLE) for _ in range(32)]
                    answers = await asyncio.gather(*(_predict(client, running.url, x, index % 2 == 0)
                                                     for index, x in enumerate(inputs)))
                    results.extend(zip(inputs, answers))
                    if results[-1][1].headers["x-flatpack-digest"] != compiled.digest:
                        return

        asyncio.run(load())
        metrics = httpx.get(f"{running.url}/metrics").text
        replanned = running.service.last_replan
    finally:
        running.stop()
    assert chosen[0] == 1 and chosen[-1] >= 4           # looked at batches of 1, then of 4 and more
    assert replanned is not None and "the batches moved to" in replanned.reason
    assert _metric(r"^flatpack_serve_replans_total (\S+)$", metrics) == "1.0"
    assert replanned.compiled.plan.stages[0].memory_mb == 3008
    digests = [response.headers["x-flatpack-digest"] for _, response in results]
    assert digests[0] == compiled.digest and digests[-1] == replanned.compiled.digest
    with torch.no_grad():
        for x, response in results:
            assert response.status_code == 200, response.text
            torch.testing.assert_close(_output(response), model(x))
