"""``flatpack serve`` under an open-loop Poisson load, beside the server a user would write.

Two servers on 127.0.0.1, each on its own port, the same model (``tests.models.ConvBlocks``):

* flatpack: ``flatpack.serve.server.Server`` over the local backend, the first group split by
  channel over two worker functions (the fork-join runtime, its store and its processes),
  with dynamic batching inside the SLO;
* baseline: one Starlette route calling the original model in the server's own process, one
  request at a time (no batching, no functions).

The load is open-loop: arrivals are a Poisson process at each rate (exponential gaps drawn
up front, so a slow server does not slow the arrivals), each request 1–4 samples, sent by
asyncio + httpx with at most ``--concurrency`` requests outstanding (an arrival that finds
them all busy waits, and its wait counts in its latency). Per server and rate: throughput
(answers/s), p50/p95/p99 latency, SLO attainment (share of all requests answered 200 within
the SLO), errors (non-200 or no answer), and for flatpack the latency model's predicted batch
latency beside the measured one.

    python benchmarks/serve_load.py --rates 5,20,40 --duration 10 --slo-ms 500
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time

import httpx
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import flatpack
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.serve.server import Server
from flatpack.serve.settings import ServeSettings
from tests.models import ConvBlocks

SAMPLE = (3, 6, 6)


def baseline_app(model: torch.nn.Module) -> Starlette:
    """The plain server: the model in the server's process, one request at a time."""
    async def predict(request: Request) -> JSONResponse:
        document = await request.json()
        with torch.no_grad():
            output = model(torch.tensor(document["inputs"]["x"], dtype=torch.float32))
        return JSONResponse({"outputs": {"output": output.tolist()}})
    return Starlette(routes=[Route("/v1/predict", predict, methods=["POST"])])


def start_baseline(model: torch.nn.Module) -> tuple[uvicorn.Server, str]:
    config = uvicorn.Config(baseline_app(model), host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


async def drive(url: str, rate: float, duration_s: float, concurrency: int, seed: int) -> list[tuple]:
    """(status or None, seconds, predicted ms or None) per request of one open-loop run."""
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    while True:
        clock += rng.expovariate(rate)
        if clock > duration_s:
            break
        arrivals.append((clock, torch.randn(rng.randint(1, 4), *SAMPLE).tolist()))
    slots = asyncio.Semaphore(concurrency)
    results: list[tuple] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()

        async def one(at: float, x: list) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            async with slots:
                try:
                    response = await client.post(f"{url}/v1/predict", json={"inputs": {"x": x}})
                    predicted = response.headers.get("x-flatpack-predicted-ms")
                    results.append((response.status_code, time.perf_counter() - sent,
                                    float(predicted) if predicted else None))
                except httpx.HTTPError:
                    results.append((None, time.perf_counter() - sent, None))

        await asyncio.gather(*(one(at, x) for at, x in arrivals))
        elapsed = time.perf_counter() - start
    return [(*result, elapsed) for result in results]


def summary(name: str, rate: float, results: list[tuple], slo_s: float) -> dict:
    ok = sorted(seconds for status, seconds, _, _ in results if status == 200)
    elapsed = results[0][3] if results else 1.0
    quantile = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1e3) if ok else (lambda q: float("nan"))
    predicted = [value for status, _, value, _ in results if status == 200 and value is not None]
    return {"server": name, "rate": rate, "requests": len(results), "throughput": len(ok) / elapsed,
            "p50": quantile(0.5), "p95": quantile(0.95), "p99": quantile(0.99),
            "slo": sum(seconds <= slo_s for seconds in ok) / max(len(results), 1),
            "errors": sum(status != 200 for status, _, _, _ in results),
            "predicted": statistics.mean(predicted) if predicted else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="5,20,40", help="requests per second, comma-separated")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--slo-ms", type=float, default=500.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    rates = [float(rate) for rate in args.rates.split(",")]
    torch.manual_seed(0)
    model = ConvBlocks().eval()
    compiled = flatpack.compile(model, (torch.randn(2, *SAMPLE),),
                                plan=Plan((StagePlan(0, 1, None, 2, split="channel"), StagePlan(2, 4)), 5))
    settings = ServeSettings(slo_s=args.slo_ms / 1e3, port=0)
    served = Server(compiled, settings).start()
    baseline, baseline_url = start_baseline(model)
    try:
        while httpx.get(f"{served.url}/readyz").status_code != 200:
            time.sleep(0.2)
        policy = served.service.batcher.policy
        print(f"flatpack: batches of at most {policy.max_batch} samples, {policy.max_delay_s * 1e3:.1f} ms max delay; "
              f"latency model {policy.model.fixed_s * 1e3:.1f} ms + {policy.model.per_sample_s * 1e3:.2f} ms/sample "
              f"({policy.model.source})")
        rows = []
        for rate in rates:
            for name, url in (("flatpack", served.url), ("baseline", baseline_url)):
                results = asyncio.run(drive(url, rate, args.duration, args.concurrency, seed=int(rate)))
                rows.append(summary(name, rate, results, settings.slo_s))
        print(f"\nSLO {args.slo_ms:.0f} ms, {args.duration:.0f} s per rate, 1-4 samples per request\n")
        print("| server | rate (req/s) | requests | answered/s | p50 ms | p95 ms | p99 ms | SLO attained | errors "
              "| predicted batch ms |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            predicted = f"{row['predicted']:.1f}" if row["predicted"] is not None else "-"
            print(f"| {row['server']} | {row['rate']:.0f} | {row['requests']} | {row['throughput']:.1f} | "
                  f"{row['p50']:.1f} | {row['p95']:.1f} | {row['p99']:.1f} | {row['slo']:.1%} | {row['errors']} | "
                  f"{predicted} |")
    finally:
        served.stop()
        baseline.should_exit = True


if __name__ == "__main__":
    main()
