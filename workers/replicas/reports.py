"""Guest reports: who may report on a VM, and READYs that arrive before their VM is recorded.

A guest (or its node agent) tells the registry ``UpdateStatus(vmid, READY)`` when the
function answers. Two rules keep those reports honest and cheap:

* **Who.** Where the reporting peer's IP is known, a report about a vmid counts only
  if it comes from that replica's IP or its node's IP (:func:`peer_allowed`); any other
  peer is refused, so a caller holding the registry token still cannot mark someone
  else's VM ready or finished.
* **Early READY.** A READY can beat the agent's CreateReply to corral: the VM runs but
  no row has its vmid yet. The registry does not hold a thread waiting for the row. It
  remembers the report as a lease ``ready:<vmid>`` (:func:`remember`; holder: the
  reporting IP, expiry: ``CORRAL_CREATE_TIMEOUT_S + CORRAL_READY_GRACE_S``) and answers
  at once. Whatever records the VM calls :func:`apply_early_reports` in the same
  transaction; a remembered READY then moves the Starting replica to Idle. A VM
  recorded between the registry's look-up and its write is caught by the registry's
  own sweep (:func:`apply_reports` on the vmids it remembered), so no READY is lost.
* **Maybes.** A READY for a vmid no row has may be the VM of a *maybe* (a create whose
  answer never reached corral, on an agent that cannot tell which request a VM was for:
  :mod:`workers.replicas.maybes`). :func:`ready_of_maybe` settles one with it as soon as
  nothing else can claim the vmid: the reporter speaks for exactly one node with maybes,
  and no create on it is still in flight. The registry tries at the READY and again at
  each sweep while the report is remembered.
* **Orphans.** A READY that no spawn recorded and no maybe took in time is an orphan VM:
  :func:`orphans` ends the remembered report with a tombstone (``gone:<vmid>``, which
  :func:`~workers.replicas.lifecycle.arrive` honours, so no late answer can still record
  it) and names the nodes behind the reporting IP, whose VM the registry then has
  released.

Where a READY comes from: a report is *behind* a node when its IP is the node's host, or
lies in one of the node's configured replica networks (``--replica-network``); a guest's
own READY (an IP other than its node's) gives its address as well, which adopting a
maybe's VM needs.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Select, delete, select
from sqlalchemy.orm import Session

from config.settings import Settings
from netplumb.addresses import host_of, ip_literal
from workers import backends
from workers.backends import inflight
from workers.backends.networks import replica_address
from workers.base.clock import now
from workers.base.errors import BackendError
from workers.base.untrusted import parse_networks
from workers.leases import MAX_HOLDER, keyed_name, take
from workers.observability import stages
from workers.replicas import maybes
from workers.replicas.lifecycle import TOMBSTONE, tombstone_name, transition
from workers.replicas.notices import Readied
from workers.replicas.orphans import note as note_orphan
from workers.store.db import Database
from workers.store.models import LIVE_STATES, Function, Lease, Node, Replica, ReplicaState

log = logging.getLogger(__name__)

PREFIX = "ready:"
UNKNOWN_PEER = "-"


def lease_name(vmid: str) -> str:
    """The lease that remembers an early READY for ``vmid`` (hashed when the id is long)."""
    return keyed_name(PREFIX, vmid)


def address_ips(address: str | None) -> set[str]:
    """The IP of the host in a node's or replica's address (``h:p``, a URL), as a set.

    A host name is never resolved (it could later stand for another machine): it has none.
    """
    literal = ip_literal(host_of(address or ""))
    return set() if literal is None else {literal}


def peer_allowed(peer: str | None, replica: Replica, *, node_too: bool = True) -> bool:
    """True if ``peer`` (an IP, or None when unknown) may report on ``replica``.

    The replica's own IP may; with ``node_too`` (READY, which the agent sends) its
    node's IP may as well.
    """
    if not peer:
        return True
    allowed = address_ips(replica.address)
    if node_too and replica.node is not None:
        allowed |= address_ips(replica.node.address)
    return peer in allowed


def remember(db: Database, settings: Settings, vmid: str, peer: str | None) -> bool:
    """Store an early READY for ``vmid``; False if another peer's report is already stored."""
    ttl = settings.create_timeout_s + settings.ready_grace_s
    with db.transaction() as s:
        return take(s, lease_name(vmid), _holder(peer, vmid), ttl)


def _holder(peer: str | None, vmid: str) -> str:
    """What an early READY's lease holds: who reported it, and the vmid (the name may be a hash).

    A vmid too long to keep there is kept as its name's hash: such a report is never
    turned into an orphan release (its VM cannot be named).
    """
    holder = f"{peer or UNKNOWN_PEER}|{vmid}"
    return holder if len(holder) <= MAX_HOLDER else f"{peer or UNKNOWN_PEER}"


def apply_early_reports(
    session: Session,
    settings: Settings,
    vmids: Iterable[str],
    readied: Readied | None = None,
) -> set[str]:
    """Apply the remembered READYs of just-recorded ``vmids`` (Starting -> Idle); those applied.

    Their functions, and each one's ``ready`` stage if its operation timed it, go to
    ``readied``, for the caller to tell once the transaction has committed.
    """
    names = {lease_name(v): v for v in vmids}
    if not names:
        return set()
    rows = session.execute(
        select(Lease.name, Lease.holder).where(Lease.name.in_(names), Lease.expires_at > now())
    ).all()
    applied: set[str] = set()
    for name, holder in rows:
        vmid = names[name]
        replica = session.scalars(
            select(Replica).where(Replica.vmid == vmid).with_for_update(of=Replica)
        ).first()
        if replica is None:
            continue  # not recorded yet: the report keeps waiting
        session.execute(delete(Lease).where(Lease.name == name))
        reporter = holder.partition("|")[0]
        peer = None if reporter == UNKNOWN_PEER else reporter
        if not peer_allowed(peer, replica):
            log.warning(
                "early READY for %s came from %s, not its replica or node: ignored", vmid, peer
            )
            continue
        note_ready(session, settings, replica)
        if replica.status != ReplicaState.STARTING:
            continue
        if readied is not None:
            readied.functions.add(replica.function.name)
            got = stages.ready(session, replica, early=True)
            if got is not None:
                readied.stages.append(got)
        transition(session, replica, ReplicaState.IDLE, settings)
        applied.add(vmid)
    if applied:
        log.info("applied %d early READY report(s)", len(applied))
    return applied


def apply_reports(db: Database, settings: Settings, vmids: Iterable[str]) -> set[str]:
    """Apply remembered READYs whose VM is now recorded; the vmids still waiting."""
    vmids = list(vmids)
    if not vmids:
        return set()
    readied = Readied()
    with db.transaction() as s:
        apply_early_reports(s, settings, vmids, readied)
        names = {lease_name(v): v for v in vmids}
        left = s.scalars(
            select(Lease.name).where(Lease.name.in_(names), Lease.expires_at > now())
        ).all()
    readied.tell(settings)
    return {names[n] for n in left}


@dataclass(frozen=True)
class Orphan:
    """A VM that said READY and that no replica took: where to release it."""

    vmid: str
    node_ids: list[str]  # the nodes behind the IP that reported it


def orphans(db: Database, settings: Settings, at: datetime | None = None) -> list[Orphan]:
    """End the early READYs nobody recorded in time; the orphan VMs to release.

    Each becomes a tombstone, so a create answered even later records nothing; a READY
    whose VM a row took meanwhile is simply forgotten. Old tombstones are dropped.
    """
    at = at or now()
    out: list[Orphan] = []
    with db.transaction() as s:
        expired = s.execute(
            delete(Lease)
            .where(Lease.name.startswith(PREFIX), Lease.expires_at <= at)
            .returning(Lease.name, Lease.holder)
        ).all()
        s.execute(delete(Lease).where(Lease.name.startswith(TOMBSTONE), Lease.expires_at <= at))
        if not expired:
            return out
        vmids = {
            row.holder.partition("|")[2]: row.holder.partition("|")[0]
            for row in expired
            if "|" in row.holder
        }
        taken = set(s.scalars(select(Replica.vmid).where(Replica.vmid.in_(list(vmids)))))
        nodes = s.execute(select(Node.id, Node.address)).all()
        keep = timedelta(seconds=settings.task_time_limit_s + settings.call_timeout_s)
        for vmid, peer in vmids.items():
            if vmid in taken:
                continue
            take(s, tombstone_name(vmid), "orphan", keep.total_seconds())
            behind = [
                nid
                for nid, address in nodes
                if peer != UNKNOWN_PEER and peer in address_ips(address)
            ]
            for node_id in behind:  # kept until released (workers.replicas.orphans)
                note_orphan(s, settings, node_id, vmid)
            out.append(Orphan(vmid, behind))
            log.warning(
                "VM %s said READY from %s and no replica took it within %gs: an "
                "orphan; releasing it on %s",
                vmid,
                peer,
                settings.create_timeout_s + settings.ready_grace_s,
                ", ".join(behind) or "no node (unknown reporter)",
            )
    return out


def live_replica(db: Database, vmid: str) -> str | None:
    """The live replica whose VM is ``vmid``, if a row has it."""
    with db.read() as s:
        return s.scalar(
            select(Replica.id).where(Replica.vmid == vmid, Replica.status.in_(LIVE_STATES))
        )


def creates_unrecorded(db: Database) -> bool:
    """Whether some VM may yet show up for a row: a create in flight, or a maybe."""
    unrecorded = (ReplicaState.CREATING, ReplicaState.MAYBE)
    with db.read() as s:
        found = s.scalar(
            select(Replica.id)
            .where(Replica.status.in_(unrecorded), Replica.vmid.is_(None))
            .limit(1)
        )
    return found is not None


def behind(node: Node, peer: str) -> bool:
    """Whether a report from ``peer`` (an IP) speaks for ``node``: its host, or its networks."""
    if peer in address_ips(node.address):
        return True
    try:
        nets = parse_networks(node.replica_networks or [])
    except ValueError:
        return False
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(ip in net for net in nets)


_ANY_MAYBE = select(Replica.id).where(Replica.status == int(ReplicaState.MAYBE)).limit(1)


def ready_of_maybe(
    db: Database,
    settings: Settings,
    vmid: str,
    peer: str | None,
    release: Callable[[str, str], None],
) -> bool | None:
    """Settle a maybe with a READY for ``vmid`` (no row has it), when it can only be the maybe's.

    ``peer`` must speak for exactly one node with maybes (:func:`behind`), and no create
    on the nodes behind it may still be in flight (marked sent, unanswered: its answer
    may yet name this vmid). That node's oldest maybe then takes the VM
    (:func:`workers.replicas.maybes.settle_vm`): adopted when the READY came from the
    guest's own IP and the function wants one more replica (True), else ended and its
    VM handed to ``release(node id, vmid)`` (False). None: not now (the caller
    remembers the READY and asks again).
    """
    if not peer or peer == UNKNOWN_PEER:
        return None
    with db.read() as s:
        if s.scalar(_ANY_MAYBE) is None:
            return None
        nodes = [n for n in s.scalars(select(Node)) if behind(n, peer)]
        ids = [n.id for n in nodes]
        # In this order: a create recorded after the first read is seen by the second.
        if not ids or s.scalar(_in_flight(ids)) is not None or _recorded(s, vmid):
            return None
        found = s.execute(
            select(Replica.id, Replica.node_id, Function)
            .join(Function, Function.id == Replica.function_id)
            .where(Replica.status == int(ReplicaState.MAYBE), Replica.node_id.in_(ids))
            .order_by(Replica.sent_at, Replica.id)
        ).all()
    if not found or len({row[1] for row in found}) != 1:
        return None  # none, or maybes on several nodes behind one IP: cannot tell whose
    replica_id, node_id, fn = found[0]
    node = next(n for n in nodes if n.id == node_id)
    address = _guest_address(settings, node, fn, peer)
    settled = maybes.settle_vm(db, settings, replica_id, vmid, address)
    if settled == maybes.Settled.RELEASED:
        release(node.id, vmid)  # also when the reporting agent acts on DESTROY itself
    return {maybes.Settled.ADOPTED: True, maybes.Settled.RELEASED: False}.get(settled)


def _recorded(s: Session, vmid: str) -> bool:
    """Whether a row has this vmid (its READY is that replica's, not a maybe's)."""
    return s.scalar(select(Replica.id).where(Replica.vmid == vmid).limit(1)) is not None


def _in_flight(node_ids: list[str]) -> Select[str]:
    """A create on these nodes that went out and is not answered yet (one, if any)."""
    return (
        select(Replica.id)
        .where(
            Replica.node_id.in_(node_ids),
            Replica.status == int(ReplicaState.CREATING),
            Replica.sent_at.is_not(None),
            Replica.vmid.is_(None),
        )
        .limit(1)
    )


def _guest_address(settings: Settings, node: Node, fn: Function, peer: str) -> str | None:
    """The address of a VM whose guest said READY from ``peer``; None if the agent said it."""
    if peer in address_ips(node.address):
        return None  # the node's agent reported: where the VM answers is not known
    try:
        return inflight.run(
            replica_address(backends.target(node), peer, backends.guest_port(fn), settings)
        )
    except BackendError as exc:
        log.warning("READY from %s cannot be its VM's address: %s", peer, exc)
        return None


def note_ready(s: Session, settings: Settings, replica: Replica) -> None:
    """A recorded replica's READY: its node is one whose guests report (once per node)."""
    node = replica.node
    if node is not None and node.ready_seen_at is None:
        maybes.note_ready_node(s, settings, node.id)
