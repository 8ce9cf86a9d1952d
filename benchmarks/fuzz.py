"""The format fuzzer at scale: the mutators of ``tests/security/fuzz_formats.py`` (the ones the
Hypothesis suite ``tests/security/test_fuzz_formats.py`` runs a few hundred of) run by the
tens of thousands, split evenly over every format flatpack reads from someone else.

Each case runs in this process under a ``signal.alarm`` guard (``--timeout`` seconds). Per
format it prints: cases, clean refusals (a flatpack error), accepted mutants, tracebacks (any
other exception, by type and first message: each is a bug), hangs, the slowest case and the
largest growth of the process's peak RSS in one case. Exit status 1 if any case gave a
traceback or hung. Cases are seeded (``--seed``): a run is reproducible, and ``--format NAME --seed S
--cases 1`` replays one case.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/fuzz.py [--cases 20000]``.
docs/security.md ("One bounded reader") records the figures.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.security.fuzz_formats import Workspace, formats, guarded

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=24_000, help="cases over all formats, split evenly (24,000)")
    parser.add_argument("--seed", type=int, default=0, help="the first case's seed; case i of a format uses seed+i")
    parser.add_argument("--timeout", type=int, default=5, help="seconds a case may take before it counts as a hang")
    parser.add_argument("--format", action="append", default=None, help="only these formats (repeatable)")
    parser.add_argument("--show", type=int, default=3, help="distinct tracebacks to list per format")
    args = parser.parse_args(argv)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="flatpack-fuzz-") as scratch:
        space = Workspace(Path(scratch))
        chosen = [fmt for fmt in formats(space) if args.format is None or fmt.name in args.format]
        if not chosen:
            parser.error(f"no format is named {args.format}")
        per_format = max(1, args.cases // len(chosen))
        print(f"{per_format:,} cases per format, {len(chosen)} formats; set up in "
              f"{time.monotonic() - started:.1f} s", flush=True)
        header = f"{'format':<20}{'cases':>8}{'refused':>9}{'accepted':>9}{'tracebacks':>11}{'hangs':>7}" \
                 f"{'slowest s':>11}{'max RSS+ MiB':>14}"
        rows, failures = [header, "-" * len(header)], 0
        details: list[str] = []
        for fmt in chosen:
            counts: Counter[str] = Counter()
            tracebacks: Counter[str] = Counter()
            slowest = grown = 0.0
            for case in range(per_format):
                seed = args.seed + case
                result = guarded(fmt, fmt.case(random.Random(seed)), seconds=args.timeout)
                counts[result.kind] += 1
                slowest, grown = max(slowest, result.seconds), max(grown, result.rss_growth)
                if result.kind in ("traceback", "hang"):
                    # one kind of failure whatever byte position or value the message names
                    kind = re.sub(r"0x[0-9a-f]+|\d+", "N", result.message.split("\n")[0])
                    kind = re.sub(r"'[^']*'", "'…'", kind)[:110]
                    tracebacks[kind] += 1
                    if tracebacks[kind] == 1:
                        details.append(f"  {fmt.name} seed {seed}: {result.kind}: {result.message[:110]}")
            failures += counts["traceback"] + counts["hang"]
            rows.append(f"{fmt.name:<20}{per_format:>8,}{counts['refused']:>9,}{counts['accepted']:>9,}"
                        f"{counts['traceback']:>11,}{counts['hang']:>7,}{slowest:>11.2f}{grown / MiB:>14.1f}")
            for message, count in tracebacks.most_common(args.show):
                rows.append(f"    {count:>6,} x {message}")
            print(rows[-1 - min(args.show, len(tracebacks))], flush=True)
    print()
    print("\n".join(rows))
    if details:
        print("\nfirst seed of each distinct traceback or hang (replay: --format NAME --seed SEED --cases 1):")
        print("\n".join(details[:60]))
    print(f"\n{failures:,} tracebacks or hangs; {time.monotonic() - started:.0f} s in all")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
