"""Prometheus metrics of one service (its own registry, so two apps in one process never mix):
requests by endpoint and status, errors by kind, queue depth, the requests of the batch being
decoded, batch sizes and decode seconds, latency, the speculative decoders' acceptance (drafted
and accepted steps, target calls), and which replica they are (``recspec_replica_info{replica=...}``,
the id ``/health`` names). Every metric declared here is set by the service."""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # no *_created series: counters and histograms only

#: Buckets of the latency histogram (seconds) and of the batch-size histogram.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    """The metrics of one replica (module doc)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, replica: str) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        Info("recspec_replica", "The app (one per Ray Serve replica) whose metrics these are",
             registry=registry).info({"replica": replica})
        self.requests = Counter("recspec_requests", "Requests answered, by endpoint and HTTP status",
                                ("endpoint", "status"), registry=registry)
        self.errors = Counter("recspec_errors", "Requests refused or failed, by kind", ("kind",), registry=registry)
        self.queue_depth = Gauge("recspec_queue_depth", "Requests waiting to be decoded", registry=registry)
        self.in_flight = Gauge("recspec_batch_in_flight", "Requests in the batch being decoded", registry=registry)
        self.batch_size = Histogram("recspec_batch_size", "Requests per decoded batch", buckets=BATCH_BUCKETS,
                                    registry=registry)
        self.batches = Counter("recspec_batches", "Batches decoded, by the decoder that ran", ("decoder",),
                               registry=registry)
        self.latency = Histogram("recspec_request_latency_seconds", "Seconds from arrival to answer of answered "
                                 "requests", ("endpoint",), buckets=LATENCY_BUCKETS, registry=registry)
        self.decode_seconds = Histogram("recspec_batch_decode_seconds", "Seconds per batched decode",
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.drafted = Counter("recspec_drafted_steps", "Identifier levels drafted (speculative decoders)",
                               registry=registry)
        self.accepted = Counter("recspec_accepted_steps", "Drafted identifier levels accepted by the target "
                                "(acceptance = accepted / drafted)", registry=registry)
        self.target_calls = Counter("recspec_target_calls", "Target forward calls per request, summed",
                                    registry=registry)

    def batch_started(self, size: int) -> None:
        """A batch of ``size`` requests starts decoding."""
        self.batch_size.observe(size)
        self.in_flight.set(size)

    def batch_done(self, seconds: float) -> None:
        """The batch in flight is decoded (or failed) after ``seconds``."""
        self.in_flight.set(0)
        self.decode_seconds.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
