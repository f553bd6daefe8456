"""The gateway's Prometheus metrics, in a registry of its own (one per gateway).

Names follow Prometheus' conventions: base units (seconds), ``_total`` on counters
(``prometheus_client`` adds it), one ``function`` label with the function's name.
Requests for a function corral does not know are counted under
``function="(unknown)"`` so random paths cannot grow the label set without bound.

* ``corral_function_invocations_total{function,code}`` - requests answered, by
  HTTP status code (the gateway's own 404 / 413 / 429 / 502 / 503 / 504 included);
* ``corral_function_duration_seconds{function}`` - arrival to the last byte sent;
* ``corral_inflight{function}`` - requests admitted (claiming or being forwarded);
  with HAProxy in front, its calls in flight too (:mod:`workers.gateway.haproxy`);
* ``corral_queue_depth{function}`` - requests waiting for a free environment (and
  those waiting in HAProxy's queue);
* ``corral_cold_starts_total{function}`` - requests that found nothing Idle and
  waited for a replica to become ready;
* ``corral_cold_start_seconds{function}`` - for those, claim start to ready;
* ``corral_cold_start_stage_seconds{stage}`` - the cold-start stages the gateway times
  (``ask``, ``claim``, ``first_byte``: :mod:`workers.gateway.traces`); the worker's
  and registry's stages of the same histogram are served by ``corral metrics``;
* ``corral_gateway_answers_refused_total{function,reason}`` - replicas' answers the
  gateway refused (:class:`workers.gateway.http1.Rejected`), by the limit broken:
  ``head_bytes``, ``head_lines``, ``head_timeout``, ``trailers``, ``upgrade``;
* ``corral_gateway_read_ahead_bytes`` - what the answers read ahead of their callers
  hold now, in memory (against ``CORRAL_GATEWAY_READ_AHEAD_BUDGET``).

With HAProxy in front, the warm path's own figures (``corral_warm_*``) are added to the
same registry by :class:`workers.gateway.haproxy.warm.WarmMetrics`.
"""

from __future__ import annotations

from typing import Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    generate_latest,
)

from workers.observability import metric_catalog as catalog

UNKNOWN = "(unknown)"


class Load(Protocol):
    """What a function's load gauges read: its admission gate (the warm path's load in)."""

    @property
    def inflight(self) -> int:
        """Requests admitted now."""

    @property
    def backlog(self) -> int:
        """Requests waiting for a place now."""


class GatewayMetrics:
    """The gateway's counters, gauges and histograms."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.invocations = catalog.FUNCTION_INVOCATIONS.counter(r)
        self.duration = catalog.FUNCTION_DURATION_SECONDS.histogram(r)
        self.inflight = catalog.INFLIGHT.gauge(r)
        self.queue_depth = catalog.QUEUE_DEPTH.gauge(r)
        self.cold_starts = catalog.COLD_STARTS.counter(r)
        self.cold_start_seconds = catalog.COLD_START_SECONDS.histogram(r)
        self.stages = catalog.COLD_START_STAGE_SECONDS.histogram(r)
        self.refused = catalog.GATEWAY_ANSWERS_REFUSED.counter(r)
        self.read_ahead = catalog.GATEWAY_READ_AHEAD_BYTES.gauge(r)
        # Labelled children, looked up once (every request touches several).
        self._counted: dict[tuple[str, int], Any] = {}
        self._timed: dict[str, Any] = {}
        self._loads: dict[str, tuple[Any, Any]] = {}
        self._watched: dict[str, Load] = {}

    def answered(self, function: str, code: int, seconds: float) -> None:
        """Count one answered request and its duration."""
        counter = self._counted.get((function, code))
        if counter is None:
            counter = self._counted[function, code] = self.invocations.labels(function, str(code))
        counter.inc()
        timer = self._timed.get(function)
        if timer is None:
            timer = self._timed[function] = self.duration.labels(function)
        timer.observe(seconds)

    def cold_start(self, function: str, seconds: float) -> None:
        """Count one cold start and how long it took."""
        self.cold_starts.labels(function).inc()
        self.cold_start_seconds.labels(function).observe(seconds)

    def stage(self, stage: str, seconds: float) -> None:
        """Observe one cold-start stage the gateway timed."""
        self.stages.labels(stage).observe(seconds)

    def load(self, function: str, inflight: int, queued: int) -> None:
        """Set a function's in-flight and queued gauges."""
        gauges = self._loads.get(function)
        if gauges is None:
            gauges = self._loads[function] = (
                self.inflight.labels(function),
                self.queue_depth.labels(function),
            )
        gauges[0].set(inflight)
        gauges[1].set(queued)

    def watch(self, function: str, gate: Load) -> None:
        """Read a function's in-flight and queued gauges from its gate at each scrape."""
        if self._watched.get(function) is gate:
            return  # (every request calls this: a lookup, no gauge set per request)
        self._watched[function] = gate
        self.inflight.labels(function).set_function(lambda: gate.inflight)
        self.queue_depth.labels(function).set_function(lambda: gate.backlog)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
