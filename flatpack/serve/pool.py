"""One served version: a digest-pinned compiled model deployed as warm replicas of its
fork-join group, its latency model measured at warm-up, and one thread per replica.

A replica (:class:`Replica`) is one deployment of the version: a fork-join master and its
workers. Every call into a replica's deployment (deploy, infer, teardown) runs on the
replica's own thread: the master serves one request at a time, so that thread lives exactly
as long as the replica. The first replica starts the store (SeaweedFS locally); the others
deploy onto it under their own run prefix (``Target.deploy(..., alongside=...)``), so a
replica costs its functions and nothing else. ``serve.scaling`` adds and removes replicas
with the load (:meth:`Version.add_replica`, :meth:`Version.remove_replica`); a batch takes
whichever replica is free.

The functions stay resident between requests (``FunctionDeployment.infer`` keeps its master
and workers warm until ``stop_inference``). None of them outlives the server, even a
SIGKILLed one, although they are started from a replica's thread and not the main one: each
function watches its invoker (``runtime.invoker_watch``) and the store is forked on a thread
that lasts as long as the process (``interrupts.on_lasting_thread``);
``tests/integration/test_serve.py`` kills a server with SIGKILL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from flatpack import logs
from flatpack.compiler import Compiled
from flatpack.errors import PlanError
from flatpack.partitioner.cost import gillis
from flatpack.partitioner.cost.gillis import ForkJoinPlan
from flatpack.partitioner.workload import Workload
from flatpack.platform.catalog import get_platform
from flatpack.serve.batcher import LatencyModel
from flatpack.serve.targets import Target
from flatpack.runtime.request_tensors import flat_outputs

LOG = logs.get("serve")
WARM_UP_REPEATS = 3         # per probed batch size; the median is kept
# while serving, the latency model's fixed part is re-fitted to the last OBSERVED_BATCHES
# batches every REFIT_EVERY batches (LatencyModel.refit): a host that gets busier (or quieter)
# than at warm-up moves the batch size, the delay and the admission bound with it
OBSERVED_BATCHES = 64
REFIT_EVERY = 16


def gillis_model(compiled: Compiled, sizes: tuple[int, int]) -> LatencyModel | None:
    """Gillis's predicted latency (``partitioner.cost.gillis.latency``) at two batch sizes, as a
    line; None for an artifact loaded from disk (it carries no Problem to price) or a plan
    without a memory tier or a profile (Gillis prices a function size from profiled layers)."""
    if compiled.problem is None or ForkJoinPlan.from_plan(compiled.plan).memory_mb is None:
        return None
    points = []
    for size in sizes:
        problem = dataclasses.replace(compiled.problem, workload=Workload(mode="infer", batch=size))
        try:
            points.append((size, gillis.latency(problem, compiled.plan).latency_s))
        except PlanError:       # compiled without a profile: nothing to price
            return None
    return LatencyModel.fit(points, "gillis")


class Replica:
    """One deployment of a version's fork-join group and the one thread that talks to it."""

    def __init__(self, digest: str, index: int) -> None:
        self.index = index
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flatpack-{digest[:8]}-r{index}")
        self.deployment: Any = None

    async def run(self, call: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, call, *args)

    async def close(self) -> None:
        """Stops its functions; queued after any batch still running on it (its one thread)."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self.teardown)
        await loop.run_in_executor(None, self.executor.shutdown)

    def teardown(self) -> None:
        if self.deployment is not None:
            self.deployment.teardown()
            self.deployment = None


class Version:
    """A deployment of ``compiled`` on ``target`` (local processes or Ray tasks) as replicas of
    its fork-join group; :meth:`start` deploys and warms the first ``replicas`` of them."""

    def __init__(self, compiled: Compiled, target: Target, max_batch: int) -> None:
        self.compiled = compiled
        self.digest = compiled.digest
        self.contract = compiled.request_contract()
        self.target = target
        self._probe_sizes = (self.contract.min_samples, max(self.contract.min_samples, min(max_batch, 16)))
        self.replicas: list[Replica] = []     # warm, in rotation
        self._free: asyncio.Queue[Replica] | None = None
        self._next_index = 1                   # the first replica is 0 and owns the store
        self.latency: LatencyModel | None = None
        self.predicted: LatencyModel | None = None    # Gillis's, where the compiled model has a Problem
        self.cold_starts = 0
        self.invocations_per_request = 0
        self._dollars_per_s = 0.0
        self._price_per_request = 0.0
        self._observed: deque[tuple[int, float]] = deque(maxlen=OBSERVED_BATCHES)
        self._since_fit = 0

    @property
    def deployment(self) -> Any:
        """The first replica's deployment (the one that started the store); None before start."""
        return self.replicas[0].deployment if self.replicas else None

    @property
    def functions_per_replica(self) -> int:
        return self.invocations_per_request

    async def start(self, replicas: int = 1) -> None:
        """Deploys and warms the first replica (its latency model measured on it), then
        ``replicas - 1`` more beside it."""
        self._free = asyncio.Queue()
        first = Replica(self.digest, 0)
        try:
            await first.run(self._start, first)
        except BaseException:
            await first.close()
            raise
        self.replicas.append(first)
        self._free.put_nowait(first)
        for _ in range(replicas - 1):
            await self.add_replica()

    def _start(self, replica: Replica) -> None:
        started = time.perf_counter()
        replica.deployment = self.target.deploy(self.compiled)
        points = []
        for size in self._probe_sizes:
            example = self._example(size)
            for _ in range(WARM_UP_REPEATS):
                began = time.perf_counter()
                replica.deployment.infer(self._call(example))
                points.append((size, time.perf_counter() - began))
        # the first call started the functions: its time is the cold start, not the model's
        points = points[1:]
        medians = [(size, statistics.median(seconds for each, seconds in points if each == size))
                   for size in sorted({size for size, _ in points})]
        self.latency = LatencyModel.fit(medians, "measured at warm-up")
        self.predicted = gillis_model(self.compiled, self._probe_sizes)
        self.cold_starts = len(replica.deployment.workers)
        self.invocations_per_request = len(replica.deployment.workers)
        platform = get_platform(replica.deployment.platform)
        degrees = [stage.replicas for stage in self.compiled.plan.stages]
        self._dollars_per_s = replica.deployment.dollars_per_second(degrees)
        self._price_per_request = platform.price_per_request
        LOG.info("version %s warm in %.1f s: %d functions, %.1f ms + %.2f ms/sample", self.digest[:12],
                 time.perf_counter() - started, self.cold_starts, self.latency.fixed_s * 1e3,
                 self.latency.per_sample_s * 1e3)

    async def add_replica(self) -> Replica:
        """Deploys one more replica beside the first (on its store), warms it with one request
        (its functions' cold start is paid here, not by a client) and puts it in rotation."""
        assert self.replicas and self._free is not None, "start the version first"
        replica = Replica(self.digest, self._next_index)
        self._next_index += 1
        try:
            await replica.run(self._start_beside, replica, self.replicas[0].deployment)
        except BaseException:
            await replica.close()
            raise
        self.cold_starts += len(replica.deployment.workers)
        self.replicas.append(replica)
        self._free.put_nowait(replica)
        return replica

    def _start_beside(self, replica: Replica, first: Any) -> None:
        replica.deployment = self.target.deploy(self.compiled, alongside=first)
        replica.deployment.infer(self._call(self._example(self._probe_sizes[0])))

    def idle_replica(self) -> Replica | None:
        """A replica other than the first (which owns the store) that runs no batch now,
        taken out of rotation; None when every such replica is busy."""
        assert self._free is not None
        kept, taken = [], None
        while not self._free.empty():
            replica = self._free.get_nowait()
            if taken is None and replica.index != 0:
                taken = replica
            else:
                kept.append(replica)
        for replica in kept:
            self._free.put_nowait(replica)
        if taken is not None:
            self.replicas.remove(taken)
        return taken

    async def remove_replica(self) -> bool:
        """Takes an idle replica (never the first) out of rotation and stops its functions;
        False when none is idle."""
        replica = self.idle_replica()
        if replica is None:
            return False
        await replica.close()
        return True

    def _example(self, samples: int) -> dict[str, torch.Tensor]:
        tensors = {}
        for name, spec in zip(self.contract.names, self.contract.specs):
            dtype = getattr(torch, spec.dtype)
            shape = (samples, *spec.shape[1:])
            tensors[name] = torch.randn(shape).to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
        return tensors

    def dollars(self, seconds: float) -> float:
        """What one batch of ``seconds`` costs: every function of the fork-join group held for
        it, and one request charge per invocation."""
        return self._dollars_per_s * seconds + self._price_per_request * self.invocations_per_request

    def observe(self, samples: int, seconds: float) -> bool:
        """Records a batch's time; every ``REFIT_EVERY`` batches re-fits :attr:`latency` to
        the recent ones and returns True (the caller re-chooses its batching policy)."""
        self._observed.append((samples, seconds))
        self._since_fit += 1
        if self._since_fit < REFIT_EVERY:
            return False
        self._since_fit = 0
        assert self.latency is not None         # set by _start, before any batch
        self.latency = self.latency.refit(list(self._observed))
        return True

    async def infer(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runs one batch on a free replica (the batcher runs at most one batch per replica)."""
        assert self._free is not None, "start the version first"
        replica = await self._free.get()
        try:
            return await replica.run(self._infer, replica, tensors)
        finally:
            self._free.put_nowait(replica)

    def _infer(self, replica: Replica, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return flat_outputs(replica.deployment.infer(self._call(tensors)))

    def _call(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | tuple[torch.Tensor, ...]:
        """The model's call for the request's inputs: by keyword where every input is named
        as a parameter of ``forward`` (HF models' ``input_ids``, ``attention_mask``), else by
        position in the graph's placeholder order (a placeholder fx or export renamed)."""
        parameters = {name for name, _, _ in self.compiled.info.signature.parameters}
        if set(tensors) <= parameters:
            return tensors
        return tuple(tensors[name] for name in self.contract.names)

    async def close(self) -> None:
        """Stops every replica's functions, the first (the store's owner) last; each after any
        batch still running on it (its one thread), so that batch finishes first."""
        replicas, self.replicas = self.replicas, []
        for replica in sorted(replicas, key=lambda r: r.index, reverse=True):
            await replica.close()
