"""The service's state behind the routes (``serve.app``): the served version and its warm
pool, the batcher, the autoscaler (``serve.scaling``), the plan chooser (``serve.replan``),
the metrics, and the blue/green switch a new artifact or a re-chosen plan goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path

from flatpack import logs
from flatpack.compiler import Compiled, load
from flatpack.serve.batcher import Batcher, BatchPolicy
from flatpack.serve.metrics import ServeMetrics
from flatpack.serve.pool import Version
from flatpack.serve.replan import PlanChooser, Replan, can_replan
from flatpack.serve.scaling import Autoscaler
from flatpack.serve.settings import ServeSettings
from flatpack.serve.targets import Target
from flatpack.runtime.request_tensors import RequestError

LOG = logs.get("serve")


class Service:
    """The state behind the routes: the current version, the batcher, the metrics."""

    def __init__(self, compiled: Compiled, settings: ServeSettings, target: Target) -> None:
        self.settings = settings
        self.target = target
        self.metrics = ServeMetrics()
        self.metrics.slo.set(settings.slo_s)
        self.version = Version(compiled, target, settings.max_batch)
        self.contract = self.version.contract
        self.batcher: Batcher | None = None
        self.draining = False
        self.failed: str | None = None          # why the first version could not start
        self._switching = asyncio.Lock()
        self._warming: asyncio.Task | None = None
        self.autoscaler: Autoscaler | None = None
        self.chooser = (PlanChooser(compiled, settings.slo_s, settings.replan_solver)
                        if settings.replan and can_replan(compiled) else None)
        self._replanning: asyncio.Task | None = None
        self.last_replan: Replan | None = None

    @property
    def ready(self) -> bool:
        return self.batcher is not None and not self.draining

    # lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Deploys and warms the first version in the background: /healthz answers meanwhile."""
        self._warming = asyncio.get_running_loop().create_task(self._warm_first())

    async def _warm_first(self) -> None:
        try:
            await self.version.start(self.settings.min_replicas)
        except Exception as err:  # noqa: BLE001 - reported by /readyz and the log, the server stays up
            self.failed = f"{type(err).__name__}: {err}"
            LOG.error("the model could not be deployed: %s", self.failed)
            return
        self.batcher = Batcher(self._policy(self.version), self._run_batch, self._record_batch)
        self.batcher.start()
        self.metrics.cold_starts.inc(self.version.cold_starts)
        self.metrics.replicas.set(len(self.version.replicas))
        self._start_autoscaler()

    def _start_autoscaler(self) -> None:
        ceiling = self.settings.replica_ceiling(self.target.cpus(), self.version.functions_per_replica)
        LOG.info("a warm pool of %d to %d replicas of %d functions each, scaled down after %g s idle",
                 self.settings.min_replicas, ceiling, self.version.functions_per_replica, self.settings.idle_s)
        if ceiling <= self.settings.min_replicas:
            return
        self.autoscaler = Autoscaler(floor=self.settings.min_replicas, ceiling=ceiling, idle_s=self.settings.idle_s,
                                     demand=self._demand, policy=lambda: self._batcher().policy,
                                     size=lambda: len(self.version.replicas), grow=self._grow, shrink=self._shrink,
                                     on_event=self._scaled)
        self.autoscaler.start()

    def _batcher(self) -> Batcher:
        assert self.batcher is not None         # the autoscaler starts after the batcher
        return self.batcher

    def _demand(self) -> tuple[int, int]:
        batcher = self._batcher()
        shed, batcher.shed_since_read = batcher.shed_since_read, 0
        return batcher.queued_samples + batcher.running_samples, shed

    async def _grow(self) -> None:
        async with self._switching:             # a pool changes under one version at a time
            version = self.version
            await version.add_replica()
            self.metrics.cold_starts.inc(len(version.replicas[-1].deployment.workers))
            self._batcher().policy = dataclasses.replace(self._batcher().policy, replicas=len(version.replicas))

    async def _shrink(self) -> bool:
        async with self._switching:
            # one batch fewer at once first, so that no batch waits for the replica being removed
            self._batcher().policy = dataclasses.replace(self._batcher().policy,
                                                         replicas=max(1, len(self.version.replicas) - 1))
            removed = await self.version.remove_replica()
            self._batcher().policy = dataclasses.replace(self._batcher().policy, replicas=len(self.version.replicas))
            return removed

    def _scaled(self, direction: str, replicas: int, reason: str) -> None:
        self.metrics.scale_events.labels(direction).inc()
        self.metrics.replicas.set(replicas)
        self._refresh_gauges(self._batcher().policy)

    def _policy(self, version: Version, announce: bool = True) -> BatchPolicy:
        assert version.latency is not None      # set by Version.start
        policy = BatchPolicy.choose(version.latency, self.settings.slo_s, self.settings.max_batch)
        policy = dataclasses.replace(policy, replicas=max(1, len(version.replicas)))
        self._refresh_gauges(policy)
        if not announce:
            return policy
        if not policy.meets_slo:
            LOG.warning("one sample takes %.0f ms through this deployment, too long for an SLO of %.0f ms: serving "
                        "for throughput (no batching delay)", version.latency.seconds(1) * 1e3,
                        self.settings.slo_s * 1e3)
        LOG.info("batches of at most %d samples, at most %.1f ms of queueing, for an SLO of %.0f ms",
                 policy.max_batch, policy.max_delay_s * 1e3, self.settings.slo_s * 1e3)
        return policy

    def _refresh_gauges(self, policy: BatchPolicy) -> None:
        self.metrics.max_batch.set(policy.max_batch)
        self.metrics.max_delay.set(policy.max_delay_s)
        self.metrics.capacity.set(policy.capacity_samples_s)
        self.metrics.sized.set(policy.sized_samples_s)

    async def drain(self) -> None:
        """New requests get 503 from now on; returns when the accepted ones are answered (or
        after ``drain_timeout_s``)."""
        self.draining = True
        if self.batcher is not None:
            try:
                await asyncio.wait_for(self.batcher.drained(), self.settings.drain_timeout_s)
            except asyncio.TimeoutError:
                LOG.error("%d request(s) still running after %.0f s of draining", self.batcher.in_flight,
                          self.settings.drain_timeout_s)

    async def stop(self) -> None:
        """Drains, then stops every function of every version."""
        await self.drain()
        if self._warming is not None and not self._warming.done():
            await self._warming            # a deployment half started is torn down whole
        if self.autoscaler is not None:
            await self.autoscaler.stop()
        if self._replanning is not None and not self._replanning.done():
            self._replanning.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replanning
        if self.batcher is not None:
            await self.batcher.stop()
        await self.version.close()

    # batches ---------------------------------------------------------------------------------
    async def _run_batch(self, tensors: dict) -> tuple[dict, str]:
        version = self.version              # read once: a switch between batches takes the next one
        outputs = await version.infer(tensors)
        self.metrics.invocations.inc(version.invocations_per_request)
        return outputs, version.digest

    def _record_batch(self, requests: int, samples: int, seconds: float) -> None:
        self.metrics.batch_requests.observe(requests)
        self.metrics.batch_samples.observe(samples)
        self.metrics.dollars.inc(self.version.dollars(seconds))
        if self.version.observe(samples, seconds) and self.batcher is not None:
            self.batcher.policy = self._policy(self.version, announce=False)
        if self.chooser is None or self.draining or (self._replanning is not None and not self._replanning.done()):
            return
        moved = self.chooser.observe(samples)
        if moved is not None:
            self._replanning = asyncio.get_running_loop().create_task(self._replan(moved), name="flatpack-replan")

    async def _replan(self, batch: int) -> None:
        """Solves the plan for batches of ``batch`` samples (off the event loop) and switches
        to it blue/green when it differs; a failure is logged and the served plan stays."""
        assert self.chooser is not None
        chooser = self.chooser
        try:
            replan = await asyncio.get_running_loop().run_in_executor(None, chooser.choose, batch)
            if replan is None:
                return
            LOG.info("re-choosing the plan: %s", replan.reason)
            await self.switch_to(replan.compiled, f"re-plan: {replan.reason}")
        except Exception as err:  # noqa: BLE001 - a re-plan that fails leaves the served plan serving
            LOG.error("the plan for batches of %d samples could not be switched to: %s: %s", batch,
                      type(err).__name__, err)
            return
        chooser.adopt(replan)
        self.metrics.replans.inc()
        self.last_replan = replan

    # blue/green ------------------------------------------------------------------------------
    async def switch(self, directory: Path, digest: str) -> Version:
        """Starts ``directory`` (pinned to ``digest``) and switches to it (:meth:`switch_to`)."""
        compiled = await asyncio.get_running_loop().run_in_executor(None, lambda: load(directory, digest=digest))
        version = await self.switch_to(compiled, "POST /admin/version")
        if self.chooser is not None:        # an artifact read back cannot be cut again: its plan stays
            self.chooser = PlanChooser(compiled, self.settings.slo_s, self.settings.replan_solver) \
                if can_replan(compiled) else None
        return version

    async def switch_to(self, compiled: Compiled, why: str) -> Version:
        """Starts ``compiled`` with as many replicas as the served version has, warms it, swaps
        it in between two batches and tears the old version down after its last batch; no
        request is dropped (the blue/green path of a version switch and of a re-plan)."""
        async with self._switching:
            candidate = Version(compiled, self.target, self.settings.max_batch)
            if candidate.contract != self.contract:
                raise RequestError(409, f"the new artifact takes other inputs ({candidate.contract.to_json()}) than "
                                        f"the one served ({self.contract.to_json()}); serve it on its own")
            await candidate.start(max(self.settings.min_replicas, len(self.version.replicas)))
            if self.batcher is None or self.draining:
                await candidate.close()
                raise RequestError(503, "the server is not ready or is draining; no switch")
            self.metrics.cold_starts.inc(candidate.cold_starts)
            old, self.version = self.version, candidate
            self.batcher.policy = self._policy(candidate)
            self.metrics.replicas.set(len(candidate.replicas))
            await old.close()               # after the batch it may be running: its thread runs one call at a time
            LOG.info("switched from %s to %s (%s)", old.digest[:12], candidate.digest[:12], why)
            return candidate
