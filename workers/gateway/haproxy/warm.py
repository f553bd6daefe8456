"""The warm path put together: HAProxy on the gateway's port, the gateway behind it.

:func:`choose` says which data plane a gateway runs (``CORRAL_GATEWAY_DATAPLANE``):
HAProxy when it is asked for or, with ``auto``, installed (2.6 or later); else the
Python gateway alone, as before. :class:`WarmPath` owns what the HAProxy data plane
adds to a gateway:

* the private directory (:class:`.layout.Layout`) with HAProxy's configuration, its
  runtime socket and the activator's unix socket, on which the Python gateway serves
  instead of the port: it answers what HAProxy hands it (:func:`behind` gives its
  requests back the caller's address and ``Host``);
* the HAProxy process (:mod:`.process`), started on the gateway's bound port;
* the router (:mod:`.router`), attached to the gateway's ledger, admission gates,
  idle-time recorder and metrics when the gateway starts on its event loop, detached and
  HAProxy stopped when it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from config.settings import Settings, reveal
from workers.autoscale.demand import Sample
from workers.gateway.asgi import Message, Receive, Scope, Send
from workers.gateway.haproxy import config
from workers.gateway.haproxy.config import HOST, PEER
from workers.gateway.haproxy.layout import Layout
from workers.gateway.haproxy.process import Binary, Process, Unavailable, find
from workers.gateway.haproxy.readings import Readings
from workers.gateway.haproxy.router import Router
from workers.gateway.haproxy.runtime import Runtime

if TYPE_CHECKING:
    from workers.gateway.proxy import Gateway

log = logging.getLogger(__name__)

_PEER, _HOST, _CLOSE = PEER.encode(), HOST.encode(), config.CLOSE.encode()
CLOSE_TEXT = 1024  # the most of a closing answer's text HAProxy is handed
CHANGE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


def choose(settings: Settings) -> Binary | None:
    """The HAProxy the gateway runs in front of it, or None (the Python path alone).

    Raises :class:`Unavailable` when ``haproxy`` is asked for and cannot be had.
    """
    wanted = settings.gateway_dataplane
    if wanted == "python":
        return None
    try:
        return find(settings.gateway_haproxy)
    except Unavailable as exc:
        if wanted == "haproxy":
            raise
        log.info("gateway: no HAProxy, the Python path carries every call: %s", exc)
        return None


def describe(binary: Binary | None) -> str:
    """What the data plane is, in a line (``corral up`` and ``corral gateway`` print it)."""
    if binary is None:
        return "python (the gateway carries every call)"
    return f"haproxy ({binary}: warm calls; the gateway activates, queues and cold-starts)"


def behind(app: Any, warm: WarmPath) -> Any:
    """``app`` served behind HAProxy, which hands it requests two ways; each is made whole.

    * as they came (not warm, or more than HAProxy's replicas can take): with the
      caller's address in ``x-corral-peer`` and its ``Host`` in ``x-corral-host``, put
      back in their places;
    * warm, but its replica could not be reached and no other could take it: rewritten
      for a replica already, sent to the backup activator of the function's backend,
      whose name it carries as ``Host``. It is made again what the caller sent: the path
      under ``/function/NAME``, the caller's address from the end of the
      ``X-Forwarded-For`` HAProxy set, ``Host`` from its ``X-Forwarded-Host``, and the
      token HAProxy checked and took off.

    Nobody else can send either: the activator's socket is private to the gateway's user.
    An answer that closes its connection says so to HAProxy (``x-corral-close``), which
    closes the caller's.
    """
    token = reveal(warm.settings.gateway_token)
    prefix = f"{config.ACTIVATOR}-".encode()

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            _restore(scope, prefix, warm, token)
            send = _closing(send)
        await app(scope, receive, send)

    return asgi


def _restore(scope: Scope, prefix: bytes, warm: WarmPath, token: str | None) -> None:
    peer = host = line = None
    kept = []
    for key, value in scope["headers"]:
        if key == _PEER:
            peer = value
        elif key == _HOST:
            host = value
        elif key == b"host":
            line = value
        else:
            kept.append((key, value))
    scope["client"] = None
    if peer is not None:  # as it came
        scope["client"] = (peer.decode("latin-1"), 0)
        line = host
    elif line is not None and line.startswith(prefix) and warm.router is not None:
        function = warm.router.function_of(line[len(prefix) :].decode("latin-1"))
        if function is not None:  # warm, and no replica took it
            line = _unwarm(scope, kept, function, token)
    if line is not None:
        kept.insert(0, (b"host", line))
    scope["headers"] = kept


def _unwarm(
    scope: Scope, headers: list[tuple[bytes, bytes]], function: str, token: str | None
) -> bytes | None:
    """Undo HAProxy's rewriting of a warm request in place; the caller's ``Host``."""
    prefix = f"/function/{function}"
    scope["path"] = prefix + scope["path"]
    scope["raw_path"] = prefix.encode() + (scope.get("raw_path") or b"/")
    host = None
    for index, (key, value) in enumerate(headers):
        if key == b"x-forwarded-for":
            chain, _, peer = value.rpartition(b",")
            scope["client"] = (peer.strip().decode("latin-1"), 0)
            headers[index] = (key, chain.strip())
        elif key == b"x-forwarded-host":
            host = value
    headers[:] = [(k, v) for k, v in headers if k != b"x-forwarded-for" or v]
    if token:
        headers.append((b"authorization", f"Bearer {token}".encode()))
    return host


def _closing(send: Send) -> Send:
    """``send``, an answer that closes its connection marked for HAProxy with its message.

    Such answers are the gateway's own short ones (:func:`workers.gateway.asgi.reply`):
    the head is held until the body, whose text goes in ``x-corral-close``.
    """
    held: Message | None = None

    async def marked(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start":
            if (b"connection", b"close") in message.get("headers", ()):
                held = message
                return
        elif held is not None:
            text = bytes(message.get("body", b"")).decode("utf-8", "replace")
            said = " ".join(text.split())[:CLOSE_TEXT].encode("latin-1", "replace")
            held["headers"] = [*held["headers"], (_CLOSE, said or b"-")]
            start, held = held, None
            await send(start)
        await send(message)

    return marked


class WarmPath:
    """HAProxy in front of one gateway: its files, its process, and its router."""

    def __init__(self, settings: Settings, binary: Binary, listen: socket.socket) -> None:
        self.settings = settings
        self.binary = binary
        self.layout = Layout.make(settings.state_dir)
        self.activator = self._bind_activator()
        config.write(settings, self.layout)
        self.process = Process(binary, self.layout, listen)
        self.router: Router | None = None
        self.readings: Readings | None = None
        self._task: asyncio.Task[None] | None = None

    def _bind_activator(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = str(self.layout.activator)
        old = os.umask(0o177)  # 0600 from the start
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        sock.listen(2048)
        sock.setblocking(False)
        return sock

    def start(self) -> None:
        """Start HAProxy (:class:`Unavailable` if it will not)."""
        try:
            self.process.start()
        except Unavailable:
            self.close_files()
            raise

    def attach(self, gateway: Gateway) -> None:
        """Route through HAProxy what the gateway's ledger lends (on the serving loop)."""
        router = self.router = Router(
            self.settings,
            gateway.ledger.lending,
            [config.backend(i) for i in range(self.settings.gateway_warm_functions)],
            str(self.layout.functions),
        )
        readings = self.readings = Readings(
            router, Runtime(self.layout.admin), self.process, gateway.invocations
        )
        gates = gateway.catalog.gates

        def polled() -> None:
            for name, gate in gates.items():
                load = readings.loads.get(name)
                gate.outside.active = load.active if load else 0
                gate.outside.queued = load.queued if load else 0
                if load is not None:  # (its demand is reported while it is recent)
                    gate.last_used = max(gate.last_used, load.busy_at)
                gate.poke()

        readings.on_poll = polled
        changes = Histogram(
            "corral_warm_route_change_seconds",
            "From the gateway's decision to HAProxy applying it: a replica's server, or a "
            "function's backend, put in (add) or taken out of (remove) its choice.",
            ["change"],
            buckets=CHANGE_BUCKETS,
            registry=gateway.metrics.registry,
        )
        router.changed = lambda change, seconds: changes.labels(change).observe(seconds)
        gateway.ledger.lending.lender = router
        gateway.metrics.registry.register(WarmMetrics(router))
        router.start(str(self.layout.admin))
        self._task = asyncio.create_task(readings.run())

    def samples(self) -> dict[str, Sample]:
        """The warm path's demand since the last call, per function."""
        return self.readings.samples() if self.readings is not None else {}

    async def close(self) -> None:
        """Give back what HAProxy holds, stop it, remove its files."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.router is not None:
            self.router.close()
            await asyncio.to_thread(self.router.stop)
        await asyncio.to_thread(self.stop)

    def stop(self) -> None:
        """Stop HAProxy and remove its files (idempotent)."""
        self.process.stop()
        self.close_files()

    def close_files(self) -> None:
        """Close the activator's socket and remove the directory."""
        self.activator.close()
        self.layout.remove()


class WarmMetrics(Collector):
    """The warm path's figures for the gateway's ``/metrics``, per function."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        """The families, read from the router's last poll."""
        router = self.router
        requests = CounterMetricFamily(
            "corral_warm_requests",
            "Requests HAProxy sent straight to a replica (the warm path).",
            labels=["function"],
        )
        for name, count in router.counts.requests.items():
            requests.add_metric([name], count)
        refused = CounterMetricFamily(
            "corral_warm_answers_refused",
            "Replicas' answers HAProxy refused or cut off (its eresp), by function.",
            labels=["function"],
        )
        for name, count in router.counts.refused.items():
            refused.add_metric([name], count)
        servers = GaugeMetricFamily(
            "corral_warm_environments",
            "Environments lent to HAProxy now, by function.",
            labels=["function"],
        )
        for name, route in router.routes.items():
            servers.add_metric([name], sum(s.maxconn for s in route.ready()))
        demoted = GaugeMetricFamily(
            "corral_warm_demoted",
            "Functions kept on the Python path: their answers broke a bound on the warm path.",
            labels=["function"],
        )
        for name in router.counts.demoted:
            demoted.add_metric([name], 1)
        restarts = CounterMetricFamily(
            "corral_warm_haproxy_restarts", "Times the gateway started HAProxy again."
        )
        restarts.add_metric([], router.counts.restarts)
        yield from (requests, refused, servers, demoted, restarts)
