"""The ray backend on a real Ray cluster of three nodes started on this machine (a head and two
workers, each with its own CPU and memory resources): the same plan and batches train to
bit-identical weights on Ray and on the local backend, with 1F1B and sync; a function killed
mid-run (its own process, or the Ray task's process) is restarted by flatpack's invoker
and the weights are those of an undisturbed run; fork-join inference answers as local's."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Iterator

import pytest
import torch

import flatpack
from flatpack.backends import get_backend, local
from flatpack.errors import InputError
from flatpack.partitioner.plan import Plan, StagePlan
from flatpack.platform.catalog import get_platform
from flatpack.runtime import forked
from tests.integration.test_local_training import BATCH, batches, make_model
from tests.proctree import cmdline, descendants, stat, wait_gone

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402 - after the skip: Ray is an optional extra

from flatpack.backends import ray as ray_backend  # noqa: E402

pytestmark = pytest.mark.slow

GIB = 1 << 30
TIER_MB = 1769          # one vCPU on the Lambda rule local and ray share: no throttling on a busy host
OPTIMIZER = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Cluster]:
    """A head and two workers, each its own raylet with its own resources (Ray's CPUs are
    scheduling labels, so 5 on a 2-core machine is fine); this process is the driver."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "memory": 2 * GIB,
                                                            "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2, memory=4 * GIB)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def compiled_for(target: str, replicas: tuple[int, int] = (2, 2), micro_batches: int = 4) -> flatpack.Compiled:
    """2 stages x 2 replicas at one fixed tier, compiled for ``target`` (the same weights:
    the model is seeded)."""
    model = make_model()
    layers = flatpack.compile(model, (torch.randn(BATCH, 8),), stages=2).plan.num_layers
    ranges = Plan.from_cuts([layers // 2 - 1], layers).ranges
    plan = Plan(tuple(StagePlan(start, end, TIER_MB, degree) for (start, end), degree in zip(ranges, replicas)),
                layers, micro_batches=micro_batches)
    return flatpack.compile(model, (torch.randn(BATCH, 8),), plan=plan, target=target)


def assert_bit_identical(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.fixture(scope="module")
def local_results(s3_server) -> dict[str, local.TrainResult]:
    """The local backend's run of the same plan and batches, per schedule."""
    results = {}
    for schedule in ("sync", "1f1b"):
        with local.deploy(compiled_for("local"), store_url=s3_server.url(""), env=s3_server.env()) as deployment:
            results[schedule] = deployment.train(batches(4), iterations=4, optimizer=OPTIMIZER, schedule=schedule)
    return results


@pytest.mark.parametrize("schedule", ["sync", "1f1b"])
def test_ray_training_is_bit_identical_to_local(ray_cluster, s3_server, local_results, schedule):
    compiled = compiled_for("ray")
    with ray_backend.deploy(compiled, store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(batches(4), iterations=4, optimizer=OPTIMIZER, schedule=schedule)
        nodes = set(deployment_nodes(deployment))
    assert_bit_identical(result.parameters, local_results[schedule].parameters)
    assert result.losses == local_results[schedule].losses
    assert result.restarts == []
    # the cluster's 5 CPUs hold the 4 one-vCPU functions only across nodes
    assert len(nodes) >= 2


def deployment_nodes(deployment: Any) -> list[str]:
    """The nodes the run's functions ran on, as their logs record them."""
    return [path.read_text().splitlines()[0].removeprefix(ray_backend.NODE_LINE)
            for path in deployment.workdir.glob("train-*.log")]


def test_a_function_that_kills_itself_is_restarted_by_the_invoker(ray_cluster, s3_server, local_results):
    kill = {"stage": 1, "replica": 1, "iteration": 2, "at": "backward", "action": "kill"}
    with ray_backend.deploy(compiled_for("ray"), store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        result = deployment.train(batches(4), iterations=4, optimizer=OPTIMIZER, schedule="sync", faults=[kill])
    assert [(r.worker, r.iteration, r.reason) for r in result.restarts] == [("s1r1", 2, "lost")]
    assert_bit_identical(result.parameters, local_results["sync"].parameters)


def test_a_killed_ray_task_process_is_restarted_by_the_invoker(ray_cluster, s3_server, local_results):
    """SIGKILL of the Ray worker process running a function's task (the function, forked from
    the worker's fork server, dies with it through the server): Ray reports the task lost (no
    Ray retry), flatpack's invoker restarts it."""
    with ray_backend.deploy(compiled_for("ray"), store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        killed: dict[str, int] = {}
        killer = threading.Thread(target=kill_task_process, args=(deployment, 0, 1, 1, killed), daemon=True)
        killer.start()
        result = deployment.train(batches(4), iterations=4, optimizer=OPTIMIZER, schedule="1f1b",
                                  faults=[{"stage": 0, "replica": 1, "iteration": 1, "action": "sleep",
                                           "seconds": 3}])
        killer.join()
    assert [(r.worker, r.reason) for r in result.restarts] == [("s0r1", "lost")]
    assert_bit_identical(result.parameters, local_results["1f1b"].parameters)
    assert killed.keys() == {"task", "function", "parent", "function_start"}
    # forked from a fork server the Ray worker started (where this host forks functions)
    assert (killed["parent"] != killed["task"]) == (forked.unavailable_reason() is None)
    # the function died with its task's process (PR_SET_PDEATHSIG), not left running beside its
    # replacement: gone, or a zombie no one has reaped yet, or its pid already another process's
    # (pid_max can be 32768); /proc/PID existing said none of that (one CI run in five)
    assert wait_gone({killed["function"]: killed["function_start"]}, 10) == {}


@pytest.mark.parametrize("fork_server", ["1", "0"])
def test_a_ray_task_returns_its_functions_exit_code_and_output_forked_or_fresh(ray_cluster, fork_server):
    """``run_function`` as a Ray task runs the function (forked from the Ray worker's fork
    server, or a fresh interpreter under ``FLATPACK_FORK_SERVER=0``) and returns its exit code
    and the tail of its output: here a role that does not parse, which the worker refuses."""
    from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV

    env = {ROLE_ENV: "{not a role", STORE_ENV: "file:///nonexistent", forked.FORK_SERVER_ENV: fork_server}
    code, output, node = ray.get(ray_backend._remote_function().options(max_retries=0).remote(env), timeout=120)
    assert code == 1
    assert b"Traceback" in output, output[-2000:]
    assert node in {entry["NodeID"] for entry in ray.nodes()}


def kill_task_process(deployment: ray_backend.RayDeployment, stage: int, replica: int, iteration: int,
                      killed: dict[str, int]) -> None:
    """Waits until the function of ``stage``/``replica`` reported ``iteration - 1`` (it then
    sleeps in ``iteration``, a fault of the test), and SIGKILLs the Ray worker process that
    runs its task; ``killed`` gets the pids of the task's process, the function and the
    function's parent, and the function's start time (to tell its pid from a reuse)."""
    deadline = time.time() + 60
    key = deployment.keys.progress(iteration - 1, stage, replica)
    while not deployment.store.exists(key):
        assert time.time() < deadline, "the function never reported"
        time.sleep(0.05)
    killed["task"], killed["function"] = task_process(f"flatpack-train-s{stage}r{replica}-a0")
    function = stat(killed["function"])
    assert function is not None
    killed["parent"], killed["function_start"] = function[1], function[2]
    os.kill(killed["task"], signal.SIGKILL)


def task_process(name: str) -> tuple[int, int]:
    """The pid of the Ray worker process running the task ``name`` (Ray titles it
    ``ray::NAME``) and of the function process under it (forked from the worker's fork server,
    or its child). Only this process's cluster (its raylets are this process's descendants) is
    searched: another test process's cluster may run a task of the same name at the same time."""
    for pid in descendants(os.getpid()):
        if cmdline(pid).split(" ")[0] != f"ray::{name}":
            continue
        functions = [child for child in descendants(pid) if "flatpack.runtime.worker" in cmdline(child)]
        assert len(functions) == 1, (name, functions)
        return pid, functions[0]
    raise AssertionError(f"no Ray worker of this process's cluster runs the task {name}")


def test_inference_on_ray_equals_local(ray_cluster, s3_server):
    inputs = [torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(seed)) for seed in range(2)]
    with local.deploy(compiled_for("local"), store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        expected = [deployment.infer(x) for x in inputs]
    with ray_backend.deploy(compiled_for("ray"), store_url=s3_server.url(""), env=s3_server.env()) as deployment:
        answers = [deployment.infer(x) for x in inputs]
    for ours, theirs in zip(answers, expected):
        assert torch.equal(ours, theirs)


def test_the_platform_is_the_clusters_and_a_plan_too_big_for_it_is_refused_before_launch(ray_cluster, s3_server):
    connection = ray_backend.connect()
    assert not connection.opened_here
    cluster = connection.cluster
    assert sorted(node.cpus for node in cluster.nodes) == [1.0, 2.0, 2.0]
    platform = get_platform("ray")
    assert platform.max_memory_mb == 4096 and platform.tier(4096).vcpus == 2.0   # the largest node bounds a tier
    with pytest.raises(InputError, match=r"needs 6 vCPU at once .* has 5: 1 vCPU short"):
        ray_backend.deploy(compiled_for("ray", replicas=(3, 3)), store_url=s3_server.url(""), env=s3_server.env())
    with pytest.raises(InputError, match=r"no node of the Ray cluster has that much"):
        ray_backend.check_capacity([("stage 0", 1, ray_backend.Demand(3.0, GIB))], cluster)
    with pytest.raises(InputError, match=r"needs 12.00 GiB of memory at once .* 10.00 GiB: 2.00 GiB short"):
        ray_backend.check_capacity([("stage 0", 3, ray_backend.Demand(0.5, 4 * GIB))], cluster)
    assert get_backend("ray") is ray_backend


def test_flatpack_run_target_ray_trains_on_the_cluster_and_passes_the_verdict(ray_cluster, tmp_path, capsys):
    """The command line end to end on the cluster this process is connected to: plan for its
    nodes, train as Ray tasks, and the verdict against single-process training."""
    from flatpack import cli

    code = cli.main(["run", "mlp", "--target", "ray", "--stages", "2", "--replicas", "2", "--memory", str(TIER_MB),
                     "--batch", "8", "--micro-batches", "2", "--iterations", "3", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "equivalence with single-process training: passed" in out
    logs = sorted((tmp_path / "run").rglob("train-s*-a0.log"))
    assert logs and all(log.read_text().startswith(ray_backend.NODE_LINE) for log in logs)


def test_address_without_target_ray_is_refused_before_anything_runs(tmp_path):
    from flatpack import cli

    assert cli.main(["run", "mlp", "--address", "auto", "--out", str(tmp_path / "run")]) != 0
    assert not (tmp_path / "run" / "store").exists()


def test_flatpack_serve_target_ray_answers_as_the_model_from_warm_ray_tasks(ray_cluster, tmp_path):
    """``flatpack serve DIR --target ray --address ADDRESS`` as a user runs it, a driver of its
    own on this cluster: its fork-join functions run as Ray tasks (under the raylets, none under
    the server), stay warm across concurrent requests of mixed sizes, and every answer equals
    the original model's; SIGTERM then stops it cleanly."""
    import asyncio
    import re
    import subprocess
    import sys

    import httpx

    from tests.integration.test_serve import SAMPLE, _output, _predict, _wait_ready
    from tests.models import ConvBlocks
    from tests.proctree import cmdline, descendants

    torch.manual_seed(0)
    model = ConvBlocks().eval()
    plan = Plan((StagePlan(0, 1, None, 2, split="channel"), StagePlan(2, 4)), 5)
    compiled = flatpack.compile(model, (torch.randn(2, *SAMPLE),), plan=plan, target="ray")
    compiled.save(tmp_path / "art")
    server = subprocess.Popen([sys.executable, "-m", "flatpack", "serve", str(tmp_path / "art"), "--digest",
                               compiled.digest, "--target", "ray", "--address", ray_cluster.address,
                               "--slo-ms", "60000", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.match(r"serving [0-9a-f]{64} on (http://\S+)", line)
        assert found, line + server.stdout.read()
        url = found.group(1)
        _wait_ready(url)
        inputs = [torch.randn(1 + index % 4, *SAMPLE) for index in range(12)]

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(_predict(client, url, x, index % 2 == 0)
                                              for index, x in enumerate(inputs)))

        responses = asyncio.run(run())
        with torch.no_grad():
            for x, response in zip(inputs, responses):
                assert response.status_code == 200, response.text
                torch.testing.assert_close(_output(response), model(x))
        served_here = [pid for pid in descendants(server.pid) if "flatpack.runtime.worker" in cmdline(pid)]
        on_ray = [pid for pid in descendants(os.getpid()) if "flatpack.runtime.worker" in cmdline(pid)]
        assert served_here == [] and len(on_ray) >= 3       # the master and two workers, under the raylets
        assert re.search(r"^flatpack_serve_cold_starts_total 3\.0$", httpx.get(f"{url}/metrics").text, re.M)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0, server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_flatpack_serve_on_ray_keeps_a_warm_pool_of_replicas_on_one_store(ray_cluster):
    """A floor of two replicas on the ray target: the second fork-join group deploys beside
    the first (its own run prefix on the first one's store, tasks of its own on the cluster),
    both answer requests as the model, and stopping the server ends both."""
    import asyncio

    import httpx

    from flatpack.serve.server import Server
    from flatpack.serve.settings import ServeSettings
    from tests.integration.test_serve import SAMPLE, _metric, _output, _predict, _wait_ready
    from tests.models import ConvBlocks

    torch.manual_seed(0)
    model = ConvBlocks().eval()
    compiled = flatpack.compile(model, (torch.randn(2, *SAMPLE),), plan=Plan((StagePlan(0, 4),), 5), target="ray")
    settings = ServeSettings(slo_s=60.0, port=0, target="ray", min_replicas=2, max_replicas=2)
    running = Server(compiled, settings).start()
    try:
        _wait_ready(running.url)
        replicas = running.service.version.replicas
        assert len(replicas) == 2 and replicas[1].deployment.store_url == replicas[0].deployment.store_url
        assert replicas[1].deployment.keys.run != replicas[0].deployment.keys.run
        inputs = [torch.randn(1 + index % 3, *SAMPLE) for index in range(16)]

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(_predict(client, running.url, x, False) for x in inputs))

        responses = asyncio.run(run())
        metrics = httpx.get(f"{running.url}/metrics").text
    finally:
        running.stop()
    with torch.no_grad():
        for x, response in zip(inputs, responses):
            assert response.status_code == 200, response.text
            torch.testing.assert_close(_output(response), model(x))
    assert _metric(r"^flatpack_serve_replicas (\S+)$", metrics) == "2.0"
    assert _metric(r"^flatpack_serve_cold_starts_total (\S+)$", metrics) == "2.0"     # one function per group
    assert running.service.version.replicas == []


def test_the_demo_on_a_ray_cluster_it_starts_itself(tmp_path):
    """README's Ray command, as a user types it: `flatpack demo --target ray --address local`
    starts a one-node Ray cluster in its own process (none of the session's), trains the
    demo's two stages as Ray tasks and passes the verdict. A process of its own, so the
    cluster it starts and stops is not this test process's connection."""
    import subprocess
    import sys

    environment = {**os.environ, "RAY_ADDRESS": ""}   # the session's cluster must not be the one it finds
    done = subprocess.run([sys.executable, "-m", "flatpack", "demo", "--target", "ray", "--address", "local",
                           "--iterations", "4", "--out", str(tmp_path / "demo")],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "trained as a pipeline of 2 Ray tasks on local" in output
    assert "equivalence with single-process training: passed" in output
    assert "Traceback" not in output
    assert (tmp_path / "demo" / "trained.safetensors").is_file()


def test_the_demo_refuses_to_measure_a_ray_calibration_as_this_hosts(tmp_path, capsys):
    from flatpack import cli

    code = cli.main(["demo", "--target", "ray", "--calibration", "measure", "--out", str(tmp_path / "demo")])
    assert code == 2
    assert "flatpack calibrate --target ray --out FILE" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
