"""What HAProxy routes: the claims the gateway lends it, as servers of the functions' backends.

The gateway's ledger (:mod:`workers.gateway.ledger`) holds every claim, as on the
Python path; the router *lends* HAProxy those no request of the gateway waits for. A
function with lent claims has a backend of the pool (``b0`` ..) and an entry in
HAProxy's map (name -> backend); each replica it holds claims on is a server of that
backend (:mod:`.routes`), named for its address (``IP:PORT``, which HAProxy also sends
as ``Host``), ``maxconn`` = the claims lent on it. A claim is lent when a request of the
Python path gives it back and no other waits for it (so its replica answered already),
never one fresh from the store.

* **Lending** (:meth:`Router.lend`): a new server (``add server`` with every option a
  dynamic server needs: it inherits no ``default-server``), or one more ``maxconn`` on
  the replica's server; the map entry once the function has a server.
* **Taking back**: a Python request that finds neither a claim in the pool nor one
  Idle in the store asks for environments HAProxy holds unused (:meth:`Router.reclaim`):
  a server's ``maxconn`` goes down, and the claim is handed over once HAProxy no longer
  uses it (at most one poll later); a server with none left closes.
* **Closing** a server: its function's map entry goes first when it was the last
  server (new requests go to the activator), then - at once if others take its calls,
  else once the backend's queue is empty - ``maint``, then ``del server`` once its last
  request ended (:mod:`.readings` sees it). Then its claims go where their *fate* says:
  back to the ledger (``return``), to the store (``release``), or dropped (``forget``:
  the store no longer has them). A function with no server left gives its backend back.
  Claims of the replica the ledger got back while its server closed (the lender takes
  none of a replica then) are offered again (:meth:`Holder.offer`).
* **Why a server closes**: unused for ``CORRAL_GATEWAY_KEEP_S``; its replica unusable or
  its claims gone (the ledger's renewal: :meth:`Router.recall`); HAProxy marked it down
  (its replica retired as suspect, as the Python path retires one that fails); the
  Python path retired it (:meth:`Router.retired`); its function demoted
  (:meth:`Router.demote`: it takes the Python path for the gateway's life).

Every change is a command on the runtime socket, sent the moment it is made, in order,
from a thread of its own (:class:`workers.gateway.haproxy.runtime.Writer`); a command
HAProxy refuses is logged and what it was for undone. How long each routing change
took to reach HAProxy is told to :attr:`Router.changed`.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Collection
from pathlib import Path

from config.settings import Settings
from workers.gateway.haproxy.routes import (
    Counts,
    Fate,
    Holder,
    Route,
    Server,
    server_name,
)
from workers.gateway.haproxy.runtime import Commands, Refused, Then, Writer
from workers.replicas.claims import Claimed

log = logging.getLogger(__name__)

POOL_MAX_CONN = 64  # idle connections HAProxy keeps per replica
POOL_PURGE = "5s"  # ...for this long (a dynamic server's default is 0: none kept)


def add_server(backend: str, name: str, maxconn: int) -> str:
    """The command that adds replica ``name`` (``IP:PORT``) to ``backend``, as it is lent."""
    return (
        f"add server {backend}/{name} {name} maxconn {maxconn}"
        f" pool-max-conn {POOL_MAX_CONN} pool-purge-delay {POOL_PURGE}"
        # marked down by its first failed connection (no health check is ever sent)
        " check observe layer4 error-limit 1 on-error mark-down"
    )


def timed(router: Router, change: str, decided: float, route: Route | None = None) -> Then:
    """What to do with HAProxy's answer to a routing change decided at ``decided``.

    Its time is told to :attr:`Router.changed`; for a function's map entry, the route is
    marked live (``add``) or not (``remove``) once HAProxy has it.
    """

    def then(refused: Refused | None, at: float) -> None:
        if refused is not None:
            log.warning("gateway: %s", refused)
            return
        if route is not None:
            route.live = change == "add"
        if router.changed is not None:
            router.changed(change, at - decided)

    return then


class Router:
    """The functions HAProxy carries, kept in step with what the ledger lends."""

    def __init__(
        self, settings: Settings, holder: Holder, backends: list[str], functions_map: str
    ) -> None:
        self.settings = settings
        self.holder = holder
        self.functions_map = functions_map
        self.free = deque(backends)  # the one free longest is given out first
        # backend -> the function it served last, for requests still on their way
        self.served: dict[str, str] = {}
        self.routes: dict[str, Route] = {}
        self.counts = Counts()
        self.open = True  # lending; off once the gateway stops
        #: Told how long each routing change took to reach HAProxy: ("add" | "remove", s).
        self.changed: Callable[[str, float], None] | None = None
        #: Asks for a look at HAProxy's counters before the next poll is due.
        self.look: Callable[[], None] = lambda: None
        self.writer: Writer | None = None  # started on the serving loop (start())
        self._early: list[tuple[str, Then | None]] = []  # commands made before start()

    def start(self, admin: str) -> None:
        """Start sending commands to HAProxy's runtime socket (on the serving loop)."""
        self.writer = writer = Writer(Commands(Path(admin)), asyncio.get_running_loop())
        writer.start()
        for command, then in self._early:
            writer.send(command, then)
        self._early = []

    def stop(self) -> None:
        """Stop sending commands (the ones queued go first)."""
        if self.writer is not None:
            self.writer.stop()

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
            self.send(f"set maxconn server {route.backend}/{server.name} {server.maxconn}")
        self.sync_map(route)
        return True

    def _add_server(self, route: Route, server: Server) -> None:
        address = f"{route.backend}/{server.name}"

        def added(refused: Refused | None, _at: float) -> None:
            # (added twice around a restart of HAProxy: the first one stands)
            if refused is not None and "already exists" not in refused.answer.lower():
                log.warning("gateway: haproxy would not add %s: %s", server.name, refused)
                self.close_server(route, server, "return", why="not added")
                self._finish(route, server)

        self.send(add_server(route.backend, server.name, server.maxconn), added)
        self.send(f"set server {address} state ready", timed(self, "add", time.perf_counter()))

    def sync_map(self, route: Route) -> None:
        """The function's map entry, in HAProxy while it has a ready server, else not.

        How long HAProxy takes to apply it after the decision is observed
        (:attr:`changed`): ``add`` - the function's calls go to HAProxy's backend from
        then on; ``remove`` - to the activator.
        """
        wanted = bool(route.ready())
        if wanted and not route.mapped:
            self.send(
                f"add map {self.functions_map} {route.function} {route.backend}",
                timed(self, "add", time.perf_counter(), route),
            )
        elif route.mapped and not wanted:
            self.send(
                f"del map {self.functions_map} {route.function}",
                timed(self, "remove", time.perf_counter(), route),
            )
        route.mapped = wanted

    def reclaim(self, function: str, count: int) -> int:
        """Ask for up to ``count`` environments HAProxy holds unused back; how many come.

        Only environments HAProxy did not need this keep window are asked for: taking
        ones it uses would move capacity, not add it (the Python path grows the function
        instead, or its admission gate, which counts the warm path's requests, holds the
        request until one ends). One HAProxy starts using meanwhile comes back when a
        request ends.
        """
        route = self.routes.get(function)
        if route is None or count <= 0:
            return 0
        need = count - sum(s.owed for s in route.servers.values() if s.state == "ready")
        asked = 0
        for server in sorted(route.ready(), key=lambda s: s.busy_at):  # least used first
            # unused: beyond the most HAProxy used at once this keep window (a server busy
            # to its last environment a moment ago would only make the next call overflow)
            take = min(need - asked, server.maxconn - max(server.sessions, server.peak))
            if take <= 0:
                continue
            server.owed += take
            asked += take
            if server.maxconn > 0:
                self.send(f"set maxconn server {route.backend}/{server.name} {server.maxconn}")
            else:
                self.close_server(route, server, "return", why="its environments went back")
        if asked:
            self.sync_map(route)
            self.look()  # at once: they may be free already
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
                self.close_server(route, server, "release", why=why)
                if not release:
                    server.fates.update(dict.fromkeys(hit, "forget"))

    def retired(self, replica_id: str) -> None:
        """The Python path retired this replica (a claim of it failed): close its server."""
        for route in self.routes.values():
            server = route.servers.get(replica_id)
            if server is not None:
                self.close_server(route, server, "release", why="retired")

    def function_of(self, backend: str) -> str | None:
        """The function a backend serves, or served last (its last requests may still come)."""
        return self.served.get(backend)

    def demote(self, function: str, why: str) -> None:
        """Keep a function on the Python path from now on (its servers close)."""
        if function in self.counts.demoted:
            return
        self.counts.demoted[function] = why
        log.warning("gateway: %s takes the Python path from now on: %s", function, why)
        route = self.routes.get(function)
        if route is not None:
            for server in list(route.servers.values()):
                self.close_server(route, server, "return", why="demoted")

    def close_server(self, route: Route, server: Server, fate: Fate, *, why: str) -> None:
        """Stop sending the server requests; its claims go by ``fate`` once it is deleted."""
        for claim in server.claims:
            server.fates.setdefault(claim.claim_id, fate)
        if server.state != "ready":
            return
        log.info("gateway: closing %s of %s in haproxy: %s", server.name, route.function, why)
        server.state = "closing"
        server.closed_at = time.perf_counter()
        self.sync_map(route)
        if route.ready():  # others take its calls, queued ones too: out of HAProxy's choice now
            self.drain(route, server)

    def drain(self, route: Route, server: Server, *, left_choice: bool = False) -> None:
        """No new call for the server (maint); deleted once its last call ended.

        ``left_choice``: the server is already out of HAProxy's choice - the function's
        last, whose map entry went when it closed (that removal was timed), drained now
        that the calls queued for it were served - so this is no routing change to time.
        """
        server.state = "draining"
        self.send(
            f"set server {route.backend}/{server.name} state maint",
            None if left_choice else timed(self, "remove", server.closed_at),
        )

    def send(self, command: str, then: Then | None = None) -> None:
        """Send HAProxy a command, in order after those made before; ``then`` its answer."""
        if self.writer is None:
            self._early.append((command, then))
        else:
            self.writer.send(command, then)

    def delete(self, route: Route, server: Server) -> None:
        """Take a drained server out of HAProxy (``del server``); its claims go then."""
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
                self.send(f"set server {address} state drain")
                self.send(f"set server {address} state maint")

        self.send(f"del server {address}", deleted)

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
                self.send(f"del map {self.functions_map} {route.function}")
            self.free.append(route.backend)
        # claims of the replica given back while it closed stayed in the pool: lend them
        self.holder.offer(route.function, server.replica_id)

    def lost(self) -> None:
        """HAProxy died: nothing of the routes is in it any more."""
        if self.writer is not None:
            self.writer.generation += 1  # what was on its way to the dead one: dropped
        for route in self.routes.values():
            route.mapped = route.live = False

    def reprogram(self) -> None:
        """HAProxy was started again: every route again, from what the ledger lent."""
        for route in list(self.routes.values()):
            for server in list(route.servers.values()):
                server.total = server.errors = server.interim = 0
                if server.state == "ready":
                    self._add_server(route, server)
                else:  # nothing of it runs in the new HAProxy
                    self._finish(route, server)
            if self.routes.get(route.function) is route:
                self.sync_map(route)

    def close(self) -> None:
        """Lend nothing more; every server closes and its claims go back to the ledger."""
        self.open = False
        for route in list(self.routes.values()):
            for server in list(route.servers.values()):
                self.close_server(route, server, "return", why="the gateway stops")
                server.state = "draining"
                self._finish(route, server)
