"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own so that two
servers in one process (the tests, a blue/green switch) never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE  # noqa: N811 - re-exported under a plain name

__all__ = ["CONTENT_TYPE", "ServeMetrics"]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("flatpack_serve_requests", "predict requests answered, by HTTP status",
                                ["status"], registry=registry)
        # a shed is the admission control's refusal (429), never an error; an error is the server's
        # failure (5xx). A client or load balancer tells them apart by status, /metrics by name.
        self.shed = Counter("flatpack_serve_shed", "requests shed (429) because they would miss the SLO, by reason: "
                            "admission (on arrival) or deadline (queued too long)", ["reason"], registry=registry)
        self.errors = Counter("flatpack_serve_errors", "requests that failed in the server (5xx): a batch failed",
                              registry=registry)
        self.latency = Histogram("flatpack_serve_request_seconds", "predict latency from arrival to answer",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.batch_samples = Histogram("flatpack_serve_batch_samples", "samples per batch run",
                                       buckets=BATCH_BUCKETS, registry=registry)
        self.batch_requests = Histogram("flatpack_serve_batch_requests", "requests per batch run",
                                        buckets=BATCH_BUCKETS, registry=registry)
        self.queue_depth = Gauge("flatpack_serve_queue_depth", "requests accepted and not yet answered",
                                 registry=registry)
        self.invocations = Counter("flatpack_serve_function_invocations", "function invocations (master and "
                                   "workers, per batch)", registry=registry)
        self.cold_starts = Counter("flatpack_serve_cold_starts", "functions started (each version's warm-up)",
                                   registry=registry)
        self.dollars = Counter("flatpack_serve_dollars", "dollars billed so far at the platform's prices",
                               registry=registry)
        self.slo = Gauge("flatpack_serve_slo_seconds", "the latency SLO", registry=registry)
        self.max_batch = Gauge("flatpack_serve_max_batch", "the batcher's maximum batch (samples)", registry=registry)
        self.max_delay = Gauge("flatpack_serve_max_delay_seconds", "the batcher's maximum queueing delay",
                               registry=registry)
        self.capacity = Gauge("flatpack_serve_capacity_samples_per_second", "the most samples per second the "
                              "latency model says the deployment serves (full batches back to back)", registry=registry)
        self.replicas = Gauge("flatpack_serve_replicas", "warm replicas of the fork-join group serving batches "
                              "side by side", registry=registry)
        self.scale_events = Counter("flatpack_serve_scale_events", "replicas added (up) or removed (down) by the "
                                    "autoscaler", ["direction"], registry=registry)
        self.replans = Counter("flatpack_serve_replans", "plans re-chosen for the batch sizes served and switched "
                               "to blue/green", registry=registry)
        self.sized = Gauge("flatpack_serve_sized_samples_per_second", "the load the batching policy is sized for "
                           "(the headroom's share of the capacity)", registry=registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
