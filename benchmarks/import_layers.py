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
from collections import Counter, defaultdict

from flatpack.sources import PACKAGE, ROOT, closure, import_graph

WORKERS = ("flatpack.runtime.worker", "flatpack.runtime.handler", "flatpack.runtime.distributed")
IMAGE_ENTRIES = ("flatpack.runtime.handler", "flatpack.runtime.fc_server")


def subpackage(module: str) -> str:
    """``flatpack.ir.passes.coarsen`` -> ``ir``; a top-level module is its own node."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(files: dict[str, Counter[str]]) -> dict[str, Counter[str]]:
    graph: dict[str, Counter[str]] = defaultdict(Counter)
    for source, targets in files.items():
        graph[subpackage(source)]  # every sub-package is a node, even one that imports nothing
        for target, count in targets.items():
            if subpackage(target) != subpackage(source):
                graph[subpackage(source)][subpackage(target)] += count
    return graph


def cycles(graph: dict[str, Counter[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    shipped = closure(IMAGE_ENTRIES, files)
    print(f"a function image ships {len(shipped)} of {len(files)} flatpack modules "
          f"(the closure of {', '.join(IMAGE_ENTRIES)})")


if __name__ == "__main__":
    main()
