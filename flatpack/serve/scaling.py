"""Warm pools that scale: replicas of a version's fork-join group follow the requests in flight.

Every ``TICK_S`` the :class:`Autoscaler` reads the demand, the samples in flight (queued and
in service, ``Batcher.queued_samples + running_samples``), and sizes the pool by the latency
model: one replica finishes ``policy.samples_within(h·S)`` queued samples within the SLO's
headroom share (full batches back to back, ``serve.batcher``), so

    wanted = ⌈in flight / samples_within(h·S)⌉, one more when a request was shed (on admission
             or on its deadline) since the last tick (the pool refused work another group could serve),
    bounded by [min_replicas, max_replicas].

Scaling **up** starts one replica at a time (a start is a cold start of the group's functions,
seconds; one at a time keeps a burst from starting a pool the next tick no longer wants) and
the batcher uses it as soon as it is warm. Scaling **down** removes one idle replica once the
pool has been **quiet** for ``idle_s`` without a break, down to ``min_replicas``: quiet is
no shed and at most ``DOWN_SHARE`` of what one replica fewer would serve in flight. The gap
between the two thresholds is the hysteresis that keeps a steady load from flapping: with
more replicas each batch waits less, the samples in flight fall under what one replica fewer
serves, and without it the pool would shrink, queue again and cold-start the same replica.
The floor stays warm, so no request after a quiet spell pays a cold start. Each event is
logged and counted (``flatpack_serve_scale_events_total{direction}``), and the pool's size is
``flatpack_serve_replicas``.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from flatpack import logs
from flatpack.serve.batcher import HEADROOM, BatchPolicy

LOG = logs.get("serve")
TICK_S = 0.2            # how often the pool is sized: well under a batch's time at any SLO worth serving
DOWN_SHARE = 0.5        # quiet: at most this share of what one replica fewer serves is in flight


@dataclass(frozen=True)
class Decision:
    """What one tick decided: ``wanted`` replicas, and why (for the log)."""

    wanted: int
    reason: str
    per_replica: int = 1        # the samples one replica serves within the SLO's headroom share


def wanted_replicas(policy: BatchPolicy, in_flight_samples: int, shed: int, replicas: int, floor: int,
                    ceiling: int) -> Decision:
    """The replicas the demand wants (see the module docstring), bounded by [floor, ceiling]."""
    per_replica = policy.samples_within(HEADROOM * policy.slo_s)
    wanted = math.ceil(in_flight_samples / per_replica) if in_flight_samples else 0
    reason = (f"{in_flight_samples} samples in flight; one replica serves {per_replica} within "
              f"{HEADROOM:g} of the {policy.slo_s * 1e3:.0f} ms SLO")
    if shed and wanted <= replicas:
        wanted = replicas + 1
        reason = f"{shed} request(s) shed with {replicas} replica(s)"
    return Decision(min(max(wanted, floor), ceiling), reason, per_replica)


def quiet(decision: Decision, in_flight_samples: int, shed: int, replicas: int) -> bool:
    """Whether a tick counts towards scaling down: nothing shed, and at most ``DOWN_SHARE``
    of what ``replicas - 1`` serve within the SLO in flight."""
    return not shed and in_flight_samples <= DOWN_SHARE * decision.per_replica * (replicas - 1)


class Autoscaler:
    """Sizes a pool every tick: ``demand`` reads (samples in flight, admission sheds since the
    last read); ``grow`` and ``shrink`` add or remove one replica (False: nothing to remove);
    ``on_event(direction, replicas, reason)`` after each change."""

    def __init__(self, *, floor: int, ceiling: int, idle_s: float, demand: Callable[[], tuple[int, int]],
                 policy: Callable[[], BatchPolicy], size: Callable[[], int], grow: Callable[[], Awaitable[None]],
                 shrink: Callable[[], Awaitable[bool]], on_event: Callable[[str, int, str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.floor, self.ceiling, self.idle_s = floor, ceiling, idle_s
        self._demand, self._policy, self._size = demand, policy, size
        self._grow, self._shrink, self._on_event = grow, shrink, on_event
        self._clock = clock
        self._wanted_all_since = clock()        # when the pool was last not quiet (see quiet())
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="flatpack-autoscaler")

    async def stop(self) -> None:
        """Ends the loop; a replica it was starting is torn down once its start returns
        (``Version.add_replica``), never leaked."""
        if self._task is None:
            return
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.tick()
            except Exception as err:  # noqa: BLE001 - a replica that fails to start leaves the pool as it was
                LOG.error("scaling failed: %s: %s; the pool keeps %d replicas", type(err).__name__, err, self._size())

    async def tick(self) -> None:
        """One sizing: at most one replica added or removed."""
        in_flight, shed = self._demand()
        replicas = self._size()
        decision = wanted_replicas(self._policy(), in_flight, shed, replicas, self.floor, self.ceiling)
        now = self._clock()
        if not quiet(decision, in_flight, shed, replicas):
            self._wanted_all_since = now
        if decision.wanted > replicas:
            LOG.info("scaling up to %d replicas: %s", replicas + 1, decision.reason)
            await self._grow()
            self._on_event("up", self._size(), decision.reason)
            self._wanted_all_since = self._clock()
        elif replicas > self.floor and now - self._wanted_all_since >= self.idle_s:
            if await self._shrink():
                reason = (f"at most {DOWN_SHARE:g} of what {replicas - 1} replica(s) serve in flight for "
                          f"{self.idle_s:g} s")
                LOG.info("scaling down to %d replicas: %s", self._size(), reason)
                self._on_event("down", self._size(), reason)
                self._wanted_all_since = self._clock()
