"""Dynamic batching inside the SLO: requests queue, a batch closes at ``max_batch`` samples or
``max_delay_s`` after its oldest request arrived, and both bounds come from the latency model
(measured at warm-up, re-fitted to the batches served: ``serve.pool.Version.observe``).

The policy (:meth:`BatchPolicy.choose`) is Clipper's and Triton's adaptive batching (Crankshaw
et al., NSDI '17, §4.3: the largest batch whose latency fits the SLO; Triton's dynamic batcher:
a preferred size and a ``max_queue_delay``), bounded by the SLO S with the deployment's
latency model t(b) = fixed + per_sample·b (:class:`LatencyModel`). The deployment runs one
batch at a time (the fork-join master serves requests in order), so in the worst case a request
arrives just after a full batch started: it waits for that batch, t(B), then for its own batch
to close, D, then for its own batch, t(B). Hence, with h the headroom kept for noise (0.8),

    B = the largest b ≤ cap with 2·t(b) ≤ h·S
    D = min(h·S − 2·t(B), t(B))

D is capped at t(B) because, under load, waiting longer than one batch's service time gains
nothing (the next batch could not start earlier), and at light load it would only add latency.
When even 2·t(1) > h·S no batch meets the SLO: the server then runs for throughput (B = the
cap, D = 0: a batch takes whatever queued while the previous one ran) and says so at start.
Admission is bounded by the same model: a request that finds Q samples queued (s its own) is
predicted to finish after the batches those Q + s samples form (⌊(Q + s)/B⌋ full ones and the
rest, each priced by t) plus the batch in service, if any (t of its size); when that exceeds S
it is shed at once instead of answering late (the server stays within the SLO for those it
accepts). A request that finds the queue empty is always admitted. Queueing is bounded by the
SLO as well: when a batch forms, a request that has waited so long that its wait plus t(its
samples) already exceeds S (the model was optimistic, the host slowed down) is shed then
rather than run late. Both sheds are :class:`Overloaded` (``reason`` "admission" or
"deadline"), answered 429 with a ``Retry-After`` of the predicted time the work ahead of it
needs (``serve.app``; docs/serve.md says why 429 and not a 5xx). A server that serves for
throughput (no batch meets the SLO) sheds nothing on deadline. Requests are concatenated
along dimension 0 and the outputs split back by each request's sample count.

With R replicas of the fork-join group (``serve.scaling``) up to R batches run at once, one
per replica: the queue drains R batches per round (:meth:`BatchPolicy.queue_seconds`), a
request waits for a batch in service only when every replica is busy, and the capacity is R
times one replica's. B and D stay the one-replica figures (each batch still runs on one group).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Sequence

import torch

from flatpack.runtime.request_tensors import Request

HEADROOM = 0.8


@dataclass(frozen=True)
class LatencyModel:
    """Seconds one batch of ``b`` samples takes through the deployment: fixed + per_sample·b.
    ``source`` says where the numbers come from (measured at warm-up, or Gillis's model)."""

    fixed_s: float
    per_sample_s: float
    source: str

    def seconds(self, samples: int) -> float:
        return self.fixed_s + self.per_sample_s * samples

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]], source: str) -> LatencyModel:
        """The least-squares line through (samples, seconds), its slope kept ≥ 0 (a batch is
        never faster than a smaller one) and its intercept ≥ 0."""
        if not points:
            raise ValueError("a latency model needs at least one measured batch")
        sizes = [float(size) for size, _ in points]
        seconds = [float(value) for _, value in points]
        mean_size, mean_seconds = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
        spread = sum((size - mean_size) ** 2 for size in sizes)
        slope = 0.0 if spread == 0 else sum((size - mean_size) * (value - mean_seconds)
                                            for size, value in zip(sizes, seconds)) / spread
        slope = max(slope, 0.0)
        return cls(max(mean_seconds - slope * mean_size, 0.0), slope, source)

    def refit(self, points: Sequence[tuple[int, float]]) -> LatencyModel:
        """This model with its fixed part moved to the batches served, ``points``: the median
        of (seconds − per_sample·samples). The slope stays the warm-up's, measured over a
        wider range of sizes than a busy server's batches (a slope fitted to those alone
        extrapolates noise to the largest batch)."""
        residuals = sorted(seconds - self.per_sample_s * size for size, seconds in points)
        return LatencyModel(max(residuals[len(residuals) // 2], 0.0), self.per_sample_s, "measured while serving")


@dataclass(frozen=True)
class BatchPolicy:
    """``max_batch`` samples, ``max_delay_s`` of queueing, for ``slo_s`` under ``model``
    (the formula is in the module docstring). ``meets_slo``: False when even one sample
    meets the SLO (the server then runs for throughput and says so)."""

    max_batch: int
    max_delay_s: float
    slo_s: float
    model: LatencyModel
    meets_slo: bool
    replicas: int = 1               # fork-join groups serving batches side by side

    @classmethod
    def choose(cls, model: LatencyModel, slo_s: float, cap: int, headroom: float = HEADROOM) -> BatchPolicy:
        budget = headroom * slo_s
        fitting = [size for size in range(1, cap + 1) if 2 * model.seconds(size) <= budget]
        if not fitting:
            # no batch meets the SLO: serve for throughput, the largest batches and no wait
            return cls(cap, 0.0, slo_s, model, False)
        size = fitting[-1]
        delay = max(0.0, min(budget - 2 * model.seconds(size), model.seconds(size)))
        return cls(size, delay, slo_s, model, True)

    def admits(self, queued_samples: int, samples: int, running_samples: int = 0) -> bool:
        """Whether a request of ``samples`` behind ``queued_samples`` (and a batch of
        ``running_samples`` in service, 0 when none) is predicted to finish within the SLO
        (see the module docstring); a request that finds nothing queued is always admitted."""
        if queued_samples == 0:
            return True
        return self.backlog_seconds(queued_samples + samples, running_samples) <= self.slo_s

    def backlog_seconds(self, queued_samples: int, running_samples: int = 0) -> float:
        """The predicted time to run ``queued_samples`` after the batch of ``running_samples``
        in service: what a shed request is told to wait (``Retry-After``)."""
        return self.queue_seconds(queued_samples) + self.running_seconds(running_samples)

    def expired(self, waited_s: float, samples: int) -> bool:
        """Whether a request of ``samples`` that has queued ``waited_s`` can no longer finish
        within the SLO (its wait plus its own samples' time exceeds it); never when serving
        for throughput."""
        return self.meets_slo and waited_s + self.model.seconds(samples) > self.slo_s

    @property
    def capacity_samples_s(self) -> float:
        """The most samples per second the deployment serves under this policy: full batches
        back to back, ``max_batch / t(max_batch)``."""
        seconds = self.model.seconds(self.max_batch)
        return self.replicas * self.max_batch / seconds if seconds > 0 else math.inf

    @property
    def sized_samples_s(self) -> float:
        """The load this policy is sized for: ``HEADROOM`` of :attr:`capacity_samples_s` (the
        same share of the SLO the batch bound keeps for noise)."""
        return HEADROOM * self.capacity_samples_s

    def queue_seconds(self, samples: int) -> float:
        """The time to run ``samples`` queued samples: full batches of ``max_batch``, then the
        rest, ``replicas`` batches side by side per round."""
        full, rest = divmod(samples, self.max_batch)
        rounds, leftover = divmod(full, self.replicas)
        if leftover:        # the last round runs the leftover full batches and the rest together
            return (rounds + 1) * self.model.seconds(self.max_batch)
        return rounds * self.model.seconds(self.max_batch) + (self.model.seconds(rest) if rest else 0.0)

    def samples_within(self, seconds: float) -> int:
        """The most queued samples one replica finishes within ``seconds`` under this policy
        (full batches back to back; at least one batch): what ``serve.scaling`` sizes the
        replicas by."""
        batch_s = self.model.seconds(self.max_batch)
        batches = int(seconds // batch_s) if batch_s > 0 else 1
        return self.max_batch * max(batches, 1)

    def running_seconds(self, samples: int) -> float:
        return self.model.seconds(samples) if samples else 0.0

    def predicted_s(self, samples: int) -> float:
        return self.model.seconds(samples)


class Overloaded(Exception):
    """A shed request (429 with ``Retry-After``): ``reason`` is "admission" (predicted to miss
    the SLO behind the queue, refused on arrival) or "deadline" (queued too long to meet it);
    ``retry_after_s``: the predicted time the work ahead of it needs."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(f"shed on {reason}: retry in {retry_after_s:.3f} s")
        self.reason = reason
        self.retry_after_s = retry_after_s


class Closed(Exception):
    """The batcher takes no new requests (the server is draining): 503."""


@dataclass
class Answer:
    outputs: dict[str, torch.Tensor]
    digest: str
    batch_samples: int
    predicted_s: float          # the latency model's time for this batch
    measured_s: float           # the time the batch took


# runs one concatenated batch: its tensors by input name -> (outputs by name, the digest that ran it)
BatchRunner = Callable[[dict[str, torch.Tensor]], Awaitable[tuple[dict[str, torch.Tensor], str]]]


@dataclass
class _Item:
    request: Request
    future: asyncio.Future
    arrived: float = field(default_factory=time.monotonic)


class Batcher:
    """The queue and the loop that forms batches and runs them one at a time."""

    def __init__(self, policy: BatchPolicy, run_batch: BatchRunner,
                 on_batch: Callable[[int, int, float], None] | None = None) -> None:
        self.policy = policy
        self._run_batch = run_batch
        self._on_batch = on_batch        # (requests, samples, seconds) after each batch
        self._pending: deque[_Item] = deque()
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._busy = 0                   # requests submitted and not yet answered
        self.closed = False
        self._running: dict[asyncio.Task, int] = {}   # the batches in service and their samples
        self._slot_free = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.shed_since_read = 0         # sheds (admission and deadline) since serve.scaling last read them

    @property
    def concurrency(self) -> int:
        """How many batches may run at once: one per replica (``policy.replicas``)."""
        return self.policy.replicas

    @property
    def queued_samples(self) -> int:
        return sum(item.request.samples for item in self._pending)

    @property
    def running_samples(self) -> int:
        return sum(self._running.values())

    @property
    def blocking_samples(self) -> int:
        """The samples of the batch a new request waits for: the smallest in service when
        every replica is busy, else 0 (a replica is free)."""
        if len(self._running) < self.concurrency or not self._running:
            return 0
        return min(self._running.values())

    @property
    def in_flight(self) -> int:
        return self._busy

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="flatpack-batcher")

    async def submit(self, request: Request) -> Answer:
        if self.closed:
            raise Closed()
        queued, blocking = self.queued_samples, self.blocking_samples
        if not self.policy.admits(queued, request.samples, blocking):
            self.shed_since_read += 1
            raise Overloaded("admission", self.policy.backlog_seconds(queued, blocking))
        item = _Item(request, asyncio.get_running_loop().create_future())
        self._pending.append(item)
        self._busy += 1
        self._idle.clear()
        self._wakeup.set()
        try:
            return await item.future
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()

    async def drained(self) -> None:
        """Returns when every accepted request has its answer."""
        await self._idle.wait()

    async def stop(self) -> None:
        """Closes the batcher to new requests, waits for the accepted ones, ends the loop."""
        self.closed = True
        await self.drained()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            while len(self._running) >= self.concurrency:   # every replica busy: requests keep queueing
                self._slot_free.clear()
                await self._slot_free.wait()
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            self._shed_expired()
            if not self._pending:
                continue
            head = self._pending[0]
            deadline = head.arrived + self.policy.max_delay_s
            while self._fill(head.request.shape_key) < self.policy.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            self._shed_expired()
            taken = self._take(head.request.shape_key)
            if taken:
                task = asyncio.get_running_loop().create_task(self._execute(taken), name="flatpack-batch")
                self._running[task] = sum(item.request.samples for item in taken)
                task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.pop(task, None)
        self._slot_free.set()

    def _shed_expired(self) -> None:
        """Sheds the queued requests that can no longer finish within the SLO (``deadline``)."""
        now = time.monotonic()
        kept: deque[_Item] = deque()
        for item in self._pending:
            if item.future.done():
                continue
            if self.policy.expired(now - item.arrived, item.request.samples):
                ahead = self.policy.backlog_seconds(sum(other.request.samples for other in kept),
                                                    self.blocking_samples)
                item.future.set_exception(Overloaded("deadline", ahead))
                self.shed_since_read += 1
            else:
                kept.append(item)
        self._pending = kept

    def _fill(self, key: tuple) -> int:
        return sum(item.request.samples for item in self._pending if item.request.shape_key == key)

    def _take(self, key: tuple) -> list[_Item]:
        """The oldest requests of ``key`` up to ``max_batch`` samples (the head always: a
        request larger than a batch runs alone); the others keep their places."""
        taken, kept, samples = [], deque(), 0
        for item in self._pending:
            fits = samples + item.request.samples <= self.policy.max_batch or not taken
            if item.request.shape_key == key and fits and not item.future.done():
                taken.append(item)
                samples += item.request.samples
            elif not item.future.done():
                kept.append(item)
        self._pending = kept
        return taken

    async def _execute(self, items: list[_Item]) -> None:
        names = list(items[0].request.tensors)
        batch = {name: torch.cat([item.request.tensors[name] for item in items]) for name in names}
        samples = sum(item.request.samples for item in items)
        started = time.perf_counter()
        try:
            outputs, digest = await self._run_batch(batch)
            sizes = [item.request.samples for item in items]
            parts = {name: torch.split(tensor, sizes) for name, tensor in outputs.items()}
        except Exception as err:  # noqa: BLE001 - a failed batch fails its requests (5xx), never the loop
            for item in items:
                if not item.future.done():
                    item.future.set_exception(err)
            return
        finally:
            if self._on_batch is not None:
                self._on_batch(len(items), samples, time.perf_counter() - started)
        predicted, measured = self.policy.predicted_s(samples), time.perf_counter() - started
        for index, item in enumerate(items):
            if not item.future.done():
                item.future.set_result(Answer({name: part[index] for name, part in parts.items()}, digest, samples,
                                              predicted, measured))
