"""What a stage worker process imports while it runs its role, measured on real jobs.

``benchmarks/import_layers.py`` times ``import flatpack.runtime.worker``; a worker imports more
than that while it runs (its role's modules, which it loads when it learns its role, and what
those load later). This script runs one tiny job per role on this machine with
``PYTHONPROFILEIMPORTTIME=1`` in the environment the workers inherit (each worker writes its
import times to its log) and reads every worker's log when the job is done:

* ``train``: 2 stages on the local backend, 2 iterations (``runtime.worker`` -> ``runtime.training``);
* ``serve``: the same model served through fork-join, 2 requests (``runtime.forkjoin``);
* ``profile``: one emulated tier profiled (``runtime.profile_function``, which times layers with ``flatpack.measure``);
* ``calibrate``: one tier calibrated, no probe pipeline (``runtime.calibrate_function``);
* ``distributed``: 2 gloo ranks of the gpu-container backend, 1 iteration (``runtime.distributed``).

Per role it prints the flatpack modules the role's workers imported (their union; the module
started with ``python -m`` counts, as ``__main__``) and the seconds their imports took beyond
torch: the self time of every module ``python -c "import torch"`` does not load, in every
import that flatpack's code started (flatpack's modules and what they pull in: the standard
library, safetensors, boto3), but not in the imports torch's own functions start while they
run (``torch._dynamo`` on an optimizer's first step, say: any program that trains pays those),
which are shown apart. Figures are the median over the role's workers and ``--repeat`` cold
runs (each job starts fresh interpreters). Timings are noisy on a shared machine; the module
counts are exact. ``--top N`` lists the N costliest imports beyond torch.

Run from the repository root: ``PYTHONPATH=$PWD python benchmarks/worker_imports.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

import flatpack
from benchmarks.import_layers import importtime_lines
from flatpack.backends import gpu_container, local
from flatpack.runtime.forked import FORK_SERVER_ENV
from flatpack.backends.profiling import profile_in_target
from flatpack.backends.target_calibration import calibrate_target
from flatpack.sources import PACKAGE

BATCH = 8
PROFILE_ENV = "PYTHONPROFILEIMPORTTIME"
# the module each role's processes start with ``python -m``: it runs as __main__, so
# -X importtime never lists it
ENTRY = {"train": "flatpack.runtime.worker", "serve": "flatpack.runtime.worker",
         "profile": "flatpack.runtime.worker", "calibrate": "flatpack.runtime.worker",
         "distributed": "flatpack.runtime.distributed"}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 5))


def example() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 16),)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(count)]


@contextlib.contextmanager
def profiled_imports() -> Iterator[None]:
    """Every process started inside writes its import times to its stderr (the workers': their
    logs); this process started before and is not affected. The local functions start as fresh
    interpreters (``FLATPACK_FORK_SERVER=0``): a forked one imports nothing, its server did."""
    os.environ[PROFILE_ENV] = "1"
    os.environ[FORK_SERVER_ENV] = "0"
    try:
        yield
    finally:
        del os.environ[PROFILE_ENV]
        del os.environ[FORK_SERVER_ENV]


def logs_under(directory: Path, pattern: str) -> list[str]:
    return [path.read_text(errors="replace") for path in sorted(directory.rglob(pattern))]


def train_job(workdir: Path) -> list[str]:
    compiled = flatpack.compile(make_model(), example(), stages=2)
    with local.deploy(compiled, workdir=workdir) as deployment, profiled_imports():
        deployment.train(batches(2), iterations=2, optimizer={"name": "adam", "lr": 0.01})
    return logs_under(workdir, "train-*.log")


def serve_job(workdir: Path) -> list[str]:
    compiled = flatpack.compile(make_model().eval(), example(), stages=2)
    with local.deploy(compiled, workdir=workdir) as deployment, profiled_imports():
        for inputs, _target in batches(2):
            deployment.infer(inputs)
    return logs_under(workdir, "infer-*.log")


def profile_job(workdir: Path) -> list[str]:
    with profiled_imports():
        profile_in_target(make_model(), example(), target="local", tiers=(1024,), batch_sizes=(1, 2), repeats=1,
                          deploy=partial(local.deploy, workdir=workdir))
    return logs_under(workdir, "profile-*.log")


def calibrate_job(workdir: Path) -> list[str]:
    with profiled_imports():
        calibrate_target("local", tiers=(1024,), round_trips=4, task_iterations=0,
                         deploy=partial(local.deploy, workdir=workdir))
    return logs_under(workdir, "calibrate-*.log")


def distributed_job(workdir: Path) -> list[str]:
    model = make_model()
    compiled = flatpack.compile(model, example(), stages=2, target="gpu-container")
    with gpu_container.deploy(compiled, backend="gloo", workdir=workdir / "ranks") as deployment, profiled_imports():
        deployment.train(batches(1), iterations=1, optimizer={"name": "sgd", "lr": 0.1})
        return logs_under(deployment.workdir, "rank_*.log")


JOBS: dict[str, Callable[[Path], list[str]]] = {
    "train": train_job, "serve": serve_job, "profile": profile_job, "calibrate": calibrate_job,
    "distributed": distributed_job,
}


def torch_modules() -> set[str]:
    """What ``import torch`` alone loads (the interpreter's start-up included)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch"], capture_output=True,
                            text=True, check=True)
    return {name for name, _own, _cumulative, _depth in importtime_lines(result.stderr)}


@dataclass(frozen=True)
class WorkerImports:
    flatpack_modules: frozenset[str]
    beyond_torch_s: float         # the imports flatpack's code started, less what `import torch` loads
    flatpack_s: float             # flatpack's own modules among them
    torch_lazy_s: float           # the imports torch's functions started as they ran (not counted above)
    roots_s: dict[str, float]     # beyond_torch_s by the import that started each tree


def is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def worker_imports(log: str, entry: str, baseline: set[str]) -> WorkerImports:
    """The imports in one worker's log. ``-X importtime`` writes a module after the ones it
    imported, so each import at depth 0 closes the tree of the lines since the last one: a tree
    whose root is a torch module is torch's own lazy import, any other one flatpack's code started."""
    modules, flatpack_us, torch_us, roots = {entry}, 0, 0, dict[str, int]()
    tree: list[tuple[str, int]] = []
    for name, own, _cumulative, depth in importtime_lines(log):
        if name not in baseline:
            tree.append((name, own))
        if name.split(".")[0] == PACKAGE:
            modules.add(name)
            flatpack_us += own if name not in baseline else 0
        if depth:
            continue
        spent = sum(own for _name, own in tree)
        if is_torch(name):
            torch_us += spent
        elif spent:
            roots[name] = roots.get(name, 0) + spent
        tree = []
    return WorkerImports(frozenset(modules), sum(roots.values()) / 1e6, flatpack_us / 1e6, torch_us / 1e6,
                         {name: us / 1e6 for name, us in roots.items()})


def measure(role: str, repeat: int, baseline: set[str]) -> list[WorkerImports]:
    workers = []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory(prefix=f"flatpack-imports-{role}-") as directory:
            logs = [log for log in JOBS[role](Path(directory)) if "import time:" in log]
        if not logs:
            raise RuntimeError(f"the {role} job's workers wrote no import times: did they inherit {PROFILE_ENV}?")
        workers += [worker_imports(log, ENTRY[role], baseline) for log in logs]
    return workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--role", action="append", choices=sorted(JOBS), default=None,
                        help=f"a role to measure (default: all: {', '.join(JOBS)})")
    parser.add_argument("--repeat", type=int, default=3, help="cold runs of each role's job (the median is shown)")
    parser.add_argument("--list", action="store_true", help="also list each role's flatpack modules")
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest imports beyond torch (median)")
    args = parser.parse_args()
    baseline = torch_modules()
    for role in args.role or JOBS:
        workers = measure(role, args.repeat, baseline)
        modules = sorted(frozenset().union(*(worker.flatpack_modules for worker in workers)))
        beyond = statistics.median(worker.beyond_torch_s for worker in workers)
        own = statistics.median(worker.flatpack_s for worker in workers)
        torch_lazy = statistics.median(worker.torch_lazy_s for worker in workers)
        print(f"{role:>11}: {len(modules):3d} flatpack modules, {beyond:.3f} s of imports beyond torch "
              f"({own:.3f} s in flatpack's own modules; torch's own imports while running: {torch_lazy:.3f} s, not "
              f"counted; median of {len(workers)} workers over {args.repeat} runs)", flush=True)
        if args.list:
            print("             " + " ".join(modules), flush=True)
        if args.top:
            roots = {name for worker in workers for name in worker.roots_s}
            costs = {name: statistics.median(worker.roots_s.get(name, 0.0) for worker in workers) for name in roots}
            print("             " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in
                                              sorted(costs.items(), key=lambda item: -item[1])[:args.top]), flush=True)


if __name__ == "__main__":
    main()
