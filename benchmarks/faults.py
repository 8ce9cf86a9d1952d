"""Randomized fault trials of the training runtime: every trial must complete with the same
weights, bit for bit, as the uninterrupted run of its configuration.

    python benchmarks/faults.py                       # 100 trials, 20 per fault kind (~25-35 min on 2 cores)
    python benchmarks/faults.py --trials 5 --kinds worker,errors     # a quick look

Each trial draws a configuration — schedule (sync, 1f1b), replicas d ∈ {1, 2} per stage,
checkpoint_every ∈ {1, 3} — for a 2-stage pipeline of a small residual MLP (6 iterations, 4
micro-batches, SGD with momentum), and one fault:

* ``worker``: SIGKILL of a random training function at a random moment of the run;
* ``runner``: SIGKILL of the process that runs ``train()`` (the invoker) at a random moment,
  then ``Deployment.resume()`` from a fresh deployment object over the same store;
* ``server``: SIGKILL of the S3 server (and then of the runner, which can no longer reach
  it), a new server on the same data directory, then ``resume()``;
* ``errors``: 10% of the functions' store requests fail with a transient error;
* ``stalls``: 5% of the functions' store requests stall for 2 s.

The reference of a configuration is its own uninterrupted pipelined run (computed once per
configuration); a trial is bit-identical when every parameter and buffer is ``torch.equal``
to it. The table has one row per fault kind: trials, those where the fault struck before the
run finished (a worker restarted, the runner was still running), completed, bit-identical, the largest
|difference| seen and the median wall time of a trial.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime.s3server import LocalS3Server
from flatpack.table import format_table

KINDS = ("worker", "runner", "server", "errors", "stalls")
ITERATIONS = 6
MICRO_BATCHES = 4
BATCH = 16
OPTIMIZER = {"name": "sgd", "lr": 0.05, "momentum": 0.9}
STORE_FAULTS = {"errors": {"error_rate": 0.10}, "stalls": {"stall_rate": 0.05, "stall_s": 2.0}}


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.hidden = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.out = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        skip = h
        for index, layer in enumerate(self.hidden):
            h = torch.tanh(layer(h))
            if index == 1:
                h = h + skip
        return self.out(h)


@dataclass(frozen=True)
class Config:
    schedule: str
    replicas: int
    checkpoint_every: int

    @property
    def label(self) -> str:
        return f"{self.schedule}/d={self.replicas}/every={self.checkpoint_every}"


def compiled_for(config: Config) -> flatpack.Compiled:
    torch.manual_seed(0)
    model = ResidualMLP()
    example = (torch.randn(BATCH, 16),)
    base = flatpack.compile(model, example, stages=2)
    plan = Plan(tuple(StagePlan(start, end, None, config.replicas) for start, end in base.plan.ranges),
                base.plan.num_layers, micro_batches=MICRO_BATCHES)
    return flatpack.compile(model, example, plan=plan)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator))
            for _ in range(ITERATIONS)]


def train_options(config: Config, **extra: object) -> dict:
    return {"optimizer": OPTIMIZER, "schedule": config.schedule, "checkpoint_every": config.checkpoint_every,
            "wait_timeout_s": 60.0, "timeout_s": 300.0, **extra}


def compare(parameters: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[bool, float]:
    identical, worst = True, 0.0
    for name, expected in reference.items():
        got = parameters[name]
        identical = identical and torch.equal(got, expected)
        worst = max(worst, float((got.double() - expected.double()).abs().max()) if got.numel() else 0.0)
    return identical, worst


# -- the runner process: deploys onto a given store and run id and trains ---------------------

def runner_main(arguments: dict) -> None:
    config = Config(**arguments["config"])
    deployment = local.deploy(compiled_for(config), store_url=arguments["store_url"], env=arguments["env"],
                              run=arguments["run"], workdir=arguments["workdir"])
    deployment.train(batches(), **train_options(config))
    print("runner finished", flush=True)


def start_runner(config: Config, server: LocalS3Server, run: str, workdir: str) -> subprocess.Popen:
    arguments = {"config": asdict(config), "store_url": server.url(""), "env": server.env(), "run": run,
                 "workdir": workdir}
    return subprocess.Popen([sys.executable, __file__, "--runner", json.dumps(arguments)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)


def wait_for_training(server: LocalS3Server, run: str, runner: subprocess.Popen) -> None:
    """Until the runner's call is recorded (it compiled, deployed and started training) or it ended."""
    with server.store() as store:
        while runner.poll() is None and not store.list(f"{run}/calls/"):
            time.sleep(0.05)


def start_runner_until_a_random_moment(config: Config, server: LocalS3Server, run: str, workdir: str,
                                       rng: random.Random, typical_s: float) -> subprocess.Popen:
    """Starts the runner and returns once it is training and a random share of a typical run
    has passed (or it ended): the moment a fault strikes."""
    runner = start_runner(config, server, run, workdir)
    wait_for_training(server, run, runner)
    try:
        runner.wait(timeout=rng.uniform(0.0, 1.0) * typical_s)
    except subprocess.TimeoutExpired:
        pass
    return runner


def resume_or_train(deployment: local.LocalDeployment, config: Config) -> None:
    """What a user does after the crash: resume the call, or start it if it never began."""
    if deployment.calls():
        deployment.resume(batches(), wait_timeout_s=60.0, timeout_s=300.0)
    else:
        deployment.train(batches(), **train_options(config))


def kill_runner_and_its_workers(runner: subprocess.Popen) -> bool:
    """SIGKILL of the invoker; its functions are left as a crashed machine would leave them
    on a platform (they die with it where the backend arranges that, and otherwise run on
    and time out: the resumed call never reads what they write)."""
    children = _descendants(runner.pid)
    hit = runner.poll() is None
    runner.kill()
    runner.wait()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return hit


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


# -- one trial per fault kind ----------------------------------------------------------------

def trial_worker(config: Config, server: LocalS3Server, rng: random.Random, typical_s: float,
                 workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    """(the trained parameters, whether a worker was killed mid-call)."""
    with local.deploy(compiled_for(config), store_url=server.url(""), env=server.env(), workdir=workdir) as deployment:
        moment = rng.uniform(0.2, 0.9) * typical_s

        def kill_one() -> None:
            time.sleep(moment)
            # the local backend's functions are processes of this machine
            alive = [worker.process for worker in tuple(deployment.workers.values())
                     if isinstance(worker.process, subprocess.Popen) and worker.process.poll() is None]
            if alive:
                victim = rng.choice(alive)
                try:
                    os.kill(victim.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        killer = threading.Thread(target=kill_one, daemon=True)
        killer.start()
        result = deployment.train(batches(), **train_options(config))
        killer.join()
        return result.parameters, bool(result.restarts)


def trial_runner(config: Config, server: LocalS3Server, rng: random.Random, typical_s: float,
                 workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    run = f"fault-{rng.getrandbits(40):010x}"
    runner = start_runner_until_a_random_moment(config, server, run, workdir, rng, typical_s)
    hit = kill_runner_and_its_workers(runner)
    deployment = local.deploy(compiled_for(config), store_url=server.url(""), env=server.env(), run=run,
                              workdir=workdir)
    with deployment:
        resume_or_train(deployment, config)
        return deployment.parameters(), hit


def trial_server(config: Config, rng: random.Random, typical_s: float,
                 workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    data_dir = Path(workdir) / "store"
    run = f"fault-{rng.getrandbits(40):010x}"
    server = LocalS3Server(data_dir=data_dir).start()
    try:
        runner = start_runner_until_a_random_moment(config, server, run, workdir, rng, typical_s)
        hit = runner.poll() is None
        if server.pid is None:
            raise RuntimeError(f"the S3 server over {data_dir} stopped before the fault; see weed.log there")
        os.killpg(server.pid, signal.SIGKILL)   # the server's process group: weed and its helpers
        time.sleep(0.5)
        kill_runner_and_its_workers(runner)
    finally:
        server.stop()
    with LocalS3Server(data_dir=data_dir).start() as again:
        deployment = local.deploy(compiled_for(config), store_url=again.url(""), env=again.env(), run=run,
                                  workdir=workdir)
        with deployment:
            resume_or_train(deployment, config)
            return deployment.parameters(), hit


def trial_store_faults(kind: str, config: Config, server: LocalS3Server, rng: random.Random,
                       workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    faults = {**STORE_FAULTS[kind], "seed": rng.getrandbits(31)}
    with local.deploy(compiled_for(config), store_url=server.url(""), env=server.env(), workdir=workdir) as deployment:
        result = deployment.train(batches(), **train_options(config, store_faults=faults))
        return result.parameters, True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials per fault kind (default 20)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.runner:
        runner_main(json.loads(args.runner))
        return
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    configs = [Config(schedule, d, every) for schedule in ("sync", "1f1b") for d in (1, 2) for every in (1, 3)]
    references: dict[Config, tuple[dict[str, torch.Tensor], float]] = {}
    rows = []
    with tempfile.TemporaryDirectory(prefix="flatpack-faults-") as scratch, LocalS3Server() as server:
        def reference(config: Config) -> tuple[dict[str, torch.Tensor], float]:
            if config not in references:
                started = time.perf_counter()
                with local.deploy(compiled_for(config), store_url=server.url(""), env=server.env(),
                                  workdir=Path(scratch) / "reference") as deployment:
                    parameters = deployment.train(batches(), **train_options(config)).parameters
                references[config] = (parameters, time.perf_counter() - started)
                print(f"reference {config.label}: {references[config][1]:.1f} s", flush=True)
            return references[config]

        for kind in kinds:
            walls, completed, identical, hits, worst, failures = [], 0, 0, 0, 0.0, []
            for index in range(args.trials):
                config = rng.choice(configs)
                expected, typical = reference(config)
                workdir = tempfile.mkdtemp(dir=scratch, prefix=f"{kind}-{index}-")
                started = time.perf_counter()
                try:
                    if kind == "worker":
                        got, hit = trial_worker(config, server, rng, typical, workdir)
                    elif kind == "runner":
                        got, hit = trial_runner(config, server, rng, typical, workdir)
                    elif kind == "server":
                        got, hit = trial_server(config, rng, typical, workdir)
                    else:
                        got, hit = trial_store_faults(kind, config, server, rng, workdir)
                except Exception as err:  # noqa: BLE001 - a failed trial is a row entry, not the end
                    failures.append(f"{config.label}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                    print(f"  {kind} trial {index} ({config.label}) FAILED: {failures[-1]}", flush=True)
                    continue
                walls.append(time.perf_counter() - started)
                completed += 1
                hits += hit
                same, diff = compare(got, expected)
                identical += same
                worst = max(worst, diff)
                print(f"  {kind} trial {index} ({config.label}): {'identical' if same else f'max |diff| {diff:.3g}'}, "
                      f"{walls[-1]:.1f} s", flush=True)
            rows.append((kind, args.trials, hits, completed, identical, worst,
                         statistics.median(walls) if walls else float("nan"), failures))
    print()
    print(format_table(["fault", "trials", "fault hit", "completed", "identical", "max |diff|", "median wall"],
                       [(kind, trials, hits, completed, identical, f"{worst:.3g}", f"{wall:.1f}s")
                        for kind, trials, hits, completed, identical, worst, wall, _ in rows],
                       numeric=range(1, 7)))
    for kind, *_, failures in rows:
        for failure in failures:
            print(f"{kind} failure: {failure}")


if __name__ == "__main__":
    main()
