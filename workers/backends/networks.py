"""Where a node's replicas may be: the check a create's reply passes before it becomes a ``Vm``.

An agent's answer names the replica's address (fcdaemon: ``ip`` and ``port``; Lambdo:
a host port on the host itself), and the gateway then forwards callers there. A
broken or hostile agent must not be able to point a replica at anything else - the
control plane's own metrics exporter, say. So every create's address passes
:func:`replica_address`:

* **the node's replica networks**: ``corral nodes add --replica-network CIDR`` (stored
  on the node), or by default the node's own IP, plus ``CORRAL_REPLICA_NETWORKS`` for
  fcdaemon nodes (whose real VMs live on a network of their node's);
* **never the control plane's listeners** (:func:`control_plane`): the registry, the
  gateway, the metrics exporter, Flower, the broker and the database, as the settings
  name them (a wildcard listen counts as loopback and this machine's own addresses).

Anything else fails the create as an *untrusted* reply
(:class:`~workers.base.errors.PermanentBackendError`, code ``untrusted``); the VM it made is
an orphan that reconcile releases. Nothing here is ever resolved: a node's address holds
the IP it registered from (or that ``corral nodes add`` resolved once), and a replica's
address must be an IP, so a name that later points elsewhere moves nothing. A node whose
stored address is still a host name (written by an older corral) has no default network:
its creates fail as untrusted until an operator re-adds it. A node's configured networks
are read from the store at most every :data:`TTL_S` seconds per process, off the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from functools import lru_cache

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from config.settings import Settings
from netplumb.addresses import ip_of, join_hostport, parse_url, split_hostport
from workers.backends.base import Target, backend
from workers.base.untrusted import (
    Listeners,
    Network,
    check_replica_address,
    listen_networks,
    parse_networks,
)
from workers.store.db import get_database
from workers.store.models import Node

__all__ = [
    "TTL_S",
    "control_plane",
    "default_networks",
    "forget",
    "networks_of",
    "remember",
    "replica_address",
]

TTL_S = 5.0
_networks: dict[str, tuple[float, list[Network]]] = {}
_lock = threading.Lock()
_DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "postgresql": 5432, "postgres": 5432}


def _url_listener(url: str | None) -> tuple[str, int] | None:
    """(host, port) of a network URL (redis://, postgresql+psycopg://...); None for files."""
    if not url:
        return None
    try:
        _, host, port = parse_url(url, _DEFAULT_PORTS)
    except ValueError:
        return None
    return host, port


@lru_cache(maxsize=8)
def _listeners(addresses: tuple[tuple[str, int], ...]) -> Listeners:
    return frozenset(
        (net, port) for host, port in addresses if port for net in listen_networks(host)
    )


def control_plane(settings: Settings) -> Listeners:
    """The control plane's own listeners, as (network, port) pairs, from ``settings``."""
    found: list[tuple[str, int]] = []
    for listen in (settings.registry_listen, settings.gateway_listen, settings.metrics_listen):
        try:
            found.append(split_hostport(listen))
        except ValueError:
            continue
    if settings.flower_port:
        found.append(("", settings.flower_port))
    for url in (settings.broker_url, settings.result_backend, settings.database_url):
        listener = _url_listener(url)
        if listener is not None:
            found.append(listener)
    return _listeners(tuple(found))


def default_networks(kind: str, address: str, settings: Settings) -> list[Network]:
    """A node's replica networks when it lists none: its own IP (and, where its VMs live on
    a network of their node's - fcdaemon nodes - ``CORRAL_REPLICA_NETWORKS``).

    A host name is not resolved: it contributes no network."""
    ip = ip_of(address)
    nets: list[Network] = [] if ip is None else [ipaddress.ip_network(ip)]
    if backend(kind).on_node_network:
        nets += parse_networks(c for c in settings.replica_networks.split(",") if c.strip())
    return nets


def _configured(node_id: str, settings: Settings) -> list[str] | None:
    """The node's own ``--replica-network`` list (None: its kind's default)."""
    with get_database(settings.database_url).read() as s:
        raw = s.scalar(select(Node.replica_networks).where(Node.id == node_id))
    return list(raw) if raw else None


def networks_of(t: Target, settings: Settings) -> list[Network]:
    """The networks the node ``t``'s replicas may be in (cached for :data:`TTL_S`).

    A store that does not answer leaves the last networks known in force: a create that
    answered must not fail its check because the store blinked (its VM would be lost).
    """
    with _lock:
        cached = _networks.get(t.id)
    if cached is not None and time.monotonic() - cached[0] < TTL_S:
        return cached[1]
    try:
        configured = _configured(t.id, settings)
    except SQLAlchemyError:
        if cached is None:
            raise
        return cached[1]
    return _keep(t, configured, settings)


def remember(t: Target, configured: list[str] | None, settings: Settings) -> None:
    """Note a node's networks as its row just read says (``replica_networks``), for its calls."""
    _keep(t, configured, settings)


def _keep(t: Target, configured: list[str] | None, settings: Settings) -> list[Network]:
    nets = (
        parse_networks(configured) if configured else default_networks(t.kind, t.address, settings)
    )
    with _lock:
        _networks[t.id] = (time.monotonic(), nets)
    return nets


def forget() -> None:
    """Drop the cached networks of every node (``nodes add`` in this process, tests)."""
    with _lock:
        _networks.clear()


def _check(t: Target, host: str, port: int, settings: Settings) -> None:
    check_replica_address(host, port, networks_of(t, settings), control_plane(settings), t.name)


async def replica_address(t: Target, host: str, port: int, settings: Settings) -> str:
    """``http://host:port`` of a new replica of node ``t``, if the node may give that address.

    Raises :class:`~workers.base.errors.PermanentBackendError` (``untrusted``) otherwise.
    """
    await asyncio.to_thread(_check, t, host, port, settings)
    return f"http://{join_hostport(host, port)}"
