"""How far `flatpack calibrate`'s figure for a store request's host CPU moves from one
measurement to the next, by how it is taken (issue 44).

``backends.request_cpu.measure_request_cpu`` times rounds of puts, gets and polls' misses
against a SeaweedFS server this benchmark starts. On the 2-core VM the interpreter (the
boto3 client, the server's handlers) runs at half speed in bursts of 0.2-2 s
(``benchmarks/host_speed.py``), so a figure taken over a second or two reads whichever speed
the host was at. This takes ``--repeats`` measurements of each method, alternated so both see
the same host, and prints per figure the mean, the coefficient of variation and the range:

* ``median of 3``: calibrate's method before METHOD_REVISION 12;
* ``mean of 6``: calibrate's method since (the shipped default).

    PYTHONPATH=. python benchmarks/request_cpu_spread.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from flatpack.backends.request_cpu import measure_request_cpu
from flatpack.platform.catalog import RequestCpu
from flatpack.runtime.s3server import LocalS3Server

METHODS: dict[str, tuple[int, Callable[[list[float]], float]]] = {
    "median of 3": (3, statistics.median),
    "mean of 6": (6, statistics.fmean),
}
FIGURES = ("put_s", "get_s", "miss_s", "put_s_per_byte", "get_s_per_byte")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="measurements of each method")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: give 2 or more (a spread needs two readings)")
    readings: dict[str, list[RequestCpu]] = {name: [] for name in METHODS}
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    with LocalS3Server() as server:
        pid = server.pid
        if pid is None:
            raise SystemExit("the S3 server is not running")
        with server.store(prefix="request-cpu-spread/") as store:
            for repeat in range(args.repeats):
                for name, (rounds, statistic) in METHODS.items():
                    began = time.perf_counter()
                    reading = measure_request_cpu(store, pid, f"r{repeat}-{rounds}", rounds=rounds,
                                                  statistic=statistic, cores=False)
                    if reading is None:
                        raise SystemExit("the store server's CPU cannot be read here (no /proc)")
                    seconds[name].append(time.perf_counter() - began)
                    readings[name].append(reading)
    print(f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {args.repeats} measurements of each method, "
          f"alternated")
    print("| method | seconds | " + " | ".join(f"{figure}: mean, CV, range" for figure in FIGURES) + " |")
    print("|---|---:|" + "---|" * len(FIGURES))
    for name in METHODS:
        cells = []
        for figure in FIGURES:
            values = [getattr(reading, figure) for reading in readings[name]]
            mean = statistics.fmean(values)
            scale, unit = (1e9, "ns/B") if figure.endswith("per_byte") else (1e3, "ms")
            spread = statistics.stdev(values) / mean * 100 if mean else 0.0
            low, high = min(values) * scale, max(values) * scale
            cells.append(f"{mean * scale:.2f} {unit}, {spread:.0f} %, {low:.2f}-{high:.2f}")
        print(f"| {name} | {statistics.median(seconds[name]):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
