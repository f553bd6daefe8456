"""What the router keeps of each function HAProxy carries, and of each replica lent to it.

:class:`Route` is one function with a backend in HAProxy (:mod:`.router`): its servers,
whether HAProxy has its map entry, and what the last poll saw of it (:mod:`.readings`).
:class:`Server` is one replica lent to HAProxy: its claims, how many of them HAProxy may
use (``maxconn``: those lent less those on their way back), its state on the way out
(``ready`` -> ``closing`` -> ``draining`` -> deleted) and where its claims go then (their
:data:`Fate`). :func:`server_name` says which replicas HAProxy can be given at all.
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import urlsplit

from workers.replicas.claims import Claimed

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

    def offer(self, function: str, replica_id: str) -> None:
        """The replica's closed server is gone: lend the claims of it kept meanwhile again."""


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
