"""Maybes: a create whose outcome is unknown keeps its row while a replacement is placed at once.

The model
---------
A create sent to a node that cannot deduplicate it (an agent of the seed protocol, a
Lambdo host) and answered ambiguously - a deadline exceeded, a connection lost mid-call,
an UNAVAILABLE the agent may have acted on, a call cut by the task's time, an owner that
died after the call went out - may or may not have made a VM. Sending it again could make
a second VM; waiting for certainty would park the request. So its owner (or whoever takes
the row after the owner lapsed: :func:`workers.replicas.owners.take`) makes the row a
*maybe* (:func:`replace`):

* the row keeps its id, node slot and GPU grant (state Maybe, 240: the node may run a VM
  for it, so nothing over-commits) and is renamed (``<request id>~<row id>``); it no
  longer counts toward the function's replicas, and its operation no longer waits for it
  (``maybe_of`` remembers which operation it was made for: ``corral ops OP`` counts its
  maybes, :func:`workers.replicas.views.maybes_of`);
* a *replacement* - a new Creating row with the original request id, the operation's
  part and the count - is placed at once by placement's usual rules (the same node or
  another), and sent like any row. The count passes from the maybe to its replacement,
  so the function's max bounds the replicas corral serves and creates: never more than
  max, though for a maybe's lifetime a VM of it may run besides them. A request gets at
  most ``MAX_PLACEMENTS`` rows in all (moves and replacements); past that, or with no
  node to place it on, the maybe stays without a replacement, gives the count back and
  its part of the operation fails.

What the node says next settles a maybe, once (every path locks the row and checks it is
still a maybe):

* **Its VM shows up** - a READY for a vmid no row has, from the maybe's node, when no
  create on that node is still in flight that could own it
  (:func:`workers.replicas.reports.ready_of_maybe`), or a late answer to the create
  itself: :func:`settle_vm` *adopts* it as an ordinary replica of the function when its
  address is known (the create's answer, or a READY sent by the guest from its own IP
  on a ``--replica-network`` of the node) and the function wants one more (below its
  target and max); otherwise the maybe ends Deleted with the vmid, and the VM is
  released.
* **No READY in time** - on a node whose guests report READY (:func:`reports_ready`: the
  function's readiness is ``guest``, or the registry has seen a READY from a recorded
  replica of the node, ``nodes.ready_seen_at``) a maybe's deadline is
  ``CORRAL_CREATE_TIMEOUT_S + CORRAL_READY_GRACE_S`` after it was made (shortened when
  a node is first seen to report: :func:`note_ready_node`); elsewhere it is
  ``CORRAL_CREATING_DEADLINE_S``. The reaper ends it Dead then, giving its slot back once.

The operation finishes when its replicas do, not when its maybes do.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.clock import now
from workers.errors import CapacityError
from workers.fleet.placement import free_node, reserve_gpu, reserve_node
from workers.operations import settle
from workers.replicas.lifecycle import deadline_for, lock_replica, transition
from workers.replicas.owners import Pending, owns
from workers.store.db import Database
from workers.store.models import LIVE_STATES, Function, Node, Replica, ReplicaState, new_id

log = logging.getLogger(__name__)

MARK = "~"  # a maybe's request id: the original, this, its row id
MAX_REQUEST_ID = 128  # replicas.request_id


def maybe_request_id(request_id: str, replica_id: str) -> str:
    """The request id a maybe goes by, freeing the original for its replacement."""
    return f"{request_id[: MAX_REQUEST_ID - len(MARK) - len(replica_id)]}{MARK}{replica_id}"


def reports_ready(node: Node, fn: Function) -> bool:
    """Whether a VM of ``fn`` made on ``node`` is known to say READY when it boots."""
    return fn.readiness == "guest" or node.ready_seen_at is not None


def ready_window(settings: Settings) -> timedelta:
    """How long after a maybe is made its READY may still come (on a node that reports)."""
    return timedelta(seconds=settings.create_timeout_s + settings.ready_grace_s)


def _deadline(settings: Settings, node: Node, fn: Function, at: datetime) -> datetime:
    if reports_ready(node, fn):
        return at + ready_window(settings)
    return at + timedelta(seconds=settings.creating_deadline_s)


def replace(  # noqa: PLR0913 - one row's replacement, its cap by name
    s: Session,
    settings: Settings,
    p: Pending,
    token: str,
    why: str,
    *,
    max_placements: int,
) -> str:
    """Make a row this handler owns, sent with an unknown outcome, a maybe; place its replacement.

    The caller holds the locks of a move (:func:`workers.replicas.moves.lock_for_moves`).
    Returns ``replaced`` (a new Creating row has the request id, unowned, to be sent),
    ``maybe`` (no replacement: the request's part failed) or ``lost`` (not this handler's
    row on that node any more: nothing changed).
    """
    replica = lock_replica(s, p.replica_id)
    if replica is None or not owns(replica, token, p.node.id):
        return "lost"
    fn = replica.function
    at = now()
    request_id, op_id = replica.request_id, replica.operation_id
    replica.status = ReplicaState.MAYBE
    replica.request_id = maybe_request_id(request_id, replica.id)
    replica.operation_id = None
    replica.maybe_of = op_id
    replica.owner = replica.owner_until = None
    replica.sent_at = replica.sent_at or at
    replica.deadline_at = _deadline(settings, p.node, fn, at)
    replica.error = f"maybe: its create on {p.node.name} went out, outcome unknown ({why})"
    s.flush()  # the request id is free for the replacement
    log.warning("replica %s on %s is a maybe: %s", replica.id, p.node.name, why)
    if replica.placements >= max_placements:
        return _unreplaced(s, replica, op_id, f"tried {replica.placements} times")
    try:
        node = reserve_node(s, fn, fn.placement or settings.placement)
    except CapacityError as exc:
        return _unreplaced(s, replica, op_id, f"no node for a replacement: {exc}")
    row = Replica(
        id=new_id(),
        request_id=request_id,
        function_id=fn.id,
        operation_id=op_id,
        status=ReplicaState.CREATING,
        build_version=fn.build_version,
        envs_total=fn.exec_envs,
        deadline_at=deadline_for(ReplicaState.CREATING, settings, at),
        node_id=node.id,
        placements=replica.placements + 1,
    )
    if fn.gpu_mem_mb:
        try:
            grant = reserve_gpu(s, fn, settings.gpu_fit)
        except CapacityError as exc:
            free_node(s, node.id)
            return _unreplaced(s, replica, op_id, f"no GPU for a replacement: {exc}")
        row.gpu_id, row.gpu_slot, row.gpu_mem_mb = grant.gpu_id, grant.slot, grant.mem_mb
    s.add(row)
    s.flush()
    replica.error += f"; replaced by {row.id} on {node.name}"
    return "replaced"


def _unreplaced(s: Session, replica: Replica, op_id: str | None, why: str) -> str:
    """A maybe with no replacement: the count goes back, the request's part fails."""
    s.execute(
        update(Function)
        .where(Function.id == replica.function_id)
        .values(replica_count=Function.replica_count - 1, updated_at=Function.updated_at)
        .execution_options(synchronize_session=False)
    )
    replica.error = f"{replica.error}; not replaced ({why})"
    s.flush()
    if op_id:
        settle(s, op_id, parts=[replica.id], ok=False, error=replica.error)
    return "maybe"


def settle_vm(
    db: Database, settings: Settings, replica_id: str, vmid: str, address: str | None
) -> bool | None:
    """A VM showed up for a maybe: adopt it (True), or end the maybe for its VM's release (False).

    Adopted when ``address`` (where the VM answers) is known and the function wants one
    more replica - below its target (or min) and its max; it is then an ordinary Idle
    replica. Otherwise the maybe ends Deleted with ``vmid``, giving its slot back, and
    the caller releases the VM. When the row is no longer a maybe (settled already): True
    if it holds this VM as a replica (adopted before), else None (it is not this row's).
    """
    with db.transaction() as s:
        maybe = lock_replica(s, replica_id)
        if maybe is None or maybe.status != ReplicaState.MAYBE:
            held = maybe is not None and maybe.vmid == vmid and maybe.status in LIVE_STATES
            return True if held else None
        if s.scalar(select(Replica.id).where(Replica.vmid == vmid).limit(1)) is not None:
            return None  # another row's VM (recorded since the caller looked)
        maybe.vmid = vmid
        if address is not None and _count_one_more(s, maybe.function_id):
            maybe.address = address
            maybe.error = None
            transition(s, maybe, ReplicaState.IDLE, settings)
            log.info("maybe %s: its VM %s showed up and is adopted", maybe.id, vmid)
            return True
        transition(
            s,
            maybe,
            ReplicaState.DELETED,
            settings,
            error=f"maybe: its VM {vmid} showed up after its replacement; released",
        )
        log.info("maybe %s: its VM %s showed up; releasing it (replaced)", maybe.id, vmid)
        return False


def _count_one_more(s: Session, function_id: str) -> bool:
    """Count one more replica of the function if it wants one (below its target and max).

    The function row is locked after the replica's: the single-replica order of
    :mod:`workers.locks`.
    """
    row = s.execute(
        select(
            Function.replica_count, Function.target, Function.min_replicas, Function.max_replicas
        )
        .where(Function.id == function_id)
        .with_for_update(key_share=True)
    ).one_or_none()
    if row is None or row.target is None:
        return False
    if row.replica_count >= min(max(row.target, row.min_replicas), row.max_replicas):
        return False
    s.execute(
        update(Function)
        .where(Function.id == function_id)
        .values(replica_count=Function.replica_count + 1, updated_at=Function.updated_at)
        .execution_options(synchronize_session=False)
    )
    return True


def note_ready_node(s: Session, settings: Settings, node_id: str) -> None:
    """A node's guest said READY for the first time: its maybes wait no longer than READY would."""
    at = now()
    first = s.connection().execute(
        update(Node)
        .where(Node.id == node_id, Node.ready_seen_at.is_(None))
        .values(ready_seen_at=at)
        .execution_options(synchronize_session=False)
    )
    if first.rowcount != 1:
        return
    until = at + ready_window(settings)
    s.execute(
        update(Replica)
        .where(
            Replica.node_id == node_id,
            Replica.status == int(ReplicaState.MAYBE),
            Replica.deadline_at > until,
        )
        .values(deadline_at=until)
        .execution_options(synchronize_session=False)
    )
