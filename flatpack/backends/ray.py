"""The ``ray`` backend: every stage replica ("function") is a Ray task on a Ray cluster, with
its tier as the task's resources (the tier's vCPU share as ``num_cpus``, its memory in bytes as
``memory``), running the same function as the local backend: ``python -m
flatpack.runtime.worker``, started on the task's node by :mod:`flatpack.runtime.ray_task`.
The functions share nothing but an S3 store every node reaches: the SeaweedFS this backend
starts on the driver's machine (``runtime.s3server``, on 127.0.0.1: a cluster whose nodes all
run on that machine), or the user's endpoint (``store_url`` with its credentials in ``env``).

**A task, not an actor.** A function is stateless between invocations: everything it needs
(the run's settings, its stage, checkpoints, tensors) is in the store, and a lost one is
restarted from the last checkpoint. A Ray task is exactly that unit; an actor would hold
state flatpack keeps in the store, and Ray would restart it with that state gone anyway.

**Who retries: flatpack's invoker, never Ray.** Every task is submitted with
``max_retries=0``: when a task is lost (its process killed, its node removed, ``ray.cancel``),
Ray reports it failed and :mod:`flatpack.backends.functions` restarts the function from its
stage's last checkpoint, replaying the iterations after it, each replayed write the same bytes
again (the exactly-once argument of ``functions._Run._resume_point``). A Ray retry would start
the function again from the iteration of its first invocation, beside a relaunch of the
invoker's own: two writers, one of them re-running iterations the other has moved past.
``tests/integration/test_ray_backend.py`` kills a function mid-run and gets the weights of an
undisturbed run.

**Tiers.** Ray's ``num_cpus`` and ``memory`` are scheduling labels: Ray places the task on a
node with that much left, but caps neither its CPU time nor its memory. So, as on local, the
function holds itself to its tier (its CPU share, peak memory and bandwidth: ``runtime.worker``),
and a plan's tiers mean the same on local and on Ray (``platform.catalog.ray``). Before any
process starts, :func:`deploy` refuses a plan the cluster cannot hold at once (every replica of
every stage runs at the same time): more vCPU or memory than the alive nodes have in all, or a
tier no single node has (:func:`check_capacity`).

**Prices.** Per vCPU-second and per GB-second: ``price_per_vcpu_s``/``price_per_gb_s``, else
the environment's ``FLATPACK_RAY_PRICE_PER_VCPU_S``/``FLATPACK_RAY_PRICE_PER_GB_S``, else AWS
Fargate's on-demand rates (``platform.catalog.RAY_PRICE_PER_VCPU_S``, with its source).

docs/ray.md has the rest: starting a cluster, what runs where, security, limits.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from flatpack.backends.functions import FUNCTION_CAPABILITIES
from flatpack.backends.local import LocalDeployment, check_deploy_request, open_deployment
from flatpack.backends.protocol import Capability
from flatpack.backends.store_files import package
from flatpack.compiler import Compiled
from flatpack.errors import InputError
from flatpack.interrupts import stopping
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from flatpack.platform.catalog import (RAY_PRICE_PER_GB_S, RAY_PRICE_PER_VCPU_S, RayCluster, RayNode, get_platform,
                                       use_ray_cluster)
from flatpack.runtime.function import Role
from flatpack.runtime.function_env import ROLE_ENV, STORE_ENV
from flatpack.units import GIB, MIB

__all__ = ["NAME", "CAPABILITIES", "LIMITS", "package", "deploy", "invoke", "teardown", "connect", "read_cluster",
           "check_capacity", "training_asks", "inference_asks", "RayDeployment", "RayInvocation", "Demand"]

NAME = "ray"
CAPABILITIES = FUNCTION_CAPABILITIES
LIMITS: dict[Capability, str] = {}   # a function backend offers every operation
# flatpack calibrate/profile --target ray start one function per memory tier (backends.profiling)
PROFILE_FUNCTIONS = True
PRICE_ENV = {"price_per_vcpu_s": "FLATPACK_RAY_PRICE_PER_VCPU_S", "price_per_gb_s": "FLATPACK_RAY_PRICE_PER_GB_S"}
UNTIERED_CPUS = 1.0      # what a function of a stage without a memory tier asks for (Ray's default for a task)
NODE_LINE = "[flatpack] ran on Ray node "   # a function's log starts with the node its task ran on
POLL_EVERY_S = 0.02      # an invocation asks Ray about its task at most this often (inference polls every 2 ms)


# -- the cluster --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Connection:
    """This process's link to a cluster: the cluster read from it, and whether ``connect``
    opened the link (teardown then closes it; a link the caller opened stays)."""

    cluster: RayCluster
    opened_here: bool
    node_hosts: tuple[str, ...]     # the alive nodes' addresses, for the store's reachability


def connect(address: str | None = None, *, price_per_vcpu_s: float | None = None,
            price_per_gb_s: float | None = None, runtime_env: dict | None = None) -> Connection:
    """Connects this process to a Ray cluster (unless it is connected already) and reads it:
    from then on ``target="ray"`` plans for its nodes (``platform.catalog.use_ray_cluster``).

    ``address``: None (the connection this process has, else ``"auto"``), ``"auto"`` (the
    cluster ``ray start`` runs on this machine, or ``RAY_ADDRESS``), ``"ray://host:port"`` (a
    remote cluster through Ray Client) or ``"local"`` (a one-node cluster started in this
    process, for a try-out). ``runtime_env``: Ray's, for the functions' interpreters on nodes
    that lack flatpack (e.g. ``{"pip": ["flatpack[ray]"]}``); docs/ray.md.
    """
    ray = _ray()
    opened_here = False
    if not ray.is_initialized():
        target = address or "auto"     # Ray's "local" starts a new instance even where a cluster runs
        try:
            ray.init(address=target, runtime_env=runtime_env, logging_level=logging.WARNING,
                     include_dashboard=False if target == "local" else None)
        except ConnectionError as err:
            raise InputError(f"no Ray cluster answers at {target!r} ({err}). Start one (`ray start --head`), pass "
                             "its address (--address ray://HOST:10001), or address='local' for a one-node cluster "
                             "started here") from None
        opened_here = True
    elif address not in (None, "auto", "local") and not address.startswith("ray://"):
        current = ray.get_runtime_context().gcs_address
        if address != current:
            raise InputError(f"this process is connected to the Ray cluster at {current}, not {address}; disconnect "
                             "(ray.shutdown()) first or leave the address out")
    nodes = [node for node in ray.nodes() if node.get("Alive") and node.get("Resources", {}).get("CPU", 0) > 0]
    cluster = read_cluster(nodes, price_per_vcpu_s=price_per_vcpu_s, price_per_gb_s=price_per_gb_s,
                           address=address or "auto")
    use_ray_cluster(cluster)
    return Connection(cluster, opened_here, tuple(sorted({str(node.get("NodeManagerAddress")) for node in nodes})))


def read_cluster(nodes: Sequence[dict], *, price_per_vcpu_s: float | None = None,
                 price_per_gb_s: float | None = None, address: str = "auto") -> RayCluster:
    """The cluster ``ray.nodes()`` describes (its alive nodes' ``CPU`` and ``memory``
    resources), priced by the arguments, else the environment (:data:`PRICE_ENV`), else the
    catalog's defaults."""
    if not nodes:
        raise InputError(f"the Ray cluster at {address} has no alive node with CPUs; add one (ray start "
                         "--address HEAD:6379 --num-cpus N)")
    parsed = tuple(RayNode(float(node["Resources"]["CPU"]), int(node["Resources"].get("memory", 0)))
                   for node in nodes)
    given = {"price_per_vcpu_s": price_per_vcpu_s, "price_per_gb_s": price_per_gb_s}
    prices, sources = {}, []
    for name, value in given.items():
        if value is None and os.environ.get(PRICE_ENV[name]):
            value = _price(os.environ[PRICE_ENV[name]], PRICE_ENV[name])
            sources.append(f"{name} from ${PRICE_ENV[name]}")
        elif value is not None:
            sources.append(f"{name} given")
        prices[name] = value
    cluster = RayCluster(parsed, source=f"ray.nodes() of the cluster at {address}: {len(parsed)} alive nodes",
                         price_per_vcpu_s=RAY_PRICE_PER_VCPU_S if prices["price_per_vcpu_s"] is None
                         else prices["price_per_vcpu_s"],
                         price_per_gb_s=RAY_PRICE_PER_GB_S if prices["price_per_gb_s"] is None
                         else prices["price_per_gb_s"])
    if sources:
        cluster = replace(cluster, price_source=f"set by the user ({', '.join(sources)}); the rest: "
                                                f"{cluster.price_source}")
    return cluster


def _price(text: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{where} must be dollars per second as a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise InputError(f"{where} must be a non-negative number of dollars per second, got {text!r}")
    return value


@dataclass(frozen=True)
class Demand:
    """What one function asks of the cluster: Ray's ``num_cpus`` and ``memory`` (bytes)."""

    cpus: float
    memory_bytes: int


def demand_of(memory_mb: int | None) -> Demand:
    """The resources of a function of a ``memory_mb`` tier on the ray platform; a stage
    without a tier asks for one CPU and no memory, as a plain Ray task does."""
    if not memory_mb:
        return Demand(UNTIERED_CPUS, 0)
    tier = get_platform(NAME).tier(memory_mb)
    return Demand(tier.vcpus, tier.memory_bytes)


def training_asks(compiled: Compiled) -> list[tuple[str, int, Demand]]:
    """The functions a training run of ``compiled`` keeps running at once: each stage's
    replicas, as ``(stage label, count, demand)``."""
    return [(f"stage {index}", stage.replicas, demand_of(stage.memory_mb))
            for index, stage in enumerate(compiled.plan.stages)]


def inference_asks(compiled: Compiled) -> list[tuple[str, int, Demand]]:
    """The functions fork-join inference keeps warm: the master and every group's workers,
    all of the fork-join plan's tier."""
    plan = ForkJoinPlan.from_plan(compiled.plan)
    demand = demand_of(plan.memory_mb)
    return [("the master", 1, demand)] + [(f"group {index}", group.workers, demand)
                                            for index, group in enumerate(plan.groups) if group.workers]


def check_capacity(asks: Sequence[tuple[str, int, Demand]], cluster: RayCluster, what: str = "the plan") -> None:
    """InputError, before any process starts, when ``cluster`` cannot run the functions
    ``asks`` lists (:func:`training_asks`, :func:`inference_asks`) at once: a function no
    single node holds, or more vCPU or memory in all than the alive nodes have (the message
    names the shortfall and who asks for it)."""
    for label, _, demand in asks:
        if not any(node.cpus >= demand.cpus and node.memory_bytes >= demand.memory_bytes for node in cluster.nodes):
            raise InputError(f"{label} of {what} asks for {demand.cpus:g} vCPU and {demand.memory_bytes / MIB:.0f} MB "
                             f"per function, and no node of the Ray cluster has that much (the largest: "
                             f"{cluster.largest_cpus:g} CPUs, {cluster.largest_memory_mb} MB). Plan smaller tiers "
                             "(--memory) or add a bigger node")
    listed = ", ".join(f"{label}: {count} x {demand.cpus:g}" for label, count, demand in asks)
    cpus = sum(count * demand.cpus for _, count, demand in asks)
    if cpus > cluster.total_cpus + 1e-9:
        raise InputError(f"{what} needs {cpus:g} vCPU at once ({listed}) and the Ray cluster has "
                         f"{cluster.total_cpus:g}: {cpus - cluster.total_cpus:g} vCPU short. Add nodes, or plan "
                         "fewer replicas or smaller tiers")
    memory = sum(count * demand.memory_bytes for _, count, demand in asks) / GIB
    available = cluster.total_memory_bytes / GIB
    if memory > available:
        raise InputError(f"{what} needs {memory:.2f} GiB of memory at once and the Ray cluster has {available:.2f} "
                         f"GiB: {memory - available:.2f} GiB short. Add nodes, or plan fewer replicas or smaller tiers")


def check_store_reachable(node_hosts: Sequence[str], store_url: str | None) -> None:
    """The S3 server deploy starts listens on 127.0.0.1 of this machine: refused (before it
    starts) for a cluster with nodes on other hosts, which need a store every node reaches."""
    if store_url is not None:
        return
    here = _ray().util.get_node_ip_address()
    elsewhere = [host for host in node_hosts if host not in (here, "127.0.0.1")]
    if elsewhere:
        raise InputError(f"the Ray cluster has nodes on other hosts ({', '.join(elsewhere)}), which cannot reach the "
                         "S3 server flatpack starts on 127.0.0.1 here; pass store_url (an s3:// url with "
                         "?endpoint_url=, reachable from every node) and its credentials in env (docs/ray.md)")


# -- the backend's functions ----------------------------------------------------------------------

def deploy(compiled: Compiled, *, address: str | None = None, store_url: str | None = None,
           env: dict[str, str] | None = None, workdir: str | os.PathLike | None = None, run: str | None = None,
           data_dir: str | os.PathLike | None = None, digest: str | None = None,
           price_per_vcpu_s: float | None = None, price_per_gb_s: float | None = None,
           runtime_env: dict | None = None, profile_tiers: Sequence[int] = ()) -> RayDeployment:
    """Connects to the Ray cluster at ``address`` (:func:`connect`), refuses a plan it cannot
    hold (:func:`check_capacity`) and a store its nodes cannot reach, then deploys as
    ``local.deploy`` does (``store_url``, ``env``, ``workdir``, ``run``, ``data_dir`` and
    ``digest`` mean the same): the store, and the stage artifacts uploaded under a run prefix.
    ``profile_tiers``: the memory tiers a calibration or profile run starts one function of
    at a time (``backends.profiling``), each checked to fit a node."""
    check_deploy_request(compiled, store_url=store_url, data_dir=data_dir, digest=digest)
    connection = connect(address, price_per_vcpu_s=price_per_vcpu_s, price_per_gb_s=price_per_gb_s,
                         runtime_env=runtime_env)
    try:
        check_capacity(training_asks(compiled), connection.cluster)
        for memory_mb in profile_tiers:
            check_capacity([(f"the {memory_mb} MB tier", 1, demand_of(memory_mb))], connection.cluster,
                           "the calibration")
        check_store_reachable(connection.node_hosts, store_url)
        deployment = open_deployment(RayDeployment, compiled, store_url=store_url, env=env, workdir=workdir,
                                     run=run, data_dir=data_dir)
    except BaseException:
        if connection.opened_here:
            _ray().shutdown()
        raise
    deployment.connection = connection
    return deployment


def invoke(deployment: RayDeployment, role: Role) -> RayInvocation:
    """Submits one function as a Ray task with its tier's resources and no Ray retries."""
    if stopping():
        raise KeyboardInterrupt("flatpack is stopping: no new function starts")
    demand = demand_of(deployment.memory_mb_of(role))
    env = {**deployment.env, ROLE_ENV: role.dumps(), STORE_ENV: deployment.store_url, "PYTHONUNBUFFERED": "1"}
    options: dict[str, Any] = {"num_cpus": demand.cpus, "max_retries": 0,
                               "name": f"flatpack-{role.kind}-{role.worker}-a{role.attempt}"}
    if demand.memory_bytes:
        options["memory"] = demand.memory_bytes
    ref = _remote_function().options(**options).remote(env)
    return RayInvocation(ref, deployment.workdir / f"{role.kind}-{role.worker}-a{role.attempt}.log")


def teardown(deployment: RayDeployment, clean: bool | None = None) -> None:
    deployment.teardown(clean=clean)


class RayInvocation:
    """A function running as a Ray task, seen by the invoker as a process (``functions.
    Invocation``): ``poll`` is its exit code once the task ended (:data:`LOST` when Ray lost
    the task: its process killed, its node gone, cancelled), ``kill`` is
    ``ray.cancel(force=True)``, which kills the task's process and with it the function. The
    function's output is written to ``log_path`` on this machine when the task ends."""

    LOST = -9

    def __init__(self, ref: Any, log_path: Path) -> None:
        self.ref = ref
        self.log_path = log_path
        self.code: int | None = None
        self.node: str | None = None
        self.failure = ""
        self._asked_at = 0.0

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        now = time.monotonic()
        if now - self._asked_at < POLL_EVERY_S:
            return None
        self._asked_at = now
        ready, _ = _ray().wait([self.ref], timeout=0)
        if ready:
            self._settle()
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            ready, _ = _ray().wait([self.ref], timeout=timeout)
            if not ready:
                raise TimeoutError(f"the Ray task did not end within {timeout} s")
            self._settle()
        assert self.code is not None  # settled above
        return self.code

    def kill(self) -> None:
        if self.code is None:
            _ray().cancel(self.ref, force=True)

    def _settle(self) -> None:
        ray = _ray()
        try:
            code, output, self.node = ray.get(self.ref)
            header = f"{NODE_LINE}{self.node}\n"
        except ray.exceptions.RayError as err:    # the task was lost: crashed, cancelled, its node died
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            self.failure = f"{type(err).__name__}: {first}"
            code, output, header = self.LOST, b"", f"[flatpack] the Ray task was lost: {self.failure}\n"
        self.log_path.write_bytes(header.encode() + output)
        self.code = code


class RayDeployment(LocalDeployment):
    """Functions are Ray tasks on the cluster's nodes; the store, the data directory and the
    logs (written here as each task ends) are the local backend's."""

    platform = NAME
    emulate_tiers = True        # Ray's resources are labels: the function holds itself to its tier
    connection: Connection | None = None

    def launch(self, role: Role) -> RayInvocation:
        return invoke(self, role)

    def memory_mb_of(self, role: Role) -> int | None:
        """The tier of ``role``'s function: its stage's for training, the tier a profile or
        calibration function measures, the fork-join plan's for inference."""
        if role.kind == "train":
            return self.compiled.plan.stages[role.stage].memory_mb
        if role.kind in ("profile", "calibrate"):     # one function per tier: its stage is the tier's MB
            return role.stage
        return ForkJoinPlan.from_plan(self.compiled.plan).memory_mb

    def _start_inference(self, threads: int, wait_timeout_s: float) -> str:
        # every fork-join function stays warm at once: refused here when the cluster cannot hold them
        if self.connection is not None:
            check_capacity(inference_asks(self.compiled), self.connection.cluster, "fork-join inference")
        return super()._start_inference(threads, wait_timeout_s)

    def teardown(self, clean: bool | None = None) -> None:
        """Stops every function and the server deploy started (``LocalDeployment.teardown``),
        then closes the link to the cluster when deploy opened it."""
        try:
            super().teardown(clean=clean)
        finally:
            connection, self.connection = self.connection, None
            if connection is not None and connection.opened_here:
                _ray().shutdown()


@functools.cache
def _remote_function() -> Any:
    """``runtime.ray_task.run_function`` as a Ray remote function (made once: Ray exports it
    to the cluster the first time it is submitted)."""
    # optional dependency: the task's module imports ray, an extra this module loads only on use
    from flatpack.runtime.ray_task import run_function

    return _ray().remote(run_function)


def _ray() -> Any:
    """The ``ray`` package (an optional extra: ``pip install 'flatpack[ray]'``)."""
    try:
        # optional dependency: ray is an extra (pip install 'flatpack[ray]')
        import ray
    except ImportError:
        raise InputError("the ray target needs Ray: pip install 'flatpack[ray]' (or 'ray>=2.40')") from None
    return ray


def backend() -> Any:
    """This module, as the backend registry hands it out."""
    return sys.modules[__name__]
