"""Nodes: adding, listing, removing and draining node agents and Lambdo hosts.

A node is either added by an operator (``corral nodes add``) or announces itself
through the registry's ``RegisterNode``; both paths end in :func:`upsert_node`,
idempotent by name (operator) or by the agent's ``node_id`` (registry).

**A node's address is an IP, fixed when it is stored.** Corral sends a node the agent
token and functions' AWS keys, accepts its agent's reports, lets its replicas be on its
network, and destroys what it lists as orphans - all by its address. A host name would
let whoever controls its DNS move all of that to another machine later, so a name is
never stored: ``RegisterNode`` must claim the IP it calls from, and an operator's
``corral nodes add NAME:PORT`` resolves the name once (:func:`resolve_address`) and
stores the IP, as ``nodes add`` then shows. Nothing re-resolves it afterwards.

**One node per address.** Two rows at one ``IP:PORT`` would be one agent seen twice:
each listing the other's VMs as its own orphans. :func:`upsert_node` refuses an address
another node holds (:class:`AddressTaken`), and the store's unique index on
``nodes.endpoint`` (the IP and port, whatever the kind) makes two concurrent additions
unable to both win.

Placement learns from creates (:func:`note_creates`, called by the spawn path in
the transaction that records a batch's results): a create that failed - a
permanent answer, or a transport error after its retries - counts against its
node, a success resets the count. After ``CORRAL_NODE_FAILURES`` failures in a row
the node is quarantined for ``CORRAL_NODE_QUARANTINE_S``, a back-off that doubles
(up to ``CORRAL_NODE_QUARANTINE_MAX_S``) each time it fails again after a
quarantine; placement skips it meanwhile and ``nodes list`` says why. A node that
never created a VM, or whose last creates failed, is on probation: a batch sends
it only as many calls as it may still fail until one succeeds (:func:`probation`).
"""

from __future__ import annotations

import math
import re
import socket
from datetime import timedelta
from typing import NotRequired, TypedDict

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from config.settings import Settings
from netplumb.addresses import HTTP_PORTS, ip_of, join_hostport, parse_url, split_hostport
from workers.backends.base import backend
from workers.base.clock import iso, now
from workers.base.errors import InputError
from workers.base.kinds import NodeKind
from workers.base.names import check_name
from workers.base.untrusted import IP, parse_networks
from workers.store.models import Node, Replica, ReplicaState
from workers.store.rows import delete_unlinking_replicas, one_or_not_found


class AddressTaken(InputError):
    """Another node is at this IP and port: one node per address."""


def normalize_address(address: str, kind: str) -> str:
    """A node address in canonical form (``host:port`` for agents, a URL for Lambdo)."""
    return backend(kind).normalize_address(address.strip())


def _parts(address: str) -> tuple[str, str, int]:
    """(scheme, or "" for ``host:port``; host; port) of a normalized node address."""
    if "://" not in address:
        host, port = split_hostport(address)
        return "", host, port
    return parse_url(address, HTTP_PORTS)


def _at(scheme: str, ip: IP, port: int) -> str:
    hostport = join_hostport(str(ip), port)
    return f"{scheme}://{hostport}" if scheme else hostport


def resolve_address(address: str, kind: str) -> tuple[str, str | None]:
    """``address`` normalized with its host as an IP, resolved now if it is a name (once:
    what is stored is the IP); also the name it was resolved from (None for an IP)."""
    address = normalize_address(address, kind)
    scheme, host, port = _parts(address)
    if ip_of(host) is not None:
        return address, None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise InputError(f"cannot resolve node host {host!r}: {exc}") from None
    ip = ip_of(str(infos[0][4][0]).split("%", 1)[0]) if infos else None
    if ip is None:
        raise InputError(f"node host {host!r} resolves to no IP address")
    return _at(scheme, ip, port), host


def _ip_address(address: str, kind: str) -> tuple[str, str]:
    """(the address in canonical form, its ``IP:PORT``); InputError for a host name."""
    scheme, host, port = _parts(normalize_address(address, kind))
    ip = ip_of(host)
    if ip is None:
        raise InputError(
            f"node address {address[:80]!r} names a host: a node is stored by IP "
            "(`corral nodes add` resolves a name once), never by a name that could "
            "later stand for another machine"
        )
    return _at(scheme, ip, port), join_hostport(str(ip), port)


def default_name(address: str) -> str:
    """A node name derived from its address."""
    bare = address.split("://", 1)[-1]
    name = re.sub(r"[^a-z0-9]+", "-", bare.lower()).strip("-")
    return name[:63].strip("-") or "node"


def upsert_node(  # noqa: PLR0913 - keyword-only options with defaults
    session: Session,
    address: str,
    *,
    name: str | None = None,
    kind: str = NodeKind.FCDAEMON,
    capacity: int | None = None,
    external_id: str | None = None,
    default_capacity: int = 64,
    replica_networks: list[str] | None = None,
) -> tuple[Node, bool]:
    """Add a node or refresh the one with the same name / node_id; returns (node, created).

    ``address``'s host must be an IP (:func:`resolve_address` turns a name into one); an
    address another node holds is refused (:class:`AddressTaken`), also when the other
    node is added at the same moment. ``replica_networks`` (CIDRs) replaces the networks
    its replicas may live in; None keeps them (a new node: its kind's default,
    :mod:`workers.backends.networks`).
    """
    address, endpoint = _ip_address(address, kind)
    name = check_name(name or default_name(address), "node")
    if capacity is not None and (capacity < 0 or capacity > 100_000):
        raise InputError(f"capacity must be between 0 and 100000, got {capacity}")
    networks = _networks(replica_networks)
    node = None
    if external_id:
        node = session.scalars(
            select(Node).where(Node.external_id == external_id).with_for_update()
        ).first()
    if node is None:
        node = session.scalars(select(Node).where(Node.name == name).with_for_update()).first()
    created = node is None
    if node is None:
        node = Node(name=name, kind=kind, address=address, live=0)
        session.add(node)
    elif node.kind != kind:
        raise InputError(f"node {name!r} is a {node.kind} node, not {kind}")
    holder = session.scalars(select(Node).where(Node.endpoint == endpoint)).first()
    if holder is not None and holder is not node:
        raise _taken(endpoint, holder.name)
    node.address = address
    node.endpoint = endpoint
    if external_id:
        node.external_id = external_id
    if capacity is not None:
        node.capacity = capacity
    elif created:
        node.capacity = default_capacity
    if networks is not None:
        node.replica_networks = networks
    node.healthy = True
    node.misses = 0
    node.unhealthy_since = None
    node.last_seen_at = now()
    try:
        session.flush()
    except IntegrityError as exc:  # another node took the address since the check above
        if "endpoint" in str(exc.orig):
            raise _taken(endpoint, "another node") from None
        raise
    return node, created


def _taken(endpoint: str, holder: str) -> AddressTaken:
    return AddressTaken(
        f"address {endpoint} is already {holder}'s: one node per address (remove that "
        "node first, `corral nodes remove NAME`, or add this one at its own address)"
    )


def _networks(cidrs: list[str] | None) -> list[str] | None:
    """``cidrs`` in canonical form (``10.0.0.0/24``); InputError naming a malformed one."""
    if cidrs is None:
        return None
    try:
        return [str(net) for net in parse_networks(cidrs)]
    except ValueError as exc:
        raise InputError(f"--replica-network: {exc}") from None


def get_node(session: Session, name: str) -> Node:
    """The node called ``name``, or :class:`NotFound`."""
    check_name(name, "node")
    return one_or_not_found(session, select(Node).where(Node.name == name), f"node {name!r}")


def remove_node(session: Session, name: str) -> None:
    """Remove a node that runs no replicas, or an unhealthy one whose rows only wait on it.

    Rows Deleting on an unhealthy node wait for it to answer before their VMs are released
    (:func:`workers.replicas.delete.release_waits`); removing the node says it will not:
    they are unlinked, and the reaper retires them with no VM to release.
    """
    node = get_node(session, name)
    waiting = 0
    if node.live and not node.healthy:
        waiting = (
            session.scalar(
                select(func.count()).where(
                    Replica.node_id == node.id, Replica.status == ReplicaState.DELETING
                )
            )
            or 0
        )
    if node.live > waiting:
        raise InputError(_still_runs(session, node, node.live - waiting))
    delete_unlinking_replicas(session, node, Replica.node_id)


def _still_runs(session: Session, node: Node, live: int) -> str:
    """Why a node cannot be removed: the replicas it runs, and the maybes it holds till when.

    A maybe (a create whose outcome is unknown, :mod:`workers.replicas`) holds its slot
    until its deadline: waiting for that is all it takes.
    """
    maybes, until = session.execute(
        select(func.count(), func.max(Replica.deadline_at)).where(
            Replica.node_id == node.id, Replica.status == ReplicaState.MAYBE
        )
    ).one()
    runs = live - maybes
    if not maybes:
        return (
            f"node {node.name!r} still runs {runs} replica(s): drain it (`corral nodes drain "
            f"{node.name}`) and wait, or delete them first"
        )
    ends = "when the reaper next passes"
    if until is not None:
        left = max(0, math.ceil((until - now()).total_seconds()))
        ends = f"by {iso(until)} (in {left} s), when the reaper next passes"
    held = (
        f"{maybes} maybe(s) - creates whose outcome its agent cannot tell, holding their "
        f"slots until their deadline - which end {ends}"
    )
    if not runs:
        return f"node {node.name!r} runs no replica but holds {held}; remove it after that"
    return (
        f"node {node.name!r} still runs {runs} replica(s) and holds {held}: drain it "
        f"(`corral nodes drain {node.name}`) and wait, or delete them first"
    )


def probation(node: Node, settings: Settings) -> int | None:
    """Creates a batch may send ``node`` before one succeeds (None: not on probation).

    A node that never created a VM, or whose last creates failed, gets only as many
    as it may still fail before quarantine (at least one).
    """
    if node.last_create_ok_at is not None and node.create_failures == 0:
        return None
    return max(1, settings.node_failures - node.create_failures)


def note_creates(
    session: Session, settings: Settings, node_id: str, outcomes: list[str | None]
) -> str | None:
    """Record a batch's creates on one node (None: success, else the error), in order.

    Returns why the node was quarantined, if these outcomes quarantined it.
    """
    node = session.get(Node, node_id, with_for_update=True, populate_existing=True)
    if node is None or not outcomes:
        return None
    at = now()
    streak = node.create_failures
    for error in outcomes:
        streak = 0 if error is None else streak + 1
    node.create_failures = streak
    if any(error is None for error in outcomes):
        node.last_create_ok_at = at
    if streak == 0:
        node.quarantine_s = None
        node.quarantined_until = None
        return None
    last = next(error for error in reversed(outcomes) if error is not None)
    node.last_error = last[:1000]
    if streak < settings.node_failures or (
        node.quarantined_until is not None and node.quarantined_until > at
    ):
        return None
    backoff = (
        settings.node_quarantine_s
        if node.quarantine_s is None
        else min(settings.node_quarantine_max_s, node.quarantine_s * 2)
    )
    node.quarantine_s = backoff
    node.quarantined_until = at + timedelta(seconds=backoff)
    why = f"quarantined for {backoff:g}s after {streak} failed creates in a row: {last}"
    node.last_error = why[:1000]
    return why


def quarantine_view(node: Node) -> str | None:
    """Why placement skips ``node`` now (its quarantine), or None."""
    if node.quarantined_until is None or node.quarantined_until <= now():
        return None
    left = (node.quarantined_until - now()).total_seconds()
    return f"{left:.0f}s left of {node.quarantine_s or 0:g}s, {node.create_failures} failures"


class NodeView(TypedDict):
    """A node as the CLI and API show it."""

    id: str
    name: str
    kind: str
    address: str
    capacity: int
    live: int
    healthy: bool
    draining: bool
    misses: int
    last_seen_at: str | None
    last_error: str | None
    create_failures: int
    quarantined: str | None
    quarantined_until: str | None
    node_id: str | None
    credential: bool
    repointed: str | None
    replica_networks: list[str] | None
    resolved_from: NotRequired[str]  # ``nodes add`` given a host name: the name it resolved


def list_nodes(session: Session) -> list[Node]:
    """Every node, by name."""
    return list(session.scalars(select(Node).order_by(Node.name)))


def drain_node(session: Session, name: str, draining: bool = True) -> Node:
    """Stop (or with ``draining=False``, resume) placing replicas on the node ``name``."""
    node = get_node(session, name)
    node.draining = draining
    return node


def node_view(node: Node) -> NodeView:
    """A node as the CLI and API show it."""
    return {
        "id": node.id,
        "name": node.name,
        "kind": node.kind,
        "address": node.address,
        "capacity": node.capacity,
        "live": node.live,
        "healthy": node.healthy,
        "draining": node.draining,
        "misses": node.misses,
        "last_seen_at": iso(node.last_seen_at),
        "last_error": node.last_error,
        "create_failures": node.create_failures,
        "quarantined": quarantine_view(node),
        "quarantined_until": iso(node.quarantined_until),
        "node_id": node.external_id,
        # identity (workers.registry.identity): an issued credential, and the last re-point
        "credential": node.credential_hash is not None,
        "repointed": (
            f"from {node.repointed_from} at {iso(node.repointed_at)}"
            if node.repointed_at is not None
            else None
        ),
        # None: its kind's default (its own host; fcdaemon also CORRAL_REPLICA_NETWORKS)
        "replica_networks": node.replica_networks,
    }
