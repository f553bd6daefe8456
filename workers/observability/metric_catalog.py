"""Every Prometheus metric corral serves: its name, type, labels, help and buckets, once.

The model
---------
corral serves metrics from two kinds of places: the exporter (``corral metrics``,
:mod:`workers.observability.exporter`) computes them at scrape time from the store and Redis, and
each gateway (:mod:`workers.gateway.metrics`, :mod:`workers.gateway.calls`) counts
what it answers in a registry of its own. Both build their metrics from the
:class:`Spec` values here, so a metric's name, labels and histogram buckets are
written in one place and the two sides of one histogram
(``corral_cold_start_stage_seconds``: the gateway's stages and the workers') cannot
drift apart. Names and labels are what dashboards and tests read: change none.

Counter names carry no ``_total``: prometheus_client adds it when it serves them.
HAProxy's warm-path figures (``corral_warm_*``) are defined beside the code that reads
HAProxy, :class:`workers.gateway.haproxy.warm.WarmMetrics`.

This module imports prometheus_client only when a metric is made, so the modules that
only name a metric or its buckets (:mod:`workers.observability.stages`) load none of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

# Histogram bucket bounds (seconds), one tuple per histogram.
#: ``corral_cold_start_stage_seconds``, everywhere it is served (gateway and exporter).
STAGE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
#: ``corral_spawn_seconds``: enqueue -> Idle; a VM create takes 0.1-2 s on a real host, a
#: cold guest longer.
SPAWN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: ``corral_function_duration_seconds``: a request's arrival to its last byte (the stages'
#: bounds from 1 ms, and a minute).
DURATION_BUCKETS = (*STAGE_BUCKETS[1:], 60.0)
#: ``corral_cold_start_seconds``: a cold start's claim to a ready replica.
COLD_START_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0)
#: ``corral_gateway_call_accept_seconds``: an asynchronous call's arrival to its 202.
ACCEPT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(frozen=True)
class Spec:
    """One metric: what it is called, what kind, its labels, help and (histograms) buckets."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def counter(self, registry: CollectorRegistry) -> Counter:
        """A counter in ``registry`` (a process that counts: the gateway)."""
        from prometheus_client import Counter

        return Counter(self.name, self.help, self.labels, registry=registry)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        """A gauge in ``registry``."""
        from prometheus_client import Gauge

        return Gauge(self.name, self.help, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry) -> Histogram:
        """A histogram with the spec's buckets in ``registry``."""
        from prometheus_client import Histogram

        return Histogram(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)

    def counter_family(self, value: float | None = None) -> CounterMetricFamily:
        """A counter computed at scrape time (the exporter); ``value`` if it has no labels."""
        from prometheus_client.core import CounterMetricFamily

        if value is not None:
            return CounterMetricFamily(self.name, self.help, value=value)
        return CounterMetricFamily(self.name, self.help, labels=list(self.labels))

    def gauge_family(self, value: float | None = None) -> GaugeMetricFamily:
        """A gauge computed at scrape time; ``value`` if it has no labels."""
        from prometheus_client.core import GaugeMetricFamily

        if value is not None:
            return GaugeMetricFamily(self.name, self.help, value=value)
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))

    def histogram_family(
        self, buckets: list[tuple[str, float]] | None = None, sum_value: float | None = None
    ) -> HistogramMetricFamily:
        """A histogram computed at scrape time (counted in the store or Redis against the
        spec's buckets): with the spec's labels, or ``buckets`` and ``sum_value`` if none."""
        from prometheus_client.core import HistogramMetricFamily

        if buckets is not None:
            return HistogramMetricFamily(self.name, self.help, buckets=buckets, sum_value=sum_value)
        return HistogramMetricFamily(self.name, self.help, labels=list(self.labels))


# Served by both the exporter and the gateways ------------------------------------------
COLD_START_STAGE_SECONDS = Spec(
    "corral_cold_start_stage_seconds",
    "histogram",
    "Seconds a cold start spends in each stage (workers.observability.stages).",
    ("stage",),
    STAGE_BUCKETS,
)

# The exporter (workers.observability.exporter), from the store ------------------------------
EXPORTER_SOURCE_UP = Spec(
    "corral_exporter_source_up",
    "gauge",
    "Whether a source answered this scrape (1) or not (0).",
    ("source",),
)
REPLICAS = Spec(
    "corral_replicas", "gauge", "Live replicas per function and state.", ("function", "state")
)
NODE_HEALTHY = Spec(
    "corral_node_healthy",
    "gauge",
    "Whether a node passes its health checks (1) or not (0).",
    ("node",),
)
NODE_REPLICAS = Spec("corral_node_replicas", "gauge", "Live replicas on a node.", ("node",))
NODE_CAPACITY = Spec("corral_node_capacity", "gauge", "Replicas a node may hold.", ("node",))
OPERATIONS = Spec(
    "corral_operations",
    "counter",
    "Finished operations by kind and outcome.",
    ("kind", "status"),
)
OPERATIONS_OPEN = Spec(
    "corral_operations_open", "gauge", "Operations pending or running.", ("kind", "status")
)
CALLS_OPEN = Spec(
    "corral_calls_open", "gauge", "Asynchronous calls not over yet, by status.", ("status",)
)
CALLS_QUEUE_AGE_SECONDS = Spec(
    "corral_calls_queue_age_seconds",
    "gauge",
    "How long the oldest queued asynchronous call has waited for its first attempt.",
)
SPAWN_SECONDS = Spec(
    "corral_spawn_seconds",
    "histogram",
    "Seconds from a spawn's enqueue (its operation accepted) to its replica Idle.",
    (),
    SPAWN_BUCKETS,
)

# The exporter, from Redis ----------------------------------------------------------------
REAPED = Spec("corral_reaped", "counter", "Replicas the reaper deleted, by reason.", ("reason",))
QUEUE_LENGTH = Spec(
    "corral_queue_length", "gauge", "Messages waiting in a Celery queue.", ("queue",)
)
QUEUE_UNACKED = Spec(
    "corral_queue_unacked",
    "gauge",
    "Messages delivered to workers and not yet acknowledged.",
)
AUTOSCALE_DESIRED_REPLICAS = Spec(
    "corral_autoscale_desired_replicas",
    "gauge",
    "The autoscaler's last target for a function.",
    ("function",),
)
AUTOSCALE_PANIC = Spec(
    "corral_autoscale_panic",
    "gauge",
    "Whether the autoscaler is in panic mode for a function.",
    ("function",),
)
CLOCK_OFFSET_SECONDS = Spec(
    "corral_clock_offset_seconds",
    "gauge",
    "How far a host's wall clock is ahead of the store's, as its workers last measured it.",
    ("host",),
)
LOG_RECORDS_DROPPED = Spec(
    "corral_log_records_dropped",
    "counter",
    "Log records workers dropped because their log's reader did not keep up.",
)
CALLS = Spec(
    "corral_calls",
    "counter",
    "Asynchronous calls' attempts by verdict (succeeded, retried, dead), and redrives.",
    ("outcome",),
)
CALLBACKS = Spec(
    "corral_callbacks",
    "counter",
    "Callbacks of finished calls, delivered or failed.",
    ("outcome",),
)
KEEPALIVE_MODE = Spec(
    "corral_keepalive_mode",
    "gauge",
    "1 for the keep-alive mode in force for an adaptive function.",
    ("function", "mode"),
)
KEEPALIVE_PREWARM_SECONDS = Spec(
    "corral_keepalive_prewarm_seconds",
    "gauge",
    "Adaptive keep-alive: no replica needed before this, after the last call's end.",
    ("function",),
)
KEEPALIVE_WINDOW_SECONDS = Spec(
    "corral_keepalive_window_seconds",
    "gauge",
    "Adaptive keep-alive: a replica kept until this, after the last call's end.",
    ("function",),
)
KEEPALIVE_IDLE_TIMES = Spec(
    "corral_keepalive_idle_times",
    "gauge",
    "Idle times in a function's histogram.",
    ("function",),
)
KEEPALIVE_WARM = Spec(
    "corral_keepalive_warm",
    "gauge",
    "Adaptive keep-alive: 1 while a replica should be up.",
    ("function",),
)

# Each gateway (workers.gateway.metrics, workers.gateway.calls) ---------------------------
FUNCTION_INVOCATIONS = Spec(
    "corral_function_invocations",
    "counter",
    "Requests the gateway answered, by HTTP status code.",
    ("function", "code"),
)
FUNCTION_DURATION_SECONDS = Spec(
    "corral_function_duration_seconds",
    "histogram",
    "Time from a request's arrival to the last byte of its response.",
    ("function",),
    DURATION_BUCKETS,
)
INFLIGHT = Spec(
    "corral_inflight",
    "gauge",
    "Requests admitted: claiming an environment or being forwarded.",
    ("function",),
)
QUEUE_DEPTH = Spec(
    "corral_queue_depth",
    "gauge",
    "Requests waiting for a free execution environment.",
    ("function",),
)
COLD_STARTS = Spec(
    "corral_cold_starts",
    "counter",
    "Requests that found no Idle replica and waited for one.",
    ("function",),
)
COLD_START_SECONDS = Spec(
    "corral_cold_start_seconds",
    "histogram",
    "For cold starts: time from the start of the claim to a ready replica.",
    ("function",),
    COLD_START_BUCKETS,
)
GATEWAY_ANSWERS_REFUSED = Spec(
    "corral_gateway_answers_refused",
    "counter",
    "Replicas' answers the gateway refused, by the limit they broke.",
    ("function", "reason"),
)
GATEWAY_READ_AHEAD_BYTES = Spec(
    "corral_gateway_read_ahead_bytes",
    "gauge",
    "Bytes of answers read ahead of their callers now, in memory.",
)
GATEWAY_CALLS = Spec(
    "corral_gateway_calls",
    "counter",
    "Requests to /async-function/ the gateway answered, by status code.",
    ("function", "code"),
)
GATEWAY_CALL_ACCEPT_SECONDS = Spec(
    "corral_gateway_call_accept_seconds",
    "histogram",
    "Time from a call's arrival to its 202 (stored and queued).",
    (),
    ACCEPT_BUCKETS,
)

#: Every spec above, by name.
SPECS = {s.name: s for s in globals().values() if isinstance(s, Spec)}
