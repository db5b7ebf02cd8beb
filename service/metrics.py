"""Prometheus metrics, in a registry of the app's own (several apps can live in one process).

A service in several processes (:mod:`padim.service.processes`) runs Prometheus' multiprocess mode: each process
writes its values to files in ``PROMETHEUS_MULTIPROC_DIR`` and one scrape adds them up (:func:`exposition`):
counters and histograms summed, each gauge as its ``multiprocess_mode`` says (the in-flight requests and the record's
journals summed over the live processes; what only the scoring process sets, as it set it).
"""

from __future__ import annotations

import math
import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from padim.core.drift import Drift

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The 0..1 score: the model's threshold is 0.5, the median normal image 0.1 (padim.core.calibration).
SCORE_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "padim_requests_total", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "padim_request_latency_seconds",
            "HTTP request latency",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_wait = Histogram(
            "padim_queue_wait_seconds",
            "time an image waits for its batch",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "padim_batch_size", "images per device batch", ["model"], buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.in_flight = Gauge(
            "padim_requests_in_flight",
            "HTTP requests being handled",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.device_errors = Counter(
            "padim_device_errors_total",
            "scoring batches that hit a device error, by "
            "outcome: split (out of memory, then scored in two halves), out_of_memory "
            "(503), error (500)",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.model_load = Gauge(
            "padim_model_load_seconds",
            "time to load and warm up a model",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "padim_queue_depth",
            "images admitted and not yet answered (decoding, waiting for the device, being scored)",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        # what the models answered: counters and a histogram (durable, summed across replicas) ...
        self.verdicts = Counter(
            "padim_verdicts_total",
            "images answered, by the model version that judged them and "
            "verdict (anomalous or normal, at the threshold the request used)",
            ["model", "version", "verdict"],
            registry=self.registry,
        )
        self.scores = Histogram(
            "padim_score",
            "image scores on the calibration's 0..1 scale (threshold 0.5), by model version",
            ["model", "version"],
            buckets=SCORE_BUCKETS,
            registry=self.registry,
        )
        self.model_version = Gauge(
            "padim_model_version",
            "the version of each model that new requests go to",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.model_changes = Counter(
            "padim_model_changes_total",
            "changes of a model while the service runs: upload (a version added), activate, rollback, unload, update "
            "(a version learned from reviews), line_threshold (a version whose threshold the line set)",
            ["model", "change"],
            registry=self.registry,
        )
        self.versions_loaded = Gauge(
            "padim_model_versions_loaded",
            "versions of each model in memory: the active one and retired ones still answering requests they admitted",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.threshold_overrides = Counter(
            "padim_threshold_overrides_total",
            "images scored for requests that set their own threshold",
            ["model"],
            registry=self.registry,
        )
        # the inspection record (padim.service.record): rows on their way to the database, pictures kept
        self.record_rows = Counter(
            "padim_record_rows_total",
            "rows of the inspection record, by outcome: journaled "
            "(durable on disk), committed (in the database), refused (not durable: the journal "
            "was full or its disk failed), adopted (from the journal of a replica that stopped, into the database)",
            ["outcome"],
            registry=self.registry,
        )
        # every series from the start: rate() and alerts see 0
        for outcome in ("journaled", "committed", "refused", "adopted"):
            self.record_rows.labels(outcome)
        self.record_rows_waiting = Gauge(
            "padim_record_rows_waiting",
            "rows in the journal that the database does not have yet",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.record_journal_bytes = Gauge(
            "padim_record_journal_bytes",
            "bytes of those rows in the journal (bounded by PADIM_RECORD_JOURNAL_MAX_BYTES)",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        self.record_database_up = Gauge(
            "padim_record_database_up",
            "1 when the last write to the record's database succeeded",
            multiprocess_mode="livemin",
            registry=self.registry,
        )
        self.record_picture_bytes = Gauge(
            "padim_record_picture_bytes",
            "bytes of stored pictures, by kind: pinned (reviewed or learned from: never evicted), flagged, passed",
            ["kind"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.record_evicted = Counter(
            "padim_record_pictures_evicted_total",
            "pictures removed by retention or the byte budget (their rows stay)",
            registry=self.registry,
        )
        self.reviews = Counter(
            "padim_reviews_total", "reviews of recorded pictures, by label", ["model", "label"], registry=self.registry
        )
        self.update_jobs = Counter(
            "padim_update_jobs_total",
            "model updates from reviews, by outcome: succeeded, failed; gate_failed when the new version lost recall",
            ["model", "outcome"],
            registry=self.registry,
        )
        # ... and the monitor's reading of its window (per process; padim.core.drift), set when scraped
        self.normal_flag_rate = Gauge(
            "padim_model_normal_flag_rate",
            "the most normal images would be flagged: the calibration's false-alarm bound",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.monitor_images = Gauge(
            "padim_monitor_images",
            "images in the monitor's window",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.monitor_flag_rate = Gauge(
            "padim_monitor_flag_rate",
            "share of the window's images at or above the model's threshold",
            ["model"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.monitor_p_value = Gauge(
            "padim_monitor_p_value",
            "p-value of each monitor test on the window (NaN while "
            "collecting or unavailable): flag_rate (more flags than normal images give), "
            "score_drift, input_drift (one-sided KS)",
            ["model", "test"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.monitor_statistic = Gauge(
            "padim_monitor_statistic",
            "effect sizes: KS D+ of score_drift and input_drift, score_psi",
            ["model", "statistic"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.monitor_alarm = Gauge(
            "padim_monitor_alarm",
            "1 when a test's p-value is below PADIM_MONITOR_LEVEL",
            ["model", "test"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )

        # lines (PADIM_LINES): each source's pictures, each sink's deliveries and outbox
        self.line_pictures = Counter(
            "padim_line_pictures_total",
            "a line's pictures by outcome: received, scored, flagged, late (delivered by its first sink later "
            "than its latency budget), rejected (undecodable), deferred (its verdict could not be journaled, the "
            "disk full: taken again later)",
            ["line", "outcome"],
            registry=self.registry,
        )
        self.line_queue = Gauge(
            "padim_line_queue_depth",
            "a line's pictures taken and not yet journaled",
            ["line"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_latency = Histogram(
            "padim_line_latency_seconds",
            "picture seen (file complete, frame read) to verdict delivered, by sink",
            ["line", "sink"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.line_source_up = Gauge(
            "padim_line_source_up",
            "1 while a line's source is connected or watching",
            ["line"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_sink_up = Gauge(
            "padim_line_sink_up",
            "1 while a sink takes messages",
            ["line", "sink"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_delivered = Counter(
            "padim_line_delivered_total", "verdicts a sink confirmed", ["line", "sink"], registry=self.registry
        )
        self.line_delivery_failures = Counter(
            "padim_line_delivery_failures_total",
            "sends that failed (the messages stay in the outbox)",
            ["line", "sink"],
            registry=self.registry,
        )
        self.line_outbox_depth = Gauge(
            "padim_line_outbox_depth",
            "verdicts waiting in a sink's outbox",
            ["line", "sink"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_outbox_age = Gauge(
            "padim_line_outbox_age_seconds",
            "age of the oldest verdict in a sink's outbox (0 when empty)",
            ["line", "sink"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_outbox_full = Gauge(
            "padim_line_outbox_full",
            "1 while a sink's outbox is at outbox.max_messages",
            ["line", "sink"],
            multiprocess_mode="livemax",
            registry=self.registry,
        )
        self.line_outbox_dropped = Counter(
            "padim_line_outbox_dropped_total",
            "verdicts dropped from a full outbox (when_full: drop_oldest)",
            ["line", "sink"],
            registry=self.registry,
        )

    def show_reading(self, model: str, drift: Drift, normal_flag_rate: float) -> None:
        """Set the monitor's gauges of ``model`` from a reading of its window."""
        self.normal_flag_rate.labels(model).set(normal_flag_rate)
        self.monitor_images.labels(model).set(drift.images)
        flag = drift.flag_rate
        self.monitor_flag_rate.labels(model).set(flag.rate if flag is not None else math.nan)
        for test, result in (
            ("flag_rate", flag),
            ("score_drift", drift.score_drift),
            ("input_drift", drift.input_drift),
        ):
            self.monitor_p_value.labels(model, test).set(result.p_value if result is not None else math.nan)
            self.monitor_alarm.labels(model, test).set(1.0 if result is not None and result.alarm else 0.0)
        for statistic, value in (
            ("score_drift", drift.score_drift.statistic if drift.score_drift else None),
            ("input_drift", drift.input_drift.statistic if drift.input_drift else None),
            ("score_psi", drift.score_drift.psi if drift.score_drift else None),
        ):
            self.monitor_statistic.labels(model, statistic).set(math.nan if value is None else value)


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The text a scrape gets: ``registry``'s metrics, or every process's in multiprocess mode."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=folder)
    return generate_latest(registry), CONTENT_TYPE_LATEST
