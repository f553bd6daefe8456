"""What HAProxy routes: the claims the gateway lends it, as servers of the functions' backends.

The gateway's ledger (:mod:`workers.gateway.ledger`) holds every claim, as on the
Python path; the router *lends* HAProxy those no request of the gateway waits for. A
function with lent claims has a backend of the pool (``b0`` ..) and an entry in
HAProxy's map (name -> backend); each replica it holds claims on is a server of that
backend, named for its address (``IP:PORT``, which HAProxy also sends as ``Host``),
``maxconn`` = the claims lent on it. A claim is lent when a request of the Python path
gives it back and no other waits for it (so its replica answered already), never one
fresh from the store.

* **Lending** (:meth:`Router.lend`): a new server (``add server`` with every option a
  dynamic server needs: it inherits no ``default-server``), or one more ``maxconn`` on
  the replica's server; the map entry once the function has a server.
* **Taking back**: a Python request that finds neither a claim in the pool nor one
  Idle in the store asks for environments back (:meth:`Router.reclaim`): a server's
  ``maxconn`` goes down by one, and the claim is handed over once HAProxy no longer
  uses it (at most one poll later); a server with none left closes. A function whose
  Python path waits is served there first: that is how demand beyond what HAProxy has
  moves to the activator, and back once it gives claims back with no one waiting.
* **Closing** a server: its function's map entry goes first when it was the last
  server (new requests go to the activator), then - once the backend's queue is empty -
  ``maint``, then ``del server`` once its last request ended. Then its claims go where
  their *fate* says: back to the ledger (``return``), to the store (``release``), or
  dropped (``forget``: the store no longer has them). A function with no server left
  gives its backend back to the pool.
* **Why a server closes**: unused for ``CORRAL_GATEWAY_KEEP_S`` (seen in HAProxy's
  counters: no request in progress and none new); its replica unusable or its claims
  gone (the ledger's renewal: :meth:`Router.recall`); HAProxy marked it down (a
  connection failed: ``observe layer4``) - the replica is retired as suspect, as the
  Python path retires one that fails (:meth:`workers.gateway.ledger.Ledger.retire`);
  or the Python path retired it (:meth:`Router.retired`).
* **Demotion**: a function whose replica sent an interim (1xx) answer, had an answer
  refused or timed out (HAProxy's ``eresp``), or whose answer ran past
  ``CORRAL_GATEWAY_TIMEOUT_S`` (the watchdog: ``show sess``, then ``shutdown
  session``) stays on the Python path for the gateway's life: there interim answers are
  dropped and every bound of :mod:`workers.gateway.http1` applies exactly.

Every change is a command on the runtime socket sent as soon as it is made, in order,
by one writer task (:meth:`Router.run`); a command HAProxy refuses is logged and what it
was for undone. Every ``POLL_S`` the router reads ``show stat`` for the backends in use:
requests in flight and queued per function (the demand the gateway reports, and what its
admission gate counts), arrivals (keep-alive's idle times), each server's use, state and
refusals. If HAProxy dies it is started again on the same socket and given every route
again, from what the ledger lent.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import urlsplit

from config.settings import Settings
from workers.autoscale.demand import Sample
from workers.autoscale.idletimes import Recorder
from workers.clock import epoch
from workers.gateway.haproxy.config import ACTIVATOR
from workers.gateway.haproxy.runtime import (
    DONE,
    Commands,
    Refused,
    Row,
    Runtime,
    RuntimeError_,
)
from workers.replicas.claims import Claimed

log = logging.getLogger(__name__)

POLL_S = 0.05  # HAProxy's counters are read this often
WATCH_S = 1.0  # streams running past the call timeout are looked for this often
POOL_MAX_CONN = 64  # idle connections HAProxy keeps per replica
POOL_PURGE = "5s"  # ...for this long (a dynamic server's default is 0: none kept)
SPARE = 4  # a function keeps its peak and a quarter more lent to HAProxy

Fate = Literal["return", "release", "forget"]


class Holder(Protocol):
    """What the router needs of the gateway's ledger."""

    def give_back(self, claimed: Claimed) -> None:
        """A claim HAProxy is done with: to a waiting request, else lent again or kept."""

    def release(self, claims: list[Claimed]) -> None:
        """Give these claims back to the store."""

    def forget(self, claims: list[Claimed]) -> None:
        """Stop holding claims the store no longer has."""

    def retire_soon(self, claimed: Claimed, reason: str) -> None:
        """Retire the claim's replica as suspect (in the background)."""


class Process(Protocol):
    """The HAProxy the router programs (:class:`workers.gateway.haproxy.process.Process`)."""

    def alive(self) -> bool:
        """True while it runs."""

    def start(self) -> None:
        """Start it again."""

    def tail(self, size: int = 2000) -> str:
        """The end of its output."""


@dataclass
class Server:
    """One replica lent to HAProxy: a server of its function's backend."""

    name: str  # IP:PORT, HAProxy's server name and the Host it sends
    replica_id: str
    claims: list[Claimed]
    state: Literal["ready", "closing", "draining"] = "ready"
    owed: int = 0  # claims to hand back to the ledger once HAProxy no longer uses them
    surplus: int = 0  # claims to give back to the store likewise (unused a keep window)
    peak: int = 0  # the most requests it served at once this keep window
    sessions: int = 0  # requests on it at the last poll
    grown_at: float = field(default_factory=time.monotonic)  # its maxconn last went up
    fates: dict[str, Fate] = field(default_factory=dict)  # by claim id, once closing
    busy_at: float = field(default_factory=time.monotonic)  # last seen in use (or added)
    suspect: str | None = None  # why its replica is retired, once it is
    deleting: bool = False  # its del server is on its way
    closed_at: float = 0.0  # time.perf_counter() it was decided to close it
    # HAProxy's counters at the last poll
    total: int = 0
    errors: int = 0
    interim: int = 0

    @property
    def maxconn(self) -> int:
        """The requests HAProxy may send it at once."""
        return len(self.claims) - self.owed - self.surplus


@dataclass
class Route:
    """One function HAProxy carries: its backend and servers, and what was seen of it."""

    function: str
    backend: str
    servers: dict[str, Server] = field(default_factory=dict)  # by replica id
    mapped: bool = False  # the map entry is in HAProxy, or on its way
    live: bool = False  # HAProxy has said it added the map entry (and not yet removed it)
    inflight: int = 0  # at the last poll: requests on its replicas now
    queued: int = 0  # ...and in its backend's queue
    arrivals: int = 0  # requests since the last demand sample
    area: float = 0.0  # integral of inflight + queued over time, since the last sample
    since: float = field(default_factory=time.monotonic)
    polled: float = field(default_factory=time.monotonic)

    def ready(self) -> list[Server]:
        """Servers HAProxy may send requests to."""
        return [s for s in self.servers.values() if s.state == "ready" and s.maxconn > 0]


@dataclass
class Load:
    """A function's requests on the warm path now (what its admission gate adds to its own)."""

    active: int = 0
    queued: int = 0
    busy_at: float = 0.0  # time.monotonic() it was last seen with a request


@dataclass
class Counts:
    """What the router did, for the metrics."""

    requests: dict[str, int] = field(default_factory=dict)  # by function
    refused: dict[str, int] = field(default_factory=dict)  # answers HAProxy refused
    demoted: dict[str, str] = field(default_factory=dict)  # function -> why
    restarts: int = 0


def server_name(address: str | None) -> str | None:
    """``IP:PORT`` of a replica HAProxy can reach (``http://`` and IPv4), else None."""
    if not address:
        return None
    try:
        parts = urlsplit(address)
        ip = ipaddress.ip_address(parts.hostname or "")
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "http" or ip.version != 4 or not port or parts.path not in ("", "/"):
        return None
    return f"{ip}:{port}"


Then = Callable[["Refused | None", float], None]  # told HAProxy's answer, and when it came


class Writer(threading.Thread):
    """The router's commands, sent from a thread of its own, in order, as they are made.

    A routing change reaches HAProxy as fast as HAProxy answers, however busy the
    gateway's event loop is with the calls it serves; what to do with each answer is
    handed back to the loop (``call_soon_threadsafe``), with the time it came. Commands
    made for an HAProxy that has died since (an older *generation*) are dropped: the
    router gives the new one every route again.
    """

    def __init__(self, commands: Commands, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="haproxy-commands", daemon=True)
        self.commands = commands
        self.loop = loop
        self.generation = 0
        self.queue: queue.SimpleQueue[tuple[int, str, Then | None] | None] = queue.SimpleQueue()

    def send(self, command: str, then: Then | None = None) -> None:
        """Queue one command (any thread)."""
        self.queue.put((self.generation, command, then))

    def stop(self) -> None:
        """End the thread once the commands queued are sent."""
        self.queue.put(None)
        self.join(10)
        self.commands.close()

    def run(self) -> None:
        """Send what comes, a batch at a time, until :meth:`stop`."""
        while True:
            first = self.queue.get()
            if first is None:
                return
            batch = [first]
            with contextlib.suppress(queue.Empty):
                while (more := self.queue.get_nowait()) is not None:
                    batch.append(more)
                else:
                    self.queue.put(None)  # (stop, once this batch is sent)
            while batch := [op for op in batch if op[0] == self.generation]:
                try:
                    answers = self.commands.ask(*(command for _, command, _ in batch))
                except RuntimeError_ as exc:
                    log.warning("gateway: %s (sent again in a moment)", exc)
                    time.sleep(POLL_S)
                    continue
                at = time.perf_counter()
                for (_, command, then), answer in zip(batch, answers, strict=True):
                    refused = None if answer.strip() in DONE else Refused(command, answer)
                    if then is not None:
                        self.loop.call_soon_threadsafe(then, refused, at)
                    elif refused is not None:
                        log.warning("gateway: %s", refused)
                break


class Router:
    """The functions HAProxy carries, kept in step with what the ledger lends."""

    def __init__(  # noqa: PLR0913 - its parts, each the router's own concern
        self,
        settings: Settings,
        runtime: Runtime,
        process: Process,
        holder: Holder,
        backends: list[str],
        functions_map: str,
        invocations: Recorder | None = None,
    ) -> None:
        self.settings = settings
        self.runtime = runtime  # commands
        self.reader = Runtime(runtime.path)  # polls
        self.process = process
        self.holder = holder
        self.functions_map = functions_map
        self.invocations = invocations
        self.free = deque(backends)  # the one free longest is given out first
        # backend -> the function it served last, for requests still on their way
        self.served: dict[str, str] = {}
        self.routes: dict[str, Route] = {}
        self.loads: dict[str, Load] = {}
        self.counts = Counts()
        self.open = True  # lending; off once the gateway stops
        self.on_poll: Callable[[], None] | None = None  # after each poll (admission's pokes)
        #: Told how long each routing change took to reach HAProxy: ("add" | "remove", s).
        self.changed: Callable[[str, float], None] | None = None
        self.writer: Writer | None = None  # started with run(), on the serving loop
        self._early: list[tuple[str, Then | None]] = []  # commands made before run()
        self._look = asyncio.Event()  # a poll wanted before its time
        self._streams: dict[str, float] = {}  # stream id -> first seen on a replica
        self._window = time.monotonic()  # when the keep window of the peaks began

    # -- lending and taking back ------------------------------------------------------------

    def lend(self, claimed: Claimed) -> bool:
        """Take a claim no request waits for; False: the ledger keeps it (Python path)."""
        name = server_name(claimed.address)
        fn = claimed.function
        if not self.open or name is None or fn in self.counts.demoted:
            return False
        if self.settings.gateway_keep_s <= 0:
            return False
        route = self.routes.get(fn)
        if route is None:
            if not self.free:
                return False  # every backend in use: this function takes the Python path
            route = self.routes[fn] = Route(fn, self.free.popleft())
            self.served[route.backend] = fn
        server = route.servers.get(claimed.replica_id)
        if server is None:
            if any(s.name == name for s in route.servers.values()):
                return False  # an old replica at the same address is still closing
            server = route.servers[claimed.replica_id] = Server(name, claimed.replica_id, [claimed])
            self._add_server(route, server)
        elif server.state != "ready":
            return False
        else:
            server.claims.append(claimed)
            server.busy_at = server.grown_at = time.monotonic()
            self._send(f"set maxconn server {route.backend}/{server.name} {server.maxconn}")
        self._map(route)
        return True

    def _add_server(self, route: Route, server: Server) -> None:
        address = f"{route.backend}/{server.name}"

        def added(refused: Refused | None, _at: float) -> None:
            if refused is not None:
                log.warning("gateway: haproxy would not add %s: %s", server.name, refused)
                self._close(route, server, "return", why="not added")
                self._finish(route, server)

        self._send(
            f"add server {address} {server.name} maxconn {server.maxconn}"
            f" pool-max-conn {POOL_MAX_CONN} pool-purge-delay {POOL_PURGE}"
            # marked down by its first failed connection (no health check is ever sent)
            " check observe layer4 error-limit 1 on-error mark-down",
            added,
        )
        self._send(
            f"set server {address} state ready", self._applied_server_add(time.perf_counter())
        )

    def _map(self, route: Route) -> None:
        """The function's map entry, in HAProxy while it has a ready server, else not.

        How long HAProxy takes to apply it after the decision is observed
        (:attr:`changed`): ``add`` - the function's calls go to HAProxy's backend from
        then on; ``remove`` - to the activator.
        """
        wanted = bool(route.ready())
        if wanted and not route.mapped:
            self._send(
                f"add map {self.functions_map} {route.function} {route.backend}",
                self._applied(route, "add"),
            )
        elif route.mapped and not wanted:
            self._send(
                f"del map {self.functions_map} {route.function}", self._applied(route, "remove")
            )
        route.mapped = wanted

    def _applied_server_add(self, decided: float) -> Then:
        """A server put in HAProxy's choice: how long from the decision."""

        def then(refused: Refused | None, at: float) -> None:
            if refused is None and self.changed is not None:
                self.changed("add", at - decided)

        return then

    def _applied_server(self, decided: float) -> Then:
        """A server taken out of HAProxy's choice: how long from the decision."""

        def then(refused: Refused | None, at: float) -> None:
            if refused is None and self.changed is not None:
                self.changed("remove", at - decided)
            elif refused is not None:
                log.warning("gateway: %s", refused)

        return then

    def _applied(self, route: Route, change: str) -> Then:
        decided = time.perf_counter()

        def then(refused: Refused | None, at: float) -> None:
            if refused is not None:
                log.warning("gateway: %s", refused)
                return
            route.live = change == "add"
            if self.changed is not None:
                self.changed(change, at - decided)

        return then

    def reclaim(self, function: str, count: int) -> int:
        """Ask for up to ``count`` environments HAProxy holds unused back; how many come.

        Only environments no request used at the last poll are asked for: taking busy
        ones would move capacity, not add it (the Python path grows the function instead,
        or its admission gate, which counts the warm path's requests, holds the request
        until one ends). One HAProxy starts using meanwhile comes back when a request ends.
        """
        route = self.routes.get(function)
        if route is None or count <= 0:
            return 0
        need = count - sum(s.owed for s in route.servers.values() if s.state == "ready")
        asked = 0
        for server in sorted(route.ready(), key=lambda s: s.busy_at):  # least used first
            take = min(need - asked, server.maxconn - server.sessions)
            if take <= 0:
                continue
            server.owed += take
            asked += take
            if server.maxconn > 0:
                self._send(f"set maxconn server {route.backend}/{server.name} {server.maxconn}")
            else:
                self._close(route, server, "return", why="its environments went back")
        if asked:
            self._map(route)
            self._look.set()  # look at once: they may be free already
        return asked + count - need

    def recall(self, claim_ids: Collection[str], *, release: bool) -> None:
        """These lent claims must go: their replica is unusable (release) or they are gone."""
        wanted = set(claim_ids)
        for route in list(self.routes.values()):
            for server in list(route.servers.values()):
                hit = {c.claim_id for c in server.claims} & wanted
                if not hit:
                    continue
                why = "unusable" if release else "gone from the store"
                self._close(route, server, "release", why=why)
                if not release:
                    server.fates.update(dict.fromkeys(hit, "forget"))

    def retired(self, replica_id: str) -> None:
        """The Python path retired this replica (a claim of it failed): close its server."""
        for route in self.routes.values():
            server = route.servers.get(replica_id)
            if server is not None:
                self._close(route, server, "release", why="retired")

    def function_of(self, backend: str) -> str | None:
        """The function a backend serves, or served last (its last requests may still come)."""
        return self.served.get(backend)

    def lent(self, claim_id: str) -> bool:
        """True while the claim is lent to HAProxy."""
        return any(
            c.claim_id == claim_id
            for route in self.routes.values()
            for s in route.servers.values()
            for c in s.claims
        )

    def demote(self, function: str, why: str) -> None:
        """Keep a function on the Python path from now on (its servers close)."""
        if function in self.counts.demoted:
            return
        self.counts.demoted[function] = why
        log.warning("gateway: %s takes the Python path from now on: %s", function, why)
        route = self.routes.get(function)
        if route is not None:
            for server in list(route.servers.values()):
                self._close(route, server, "return", why="demoted")

    def _close(self, route: Route, server: Server, fate: Fate, *, why: str) -> None:
        """Stop sending the server requests; its claims go by ``fate`` once it is deleted."""
        for claim in server.claims:
            server.fates.setdefault(claim.claim_id, fate)
        if server.state != "ready":
            return
        log.info("gateway: closing %s of %s in haproxy: %s", server.name, route.function, why)
        server.state = "closing"
        server.closed_at = time.perf_counter()
        self._map(route)
        if route.ready():  # others take its calls, queued ones too: out of HAProxy's choice now
            self._drain(route, server)

    def _drain(self, route: Route, server: Server) -> None:
        """No new call for the server (maint); deleted once its last call ended."""
        server.state = "draining"
        self._send(
            f"set server {route.backend}/{server.name} state maint",
            self._applied_server(server.closed_at),
        )

    # -- polling ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Forever: poll the counters, watch streams and HAProxy (commands: :class:`Writer`).

        A poll may read a server whose commands are still on their way: it is not there
        yet, or still in maintenance; only a server HAProxy marked down counts as failed.
        """
        self.writer = writer = Writer(Commands(self.runtime.path), asyncio.get_running_loop())
        writer.start()
        for command, then in self._early:
            writer.send(command, then)
        self._early = []
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
            await asyncio.to_thread(writer.stop)

    def _send(self, command: str, then: Then | None = None) -> None:
        if self.writer is None:
            self._early.append((command, then))
        else:
            self.writer.send(command, then)

    async def poll(self) -> None:
        """Read the counters of the backends in use and act on them."""
        routes = list(self.routes.values())
        if not routes:
            self._demand_idle()
            return
        rows = await self.reader.stat([r.backend for r in routes])
        by_backend: dict[str, dict[str, Row]] = {}
        for row in rows:
            by_backend.setdefault(row.backend, {})[row.server] = row
        now = time.monotonic()
        for route in routes:
            if self.routes.get(route.function) is route:
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
        for route in self.routes.values():
            ready = route.ready()
            peak = sum(server.peak for server in ready)
            spare = sum(server.maxconn for server in ready) - peak - peak // SPARE
            for server in reversed(ready):  # the last ones first: balance first fills the first
                unused = min(spare, server.maxconn - server.peak)
                if 0 < unused < server.maxconn and server.grown_at <= since:
                    server.surplus += unused
                    spare -= unused
                    self._send(f"set maxconn server {route.backend}/{server.name} {server.maxconn}")
            for server in ready:
                server.peak = 0
        self._send("clear counters")  # HAProxy's peaks (smax) start again

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
            self.counts.requests[route.function] = (
                self.counts.requests.get(route.function, 0) + arrivals
            )
        self._record(route.function, arrivals, route.inflight)
        load = self.loads.setdefault(route.function, Load())
        load.active, load.queued = route.inflight, route.queued
        if arrivals or route.inflight or route.queued:
            load.busy_at = now
        self._map(route)

    def _poll_server(self, route: Route, server: Server, row: Row, now: float) -> int:
        """Act on one server's counters; the requests it took since the last poll."""
        new = max(0, row.total - server.total)
        errors, interim = max(0, row.errors - server.errors), max(0, row.interim - server.interim)
        server.total, server.errors, server.interim = row.total, row.errors, row.interim
        server.peak = max(server.peak, row.peak, row.sessions)
        server.sessions = row.sessions
        if row.sessions or new:
            server.busy_at = now
        if errors:
            self.counts.refused[route.function] = (
                self.counts.refused.get(route.function, 0) + errors
            )
            self.demote(route.function, f"haproxy refused {errors} answer(s) of {server.name}")
        if interim:
            self.demote(route.function, f"{server.name} sent interim (1xx) answers")
        if server.state == "ready":
            self._poll_ready(route, server, row, now)
        if server.state == "closing" and (route.queued == 0 or route.ready()):
            self._drain(route, server)  # (the function's last: its queue served first)
        elif server.state == "draining" and not row.sessions and not row.queued:
            self._delete(route, server)
        return new

    def _poll_ready(self, route: Route, server: Server, row: Row, now: float) -> None:
        if row.status.startswith("DOWN") and server.suspect is None:
            server.suspect = f"haproxy could not reach it ({row.status})"
            self._close(route, server, "release", why=server.suspect)
            first = server.claims[0]
            server.fates[first.claim_id] = "forget"  # the suspect call gives it back
            self.holder.retire_soon(first, server.suspect)
            return
        free = len(server.claims) - row.sessions  # what HAProxy does not use now
        if server.owed and free > 0:  # to the Python path, which asked for them
            count = min(free, server.owed)
            handed, server.claims = server.claims[:count], server.claims[count:]
            server.owed -= count
            free -= count
            for claim in handed:
                self.holder.give_back(claim)
        if server.surplus and free > 0:  # unused a keep window: to the store
            spare = min(free, server.surplus)
            released, server.claims = server.claims[:spare], server.claims[spare:]
            server.surplus -= spare
            self.holder.release(released)
        keep = self.settings.gateway_keep_s
        if server.state == "ready" and now - server.busy_at >= keep:
            self._close(route, server, "release", why="unused")

    def _delete(self, route: Route, server: Server) -> None:
        if server.deleting:
            return
        server.deleting = True
        address = f"{route.backend}/{server.name}"

        def deleted(refused: Refused | None, _at: float) -> None:
            server.deleting = False
            if refused is None:
                self._finish(route, server)
                return
            log.debug("gateway: %s", refused)  # the next poll tries again
            if "connections" in refused.answer:
                # a connection that went idle after maint stays in the server's pool
                # (HAProxy 2.6 purges idle ones when a server enters maint): in again
                self._send(f"set server {address} state drain")
                self._send(f"set server {address} state maint")

        self._send(f"del server {address}", deleted)

    def _finish(self, route: Route, server: Server) -> None:
        """The server is gone from HAProxy: its claims go by their fates."""
        if route.servers.get(server.replica_id) is not server:
            return
        del route.servers[server.replica_id]
        by: dict[Fate, list[Claimed]] = {"return": [], "release": [], "forget": []}
        for claim in server.claims:
            by[server.fates.get(claim.claim_id, "release")].append(claim)
        server.claims = []
        self.holder.forget(by["forget"])
        self.holder.release(by["release"])
        for claim in by["return"]:
            self.holder.give_back(claim)
        if not route.servers and self.routes.get(route.function) is route:
            del self.routes[route.function]
            if route.mapped:
                self._send(f"del map {self.functions_map} {route.function}")
            self.free.append(route.backend)
            self.loads.pop(route.function, None)

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
        for name in [n for n in self.loads if n not in self.routes]:
            del self.loads[name]

    def samples(self) -> dict[str, Sample]:
        """Each function's warm demand since the last call (for the autoscaler)."""
        now = time.monotonic()
        out = {}
        for route in self.routes.values():
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
        backends = {r.backend: r for r in self.routes.values() if r.inflight}
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
            self._send(f"shutdown session {ident}")
            self.demote(route.function, "an answer ran past the call timeout")

    async def _restart(self) -> None:
        """HAProxy died: start it again and give it every route again."""
        log.error("gateway: haproxy exited; starting it again: %s", self.process.tail(500))
        self.counts.restarts += 1
        if self.writer is not None:
            self.writer.generation += 1  # what was on its way to the dead one: dropped
        self.reader.close()
        for route in self.routes.values():  # nothing of them is in the new HAProxy
            route.mapped = route.live = False
        try:
            await asyncio.to_thread(self.process.start)
        except Exception as exc:
            log.error("gateway: haproxy would not start again: %s", exc)
            await asyncio.sleep(1.0)
            return
        for route in list(self.routes.values()):
            for server in list(route.servers.values()):
                server.total = server.errors = server.interim = 0
                if server.state == "ready":
                    self._add_server(route, server)
                else:  # nothing of it runs in the new HAProxy
                    self._finish(route, server)
            if self.routes.get(route.function) is route:
                self._map(route)

    async def close(self) -> None:
        """Lend nothing more; every server closes and its claims go back to the ledger."""
        self.open = False
        for route in list(self.routes.values()):
            for server in list(route.servers.values()):
                self._close(route, server, "return", why="the gateway stops")
                server.state = "draining"
                self._finish(route, server)
