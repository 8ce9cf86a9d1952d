"""Randomized fault trials of the ray backend on a real Ray cluster started on this machine (a
head and three worker nodes, each its own raylet): every trial must finish with the same
weights, bit for bit, as the undisturbed Ray run of its configuration.

    python benchmarks/ray_faults.py                   # 2 trials per fault kind (a quick look)
    python benchmarks/ray_faults.py --trials 20       # the full figure (~1-2 h on 2 cores)

A trial draws a configuration (schedule sync or 1f1b, 2 stages x 2 replicas, checkpoint_every
1 or 3; faults.py's residual MLP, 6 iterations of 4 micro-batches) and one fault at a random
moment of the run:

* ``node``: a worker node removed (its raylet and every process on it killed, as a lost VM);
  the run goes on on the other nodes, and a fresh node joins afterwards for the next trial;
* ``task``: SIGKILL of the Ray worker process running a random function's task (the
  function dies with it; Ray reports the task lost and does not retry it: flatpack does);
* ``driver``: SIGKILL of the process running ``train()`` (a Ray driver of its own; Ray ends
  its tasks), then ``resume()`` from a new deployment in this process over the same store;
* ``store``: SIGKILL of the S3 server, then of the driver that can no longer reach it, a new
  server over the same data directory, then ``resume()``.

The table has one row per fault kind: trials, those where the fault struck before the run
had finished, completed, bit-identical, the largest |difference| and the median trial time.
"""

from __future__ import annotations

import argparse
import logging
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
from dataclasses import asdict
from pathlib import Path

from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from faults import (Config, batches, compare, compiled_for, kill_runner_and_its_workers,
                    train_options, wait_for_training)

from flatpack.backends import ray as ray_backend
from flatpack.runtime.s3server import LocalS3Server
from flatpack.table import format_table

KINDS = ("node", "task", "driver", "store")
GIB = 1 << 30
CONFIGS = (Config("sync", 2, 1), Config("1f1b", 2, 3))


def start_cluster() -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 2 * GIB,
                                                            "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=2, memory=4 * GIB)
    cluster.wait_for_nodes()
    return cluster


# -- the driver process: deploys onto the cluster, a given store and run id, and trains --------

def driver_main(arguments: dict) -> None:
    config = Config(**arguments["config"])
    deployment = ray_backend.deploy(compiled_for(config), address=arguments["address"],
                                    store_url=arguments["store_url"], env=arguments["env"], run=arguments["run"],
                                    workdir=arguments["workdir"])
    deployment.train(batches(), **train_options(config))
    print("driver finished", flush=True)


def driver_until_a_random_moment(config: Config, address: str, server: LocalS3Server, run: str, workdir: str,
                                 rng: random.Random, typical_s: float) -> subprocess.Popen:
    arguments = {"config": asdict(config), "address": address, "store_url": server.url(""), "env": server.env(),
                 "run": run, "workdir": workdir}
    driver = subprocess.Popen([sys.executable, __file__, "--driver", json.dumps(arguments)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    wait_for_training(server, run, driver)
    try:
        driver.wait(timeout=rng.uniform(0.0, 1.0) * typical_s)
    except subprocess.TimeoutExpired:
        pass
    return driver


def resume_here(config: Config, server: LocalS3Server, run: str, workdir: str) -> dict[str, torch.Tensor]:
    with ray_backend.deploy(compiled_for(config), store_url=server.url(""), env=server.env(), run=run,
                            workdir=workdir) as deployment:
        if deployment.calls():
            deployment.resume(batches(), wait_timeout_s=60.0, timeout_s=300.0)
        else:
            deployment.train(batches(), **train_options(config))
        return deployment.parameters()


# -- the faults ----------------------------------------------------------------------------------

def function_processes() -> dict[int, int]:
    """Every running training function process of this machine -> its parent (the Ray
    worker process running its task)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"flatpack.runtime.worker" not in cmdline.read():
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                found[int(pid)] = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return found


def trial_in_process(kind: str, config: Config, cluster, server: LocalS3Server, rng: random.Random,
                     typical_s: float, workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    """``node`` and ``task``: the fault strikes while this process trains."""
    with ray_backend.deploy(compiled_for(config), store_url=server.url(""), env=server.env(),
                            workdir=workdir) as deployment:
        moment = rng.uniform(0.2, 0.9) * typical_s
        removed = []

        def strike() -> None:
            time.sleep(moment)
            if kind == "task":
                parents = list(function_processes().values())
                if parents:
                    try:
                        os.kill(rng.choice(parents), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            else:
                victim = rng.choice(list(cluster.worker_nodes))
                cluster.remove_node(victim, allow_graceful=False)
                removed.append(victim)

        striker = threading.Thread(target=strike, daemon=True)
        striker.start()
        result = deployment.train(batches(), **train_options(config))
        striker.join()
    if removed:
        cluster.add_node(num_cpus=2, memory=4 * GIB)     # a fresh node for the next trial
        cluster.wait_for_nodes()
    return result.parameters, bool(result.restarts)


def trial_driver(config: Config, address: str, server: LocalS3Server, rng: random.Random, typical_s: float,
                 workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    run = f"fault-{rng.getrandbits(40):010x}"
    driver = driver_until_a_random_moment(config, address, server, run, workdir, rng, typical_s)
    hit = kill_runner_and_its_workers(driver)
    return resume_here(config, server, run, workdir), hit


def trial_store(config: Config, address: str, rng: random.Random, typical_s: float,
                workdir: str) -> tuple[dict[str, torch.Tensor], bool]:
    data_dir = Path(workdir) / "store"
    run = f"fault-{rng.getrandbits(40):010x}"
    server = LocalS3Server(data_dir=data_dir).start()
    try:
        driver = driver_until_a_random_moment(config, address, server, run, workdir, rng, typical_s)
        hit = driver.poll() is None
        if server.pid is None:
            raise RuntimeError(f"the S3 server over {data_dir} stopped before the fault")
        os.killpg(server.pid, signal.SIGKILL)
        time.sleep(0.5)
        kill_runner_and_its_workers(driver)
    finally:
        server.stop()
    with LocalS3Server(data_dir=data_dir).start() as again:
        return resume_here(config, again, run, workdir), hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2, help="trials per fault kind (default 2; 20 for the figure)")
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver_main(json.loads(args.driver))
        return
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; choose from {', '.join(KINDS)}")
    import ray

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    cluster = start_cluster()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    references: dict[Config, tuple[dict[str, torch.Tensor], float]] = {}
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="flatpack-ray-faults-") as scratch, LocalS3Server() as server:
            for config in CONFIGS:
                started = time.perf_counter()
                with ray_backend.deploy(compiled_for(config), store_url=server.url(""), env=server.env(),
                                        workdir=Path(scratch) / "reference") as deployment:
                    parameters = deployment.train(batches(), **train_options(config)).parameters
                references[config] = (parameters, time.perf_counter() - started)
                print(f"reference {config.label}: {references[config][1]:.1f} s", flush=True)
            for kind in kinds:
                walls, completed, identical, hits, worst, failures = [], 0, 0, 0, 0.0, []
                for index in range(args.trials):
                    config = rng.choice(CONFIGS)
                    expected, typical = references[config]
                    workdir = tempfile.mkdtemp(dir=scratch, prefix=f"{kind}-{index}-")
                    started = time.perf_counter()
                    try:
                        if kind in ("node", "task"):
                            got, hit = trial_in_process(kind, config, cluster, server, rng, typical, workdir)
                        elif kind == "driver":
                            got, hit = trial_driver(config, cluster.address, server, rng, typical, workdir)
                        else:
                            got, hit = trial_store(config, cluster.address, rng, typical, workdir)
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
                    print(f"  {kind} trial {index} ({config.label}): "
                          f"{'identical' if same else f'max |diff| {diff:.3g}'}, {walls[-1]:.1f} s", flush=True)
                rows.append((kind, args.trials, hits, completed, identical, worst,
                             statistics.median(walls) if walls else float("nan"), failures))
    finally:
        ray.shutdown()
        cluster.shutdown()
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
