"""The layering of flatpack's sub-packages, measured: the import graph and a worker's start-up imports.

Prints

1. the sub-package import graph — every ``import``/``from ... import`` of a flatpack module,
   function-level imports included, imports under ``if TYPE_CHECKING:`` excluded
   (:func:`flatpack.sources.import_graph`) — as edges ``a -> b (n imports)``, then its strongly
   connected components of more than one member (cycles) at the sub-package level and at the
   file level;
2. what a stage worker imports at start-up (``python -X importtime -c 'import torch; import MODULE'``):
   the number of flatpack modules, and the seconds the import takes once torch is loaded
   (flatpack's modules and whatever else they pull in, such as scipy);
3. how many of flatpack's files a function image ships (:func:`flatpack.sources.closure` of
   its entry modules) out of all of them.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/import_layers.py``. Timings
are noisy on a shared machine (quote the median of ``--repeat`` runs); the counts are exact.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from flatpack.backends.images import FUNCTION_ENTRIES
from flatpack.sources import PACKAGE, ROOT, closure, cycles, import_graph, package_graph

WORKERS = ("flatpack.runtime.worker", "flatpack.runtime.handler", "flatpack.runtime.distributed")


def worker_imports(module: str) -> tuple[list[str], float]:
    """The flatpack modules ``import module`` loads, and the seconds that import takes once
    torch is loaded: the cumulative time of every top-level import after ``import torch``."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import torch; import {module}"],
                            capture_output=True, text=True, env=env, cwd=ROOT.parent, check=True)
    modules, cumulative_us, torch_done = [], 0, False
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _own, cumulative, raw_name = line.removeprefix("import time:").split("|")
        if not cumulative.strip().isdigit():
            continue   # the header line
        name = raw_name.strip()
        top_level = raw_name.startswith(" ") and not raw_name.startswith("  ")
        if name.split(".")[0] == PACKAGE:
            modules.append(name)
        if torch_done and top_level:
            cumulative_us += int(cumulative)
        if top_level and name == "torch":
            torch_done = True
    return sorted(set(modules)), cumulative_us / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--worker", action="append", default=None,
                        help=f"a module a stage worker starts from (default: {', '.join(WORKERS)})")
    parser.add_argument("--repeat", type=int, default=3, help="import timings per worker module (the median is shown)")
    args = parser.parse_args()
    files = import_graph()
    packages = package_graph(files)
    print(f"flatpack at {ROOT}: {len(files)} modules")
    print("sub-package import graph (function-level imports included, TYPE_CHECKING excluded):")
    for source in sorted(packages):
        for target, count in sorted(packages[source].items()):
            print(f"  {source:>18} -> {target:<18} {count:3d} import(s)")
    print(f"sub-package cycles: {cycles(packages) or 'none'}")
    print(f"file cycles: {cycles(files) or 'none'}")
    for module in args.worker or WORKERS:
        runs = [worker_imports(module) for _ in range(args.repeat)]
        modules = runs[0][0]
        seconds = statistics.median(seconds for _, seconds in runs)
        print(f"import {module}: {len(modules)} flatpack modules, {seconds:.3f} s beyond torch "
              f"(median of {args.repeat}; torch imported first)")
        print("  " + " ".join(modules))
    shipped = closure(FUNCTION_ENTRIES, files)
    print(f"a function image ships {len(shipped)} of {len(files)} flatpack modules "
          f"(the closure of {', '.join(FUNCTION_ENTRIES)})")


if __name__ == "__main__":
    main()
