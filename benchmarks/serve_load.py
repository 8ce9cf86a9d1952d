"""``flatpack serve`` under an open-loop Poisson load, beside the server a user would write.

Two servers on 127.0.0.1, each its own process (the load generator's process holds neither,
so they do not share its GIL), the same model (``tests.models.ConvBlocks``, seed 0):

* flatpack: ``flatpack serve ARTIFACT_DIR --digest D --target local --slo-ms S --port 0``, the
  first group split by channel over two worker functions (the fork-join runtime, its store
  and its processes), with dynamic batching inside the SLO;
* baseline: one Starlette route on uvicorn calling the original model in the server's own
  process, one request at a time (no batching, no functions): ``--baseline-server``.

The load is open-loop: arrivals are a Poisson process at each rate (exponential gaps drawn
up front, so a slow server does not slow the arrivals), each request 1–4 samples, sent by
asyncio + httpx with at most ``--concurrency`` requests outstanding (an arrival that finds
them all busy waits, and its wait counts in its latency). Per server and rate: throughput
(answers/s), p50/p95/p99 latency, SLO attainment (share of all requests answered 200 within
the SLO), errors (non-200 or no answer; 503s are shed requests), and for flatpack the latency
model's predicted batch time beside the measured one (means over the answered requests), and
the dollars its /metrics counted per 1,000 answers.

    python benchmarks/serve_load.py --rates 2,5,10,20 --duration 10 --slo-ms 1000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

SAMPLE = (3, 6, 6)
ROOT = Path(__file__).resolve().parents[1]


def the_model() -> torch.nn.Module:
    from tests.models import ConvBlocks

    torch.manual_seed(0)
    return ConvBlocks().eval()


def run_baseline_server() -> None:
    """The plain server (this script with ``--baseline-server``): prints its URL, serves until killed."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    model = the_model()

    async def predict(request: Request) -> JSONResponse:
        document = await request.json()
        with torch.no_grad():
            output = model(torch.tensor(document["inputs"]["x"], dtype=torch.float32))
        return JSONResponse({"outputs": {"output": output.tolist()}})

    config = uvicorn.Config(Starlette(routes=[Route("/v1/predict", predict, methods=["POST"])]), host="127.0.0.1",
                            port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        print(f"listening on http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", flush=True)
        await task

    asyncio.run(main())


def start(command: list[str], pattern: str, log: Path) -> tuple[subprocess.Popen, str]:
    """Starts a server whose first line of output names its URL; its log goes to ``log``."""
    with open(log, "wb") as stream:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stream, text=True, cwd=ROOT)
    assert process.stdout is not None
    line = process.stdout.readline()
    match = re.search(pattern, line)
    if not match:
        process.kill()
        raise SystemExit(f"{command[:4]} did not start: {line!r}; see {log}")
    return process, match.group(1)


def wait_ready(url: str) -> None:
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} never became ready")


async def drive(url: str, rate: float, duration_s: float, concurrency: int, seed: int) -> list[tuple]:
    """(status or the client's error, seconds, (predicted, measured batch ms) or None, run seconds) per request
    of one open-loop run."""
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
                    measured = response.headers.get("x-flatpack-batch-ms")
                    results.append((response.status_code, time.perf_counter() - sent,
                                    (float(predicted), float(measured)) if predicted and measured else None))
                except httpx.HTTPError as err:       # no answer: counted as an error, by kind
                    results.append((type(err).__name__, time.perf_counter() - sent, None))

        await asyncio.gather(*(one(at, x) for at, x in arrivals))
        elapsed = time.perf_counter() - start
    return [(*result, elapsed) for result in results]


def summary(name: str, rate: float, results: list[tuple], slo_s: float) -> dict:
    ok = sorted(seconds for status, seconds, _, _ in results if status == 200)
    elapsed = results[0][3] if results else 1.0
    quantile = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1e3) if ok else (lambda q: float("nan"))
    batches = [value for status, _, value, _ in results if status == 200 and value is not None]
    return {"server": name, "rate": rate, "requests": len(results), "throughput": len(ok) / elapsed,
            "p50": quantile(0.5), "p95": quantile(0.95), "p99": quantile(0.99),
            "slo": sum(seconds <= slo_s for seconds in ok) / max(len(results), 1),
            "errors": sum(status != 200 for status, _, _, _ in results),
            "shed": sum(status == 503 for status, _, _, _ in results), "answered": len(ok),
            "kinds": sorted({str(status) for status, _, _, _ in results if status not in (200, 503)}),
            "predicted": statistics.mean(value[0] for value in batches) if batches else None,
            "measured": statistics.mean(value[1] for value in batches) if batches else None}


def dollars(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = re.search(r"^flatpack_serve_dollars_total (\S+)$", text, re.M)
    assert found is not None, "the server's /metrics has no flatpack_serve_dollars_total"
    return float(found.group(1))





def compile_artifact(directory: Path) -> str:
    import flatpack
    from flatpack.partitioner.plan import Plan, StagePlan

    compiled = flatpack.compile(the_model(), (torch.randn(2, *SAMPLE),),
                                plan=Plan((StagePlan(0, 1, None, 2, split="channel"), StagePlan(2, 4)), 5))
    compiled.save(directory)
    return compiled.digest


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rates", default="2,5,10,20", help="requests per second, comma-separated")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        run_baseline_server()
        return
    rates = [float(rate) for rate in args.rates.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="serve-load-logs-"))       # kept: the servers' logs, if one fails
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        digest = compile_artifact(Path(scratch) / "artifact")
        served, served_url = start([sys.executable, "-m", "flatpack", "serve", str(Path(scratch) / "artifact"),
                                    "--digest", digest, "--target", "local", "--slo-ms", str(args.slo_ms),
                                    "--port", "0"], r"serving [0-9a-f]+ on (http://\S+)", logs / "flatpack.log")
        baseline, baseline_url = start([sys.executable, __file__, "--baseline-server"], r"listening on (http://\S+)",
                                  logs / "baseline.log")
        try:
            wait_ready(served_url)
            rows = []
            for rate in rates:
                for name, url in (("flatpack", served_url), ("baseline", baseline_url)):
                    spent = dollars(url) if name == "flatpack" else 0.0
                    results = asyncio.run(drive(url, rate, args.duration, args.concurrency, seed=int(rate)))
                    row = summary(name, rate, results, args.slo_ms / 1e3)
                    if name == "flatpack":
                        row["dollars"] = (dollars(url) - spent) / max(row["answered"], 1) * 1000
                    rows.append(row)
        finally:
            for process in (served, baseline):
                process.send_signal(signal.SIGTERM)
            for process in (served, baseline):
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    print(table(rows, args))
    print(f"\nthe servers' logs: {logs}")


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"SLO {args.slo_ms:.0f} ms, {args.duration:.0f} s per rate, 1-4 samples per request, "
             f"at most {args.concurrency} outstanding", "",
             "| server | rate (req/s) | requests | answered/s | p50 ms | p95 ms | p99 ms | SLO attained | errors "
             "(503 shed) | predicted / measured batch ms | $ per 1,000 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        batch = (f"{row['predicted']:.1f} / {row['measured']:.1f}" if row["predicted"] is not None else "-")
        cost = f"{row['dollars']:.2e}" if "dollars" in row else "-"
        lines.append(f"| {row['server']} | {row['rate']:.0f} | {row['requests']} | {row['throughput']:.1f} | "
                     f"{row['p50']:.1f} | {row['p95']:.1f} | {row['p99']:.1f} | {row['slo']:.1%} | "
                     f"{row['errors']} ({row['shed']}{', ' if row['kinds'] else ''}{' '.join(row['kinds'])}) | "
                     f"{batch} | {cost} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))      # tests.models, when run as a script from anywhere
    main()
