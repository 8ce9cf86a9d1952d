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
(answers/s), p50/p95/p99 latency of the answers, SLO attainment (of all requests, and of
those answered: 200 within the SLO), shed requests (429 with Retry-After: flatpack's
admission control refusing what would miss the SLO, never counted as errors), errors (a 5xx,
no answer or a client timeout, or a 200 whose outputs differ from the original model's: every
answer is checked after the run), and for flatpack the latency model's predicted batch time
beside the measured one (means over the answered requests) and the dollars its /metrics
counted per 1,000 answers.

Rates are absolute (``--rates``) or multiples of the load flatpack's batching policy is sized
for (``--multiples 1,2,1``: the server's ``flatpack_serve_sized_samples_per_second`` over the
mean request size, read after warm-up), run back to back on the same flatpack server in that
order (1, 2, 1: the sized load, twice it, and whether it recovers when the load drops), then
the baseline at the same absolute rates.

    python benchmarks/serve_load.py --rates 2,5,10,20 --duration 10 --slo-ms 1000
    python benchmarks/serve_load.py --multiples 1,2,1 --duration 20 --slo-ms 1000
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
SAMPLES_PER_REQUEST = (1, 4)        # each request's sample count is drawn uniformly from this range
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
    """(status or the client's error, seconds, (predicted, measured batch ms) or None, input, output or None,
    run seconds) per request of one open-loop run."""
    rng = random.Random(seed)
    arrivals, clock = [], 0.0
    while True:
        clock += rng.expovariate(rate)
        if clock > duration_s:
            break
        arrivals.append((clock, torch.randn(rng.randint(*SAMPLES_PER_REQUEST), *SAMPLE)))
    slots = asyncio.Semaphore(concurrency)
    results: list[tuple] = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        start = time.perf_counter()

        async def one(at: float, x: torch.Tensor) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent = time.perf_counter()
            async with slots:
                try:
                    response = await client.post(f"{url}/v1/predict", json={"inputs": {"x": x.tolist()}})
                    predicted = response.headers.get("x-flatpack-predicted-ms")
                    measured = response.headers.get("x-flatpack-batch-ms")
                    output = response.json()["outputs"]["output"] if response.status_code == 200 else None
                    results.append((response.status_code, time.perf_counter() - sent,
                                    (float(predicted), float(measured)) if predicted and measured else None,
                                    x, output))
                except httpx.HTTPError as err:       # no answer: counted as an error, by kind
                    results.append((type(err).__name__, time.perf_counter() - sent, None, x, None))

        await asyncio.gather(*(one(at, x) for at, x in arrivals))
        elapsed = time.perf_counter() - start
    return [(*result, elapsed) for result in results]


def wrong_outputs(results: list[tuple]) -> int:
    """The answers (200) whose outputs are not the original model's (assert_close's float32
    tolerances), computed here after the run so the check takes no CPU from the servers."""
    model, wrong = the_model(), 0
    with torch.no_grad():
        for status, _, _, x, output, _ in results:
            if status == 200:
                try:
                    torch.testing.assert_close(torch.tensor(output, dtype=torch.float32), model(x))
                except AssertionError:
                    wrong += 1
    return wrong


def summary(name: str, rate: float, results: list[tuple], slo_s: float, multiple: float | None = None) -> dict:
    wrong = wrong_outputs(results)
    ok = sorted(seconds for status, seconds, *_ in results if status == 200)
    elapsed = results[0][-1] if results else 1.0
    quantile = (lambda q: ok[min(len(ok) - 1, int(q * len(ok)))] * 1e3) if ok else (lambda q: float("nan"))
    batches = [value for status, _, value, *_ in results if status == 200 and value is not None]
    shed = sum(status == 429 for status, *_ in results)
    failed = [status for status, *_ in results if status not in (200, 429)]
    within = sum(seconds <= slo_s for seconds in ok)
    return {"server": name, "rate": rate, "multiple": multiple, "requests": len(results),
            "throughput": len(ok) / elapsed, "p50": quantile(0.5), "p95": quantile(0.95), "p99": quantile(0.99),
            "slo": within / max(len(results), 1), "slo_answered": within / max(len(ok), 1),
            "shed": shed, "errors": len(failed) + wrong, "wrong": wrong, "answered": len(ok),
            "kinds": sorted({str(status) for status in failed}),
            "predicted": statistics.mean(value[0] for value in batches) if batches else None,
            "measured": statistics.mean(value[1] for value in batches) if batches else None}


def metric(url: str, name: str) -> float:
    """The value of the unlabelled metric ``name`` on the server's /metrics."""
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found is not None, f"the server's /metrics has no {name}"
    return float(found.group(1))


def dollars(url: str) -> float:
    return metric(url, "flatpack_serve_dollars_total")


def request_rates(args: argparse.Namespace, served_url: str) -> list[tuple[float, float | None]]:
    """(requests per second, multiple of the sized load or None) per phase."""
    if args.multiples is None:
        return [(float(rate), None) for rate in args.rates.split(",")]
    sized = metric(served_url, "flatpack_serve_sized_samples_per_second")
    per_request = sum(SAMPLES_PER_REQUEST) / 2
    return [(float(multiple) * sized / per_request, float(multiple)) for multiple in args.multiples.split(",")]


def run_phases(name: str, url: str, rates: list[tuple[float, float | None]], args: argparse.Namespace) -> list[dict]:
    rows = []
    for index, (rate, multiple) in enumerate(rates):
        spent = dollars(url) if name == "flatpack" else 0.0
        results = asyncio.run(drive(url, rate, args.duration, args.concurrency, seed=index))
        row = summary(name, rate, results, args.slo_ms / 1e3, multiple)
        if name == "flatpack":
            row["dollars"] = (dollars(url) - spent) / max(row["answered"], 1) * 1000
            row["replicas"] = metric(url, "flatpack_serve_replicas")
        rows.append(row)
        print(table([row], args).splitlines()[-1], file=sys.stderr, flush=True)   # progress, on a busy host
    return rows


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
    parser.add_argument("--multiples", default=None,
                        help="instead of --rates: multiples of the load the server's batching is sized for, run in "
                             "this order (1,2,1: sized, twice it, and back)")
    parser.add_argument("--max-batch", type=int, default=None, help="flatpack serve's --max-batch")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per rate")
    parser.add_argument("--slo-ms", type=float, default=1000.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--min-replicas", type=int, default=None, help="flatpack serve's --min-replicas")
    parser.add_argument("--max-replicas", type=int, default=None,
                        help="flatpack serve's --max-replicas (above --min-replicas: the pool scales with the load)")
    parser.add_argument("--idle-s", type=float, default=None, help="flatpack serve's --idle-s")
    parser.add_argument("--baseline-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline_server:
        run_baseline_server()
        return
    # a SIGTERM (a timeout) unwinds like Ctrl-C: the finally below stops both servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    logs = Path(tempfile.mkdtemp(prefix="serve-load-logs-"))       # kept: the servers' logs, if one fails
    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        digest = compile_artifact(Path(scratch) / "artifact")
        served, served_url = start([sys.executable, "-m", "flatpack", "serve", str(Path(scratch) / "artifact"),
                                    "--digest", digest, "--target", "local", "--slo-ms", str(args.slo_ms),
                                    "--port", "0", *serve_flags(args)],
                                   r"serving [0-9a-f]+ on (http://\S+)", logs / "flatpack.log")
        baseline, baseline_url = start([sys.executable, __file__, "--baseline-server"], r"listening on (http://\S+)",
                                  logs / "baseline.log")
        try:
            wait_ready(served_url)
            rates = request_rates(args, served_url)
            # flatpack's phases back to back (recovery after an overload is what they show), then the baseline's
            rows = run_phases("flatpack", served_url, rates, args) + run_phases("baseline", baseline_url, rates, args)
        finally:
            for process in (served, baseline):
                process.send_signal(signal.SIGTERM)
            for process in (served, baseline):
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    print(table(rows, args))
    replicas = [f"{row['replicas']:.0f}" for row in rows if "replicas" in row]
    if replicas:
        print(f"\nflatpack's warm replicas at the end of each phase: {', '.join(replicas)}; scale events in "
              f"{logs / 'flatpack.log'} ('scaling up', 'scaling down')")
    print(f"\nthe servers' logs: {logs}")


def serve_flags(args: argparse.Namespace) -> list[str]:
    """The flags of ``flatpack serve`` this run sets (the server's defaults otherwise)."""
    flags = {"--max-batch": args.max_batch, "--min-replicas": args.min_replicas, "--max-replicas": args.max_replicas,
             "--idle-s": args.idle_s}
    return [item for flag, value in flags.items() if value is not None for item in (flag, str(value))]


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [f"SLO {args.slo_ms:.0f} ms, {args.duration:.0f} s per rate, {SAMPLES_PER_REQUEST[0]}-"
             f"{SAMPLES_PER_REQUEST[1]} samples per request, at most {args.concurrency} outstanding", "",
             "| server | load | rate (req/s) | requests | answered/s | p50 ms | p95 ms | p99 ms | SLO attained (all / "
             "answered) | shed (429) | errors (5xx, no answer, wrong) | predicted / measured batch ms | $ per 1,000 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        batch = (f"{row['predicted']:.1f} / {row['measured']:.1f}" if row["predicted"] is not None else "-")
        cost = f"{row['dollars']:.2e}" if "dollars" in row else "-"
        load = f"{row['multiple']:g}x sized" if row["multiple"] is not None else "-"
        kinds = ", ".join([*row["kinds"], *([f"{row['wrong']} wrong"] if row["wrong"] else [])])
        lines.append(f"| {row['server']} | {load} | {row['rate']:.1f} | {row['requests']} | {row['throughput']:.1f} | "
                     f"{row['p50']:.1f} | {row['p95']:.1f} | {row['p99']:.1f} | {row['slo']:.1%} / "
                     f"{row['slo_answered']:.1%} | {row['shed']} | {row['errors']}{f' ({kinds})' if kinds else ''} | "
                     f"{batch} | {cost} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))      # tests.models, when run as a script from anywhere
    main()
