"""What the invoker's own work costs a local run's steady state (issue 19, ninth pass).

``flatpack demo`` trained 4 iterations and compared the prediction with the median of
iterations 2 and 3 (it trains 12 now and takes iterations 2-11). Those come before the invoker
works beside the workers. It uploads each new iteration's data (``functions.DATA_WINDOW``
iterations ahead of the last one every worker reported, ``FEED_THREADS`` puts at a time;
the first window goes up before the workers start) and, after each checkpoint every stage
has reported, deletes the keys of the iterations it covers (``_Run._release``). On the
local backend both run on the cores the workers and the store share, and neither is in the
model's κ (``funcpipe.host_contention``: the workers and the store).

This runs the demo's job ``--iterations`` long in five variants, round-robin for
``--rounds`` rounds so that the host's drift falls on all of them alike:

* ``as-run``: the runtime as shipped;
* ``one-put-at-a-time``: the feed's puts one after another (``FEED_THREADS`` = 1, as before
  issue 19's ninth pass);
* ``data-upfront``: every iteration's data uploaded before the workers start (the window
  made larger than the run);
* ``no-garbage``: no deletions until the run ends;
* ``neither``: both.

The last three switch off work a long run needs (the store would grow without bound); no user
setting does so, on purpose: they exist here only to measure what that work costs. Printed
per variant and round: the prediction, the median of iterations 2-3 (the demo's window),
the median of iterations 2 onwards, every iteration's milliseconds; then each variant's
median over rounds.

    PYTHONPATH=. python benchmarks/steady_state.py [--iterations 16] [--rounds 2] [--model vgg16]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from flatpack.backends import functions
from flatpack.cli import main as flatpack_main

VARIANTS = ("as-run", "one-put-at-a-time", "data-upfront", "no-garbage", "neither")


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The runtime with the invoker's data feed and/or garbage deletion held back."""
    window, release, threads = functions.DATA_WINDOW, functions._Run._release, functions.FEED_THREADS
    try:
        if name == "one-put-at-a-time":
            functions.FEED_THREADS = 1
        if name in ("data-upfront", "neither"):
            functions.DATA_WINDOW = 1 << 20
        if name in ("no-garbage", "neither"):
            def held_back(self: functions._Run, end: int, *, now: bool = False) -> None:
                if now:   # the segment's end: what the store holds goes then, as it does as run
                    release(self, end, now=True)
            functions._Run._release = held_back   # type: ignore[method-assign]
        yield
    finally:
        functions.DATA_WINDOW, functions._Run._release = window, release   # type: ignore[method-assign]
        functions.FEED_THREADS = threads


def run_demo(model: str, iterations: int, out: Path) -> tuple[float, list[float], float, float]:
    """The demo's job (``flatpack demo --json``): its predicted iteration, each measured one,
    the median of the first two it keeps (the window the demo measured at 4 iterations) and
    the median of all it keeps, as its report sets beside the prediction."""
    document_path = out / "demo.json"
    with open(document_path, "w") as stdout, contextlib.redirect_stdout(stdout):
        try:
            flatpack_main(["demo", "--model", model, "--iterations", str(iterations), "--out", str(out / "run"),
                           "--json"])
        except SystemExit:
            pass
    comparison = json.loads(document_path.read_text())["comparison"]
    measured = comparison["measured"]
    seconds = [iteration["seconds"] for iteration in measured["iterations"]]
    kept = [iteration["seconds"] for iteration in measured["iterations"] if iteration["kept"]]
    return comparison["predicted"]["iteration_s"], seconds, statistics.median(kept[:2]), measured["iteration_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="vgg16")
    args = parser.parse_args()
    if args.iterations < 6:
        parser.error("--iterations must be at least 6: the 2 the demo skips, its window of 2, and a steady state "
                     "after it")
    steady: dict[str, list[float]] = {name: [] for name in VARIANTS}
    window: dict[str, list[float]] = {name: [] for name in VARIANTS}
    print(f"{args.model}, the demo's job, {args.iterations} iterations; ms", flush=True)
    for round_number in range(args.rounds):
        for name in VARIANTS:
            with tempfile.TemporaryDirectory() as scratch, variant(name):
                predicted, seconds, first_two, all_kept = run_demo(args.model, args.iterations, Path(scratch))
            window[name].append(first_two)
            steady[name].append(all_kept)
            print(f"round {round_number + 1} {name:>18}: predicted {predicted * 1e3:.1f}, iterations 2-3 "
                  f"{window[name][-1] * 1e3:.1f}, iterations 2-{args.iterations - 1} {steady[name][-1] * 1e3:.1f} "
                  f"({predicted / steady[name][-1] - 1:+.1%}); each: "
                  f"{' '.join(f'{value * 1e3:.0f}' for value in seconds)}", flush=True)
    print("\nmedian over rounds (ms): variant, iterations 2-3, steady state")
    for name in VARIANTS:
        print(f"  {name:>18}: {statistics.median(window[name]) * 1e3:.1f}  {statistics.median(steady[name]) * 1e3:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
