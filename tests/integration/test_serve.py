"""``flatpack serve`` end to end: a real uvicorn server on a free port (on a thread, or in a
subprocess for SIGTERM), a real httpx client, the local backend's functions behind it.

ConvBlocks is served with its first group split by channel over two worker functions (any
batch size runs), so every answer crosses the fork-join runtime."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import flatpack
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.serve.server import Server
from flatpack.serve.settings import ServeSettings
from tests.models import ConvBlocks
from tests.proctree import cmdline, descendants, kill_all, wait_gone

pytestmark = pytest.mark.timeout(600)
SAMPLE = (3, 6, 6)
TOKEN = "test-token-0123456789abcdef"
READY_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return ConvBlocks().eval()


def _compile(model: torch.nn.Module, stages: tuple[StagePlan, ...]) -> flatpack.Compiled:
    return flatpack.compile(model, (torch.randn(2, *SAMPLE),), plan=Plan(stages, 5))


@pytest.fixture(scope="module")
def artifacts(model, tmp_path_factory) -> tuple[Path, str, Path, str]:
    """Two artifacts of the same model under two plans (two digests): blue and green."""
    root = tmp_path_factory.mktemp("serve")
    blue = _compile(model, (StagePlan(0, 1, None, 2, split="channel"), StagePlan(2, 4)))
    green = _compile(model, (StagePlan(0, 4),))
    blue.save(root / "blue")
    green.save(root / "green")
    assert blue.digest != green.digest
    return root / "blue", blue.digest, root / "green", green.digest


def _wait_ready(url: str, timeout_s: float = READY_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/readyz", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} was not ready within {timeout_s} s")


@pytest.fixture(scope="module")
def server(artifacts):
    directory, digest, _, _ = artifacts
    # an SLO no batch misses even on a loaded 2-core host: these tests are about answers, and
    # the admission control that sheds what would miss a tight one is tests/unit/test_serve_batching.py's
    settings = ServeSettings(slo_s=60.0, port=0, max_body_bytes=64 * 1024, max_request_samples=16,
                             admin_token=TOKEN)
    running = Server(flatpack.load(directory, digest=digest), settings).start()
    try:
        _wait_ready(running.url)
        yield running
    finally:
        running.stop()


def _json_body(x: torch.Tensor) -> dict:
    return {"inputs": {"x": x.tolist()}}


async def _predict(client: httpx.AsyncClient, url: str, x: torch.Tensor, safetensors: bool) -> httpx.Response:
    if safetensors:
        return await client.post(f"{url}/v1/predict", content=save_safetensors({"x": x}),
                                 headers={"content-type": "application/safetensors"})
    return await client.post(f"{url}/v1/predict", json=_json_body(x))


def _output(response: httpx.Response) -> torch.Tensor:
    if response.headers["content-type"].startswith("application/safetensors"):
        return load_safetensors(response.content)["output"]
    return torch.tensor(response.json()["outputs"]["output"])


def test_concurrent_requests_of_mixed_batch_sizes_equal_the_model(server, model, artifacts):
    """120 requests at once, 1 to 5 samples each, JSON and safetensors: every answer equals the
    model's on that request alone, names the digest, and requests shared batches."""
    digest = artifacts[1]
    torch.manual_seed(1)
    inputs = [torch.randn(1 + index % 5, *SAMPLE) for index in range(120)]

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_predict(client, server.url, x, index % 3 == 0)
                                          for index, x in enumerate(inputs)))

    responses = asyncio.run(run())
    with torch.no_grad():
        for x, response in zip(inputs, responses):
            assert response.status_code == 200, response.text
            assert response.headers["x-flatpack-digest"] == digest
            torch.testing.assert_close(_output(response), model(x))
    assert responses[1].json()["digest"] == digest
    metrics = httpx.get(f"{server.url}/metrics").text
    batches = float(_metric(r"^flatpack_serve_batch_requests_count (\S+)$", metrics))
    served = float(_metric(r"^flatpack_serve_batch_requests_sum (\S+)$", metrics))
    assert served >= 120 and batches < served       # several requests per batch
    assert 'flatpack_serve_requests_total{status="200"}' in metrics
    assert re.search(r"^flatpack_serve_cold_starts_total 3\.0$", metrics, re.M)   # the master and 2 workers
    assert re.search(r"^flatpack_serve_dollars_total [0-9.e+-]+$", metrics, re.M)


BAD_REQUESTS = [
    ("wrong shape", {"json": {"inputs": {"x": torch.zeros(2, 3, 5, 6).tolist()}}}, 422, "input 'x' has shape"),
    ("wrong rank", {"json": {"inputs": {"x": torch.zeros(2, 3).tolist()}}}, 422, "2 dimensions"),
    ("dtype", {"content": save_safetensors({"x": torch.zeros(2, *SAMPLE, dtype=torch.float64)}),
               "headers": {"content-type": "application/safetensors"}}, 422, "dtype float64"),
    ("too large", {"content": b"{" + b" " * 70_000 + b"}", "headers": {"content-type": "application/json"}}, 413,
     "the limit is 65536"),
    ("too many samples", {"json": {"inputs": {"x": torch.zeros(17, *SAMPLE).tolist()}}}, 413, "limit is 16"),
    ("malformed JSON", {"content": b'{"inputs": {"x": [1, 2', "headers": {"content-type": "application/json"}}, 400,
     "not valid JSON"),
    ("not an object", {"json": [1, 2]}, 400, '{"inputs"'),
    ("ragged", {"json": {"inputs": {"x": [[1.0], [1.0, 2.0]]}}}, 422, "not a rectangular list"),
    ("unknown input", {"json": {"inputs": {"y": [[1.0]]}}}, 422, "unknown input 'y'"),
    ("missing input", {"json": {"inputs": {}}}, 422, "input 'x' is missing"),
    ("wrong content-type", {"content": b"x=1", "headers": {"content-type": "text/plain"}}, 415,
     "Content-Type must be application/json"),
    ("not safetensors", {"content": b"\x00" * 16, "headers": {"content-type": "application/safetensors"}}, 400,
     "not a safetensors file"),
]


@pytest.mark.parametrize(("case", "request_args", "status", "message"),
                         BAD_REQUESTS, ids=[case[0] for case in BAD_REQUESTS])
def test_a_bad_request_gets_a_4xx_with_one_clear_message(server, case, request_args, status, message):
    response = httpx.post(f"{server.url}/v1/predict", timeout=30, **request_args)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]


def test_health_readiness_schema_and_admin_auth(server, artifacts):
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/readyz").json() == {"ready": True, "digest": artifacts[1]}
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert set(schema["paths"]) == {"/v1/predict", "/healthz", "/readyz", "/metrics",
                                    "/admin/version"}
    properties = schema["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert properties["properties"]["inputs"]["required"] == ["x"]
    body = {"artifact_dir": str(artifacts[2]), "digest": artifacts[3]}
    assert httpx.post(f"{server.url}/admin/version", json=body).status_code == 401
    wrong = httpx.post(f"{server.url}/admin/version", json=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401 and TOKEN not in wrong.text


def test_a_version_switch_under_load_fails_no_request(server, model, artifacts):
    """Requests keep coming while /admin/version starts green, warms it, swaps and drains blue:
    every one is answered correctly, by blue before the swap and green after."""
    _, blue, green_dir, green = artifacts
    torch.manual_seed(2)
    results: list[tuple[torch.Tensor, httpx.Response]] = []

    async def load(stop: asyncio.Event, client: httpx.AsyncClient) -> None:
        index = 0
        while not stop.is_set():
            batch = [torch.randn(1 + (index + k) % 4, *SAMPLE) for k in range(8)]
            index += 8
            answers = await asyncio.gather(*(_predict(client, server.url, x, False) for x in batch))
            results.extend(zip(batch, answers))

    async def run() -> httpx.Response:
        stop = asyncio.Event()
        async with httpx.AsyncClient(timeout=300) as client:
            loader = asyncio.create_task(load(stop, client))
            await asyncio.sleep(0.5)
            switched = await client.post(f"{server.url}/admin/version", headers={"authorization": f"Bearer {TOKEN}"},
                                         json={"artifact_dir": str(green_dir), "digest": green})
            await asyncio.sleep(0.5)
            stop.set()
            await loader
            return switched

    switched = asyncio.run(run())
    assert switched.status_code == 200, switched.text
    assert switched.json() == {"digest": green}
    with torch.no_grad():
        for x, response in results:
            assert response.status_code == 200, response.text
            torch.testing.assert_close(_output(response), model(x))
    digests = [response.headers["x-flatpack-digest"] for _, response in results]
    assert digests[0] == blue and digests[-1] == green
    # blue, then green, never back: across the load's groups of 8, each sent after the last
    # was answered (within a group, sent at once, the swap may answer any of them first)
    groups = [set(digests[start:start + 8]) for start in range(0, len(digests), 8)]
    swap = next(index for index, group in enumerate(groups) if green in group)
    assert all(group == {blue} for group in groups[:swap]) and all(group == {green} for group in groups[swap + 1:])
    assert httpx.get(f"{server.url}/readyz").json()["digest"] == green


def test_a_shed_request_gets_429_with_retry_after_and_is_no_error(server):
    """A policy whose latency model says every batch takes 100 s against the 60 s SLO, with a
    2 s batching delay: the first request is admitted (the queue was empty) and waits for its
    batch; every other one, arriving behind it, is shed with 429, a Retry-After of the
    predicted backlog, and counted as shed, not as an error."""
    from flatpack.serve.batcher import BatchPolicy, LatencyModel

    batcher = server.service.batcher
    real = batcher.policy
    before = httpx.get(f"{server.url}/metrics").text
    # meets_slo=False: the admitted request is not shed on its deadline either (it runs for throughput)
    batcher.policy = BatchPolicy(64, 2.0, 60.0, LatencyModel(100.0, 0.0, "test"), False)
    try:
        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.create_task(_predict(client, server.url, torch.randn(1, *SAMPLE), False))
                await asyncio.sleep(0.3)        # queued, waiting out the 2 s delay
                others = await asyncio.gather(*(_predict(client, server.url, torch.randn(2, *SAMPLE), False)
                                                for _ in range(6)))
                return [await first, *others]

        first, *others = asyncio.run(run())
    finally:
        batcher.policy = real
    assert first.status_code == 200, first.text
    for response in others:
        assert response.status_code == 429, response.text
        assert int(response.headers["retry-after"]) >= 100       # the backlog the model predicts
        assert response.headers["x-flatpack-shed"] == "admission"
        assert response.json()["shed"] == "admission"
    after = httpx.get(f"{server.url}/metrics").text

    def count(pattern: str, text: str) -> float:
        found = re.search(pattern, text, re.M)
        return float(found.group(1)) if found else 0.0

    shed = r'^flatpack_serve_shed_total\{reason="admission"\} (\S+)$'
    assert count(shed, after) - count(shed, before) == 6
    assert count(r"^flatpack_serve_errors_total (\S+)$", after) == 0
    assert count(r"^flatpack_serve_sized_samples_per_second (\S+)$", after) > 0


def _serve_cli(directory: Path, digest: str) -> tuple[subprocess.Popen, str]:
    """``flatpack serve DIRECTORY`` in a subprocess on a free port, ready; (process, url)."""
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "flatpack", "serve", str(directory), "--digest", digest,
                                "--target", "local", "--slo-ms", "60000", "--port", "0"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.match(r"serving ([0-9a-f]{64}) on (http://\S+)", line)
        assert match, line
        assert match.group(1) == digest
        _wait_ready(match.group(2))
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process, match.group(2)


linux_proc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")


@linux_proc
def test_sigterm_under_load_fails_no_accepted_request_and_leaves_no_process(artifacts, model):
    """The CLI server in a subprocess: SIGTERM while requests stream in. Every request it
    accepted is answered correctly; later ones get 503 or find the port closed; the server
    exits 0 and every function and store process it started is gone."""
    directory, digest, _, _ = artifacts
    process, url = _serve_cli(directory, digest)
    children: dict[int, int] = {}
    try:
        children = descendants(process.pid)
        assert len(children) >= 4          # the store server, the master, two workers
        outcomes = asyncio.run(_load_then_sigterm(url, process))
        assert process.wait(timeout=120) == 0, process.stdout.read()  # pyright: ignore[reportOptionalMemberAccess]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    accepted = [(x, response) for x, response, _ in outcomes if response is not None and response.status_code != 503]
    with torch.no_grad():
        for x, response in accepted:
            assert response.status_code == 200, response.text
            torch.testing.assert_close(_output(response), model(x))
    assert len(accepted) >= 8
    for _, response, after in outcomes:
        assert response is not None or after, "a request sent before SIGTERM got no answer"
    leftover = wait_gone(children, 30)
    kill_all(children)
    assert leftover == {}


@linux_proc
def test_sigkill_of_the_server_takes_every_function_and_the_store_with_it(artifacts):
    """No handler runs on SIGKILL: the functions (started from the version's thread, not the
    main one) end by their own watch of the server, the store by PR_SET_PDEATHSIG on the
    thread that lasts as long as the server (both used to survive it)."""
    directory, digest, _, _ = artifacts
    process, _ = _serve_cli(directory, digest)
    children: dict[int, int] = {}
    try:
        children = descendants(process.pid)
        commands = [cmdline(pid) for pid in children]
        assert sum("flatpack.runtime.worker" in command for command in commands) == 3, commands  # master + 2
        assert any("weed" in command for command in commands), commands
        process.kill()
        process.wait()
        assert wait_gone(children, 30) == {}
    finally:
        process.kill()
        process.wait()
        kill_all(children)


async def _load_then_sigterm(url: str, process: subprocess.Popen) -> list:
    """Waves of 8 concurrent requests; SIGTERM after the second wave has been sent; waves
    continue until the port closes. Each outcome: (input, response or None, sent after SIGTERM)."""
    outcomes: list = []
    signalled = False

    async def one(client: httpx.AsyncClient, x: torch.Tensor, after: bool) -> None:
        try:
            response = await _predict(client, url, x, False)
        except httpx.TransportError:
            response = None
        outcomes.append((x, response, after))

    async with httpx.AsyncClient(timeout=120) as client:
        for wave in range(200):
            batch = [torch.randn(1 + k % 3, *SAMPLE) for k in range(8)]
            tasks = [asyncio.create_task(one(client, x, signalled)) for x in batch]
            await asyncio.sleep(0.05)
            if wave == 1:
                process.send_signal(signal.SIGTERM)
                signalled = True
            await asyncio.gather(*tasks)
            if signalled and all(response is None for _, response, after in outcomes[-8:]):
                break
    return outcomes


def test_a_model_given_by_name_is_compiled_for_inference_and_served_by_position():
    """``flatpack serve mlp``: the example is compiled for inference under the SLO; its graph
    names its input ``input_1``, not ``forward``'s parameter, so the version calls it by
    position, and the answer equals the model's."""
    from flatpack.serve.command import _build_model
    from flatpack.serve.pool import Version
    from flatpack.serve.server import resolve
    from flatpack.serve.targets import Target

    model, example = _build_model("mlp", "tiny")
    compiled = resolve(model, example, settings=ServeSettings(slo_s=0.5))
    version = Version(compiled, Target("local"), 16)
    assert version.contract.names == ("input_1",)
    x = torch.randn(3, 64)

    async def run() -> dict:
        await version.start()
        try:
            return await version.infer({"input_1": x})
        finally:
            await version.close()

    outputs = asyncio.run(run())
    with torch.no_grad():
        torch.testing.assert_close(outputs["output"], model(x))
    assert version.latency is not None and version.latency.source == "measured at warm-up"


def _metric(pattern: str, metrics: str) -> str:
    """The value a /metrics line matching ``pattern`` holds (the test fails naming the pattern)."""
    found = re.search(pattern, metrics, re.M)
    assert found is not None, f"no metric matches {pattern!r} in /metrics"
    return found.group(1)
