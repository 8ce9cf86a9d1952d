"""What the local store's mutual TLS on its HTTP ports costs (issue 37).

The master, volume, filer and admin HTTP ports of the local store (``weed mini``) take only
clients holding the certificate made at each start (``flatpack/runtime/s3server.py``); weed's
own components then talk HTTPS to each other, so every object an S3 client puts or gets crosses
one TLS hop inside weed (the S3 gateway and the filer to the volume server). This measures what
that costs against the same server with those ports on plain HTTP (the configuration before
issue 37, which another local user could drive: ``/col/delete`` deleted a run's data). The
plain variant exists only here, by replacing the server's environment; no user setting opens it.

Round-robin over ``--rounds`` rounds, each variant starts a fresh server and times ``--requests``
put-then-get pairs of each object size through the S3 API (boto3, the workers' client), and
reads the weed process's CPU seconds from /proc. Printed: per variant and size the median
milliseconds of a put+get pair and weed's CPU milliseconds per pair, then the ratio TLS/plain.

    PYTHONPATH=. python benchmarks/store_tls.py [--rounds 3] [--requests 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from flatpack.cpus import process_cpu_seconds
from flatpack.runtime.s3server import LocalS3Server

SIZES = (64 << 10, 1 << 20, 4 << 20)


class PlainHttpServer(LocalS3Server):
    """The store with its master, volume, filer and admin HTTP ports on plain HTTP (pre-issue-37)."""

    def _security_env(self) -> dict[str, str]:
        return {name: value for name, value in super()._security_env().items() if not name.startswith("WEED_HTTPS_")}


def measure(server_class: type[LocalS3Server], requests: int) -> dict[int, tuple[float, float]]:
    """Per object size: (median ms of a put+get pair, weed CPU ms per pair)."""
    figures = {}
    with server_class() as server, server.store("bench") as store:
        pid = server.pid
        assert pid is not None
        for size in SIZES:
            payload = bytes(size)
            store.put("warm", payload)
            store.get("warm")
            pairs = []
            cpu_before = process_cpu_seconds(pid) or 0.0
            for index in range(requests):
                start = time.perf_counter()
                store.put(f"k{index % 8}", payload)
                store.get(f"k{index % 8}")
                pairs.append(time.perf_counter() - start)
            cpu_after = process_cpu_seconds(pid) or 0.0
            figures[size] = (statistics.median(pairs) * 1e3, (cpu_after - cpu_before) * 1e3 / requests)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    options = parser.parse_args()
    variants = {"mutual TLS (shipped)": LocalS3Server, "plain HTTP (before)": PlainHttpServer}
    results: dict[str, dict[int, list[tuple[float, float]]]] = {name: {size: [] for size in SIZES} for name in variants}
    for round_index in range(options.rounds):
        for name, server_class in variants.items():
            for size, figure in measure(server_class, options.requests).items():
                results[name][size].append(figure)
                print(f"round {round_index + 1} {name:22s} {size >> 10:5d} KiB: put+get {figure[0]:7.2f} ms, "
                      f"weed CPU {figure[1]:6.2f} ms per pair", flush=True)
    print("\nmedian over rounds")
    print(f"{'size':>9s} {'variant':22s} {'put+get ms':>11s} {'weed CPU ms':>12s}")
    medians = {name: {size: (statistics.median(f[0] for f in figures), statistics.median(f[1] for f in figures))
                      for size, figures in per_size.items()} for name, per_size in results.items()}
    for size in SIZES:
        for name in variants:
            latency, cpu = medians[name][size]
            print(f"{size >> 10:6d} KiB {name:22s} {latency:11.2f} {cpu:12.2f}")
        tls, plain = medians["mutual TLS (shipped)"][size], medians["plain HTTP (before)"][size]
        print(f"{size >> 10:6d} KiB {'ratio TLS / plain':22s} {tls[0] / plain[0]:11.2f} {tls[1] / plain[1]:12.2f}")


if __name__ == "__main__":
    main()
