"""What HAProxy's counters say, read every ``POLL_S``, and what the router does about it.

Every ``POLL_S`` the readings take ``show stat`` of the backends in use (on a runtime
connection of their own: the router's commands are not held back) and act on each
function (:mod:`.routes`):

* **demand**: requests in flight on its replicas and queued in its backend - what its
  admission gate counts (:attr:`Readings.loads`, :attr:`Readings.on_poll`) and the demand
  the gateway reports (:meth:`Readings.samples`, time-weighted over the interval);
* **idle times**: each new request an invocation for keep-alive's histograms, busy until
  now while requests are in flight (as exact as the poll);
* **each server**: environments the Python path asked back handed over once HAProxy no
  longer uses them; those a keep window's peak (HAProxy's ``smax``, exact; cleared each
  window) and a quarter more did not need given back to the store; a server unused for
  the keep window closed; one HAProxy marked down closed and its replica retired as
  suspect; a draining one deleted once its last request ended; answers HAProxy refused
  (``eresp``) or interim answers (``hrsp_1xx``) demote its function.

Every ``WATCH_S`` the watchdog reads ``show sess`` while requests are in flight and cuts
off (``shutdown session``) a stream on a replica running past ``CORRAL_GATEWAY_TIMEOUT_S``,
demoting its function. If HAProxy has died, it is started again on the same socket and
the router gives it every route again.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from config.settings import Settings
from workers.autoscale.demand import Sample
from workers.autoscale.idletimes import Recorder
from workers.base.clock import epoch
from workers.gateway.haproxy.config import ACTIVATOR
from workers.gateway.haproxy.router import Router
from workers.gateway.haproxy.routes import Load, Route, Server
from workers.gateway.haproxy.runtime import Row, Runtime, RuntimeError_

log = logging.getLogger(__name__)

POLL_S = 0.05  # HAProxy's counters are read this often
WATCH_S = 1.0  # streams running past the call timeout are looked for this often
SPARE = 4  # a function keeps its peak and a quarter more lent to HAProxy


class Process(Protocol):
    """The HAProxy read (:class:`workers.gateway.haproxy.process.Process`)."""

    def alive(self) -> bool:
        """True while it runs."""

    def start(self) -> None:
        """Start it again."""

    def tail(self, size: int = 2000) -> str:
        """The end of its output."""


class Readings:
    """HAProxy's counters, read and acted on; the watchdog; restarts."""

    def __init__(
        self,
        router: Router,
        reader: Runtime,
        process: Process,
        invocations: Recorder | None = None,
    ) -> None:
        self.router = router
        self.settings: Settings = router.settings
        self.reader = reader
        self.process = process
        self.invocations = invocations
        self.loads: dict[str, Load] = {}
        self.on_poll: Callable[[], None] | None = None  # after each poll (admission's pokes)
        self._look = asyncio.Event()  # a poll wanted before its time
        router.look = self._look.set
        self._streams: dict[str, float] = {}  # stream id -> first seen on a replica
        self._window = time.monotonic()  # when the keep window of the peaks began

    async def run(self) -> None:
        """Forever: poll the counters, watch streams and HAProxy.

        A poll may read a server whose commands are still on their way: it is not there
        yet, or still in maintenance; only a server HAProxy marked down counts as failed.
        """
        try:
            watched = 0.0
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(POLL_S):
                        await self._look.wait()
                self._look.clear()
                if not self.process.alive():
                    await self._restart()
                    continue
                try:
                    await self.poll()
                    if time.monotonic() - watched >= WATCH_S:
                        watched = time.monotonic()
                        await self.watch()
                except RuntimeError_ as exc:
                    if self.process.alive():
                        log.warning("gateway: haproxy's runtime socket: %s", exc)
        finally:
            self.reader.close()

    async def poll(self) -> None:
        """Read the counters of the backends in use and act on them."""
        routes = list(self.router.routes.values())
        if not routes:
            self._demand_idle()
            return
        rows = await self.reader.stat([r.backend for r in routes])
        by_backend: dict[str, dict[str, Row]] = {}
        for row in rows:
            by_backend.setdefault(row.backend, {})[row.server] = row
        now = time.monotonic()
        for route in routes:
            if self.router.routes.get(route.function) is route:
                self._poll_route(route, by_backend.get(route.backend, {}), now)
        keep = self.settings.gateway_keep_s
        if now - self._window >= keep:
            self._trim(now - keep)
            self._window = now
        self._demand_idle()
        if self.on_poll is not None:
            self.on_poll()

    def _trim(self, since: float) -> None:
        """Give back environments no request used this keep window, but a margin for bursts.

        Each function keeps the most its calls used at once (HAProxy's peaks, exact) and a
        quarter more: a call beyond what HAProxy holds goes to the activator, a longer way,
        so bursts a little above the last window's stay warm. A server that took more
        claims within the window is left alone until the next.
        """
        for route in self.router.routes.values():
            ready = route.ready()
            peak = sum(server.peak for server in ready)
            spare = sum(server.maxconn for server in ready) - peak - peak // SPARE
            for server in reversed(ready):  # the last ones first: balance first fills the first
                unused = min(spare, server.maxconn - server.peak)
                if 0 < unused < server.maxconn and server.grown_at <= since:
                    server.surplus += unused
                    spare -= unused
                    self.router.send(
                        f"set maxconn server {route.backend}/{server.name} {server.maxconn}"
                    )
            for server in ready:
                server.peak = 0
        self.router.send("clear counters")  # HAProxy's peaks (smax) start again

    def _poll_route(self, route: Route, rows: dict[str, Row], now: float) -> None:
        backend = rows.get("BACKEND")
        route.area += (route.inflight + route.queued) * (now - route.polled)
        route.polled = now
        route.queued = backend.queued if backend else 0
        route.inflight = 0
        arrivals = 0
        for server in list(route.servers.values()):
            row = rows.get(server.name)
            if row is None:
                continue  # not added yet (its commands are on their way)
            route.inflight += row.sessions
            arrivals += self._poll_server(route, server, row, now)
        route.arrivals += arrivals
        if arrivals:
            self.router.counts.requests[route.function] = (
                self.router.counts.requests.get(route.function, 0) + arrivals
            )
        self._record(route.function, arrivals, route.inflight)
        load = self.loads.setdefault(route.function, Load())
        load.active, load.queued = route.inflight, route.queued
        if arrivals or route.inflight or route.queued:
            load.busy_at = now
        self.router.sync_map(route)

    def _poll_server(self, route: Route, server: Server, row: Row, now: float) -> int:
        """Act on one server's counters; the requests it took since the last poll.

        A server is marked down by its first connection that could not be made
        (``observe layer4``), and the request it failed is sent to another server or the
        activator, which count it; HAProxy counts it in the server's ``stot`` and nowhere
        else (not ``econ``, ``wretr`` or ``wredis``). So what a server that is down now
        took since the last poll is not counted: those are the requests it failed (one it
        took just before its failure, in the same poll, is not counted either).
        """
        new = 0 if row.status.startswith("DOWN") else max(0, row.total - server.total)
        errors, interim = max(0, row.errors - server.errors), max(0, row.interim - server.interim)
        server.total, server.errors, server.interim = row.total, row.errors, row.interim
        server.peak = max(server.peak, row.peak, row.sessions)
        server.sessions = row.sessions
        if row.sessions or new:
            server.busy_at = now
        if errors:
            self.router.counts.refused[route.function] = (
                self.router.counts.refused.get(route.function, 0) + errors
            )
            self.router.demote(
                route.function, f"haproxy refused {errors} answer(s) of {server.name}"
            )
        if interim:
            self.router.demote(route.function, f"{server.name} sent interim (1xx) answers")
        if server.state == "ready":
            self._poll_ready(route, server, row, now)
        if server.state == "closing" and (route.queued == 0 or route.ready()):
            # the function's last: its queue served first (its map entry went at the close)
            self.router.drain(route, server, left_choice=not route.ready())
        elif server.state == "draining" and not row.sessions and not row.queued:
            self.router.delete(route, server)
        return new

    def _poll_ready(self, route: Route, server: Server, row: Row, now: float) -> None:
        if row.status.startswith("DOWN") and server.suspect is None:
            server.suspect = f"haproxy could not reach it ({row.status})"
            self.router.close_server(route, server, "release", why=server.suspect)
            first = server.claims[0]
            server.fates[first.claim_id] = "forget"  # the suspect call gives it back
            self.router.holder.retire_soon(first, server.suspect)
            return
        free = len(server.claims) - row.sessions  # what HAProxy does not use now
        if server.owed and free > 0:  # to the Python path, which asked for them
            count = min(free, server.owed)
            handed, server.claims = server.claims[:count], server.claims[count:]
            server.owed -= count
            free -= count
            for claim in handed:
                self.router.holder.give_back(claim)
        if server.surplus and free > 0:  # unused a keep window: to the store
            spare = min(free, server.surplus)
            released, server.claims = server.claims[:spare], server.claims[spare:]
            server.surplus -= spare
            self.router.holder.release(released)
        keep = self.settings.gateway_keep_s
        if server.state == "ready" and now - server.busy_at >= keep:
            self.router.close_server(route, server, "release", why="unused")

    # -- what was seen ----------------------------------------------------------------------

    def _record(self, function: str, arrivals: int, inflight: int) -> None:
        """Keep-alive's idle times: each arrival an invocation; in use until now if busy."""
        recorder = self.invocations
        if recorder is None:
            return
        for _ in range(arrivals):
            recorder.started(function)
            recorder.ended(function)
        if inflight:
            recorder.ended(function)  # (busy until now: the next arrival is not after idle)

    def _demand_idle(self) -> None:
        for name in [n for n in self.loads if n not in self.router.routes]:
            del self.loads[name]

    def samples(self) -> dict[str, Sample]:
        """Each function's warm demand since the last call (for the autoscaler)."""
        now = time.monotonic()
        out = {}
        for route in self.router.routes.values():
            area = route.area + (route.inflight + route.queued) * (now - route.polled)
            span = max(now - route.since, 1e-6)
            out[route.function] = Sample(
                inflight=route.inflight,
                queued=route.queued,
                concurrency=round(area / span, 3),
                requests=route.arrivals,
                at=epoch(),
            )
            route.area, route.polled, route.since, route.arrivals = 0.0, now, now, 0
        return out

    # -- the watchdog and restarts ----------------------------------------------------------

    async def watch(self) -> None:
        """Cut off answers running past the call timeout; their functions are demoted."""
        backends = {r.backend: r for r in self.router.routes.values() if r.inflight}
        if not backends:
            self._streams.clear()
            return
        now = time.monotonic()
        seen: dict[str, float] = {}
        late = []
        for stream in await self.reader.sessions():
            route = backends.get(stream.backend)
            if (
                route is None
                or stream.server in ("", "<none>")
                or stream.server.startswith(ACTIVATOR)
            ):
                continue
            first = seen[stream.id] = self._streams.get(stream.id, now)
            if now - first > self.settings.gateway_timeout_s:
                late.append((stream.id, route))
        self._streams = seen
        for ident, route in late:
            self.router.send(f"shutdown session {ident}")
            self.router.demote(route.function, "an answer ran past the call timeout")

    async def _restart(self) -> None:
        """HAProxy died: start it again and have the router give it every route again."""
        log.error("gateway: haproxy exited; starting it again: %s", self.process.tail(500))
        self.router.counts.restarts += 1
        self.router.lost()
        self.reader.close()
        try:
            await asyncio.to_thread(self.process.start)
        except Exception as exc:
            log.error("gateway: haproxy would not start again: %s", exc)
            await asyncio.sleep(1.0)
            return
        self.router.reprogram()
