"""A real cold start, traced: the span tree, the stages on the operation, the histograms.

The data path runs for real on loopback: the gateway (uvicorn), a Celery worker on the
session's Redis, corral's registry, and an fcdaemon agent whose replicas are processes
that report READY to the registry once their HTTP port answers (guest readiness). Spans
go to the SDK's in-memory exporter (:func:`workers.observability.tracing.use`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import SecretStr

from agents import ProcessDriver, serve_fcdaemon
from config.settings import ConfigError
from corral import api
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls, otlp_sink
from testkit.eventually import eventually
from tests.fixtures import Env
from tests.workers.replicas.helpers import deploy_fn
from workers.base.redis_client import redis_client
from workers.gateway import RunningGateway, serve_gateway
from workers.observability import stages, tracing
from workers.observability.exporter import StoreCollector
from workers.registry.service import serve_registry

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
WORKER_STAGES = {"queue", "plan", "placement", "agent_call", "record", "ready"}
GATEWAY_STAGES = {"ask", "claim", "first_byte"}


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, into the SDK's in-memory exporter; off again afterwards."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.stop()
    provider.shutdown()


def _wait_for(
    exporter: InMemorySpanExporter, names: set[str], timeout: float = 20.0
) -> dict[str, ReadableSpan]:
    """The finished spans by name, once every one of ``names`` has ended."""
    deadline = time.monotonic() + timeout
    while True:
        got = {span.name: span for span in exporter.get_finished_spans()}
        if names <= got.keys():
            return got
        assert time.monotonic() < deadline, f"spans missing: {sorted(names - got.keys())}"
        time.sleep(0.05)


def _parent(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def _metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line {line_start!r} in:\n{text}")


@pytest.fixture(params=[True, False], ids=["spawned-here", "through-the-broker"])
def data_path(
    request: pytest.FixtureRequest, thread_worker: Env, redis_url: str
) -> Iterator[RunningGateway]:
    """Registry, an agent that reports READY to it, a guest-ready function, a gateway.

    The gateway carries out its cold start's spawn itself, or sends it to the worker.
    """
    env = thread_worker
    redis_client(redis_url).delete(stages.KEY)  # type: ignore[union-attr]
    registry = serve_registry(env.settings, "127.0.0.1:0", queue=QUEUE)
    agent = serve_fcdaemon(
        "127.0.0.1:0",
        driver=ProcessDriver(),
        registry=f"127.0.0.1:{registry.port}",
        advertise_ip="127.0.0.1",
    )
    gateway = None
    try:
        # the agent registers itself (retrying with backoff while the registry starts)
        eventually(lambda: api.nodes(settings=env.settings), 60, "the agent to register")
        deploy_fn(env, "traced", image="examples.hello", readiness="guest")
        gateway = serve_gateway(
            env.settings.model_copy(
                update={"gateway_cold_start_timeout_s": 30.0, "gateway_spawn_here": request.param}
            ),
            "127.0.0.1:0",
            queue=HereFirst(QUEUE),
        )
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace=0)
        registry.stop(grace=0)


def _check_tree(got: dict[str, ReadableSpan]) -> None:
    """request -> claim -> [publish ->] task -> its stages; request -> first byte; in order."""
    request, claim = got["GET /function/{name}"], got["claim"]
    task = got["run/corral.spawn"]
    publish = got.get("apply_async/corral.spawn", claim)  # spawned here: no message
    placement, create = got["spawn.placement"], got["agent.create"]
    record, ready, first = got["spawn.record"], got["replica.ready"], got["upstream.first_byte"]
    # One trace, continuing the caller's: every span of the cold start is in it.
    assert {format(s.context.trace_id, "032x") for s in got.values()} == {CALLER_TRACE}
    assert request.kind == SpanKind.SERVER and _parent(request) == int(CALLER_SPAN, 16)
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 200
    assert _parent(claim) == request.context.span_id
    if publish is not claim:
        assert _parent(publish) == claim.context.span_id and publish.kind == SpanKind.PRODUCER
    assert _parent(task) == publish.context.span_id and task.kind == SpanKind.CONSUMER
    for stage in (placement, create, record, ready):
        assert _parent(stage) == task.context.span_id, stage.name
    assert create.kind == SpanKind.CLIENT
    assert create.attributes is not None and create.attributes["corral.node"]
    assert _parent(first) == request.context.span_id

    def at(ns: int | None) -> int:
        assert ns is not None
        return ns

    # Each stage ends before the next begins (the clocks: this host's).
    assert at(request.start_time) <= at(claim.start_time) <= at(publish.start_time)
    assert at(placement.end_time) <= at(create.start_time)
    assert at(create.end_time) <= at(record.end_time) <= at(ready.end_time)
    assert at(ready.end_time) <= at(claim.end_time) <= at(first.start_time)
    assert at(first.end_time) <= at(request.end_time)


@pytest.mark.timeout(120)
def test_a_cold_start_is_one_trace_from_request_to_first_byte(
    data_path: RunningGateway,
    thread_worker: Env,
    spans: InMemorySpanExporter,
    redis_url: str,
) -> None:
    answer = httpcalls.get(
        f"{data_path.url}/function/traced",
        timeout=60,
        headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
    )
    assert answer.status_code == 200 and answer.text == "hello from corral\n"
    here = data_path.app.gateway.settings.gateway_spawn_here
    _check_tree(
        _wait_for(
            spans,
            {
                "GET /function/{name}",
                "claim",
                "run/corral.spawn",
                "spawn.placement",
                "agent.create",
                "spawn.record",
                "replica.ready",
                "upstream.first_byte",
                *([] if here else ["apply_async/corral.spawn"]),
            },
        )
    )

    # The spawn's stages are stored on its operation (``corral ops OP --json``)...
    (op,) = [o for o in api.operations(settings=thread_worker.settings) if o["kind"] == "spawn"]
    assert op["result"] is not None
    stored = op["result"]["stages"]
    # every stage, ``ready`` included (0 when the guest's READY beat its VM's record: a
    # busy worker records the create's answer after the guest has booted and reported)
    assert set(stored) == WORKER_STAGES and all(v >= 0 for v in stored.values())
    assert op["result"]["trace"]["traceparent"].split("-")[1] == CALLER_TRACE

    # ...and counted: the worker's and registry's in Redis (served by corral metrics),
    # the gateway's in its own /metrics.
    samples = {
        (s.labels.get("stage"), s.name): s.value
        for family in StoreCollector(thread_worker.db, redis_client(redis_url)).collect()
        if family.name == stages.METRIC
        for s in family.samples
    }
    for stage in WORKER_STAGES:
        assert samples[stage, f"{stages.METRIC}_count"] == 1, stage
    text = httpcalls.get(f"{data_path.url}/metrics", timeout=10).text
    for stage in GATEWAY_STAGES:
        assert _metric(text, f'{stages.METRIC}_count{{stage="{stage}"}}') == 1, stage


def test_a_caller_without_the_token_opens_no_span(
    spans: InMemorySpanExporter, corral_env: Env
) -> None:
    """The request span (caller's traceparent, path) comes after the token check (issue 29)."""
    settings = corral_env.settings.model_copy(update={"gateway_token": SecretStr("t0ken")})
    gateway = serve_gateway(settings, "127.0.0.1:0", queue=HereFirst(QUEUE))
    parent = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
    try:
        path = f"{gateway.url}/function/ghost/{'p' * 60_000}"
        assert httpcalls.get(path, headers=parent, timeout=10).status_code == 401
        token = {**parent, "authorization": "Bearer t0ken"}
        assert (
            httpcalls.get(f"{gateway.url}/function/ghost", headers=token, timeout=10).status_code
            == 404
        )
    finally:
        gateway.stop()
    (request,) = [s for s in spans.get_finished_spans() if s.name == "GET /function/{name}"]
    assert request.attributes is not None
    assert request.attributes["http.response.status_code"] == 404  # the authorised one only


def test_tracing_off_costs_nothing_and_records_nothing() -> None:
    """Off (the default): no tracer, one shared null context, no context carried."""
    tracing.stop()
    assert tracing.tracer is None and not tracing.on()
    assert tracing.span("a") is tracing.span("b")  # the one null context, nothing made
    with tracing.span("a") as span:
        assert span is None
    assert tracing.carrier() is None and tracing.current() is None
    assert tracing.context_of({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}) is None
    tracing.record_between("a", 0, 1, parent=None)  # nothing to record into: no error either


def test_stages_of_a_stored_operation_are_counted_once(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    client.delete(stages.KEY)
    stages.observe(client, {"queue": 0.003, "agent_call": 0.2, "bogus": 1.0})
    stages.observe(client, {"queue": 0.0001, "agent_call": 99.0})
    got = stages.histogram(client.hgetall(stages.KEY))
    assert set(got) == {"queue", "agent_call"}  # unknown stages are not counted
    buckets, total = got["queue"]
    assert dict(buckets)[0.0005] == 1 and dict(buckets)[0.005] == 2
    assert buckets[-1] == (float("inf"), 2) and total == pytest.approx(0.0031)
    buckets, total = got["agent_call"]
    assert dict(buckets)[0.25] == 1 and dict(buckets)[30.0] == 1 and buckets[-1][1] == 2
    client.delete(stages.KEY)


def test_spans_leave_the_process_over_otlp_when_an_endpoint_is_set(corral_env: Env) -> None:
    """CORRAL_OTLP_ENDPOINT set: start() exports over OTLP/gRPC (a real receiver here)."""
    tracing.stop()
    assert not tracing.start("corral-test", corral_env.settings)  # unset: stays off
    assert tracing.tracer is None
    receiver = otlp_sink.serve()
    try:
        settings = corral_env.set(otlp_endpoint=receiver.endpoint)
        assert tracing.start("corral-test", settings) and tracing.on()
        assert tracing.start("corral-test", settings)  # once per process
        with tracing.span("outer") as outer:
            assert outer is not None
            with tracing.span("inner", attributes={"corral.function": "f"}):
                pass
        assert tracing.flush()
        deadline = time.monotonic() + 10
        while receiver.sink.count < 2:
            assert time.monotonic() < deadline, "no spans arrived"
            time.sleep(0.02)
        got = {span.name: span for span in receiver.sink.spans}
        assert got["inner"].service == "corral-test"
        assert got["inner"].parent_id == got["outer"].span_id
        assert got["inner"].trace_id == got["outer"].trace_id
    finally:
        tracing.stop()
        receiver.stop()


def test_a_malformed_otlp_endpoint_is_refused(corral_env: Env) -> None:
    with pytest.raises(ConfigError, match="CORRAL_OTLP_ENDPOINT"):
        corral_env.set(otlp_endpoint="127.0.0.1:4317")  # no scheme
    assert corral_env.set(otlp_endpoint="").otlp_endpoint is None  # empty: off


def test_an_endpoint_without_the_otlp_extra_is_a_clear_error(
    corral_env: Env,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "_NEEDED", (*tracing._NEEDED, "opentelemetry.not_installed"))
    settings = corral_env.set(otlp_endpoint="http://127.0.0.1:4317")
    with pytest.raises(tracing.TracingUnavailable, match=r"corral\[otlp\]"):
        tracing.start("corral-test", settings)
    assert tracing.tracer is None
