"""Prometheus metrics, in a registry of the app's own (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("padim_requests_total", "HTTP requests by route and status", ["route", "status"], registry=self.registry)
        self.latency = Histogram("padim_request_latency_seconds", "HTTP request latency", ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("padim_queue_wait_seconds", "time an image waits for its batch", ["model"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("padim_batch_size", "images per device batch", ["model"], buckets=BATCH_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("padim_requests_in_flight", "HTTP requests being handled", registry=self.registry)
        self.device_errors = Counter("padim_device_errors_total", "scoring batches that hit a device error, by "
                                     "outcome: split (out of memory, then scored in two halves), out_of_memory "
                                     "(503), error (500)", ["model", "outcome"], registry=self.registry)
        self.model_load = Gauge("padim_model_load_seconds", "time to load and warm up a model", ["model"], registry=self.registry)
        self.queue_depth = Gauge("padim_queue_depth", "images waiting for a batch", ["model"], registry=self.registry)
