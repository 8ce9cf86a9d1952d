"""What running the functions as Ray tasks costs a run: the same plan and batches trained on
the local backend and on the ray backend (a head and two worker nodes started on this
machine), round-robin for ``--rounds`` rounds so that the host's drift falls on both alike.

    python benchmarks/ray_overhead.py                       # 2 rounds, 12 iterations
    python benchmarks/ray_overhead.py --rounds 3 --width 512

Both backends start the same function (``runtime.worker``) on the same S3 server; what differs
is how it is started (a process of the invoker, or a Ray task whose process starts it) and how
the invoker learns that it ended (``Popen.poll``, or ``ray.wait``). The iteration time is the
timeline's median from the third iteration on (``runtime.timeline.summarize``), so a function's
start-up is not in it; the start-up (deploy to the first iteration's end) is printed beside it.
Printed: per round and backend the median iteration and the start-up; then the ratio of Ray's
median to local's (issue 39 asks for at most 1.15). The weights of every Ray run are checked
bit-identical to local's.

``--fidelity``: then a separate ``flatpack calibrate --target ray --address ...`` run measures
the cluster, and six plans of benchmarks/fidelity.py's cases run through ``flatpack run
--target ray`` with that calibration (``JobOptions.of(target="ray")``); printed per plan the
calibrated prediction, the measured median iteration and the error, then the MAPE.
"""

from __future__ import annotations

import argparse
import logging
import io
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import flatpack
from flatpack.backends import local
from flatpack.backends import ray as ray_backend
from flatpack.ir.profile import CACHE_ENV
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.runtime import timeline
from flatpack.runtime.s3server import LocalS3Server
from flatpack.table import format_table

GIB = 1 << 30
TIER_MB = 1769           # one vCPU: the function is not throttled, on either backend
BATCH = 64
MICRO_BATCHES = 4
SKIP = 2                 # the first iterations hold the functions' start-up


class Wide(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def compiled_for(target: str, width: int) -> flatpack.Compiled:
    torch.manual_seed(0)
    model = Wide(width)
    example = (torch.randn(BATCH, 64),)
    base = flatpack.compile(model, example, stages=2)
    plan = Plan(tuple(StagePlan(start, end, TIER_MB, 2) for start, end in base.plan.ranges), base.plan.num_layers,
                micro_batches=MICRO_BATCHES)
    return flatpack.compile(model, example, plan=plan, target=target)


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 64, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
            for _ in range(count)]


def measure(deployment, iterations: int) -> tuple[float, float, dict[str, torch.Tensor]]:
    """(median iteration seconds from the third on, seconds from train() to the first
    iteration's end, the final weights)."""
    started = time.time()
    result = deployment.train(batches(iterations), iterations=iterations, optimizer="adam", schedule="1f1b")
    summary = timeline.summarize(result.events, skip_first=SKIP)
    first_end = min(it.end for it in summary.iterations)
    assert summary.iteration_s is not None, "the run measured no steady-state iteration"
    return summary.iteration_s, first_end - started, result.parameters


FIDELITY_TIERS = (512, 1024)


def fidelity(address: str, iterations: int) -> None:
    """Calibrates the cluster, runs six of fidelity.py's plans on it and prints the
    calibrated prediction's error against each measured median iteration."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fidelity import CASES, mape

    from flatpack import zoo
    from flatpack.job import run_training
    from flatpack.job_options import JobOptions

    cases = [CASES[index] for index in (1, 2, 4, 7, 8, 9)]   # vgg16, resnet50 and rnn-3; 1-2 stages, d 1-2
    with tempfile.TemporaryDirectory(prefix="flatpack-ray-fidelity-") as scratch:
        # the models are profiled afresh, as fidelity.py profiles each round: a cached profile
        # measured while the host was busy stretches every prediction made from it (resnet50's
        # 2 x 1 plan read 171 ms predicted from the cache against 122 from a fresh profile, and
        # 119-138 measured: the +23 to +33 % it showed here in three runs)
        os.environ[CACHE_ENV] = str(Path(scratch) / "profiles")
        calibration = Path(scratch) / "calibration.json"
        command = [sys.executable, "-m", "flatpack", "calibrate", "--target", "ray", "--address", address,
                   "--tiers", ",".join(map(str, FIDELITY_TIERS)), "--out", str(calibration)]
        print("$ " + " ".join(command[1:]), flush=True)
        subprocess.run(command, check=True, stdout=sys.stderr, env={**os.environ, "PYTHONPATH": os.getcwd()})
        rows, errors = [], []
        for index, case in enumerate(cases):
            model, example = zoo.build(case.model, "tiny")
            options = JobOptions.of(batch=case.batch, micro_batches=case.micro_batches, iterations=iterations,
                                 optimizer="adam", lr=1e-3, solver=case.shape,  # pyright: ignore[reportArgumentType]
                                 replicas=(case.shape.replicas,), memory_mb=(case.shape.memory_mb,),
                                 out=Path(scratch) / f"run-{index}", verify=False, schedule=case.schedule,
                                 passes="fuse-elementwise,merge-branches,coarsen{max-layers=8,by=time}",
                                 calibration=calibration, target="ray", address=address)
            comparison = run_training(model, example, options, stream=io.StringIO()).comparison
            error = comparison.iteration_error
            errors.append(error)
            rows.append((case.model, case.label, f"{comparison.predicted_iteration_s * 1000:.0f}",
                         f"{comparison.measured_iteration_s * 1000:.0f}", f"{error * 100:+.1f}%"))
            print(f"{case.model} {case.label}: predicted {rows[-1][2]} ms, measured {rows[-1][3]} ms, "
                  f"error {rows[-1][4]}", flush=True)
    print()
    print(format_table(["model", "plan", "predicted ms", "measured ms", "error"], rows, numeric={2, 3, 4}))
    print(f"\ncalibrated prediction on Ray: MAPE {mape(errors, f' over {len(errors)} plans')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--width", type=int, default=256, help="the hidden layers' width (compute per iteration)")
    parser.add_argument("--fidelity", action="store_true", help="then calibrate the cluster and predict 6 plans")
    parser.add_argument("--fidelity-iterations", type=int, default=7)
    args = parser.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    torch.set_num_threads(1)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 2 * GIB,
                                                            "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, memory=4 * GIB)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging.WARNING)
    rows, medians = [], {"local": [], "ray": []}
    try:
        with LocalS3Server() as server:
            for round_ in range(args.rounds):
                weights = {}
                for name, deploy in (("local", local.deploy), ("ray", ray_backend.deploy)):
                    with deploy(compiled_for(name, args.width), store_url=server.url(""),
                                env=server.env()) as deployment:
                        iteration_s, startup_s, weights[name] = measure(deployment, args.iterations)
                    medians[name].append(iteration_s)
                    rows.append((round_, name, f"{iteration_s * 1000:.1f}", f"{startup_s:.2f}"))
                    print(f"round {round_} {name}: median iteration {iteration_s * 1000:.1f} ms, start-up "
                          f"{startup_s:.2f} s", flush=True)
                same = all(torch.equal(weights["ray"][key], value) for key, value in weights["local"].items())
                print(f"round {round_}: Ray's weights {'bit-identical to' if same else 'DIFFER from'} local's",
                      flush=True)
        print()
        print(format_table(["round", "backend", "median iteration ms", "start-up s"], rows, numeric={0, 2, 3}))
        local_s, ray_s = statistics.median(medians["local"]), statistics.median(medians["ray"])
        print(f"\nmedian iteration: local {local_s * 1000:.1f} ms, ray {ray_s * 1000:.1f} ms; ray / local = "
              f"{ray_s / local_s:.3f}", flush=True)
        if args.fidelity:
            print()
            fidelity(str(cluster.address), args.fidelity_iterations)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
