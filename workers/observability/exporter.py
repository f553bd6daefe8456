"""The control plane's Prometheus exporter (``corral metrics``): computed at scrape time.

The model
---------
Celery runs corral's work in many prefork processes on many hosts; counters kept
in any one of them would see a fraction of the work and vanish with it. So the
exporter keeps no counters of its own: each scrape, :class:`StoreCollector` reads
what the fleet already records - the SQL store and the broker's Redis - and turns
it into metrics. Any number of exporters give the same answers.

From the store:

* ``corral_replicas{function,state}`` - live replicas per function and state
  (every live state of every function, zeros included);
* ``corral_spawn_seconds`` - histogram of enqueue -> Idle for every replica that
  ever became ready: its operation's ``created_at`` (the request was accepted and
  queued; a replica's request id starts with its operation's id) to the replica's
  ``ready_at``; bucketed in SQL, one aggregate query;
* ``corral_node_healthy{node}`` (1 or 0), ``corral_node_replicas{node}``,
  ``corral_node_capacity{node}``;
* ``corral_operations_total{kind,status}`` - finished operations (succeeded,
  failed, partial): a counter, it only grows; ``corral_operations_open{kind,status}``
  - operations still pending or running: a gauge;
* ``corral_calls_open{status}`` - asynchronous calls queued, running and retrying, and
  ``corral_calls_queue_age_seconds`` - how long the oldest queued call has waited
  (:mod:`workers.invocations.stats`).

From Redis:

* ``corral_reaped_total{reason}`` - replicas the reaper deleted, per reason
  (stuck, stale, idle); the reap task adds each pass's counts to one Redis hash
  (:func:`count_reaped`), so every worker process adds to the same total;
* ``corral_cold_start_stage_seconds{stage}`` - the cold-start stages that workers and
  registries time (:mod:`workers.observability.stages`: queue, plan, placement, agent_call, record,
  ready), counted in one Redis hash every process adds to (the gateway serves its own
  stages, ask, claim and first_byte, in its ``/metrics``);
* ``corral_queue_length{queue}`` - messages waiting in each of corral's Celery
  queues (``LLEN`` of the queue's list, over kombu's priority lists), and
  ``corral_queue_unacked`` - messages delivered to a worker and not yet
  acknowledged;
* ``corral_calls_total{outcome}`` - attempts' verdicts (``succeeded``, ``retried``,
  ``dead``) and redrives, and ``corral_callbacks_total{outcome}`` - callbacks
  ``delivered`` and ``failed``: one Redis hash every worker adds to
  (:func:`workers.invocations.stats.count`);
* ``corral_autoscale_desired_replicas{function}`` and
  ``corral_autoscale_panic{function}`` - the autoscaler's last decision;
* for functions with adaptive keep-alive, as the autoscaler's last pass read them
  (:mod:`workers.autoscale.keepalive`): ``corral_keepalive_mode{function,mode}`` (1
  for the mode in force: fixed, histogram or forecast),
  ``corral_keepalive_prewarm_seconds{function}`` and
  ``corral_keepalive_window_seconds{function}`` (both after the end of the last
  call; not exported while the fixed keep-alive holds),
  ``corral_keepalive_idle_times{function}`` (idle times in the histogram) and
  ``corral_keepalive_warm{function}`` (1 while a replica should be up).

and what the workers report of themselves:

* ``corral_clock_offset_seconds{host}`` - how far a host's wall clock is from the store's,
  as its workers last measured it (:mod:`workers.observability.clock_offsets`; corral reads
  no host's clock, this is for operators);
* ``corral_log_records_dropped_total`` - log records workers dropped because their log's
  reader did not keep up (:mod:`workers.observability.logs`: logging never blocks a task).

``corral_exporter_source_up{source}`` says whether the store and Redis answered
this scrape; a source that fails leaves its metrics out instead of failing the scrape.

Serving: :func:`serve` runs prometheus_client's ASGI app on uvicorn behind
:mod:`netplumb.asgiserve`'s bounds (:data:`LIMITS`), in a background thread; a
scrape reads the store and Redis in a worker thread. It refuses an address off
loopback unless a token is set (``CORRAL_METRICS_TOKEN``; Prometheus sends it as
``Authorization: Bearer ...``) or ``insecure`` is asked for; with a token set, every
request must carry it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client import CollectorRegistry, make_asgi_app
from prometheus_client.core import (
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import Float, case, cast, func, select
from sqlalchemy.sql.elements import ColumnElement

from config.celery import QUEUES
from netplumb import asgiserve
from netplumb.addresses import join_hostport, split_hostport
from netplumb.listening import listen_refusal
from workers.autoscale.keepalive import MODES
from workers.autoscale.passes import DECISIONS_KEY, KEEPALIVE_KEY
from workers.base.errors import InputError
from workers.base.kinds import OpKind
from workers.invocations import stats as call_stats
from workers.observability import clock_offsets, logs, stages
from workers.observability import metric_catalog as catalog
from workers.store.db import Database
from workers.store.models import LIVE_STATES, OP_OPEN, Function, Node, Operation, Replica

log = logging.getLogger(__name__)

REAPED_KEY = "corral:metrics:reaped"
REAP_REASONS = ("stuck", "stale", "idle")
# kombu's Redis transport keeps a queue's messages of priority p > 0 in "<queue>\x06\x16<p>"
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)
UNACKED_KEY = "unacked"


def count_reaped(client: redis.Redis, counts: Mapping[str, int]) -> None:
    """Add one reaper pass's deletions per reason to the shared totals."""
    pipe = client.pipeline(transaction=False)
    for reason, n in counts.items():
        if n:
            pipe.hincrby(REAPED_KEY, reason, n)
    pipe.execute()


def _seconds(db: Database, later: Any, earlier: Any) -> ColumnElement[Any]:
    """``later - earlier`` in seconds, as this database spells it."""
    if db.is_sqlite:
        return (func.julianday(later) - func.julianday(earlier)) * 86400.0
    return cast(func.extract("epoch", later - earlier), Float)


class StoreCollector(Collector):
    """Metrics read from the store and Redis on every scrape."""

    def __init__(self, db: Database, client: redis.Redis | None) -> None:
        self.db = db
        self.client = client

    def collect(self) -> Iterator[Metric]:
        """Every metric, computed now."""
        up = catalog.EXPORTER_SOURCE_UP.gauge_family()
        try:
            families = list(self._from_store())
        except Exception as exc:  # the store is down: say so, keep the scrape
            log.warning("metrics: the store did not answer: %s", exc)
            families = []
            up.add_metric(["store"], 0)
        else:
            up.add_metric(["store"], 1)
        if self.client is not None:
            try:
                families += list(self._from_redis(self.client))
            except redis.RedisError as exc:
                log.warning("metrics: Redis did not answer: %s", exc)
                up.add_metric(["redis"], 0)
            else:
                up.add_metric(["redis"], 1)
        yield from families
        yield up

    def _from_store(self) -> Iterable[Metric]:
        with self.db.read() as s:
            names = dict(s.execute(select(Function.id, Function.name)).all())
            counts = {
                (fid, status): n
                for fid, status, n in s.execute(
                    select(Replica.function_id, Replica.status, func.count())
                    .where(Replica.status.in_(LIVE_STATES))
                    .group_by(Replica.function_id, Replica.status)
                )
            }
            nodes = s.execute(
                select(Node.name, Node.healthy, Node.live, Node.capacity).order_by(Node.name)
            ).all()
            ops = s.execute(
                select(Operation.kind, Operation.status, func.count()).group_by(
                    Operation.kind, Operation.status
                )
            ).all()
            spawn = self._spawn_histogram(s)
            calls = call_stats.open_calls(s)

        replicas = catalog.REPLICAS.gauge_family()
        for fid, name in sorted(names.items(), key=lambda kv: kv[1]):
            for state in LIVE_STATES:
                replicas.add_metric([name, state.label], counts.get((fid, state), 0))
        yield replicas
        yield spawn

        healthy = catalog.NODE_HEALTHY.gauge_family()
        live = catalog.NODE_REPLICAS.gauge_family()
        capacity = catalog.NODE_CAPACITY.gauge_family()
        for name, ok, n, cap in nodes:
            healthy.add_metric([name], 1 if ok else 0)
            live.add_metric([name], n)
            capacity.add_metric([name], cap)
        yield from (healthy, live, capacity)

        finished = catalog.OPERATIONS.counter_family()
        still = catalog.OPERATIONS_OPEN.gauge_family()
        for kind, status, n in sorted(ops):
            (still if status in OP_OPEN else finished).add_metric([kind, status], n)
        yield from (finished, still)

        open_calls = catalog.CALLS_OPEN.gauge_family()
        for call_status, waiting in sorted(calls.by_status.items()):
            open_calls.add_metric([call_status], waiting)
        yield open_calls
        yield catalog.CALLS_QUEUE_AGE_SECONDS.gauge_family(calls.oldest_queued_s)

    def _spawn_histogram(self, s: Any) -> HistogramMetricFamily:
        dt = _seconds(self.db, Replica.ready_at, Operation.created_at)
        bounds = catalog.SPAWN_BUCKETS
        row = s.execute(
            select(
                func.count(),
                func.coalesce(func.sum(dt), 0.0),
                *[
                    func.coalesce(func.sum(case((dt <= b, 1), else_=0)), 0)
                    for b in catalog.SPAWN_BUCKETS
                ],
            )
            .select_from(Replica)
            .join(Operation, Operation.id == func.substr(Replica.request_id, 1, 32))
            .where(Replica.ready_at.is_not(None), Operation.kind.in_((OpKind.SPAWN, OpKind.SCALE)))
        ).one()
        total, seconds, *cumulative = row
        buckets = [(_le(b), float(n)) for b, n in zip(bounds, cumulative, strict=True)]
        buckets.append(("+Inf", float(total)))
        return catalog.SPAWN_SECONDS.histogram_family(buckets, float(seconds))

    def _from_redis(self, client: redis.Redis) -> Iterable[Metric]:
        pipe = client.pipeline(transaction=False)
        pipe.hgetall(REAPED_KEY)
        for queue in QUEUES:
            for step in PRIORITY_STEPS:
                pipe.llen(queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}")
        pipe.hlen(UNACKED_KEY)
        pipe.hgetall(DECISIONS_KEY)
        pipe.hgetall(KEEPALIVE_KEY)
        pipe.hgetall(stages.KEY)
        pipe.hgetall(call_stats.KEY)
        replies = pipe.execute()
        reaped_raw, lengths, unacked, decisions, keep_alive, timed, called = (
            replies[0],
            replies[1:-5],
            replies[-5],
            replies[-4],
            replies[-3],
            replies[-2],
            replies[-1],
        )
        yield _stages(timed)
        yield from _calls(called)

        reaped = catalog.REAPED.counter_family()
        got = {_text(k): int(v) for k, v in reaped_raw.items()}
        for reason in sorted(set(REAP_REASONS) | set(got)):
            reaped.add_metric([reason], got.get(reason, 0))
        yield reaped

        queued = catalog.QUEUE_LENGTH.gauge_family()
        steps = len(PRIORITY_STEPS)
        for i, queue in enumerate(QUEUES):
            queued.add_metric([queue], sum(lengths[i * steps : (i + 1) * steps]))
        yield queued
        yield catalog.QUEUE_UNACKED.gauge_family(unacked)

        desired = catalog.AUTOSCALE_DESIRED_REPLICAS.gauge_family()
        panic = catalog.AUTOSCALE_PANIC.gauge_family()
        for name, raw in sorted((_text(k), v) for k, v in decisions.items()):
            try:
                last = json.loads(raw)
                desired.add_metric([name], float(last["desired"]))
                panic.add_metric([name], 1 if last["panicking"] else 0)
            except (ValueError, KeyError, TypeError):
                continue
        yield from (desired, panic)
        yield from _keep_alive(keep_alive)
        yield from _workers(client)


def _workers(client: redis.Redis) -> Iterable[Metric]:
    """What the workers report of themselves: their hosts' clocks, their dropped log records."""
    offset = catalog.CLOCK_OFFSET_SECONDS.gauge_family()
    for host, seconds in sorted(clock_offsets.offsets(client).items()):
        offset.add_metric([host], seconds)
    yield offset
    yield catalog.LOG_RECORDS_DROPPED.counter_family(
        logs.dropped_total(client),
    )


def _calls(raw: Mapping[bytes | str, bytes | str]) -> Iterable[Metric]:
    """The asynchronous calls' shared totals: attempts' verdicts and redrives, callbacks."""
    calls = catalog.CALLS.counter_family()
    delivered = catalog.CALLBACKS.counter_family()
    for event, n in call_stats.totals(raw).items():
        if event.startswith("callback_"):
            delivered.add_metric([event.removeprefix("callback_")], n)
        else:
            calls.add_metric([event], n)
    yield from (calls, delivered)


def _stages(raw: dict[bytes, bytes]) -> Metric:
    """The cold-start stages that workers and registries counted (workers.observability.stages)."""
    family = catalog.COLD_START_STAGE_SECONDS.histogram_family()
    for stage, (buckets, total) in stages.histogram(raw).items():
        family.add_metric(
            [stage],
            [(_le(bound) if bound != float("inf") else "+Inf", count) for bound, count in buckets],
            sum_value=total,
        )
    return family


def _keep_alive(published: dict[bytes, bytes]) -> Iterable[Metric]:
    """The adaptive functions' keep-alive windows, as the last autoscaler pass read them."""
    mode = catalog.KEEPALIVE_MODE.gauge_family()
    prewarm = catalog.KEEPALIVE_PREWARM_SECONDS.gauge_family()
    window = catalog.KEEPALIVE_WINDOW_SECONDS.gauge_family()
    idle_times = catalog.KEEPALIVE_IDLE_TIMES.gauge_family()
    warm = catalog.KEEPALIVE_WARM.gauge_family()
    for name, raw in sorted((_text(k), v) for k, v in published.items()):
        try:
            w = json.loads(raw)
            in_force = str(w["mode"])
            for m in MODES:
                mode.add_metric([name, m], 1 if m == in_force else 0)
            idle_times.add_metric([name], float(w["idle_times"]))
            if w["keep_s"] is not None:
                prewarm.add_metric([name], float(w["prewarm_s"]))
                window.add_metric([name], float(w["keep_s"]))
            if w.get("warm") is not None:
                warm.add_metric([name], 1 if w["warm"] else 0)
        except (ValueError, KeyError, TypeError):
            continue
    yield from (mode, prewarm, window, idle_times, warm)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _le(bound: float) -> str:
    return repr(float(bound))


# -- serving ---------------------------------------------------------------------------------


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as a pair, or a clear :class:`InputError`."""
    try:
        host, port = split_hostport(listen)
    except ValueError:
        host, port = "", 0
    if not host:
        raise InputError(f"--listen must be HOST:PORT, got {listen!r}")
    return host, port


#: What the exporter allows a caller before its token is checked (netplumb.asgiserve): 16
#: connections, 8 from one address, 4 of them before they have shown the token.
LIMITS = asgiserve.Limits(
    max_connections=16,
    per_peer=8,
    anonymous_per_peer=4,
    head_bytes=32 * 1024,
    head_timeout_s=10.0,
)


class _Collected(Collector):
    """Metric families read already, served as they are."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        """The families read."""
        return iter(self.families)


def scrape_app(collector: Collector) -> asgiserve.App:
    """prometheus_client's ASGI app over what ``collector`` reads, read in a thread.

    A scrape queries the store and Redis: off the event loop, which goes on serving
    (and refusing) other connections meanwhile.
    """

    async def app(scope: asgiserve.Scope, receive: asgiserve.Receive, send: asgiserve.Send) -> None:
        families = await asyncio.to_thread(lambda: list(collector.collect()))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected(families))
        await make_asgi_app(registry)(scope, receive, send)

    return app


def guarded(app: asgiserve.App, token: str | None) -> asgiserve.App:
    """``app`` behind ``Authorization: Bearer <token>`` (when a token is set), on /metrics only."""
    expected = f"Bearer {token}".encode() if token else None

    async def asgi(
        scope: asgiserve.Scope, receive: asgiserve.Receive, send: asgiserve.Send
    ) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in ("/metrics", "/"):
            await _plain(send, 404, b"not found; metrics are at /metrics\n")
            return
        if expected is not None:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, expected):  # its body, if any, is never read
                extra = [(b"www-authenticate", b"Bearer"), (b"connection", b"close")]
                await _plain(send, 401, b"a bearer token is required\n", extra)
                return
        asgiserve.authenticated(scope)  # its connection no longer counts as anonymous
        await app(scope, receive, send)

    return asgi


async def _plain(
    send: asgiserve.Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send(
        {"type": "http.response.start", "status": status, "headers": headers + (extra or [])}
    )
    await send({"type": "http.response.body", "body": body})


@dataclass
class RunningExporter:
    """A serving exporter: where it listens, and how to stop it."""

    host: str
    port: int
    server: asgiserve.BackgroundServer

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{join_hostport(self.host, self.port)}/metrics"

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.stop()


def serve(
    db: Database,
    client: redis.Redis | None,
    listen: str,
    *,
    token: str | None = None,
    insecure: bool = False,
) -> RunningExporter:
    """Serve the metrics on ``listen`` in a background thread (port 0 picks a free one)."""
    host, port = parse_listen(listen)
    refusal = listen_refusal(
        "corral metrics", host, token, "CORRAL_METRICS_TOKEN", insecure=insecure
    )
    if refusal is not None:
        raise InputError(refusal)
    app = guarded(scrape_app(StoreCollector(db, client)), token)
    server = asgiserve.start(app, asgiserve.bind(host, port), LIMITS, name="corral-metrics")
    return RunningExporter(host, server.port, server)
