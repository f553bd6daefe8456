"""The gateway's ASGI application and server: routes, demand reports, listening rules.

Routes: ``/function/NAME[/PATH]`` (any method) goes to the proxy
(:mod:`workers.gateway.proxy`); ``POST /async-function/NAME[/PATH]`` and ``GET /calls/ID``
to asynchronous calls (:mod:`workers.gateway.calls`), when the gateway is handed a
:class:`~workers.invocations.queue.CallQueue`; ``GET /metrics`` serves the Prometheus text
(:mod:`workers.gateway.metrics`); ``GET /healthz`` answers ``ok``. With a token set,
``/metrics`` needs it too; ``/healthz`` never does (it says nothing).

While it runs, the gateway publishes each function's demand once per
``CORRAL_GATEWAY_REPORT_INTERVAL_S`` (:func:`workers.autoscale.demand.report`, to the broker's
Redis) for the autoscaler: every function that had a request in the last minute,
idle ones with zeros so their demand is seen to fall; and, at the same time, the
starts and ends of the invocations it served (:mod:`workers.autoscale.idletimes`) for
the keep-alive histograms.

It is served by uvicorn on one asyncio loop, behind the listener bounds of
:mod:`netplumb.asgiserve` (connections in all and per peer, the request head's size and
deadline, trailers), its caps kept below the descriptor limit it raises at start (two
descriptors a connection, :data:`RESERVED_DESCRIPTORS` for the rest; the connections to
replicas stay within the same number); the store calls run in a bounded thread pool.
It refuses to listen on a non-loopback address without ``CORRAL_GATEWAY_TOKEN`` unless
told ``insecure`` (then it warns at every start).

With the HAProxy data plane (:mod:`workers.gateway.haproxy`: ``CORRAL_GATEWAY_DATAPLANE``,
HAProxy by default where it is installed) the gateway binds the port as always and hands
it to a private HAProxy, which carries warm calls; the gateway itself serves on a unix
socket behind it, as the activator, and its demand reports add the warm path's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from config.settings import Settings, parse_networks, reveal
from netplumb import asgiserve
from netplumb.addresses import join_hostport
from netplumb.listening import Server, listen_address
from workers.autoscale import demand, idletimes
from workers.base.errors import CorralError
from workers.dispatch import TaskQueue
from workers.gateway.asgi import Receive, Scope, Send
from workers.gateway.calls import PREFIXES, CallsFront
from workers.gateway.haproxy.process import Unavailable
from workers.gateway.haproxy.warm import WarmPath, behind, choose, describe
from workers.gateway.proxy import PREFIX, Gateway
from workers.invocations.queue import CallQueue
from workers.observability import tracing
from workers.store.db import Database, get_database

log = logging.getLogger(__name__)

ACTIVE_S = 60.0  # a function is reported for this long after its last request
KEEP_ALIVE_S = 30  # a kept-alive connection's wait for its next request
# Descriptors kept for all but callers' and replicas' connections: the store's, Redis's,
# the agents' channels of the cold starts carried out here, logs, the listener.
RESERVED_DESCRIPTORS = 128


GATEWAY = Server("corral gateway", "CORRAL_GATEWAY_LISTEN", "CORRAL_GATEWAY_TOKEN")


class ListenRefused(CorralError):
    """The gateway may not listen where it was asked to."""


def check_listen(settings: Settings, listen: str, *, insecure: bool = False) -> tuple[str, int]:
    """Where to listen; refuses a non-loopback address without a token unless ``insecure``."""
    try:
        host, port = listen_address(
            GATEWAY, listen, reveal(settings.gateway_token), insecure=insecure
        )
    except ValueError as exc:
        raise ListenRefused(str(exc)) from None
    return host, port


class GatewayApp:
    """The ASGI application: the proxy for ``/function/``, Starlette for the rest."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        redis_url: str | None = None,
        gateway_id: str | None = None,
        calls: CallsFront | None = None,
    ) -> None:
        self.gateway = gateway
        self.calls = calls
        self.redis_url = redis_url
        self.gateway_id = gateway_id or (
            f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        )
        self._reporter: asyncio.Task[None] | None = None
        self.site = Starlette(
            routes=[Route("/metrics", self.metrics), Route("/healthz", self.healthz)],
            lifespan=self.lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point."""
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await self.gateway.handle(scope, receive, send)
        elif (
            self.calls is not None
            and scope["type"] == "http"
            and scope["path"].startswith(PREFIXES)
        ):
            await self.calls.handle(scope, receive, send)
        else:
            await self.site(scope, receive, send)

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        """Open the upstream client and start the demand reports; undo both at shutdown."""
        await self.gateway.start()
        if self.redis_url and self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            self._reporter = asyncio.create_task(self._report_forever(self.redis_url))
        try:
            yield
        finally:
            if self._reporter is not None:
                self._reporter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reporter
            await self.gateway.close()

    async def metrics(self, request: Request) -> Response:
        """The Prometheus exposition text."""
        if not self.gateway.authorized(request.scope):
            return PlainTextResponse(
                "missing or invalid gateway token\n", 401, headers={"www-authenticate": "Bearer"}
            )
        body, content_type = self.gateway.metrics.render()
        return Response(body, headers={"content-type": content_type})

    async def healthz(self, _request: Request) -> Response:
        """Liveness."""
        return PlainTextResponse("ok\n")

    async def _report_forever(self, url: str) -> None:
        client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        interval = self.gateway.settings.gateway_report_interval_s
        try:
            while True:
                await asyncio.sleep(interval)
                try:
                    await self._report_once(client)
                except Exception as exc:  # Redis away, or a bug: the next interval tries again
                    log.warning("gateway: demand report failed: %s", exc)
        finally:
            client.close()

    async def _report_once(self, client: redis.Redis) -> None:
        """Report the invocations seen and each active function's demand sample, once."""
        seen = self.gateway.invocations.take()
        if seen:  # for the keep-alive histograms
            shape = idletimes.Shape.from_settings(self.gateway.settings)
            await self.gateway.background.report(idletimes.record_quietly, client, shape, seen)
        now = time.monotonic()
        samples = {
            name: gate.sample()
            for name, gate in self.gateway.catalog.gates.items()
            if gate.active or gate.queued or now - gate.last_used < ACTIVE_S
        }
        if self.gateway.warm is not None:  # what HAProxy carried meanwhile
            for name, warm in self.gateway.warm.samples().items():
                samples[name] = _added(samples.get(name), warm)
        if samples:
            await self.gateway.background.report(demand.report, client, self.gateway_id, samples)


def _added(mine: demand.Sample | None, warm: demand.Sample) -> demand.Sample:
    """One function's demand here and on the warm path, over the same interval."""
    if mine is None:
        return warm
    return demand.Sample(
        inflight=mine.inflight + warm.inflight,
        queued=mine.queued + warm.queued,
        concurrency=round(mine.concurrency + warm.concurrency, 3),
        requests=mine.requests + warm.requests,
        at=max(mine.at, warm.at),
    )


def build_app(
    db: Database, settings: Settings, queue: TaskQueue, calls: CallQueue | None = None
) -> GatewayApp:
    """The gateway application over a store, reporting demand to the broker's Redis.

    ``calls``: where asynchronous calls are sent (None: ``/async-function/`` is not served).
    """
    gateway = Gateway(db, settings, queue)
    front = CallsFront(gateway, db, calls) if calls is not None else None
    return GatewayApp(gateway, redis_url=settings.broker_url, calls=front)


class RunningGateway:
    """A gateway served in a background thread (tests, ``corral up``)."""

    def __init__(
        self, server: asgiserve.BackgroundServer, listen: socket.socket, app: GatewayApp
    ) -> None:
        self.server = server
        host, self.port = listen.getsockname()[:2]
        self.app = app
        self.url = f"http://{join_hostport(host, self.port)}"
        self.warm = app.gateway.warm
        self.dataplane = describe(self.warm.binary if self.warm is not None else None)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and wait for the thread (HAProxy, if any, stops with it)."""
        try:
            self.server.stop(timeout)
        finally:
            if self.warm is not None:
                self.warm.stop()


def _limits(settings: Settings, app: GatewayApp, *, activator: bool = False) -> asgiserve.Limits:
    """The listener's bounds, kept below the descriptor limit (raised first); the
    connections to replicas are kept within the same number.

    ``activator``: the activator's socket behind HAProxy, whose every connection comes from
    HAProxy. HAProxy caps each caller's connections (``config``), so here they have the
    total alone: a per-peer cap would cap all callers together.
    """
    limits = asgiserve.within_descriptors(
        asgiserve.Limits(
            max_connections=settings.gateway_max_connections,
            per_peer=settings.gateway_max_connections_per_peer,
            anonymous_per_peer=settings.gateway_anonymous_per_peer,
            head_bytes=settings.gateway_max_head_bytes,
            head_timeout_s=settings.gateway_read_timeout_s,
            idle_s=KEEP_ALIVE_S,
            descriptors=2,  # a caller's connection and, while it is forwarded, a replica's
            reserve=RESERVED_DESCRIPTORS,
            exempt=parse_networks(settings.gateway_trusted_proxies),
        )
    )
    app.gateway.upstreams.sockets.limit = limits.max_connections
    if activator:
        most = limits.max_connections
        return dataclasses.replace(limits, per_peer=most, anonymous_per_peer=most)
    return limits


def _options(settings: Settings) -> dict[str, Any]:
    """uvicorn's options for the gateway (the netplumb.asgiserve defaults otherwise)."""
    return {"lifespan": "on", "timeout_graceful_shutdown": int(settings.gateway_timeout_s)}


def _bind(host: str, port: int) -> socket.socket:
    try:
        return asgiserve.bind(host, port)
    except OSError as exc:
        raise ListenRefused(f"gateway cannot listen on {host}:{port}: {exc}") from None


def _warm_path(settings: Settings, sock: socket.socket, app: GatewayApp) -> WarmPath | None:
    """HAProxy started on ``sock`` in front of ``app``; None: the Python path alone."""
    try:
        binary = choose(settings)
    except Unavailable as exc:
        raise ListenRefused(f"the HAProxy data plane was asked for: {exc}") from None
    if binary is None:
        return None
    try:
        warm = WarmPath(settings, binary, sock)
        warm.start()
    except (Unavailable, OSError) as exc:
        if settings.gateway_dataplane == "haproxy":
            raise ListenRefused(f"the HAProxy data plane would not start: {exc}") from None
        log.warning("gateway: HAProxy would not start; the Python path carries every call: %s", exc)
        return None
    app.gateway.warm = warm
    return warm


def serve_gateway(  # noqa: PLR0913 - keyword-only options with defaults, and its queue
    settings: Settings,
    listen: str | None = None,
    *,
    queue: TaskQueue,
    insecure: bool = False,
    db: Database | None = None,
    app: GatewayApp | None = None,
    calls: CallQueue | None = None,
) -> RunningGateway:
    """Start a gateway in a background thread; returns once it accepts connections."""

    host, port = check_listen(settings, listen or settings.gateway_listen, insecure=insecure)
    sock = _bind(host, port)
    tracing.start("corral-gateway", settings)
    app = app or build_app(db or get_database(settings.database_url), settings, queue, calls)
    warm = _warm_path(settings, sock, app)
    served, where = (behind(app, warm), warm.activator) if warm is not None else (app, sock)
    limits = _limits(settings, app, activator=warm is not None)
    try:
        server = asgiserve.start(served, where, limits, name="gateway", **_options(settings))
    except OSError as exc:
        if warm is not None:
            warm.stop()
        raise ListenRefused(str(exc)) from None
    return RunningGateway(server, sock, app)


def run_gateway(  # noqa: PLR0913 - keyword-only options with defaults, and its queues
    settings: Settings,
    listen: str | None = None,
    *,
    queue: TaskQueue,
    insecure: bool = False,
    on_ready: Callable[[str, str], None] | None = None,
    calls: CallQueue | None = None,
) -> None:
    """Serve a gateway in the foreground until SIGINT / SIGTERM; it asks ``queue`` for work
    (and sends asynchronous calls to ``calls``).

    ``on_ready`` is told where it listens and which data plane it runs.
    """

    host, port = check_listen(settings, listen or settings.gateway_listen, insecure=insecure)
    sock = _bind(host, port)
    tracing.start("corral-gateway", settings)  # spans, when CORRAL_OTLP_ENDPOINT is set
    app = build_app(get_database(settings.database_url), settings, queue, calls)
    warm = _warm_path(settings, sock, app)
    url = f"http://{join_hostport(host, sock.getsockname()[1])}"
    if on_ready is not None:
        on_ready(url, describe(warm.binary if warm is not None else None))
    # What start-up made (modules, settings, the app) lives as long as the process: the
    # garbage collector, run every few hundred requests, need not walk it each time.
    gc.freeze()
    try:
        if warm is None:
            asgiserve.run(app, sock, _limits(settings, app), **_options(settings))
        else:
            limits = _limits(settings, app, activator=True)
            asgiserve.run(behind(app, warm), warm.activator, limits, **_options(settings))
    finally:
        if warm is not None:
            warm.stop()
