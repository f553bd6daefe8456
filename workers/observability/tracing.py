"""Traces of corral's work with OpenTelemetry: off, and free, unless CORRAL_OTLP_ENDPOINT is set.

The model
---------
A cold start crosses four processes: the gateway (a request finds nothing Idle; its
claim asks for a spawn), the broker and a Celery worker (the spawn's task: placement,
the agent's CreateReplica, recording the VM), the registry (the guest's READY) and the
gateway again (the first byte of the answer). Each step is a span of one trace::

    GET /function/{name}                gateway, SERVER
    |-- claim                           gateway: its pool, the store, a cold start
    |   `-- apply_async/corral.spawn    gateway, PRODUCER  (Celery's instrumentation)
    |       `-- run/corral.spawn        worker, CONSUMER   (context in the message headers)
    |           |-- spawn.placement     rows written, node reserved, rows owned
    |           |-- agent.create        CLIENT: CreateReplica (on the worker's event loop)
    |           |-- spawn.record        the VM recorded: the replica Idle (or Starting)
    |           `-- replica.ready       registry: VM recorded -> the guest's READY
    `-- upstream.first_byte             gateway: claimed -> first byte of the answer

The Celery hop is ``opentelemetry-instrumentation-celery``'s: it puts the W3C
``traceparent`` in each task message's headers and continues the trace in the worker.
The READY arrives long after the spawn's task ended, from another process: the task
stores its span's context on the operation (``result.trace``) and the registry, when it
applies the READY, records a span under it (:func:`record`).

Off by default: :data:`tracer` is None, OpenTelemetry is not even imported, and every
caller either checks ``tracer is None`` (the gateway's hot path) or uses :func:`span`,
which is then one shared null context. :func:`start`, called once by each long-running
process (after any fork: a prefork child, not its parent), turns tracing on when
``CORRAL_OTLP_ENDPOINT`` is set: an SDK ``TracerProvider`` whose batch processor exports
over OTLP/gRPC (any OTLP collector: Jaeger, Tempo, the OpenTelemetry Collector), with
Celery instrumented on it. The standard ``OTEL_*`` variables apply (sampling:
``OTEL_TRACES_SAMPLER``; the exporter's headers and TLS: ``OTEL_EXPORTER_OTLP_*``;
``OTEL_SERVICE_NAME`` overrides the service name). :func:`use` does the same with any
provider (the tests: the SDK's in-memory exporter). The provider is corral's own, never
OpenTelemetry's global one, so a process (a test run) can switch it. The SDK, exporter
and instrumentation are the ``otlp`` extra (``pip install 'corral[otlp]'``); an endpoint
set without them is refused at start (:class:`TracingUnavailable`) rather than ignored.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from config.settings import Settings
from workers.base.errors import CorralError

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

NAME = "corral"


class TracingUnavailable(CorralError):
    """Traces were asked for (``CORRAL_OTLP_ENDPOINT``) and cannot be sent."""


#: The tracer in force; None: tracing is off (check it before doing any tracing work).
tracer: Tracer | None = None
_provider: TracerProvider | None = None
_owned = False  # the provider is start()'s: stop() shuts it down
_pid: int | None = None  # the process start() ran in (a fork must start again)
_lock = threading.Lock()
_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()
_NEEDED = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.instrumentation.celery",
)  # the otlp extra


def on() -> bool:
    """Whether spans are being recorded in this process."""
    return tracer is not None


def start(service: str, settings: Settings) -> bool:
    """Turn tracing on for this process when ``CORRAL_OTLP_ENDPOINT`` is set; True if on.

    Idempotent per process; a forked child starts its own (its parent's exporter thread
    and gRPC channel do not survive a fork).
    """
    global _owned, _pid
    if not settings.otlp_endpoint:
        return False
    with _lock:
        if tracer is not None and _pid == os.getpid():
            return True
        check(settings)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        endpoint = settings.otlp_endpoint
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
            )
        )
        _use(provider)
        _owned, _pid = True, os.getpid()
    log.info("tracing: %s sends spans to %s (OTLP/gRPC)", service, endpoint)
    return True


def check(settings: Settings) -> None:
    """Refuse an ``CORRAL_OTLP_ENDPOINT`` this install cannot send to (the ``otlp`` extra)."""
    if not settings.otlp_endpoint:
        return
    for module in _NEEDED:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            raise TracingUnavailable(
                f"CORRAL_OTLP_ENDPOINT is set but {module} is not installed: "
                "pip install 'corral[otlp]', or unset it"
            )


def use(provider: TracerProvider) -> None:
    """Record spans with ``provider`` (and instrument Celery on it); tests use this."""
    global _owned, _pid
    with _lock:
        _use(provider)
        _owned, _pid = False, os.getpid()


def _use(provider: TracerProvider) -> None:
    global tracer, _provider
    instrumentor = _celery()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    instrumentor.instrument(tracer_provider=provider)
    _provider = provider
    tracer = provider.get_tracer(NAME)


def _celery() -> Any:
    """Celery's instrumentation (one per process: the instrumentor is a singleton)."""
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    return CeleryInstrumentor()  # type: ignore[no-untyped-call]


def stop() -> None:
    """Turn tracing off: uninstrument Celery; a provider :func:`start` made is flushed and shut."""
    global tracer, _provider, _owned
    with _lock:
        if _provider is None:
            return
        instrumentor = _celery()
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
        provider, owned = _provider, _owned
        tracer = _provider = None
        _owned = False
    if owned:
        provider.shutdown()


def flush(timeout_s: float = 5.0) -> bool:
    """Export the spans recorded so far (before a process exits); False if it timed out."""
    provider = _provider
    return True if provider is None else provider.force_flush(int(timeout_s * 1000))


def _kind(kind: str) -> Any:
    from opentelemetry.trace import SpanKind

    return getattr(SpanKind, kind.upper())


@contextlib.contextmanager
def _span(
    name: str, kind: str, attributes: Mapping[str, Any] | None, parent: Context | None
) -> Iterator[Span]:
    assert tracer is not None  # noqa: S101 - span() checked it
    with tracer.start_as_current_span(
        name, context=parent, kind=_kind(kind), attributes=dict(attributes or {})
    ) as current:
        yield current


def span(
    name: str,
    *,
    kind: str = "internal",
    attributes: Mapping[str, Any] | None = None,
    parent: Context | None = None,
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a block, current inside it (a null context when tracing is off)."""
    if tracer is None:
        return _OFF
    return _span(name, kind, attributes, parent)


def current() -> Context | None:
    """The current context, to carry to another thread or event loop; None when off."""
    if tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def carrier() -> dict[str, str] | None:
    """The current span's context as W3C headers (``traceparent``), to store; None when off."""
    return carrier_of(current())


def carrier_of(context: Context | None) -> dict[str, str] | None:
    """A context (:func:`current`) as W3C headers, to store; None when off or empty."""
    if tracer is None or context is None:
        return None
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out, context=context)
    return out or None


def context_of(carried: object) -> Context | None:
    """The context a :func:`carrier` stored (None when off, or nothing usable was stored)."""
    if tracer is None or not isinstance(carried, dict):
        return None
    from opentelemetry import propagate

    headers = {str(k): str(v) for k, v in carried.items() if isinstance(v, str)}
    return propagate.extract(headers) if headers else None


def record_between(  # noqa: PLR0913 - a span's parts, the rest by name
    name: str,
    start_ns: int,
    end_ns: int,
    *,
    parent: Context | None,
    attributes: Mapping[str, Any] | None = None,
    kind: str = "internal",
) -> None:
    """Record a span from ``start_ns`` to ``end_ns`` (wall clock, ns) after the fact."""
    if tracer is None:
        return
    done = tracer.start_span(
        name,
        context=parent,
        kind=_kind(kind),
        attributes=dict(attributes or {}),
        start_time=start_ns,
    )
    done.end(end_time=max(start_ns, end_ns))
