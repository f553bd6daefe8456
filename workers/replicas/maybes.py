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
  for it, so nothing over-commits) and is renamed (``<request id>~<row id>``); the move
  from Creating to Maybe (:mod:`workers.store.states`) gives its count back and hands
  its operation on: the operation no longer waits for it (``maybe_of`` remembers which
  operation it was made for: ``corral ops OP`` counts its maybes,
  :func:`workers.replicas.views.maybes_of`);
* a *replacement* - a new Creating row with the original request id, the operation's
  part and the count - is placed at once by placement's usual rules (the same node or
  another), counted in the same transaction, and sent like any row. The count passes
  from the maybe to its replacement, so the function's max bounds the replicas corral
  serves and creates: never more than max, though for a maybe's lifetime a VM of it may
  run besides them. A request gets at most ``MAX_PLACEMENTS`` rows in all (moves and
  replacements); past that, or with no node to place it on (a full node: the maybe
  holds a slot itself), the maybe stays without a replacement (its count given back)
  and **keeps its part of the operation open**: the operation waits on the maybe
  itself (``operation_id`` stays), until its VM shows up or its deadline passes.

What the node says next settles a maybe, once (every path locks the row and checks it is
still a maybe):

* **Its VM shows up** - a READY for a vmid no row has, from the maybe's node, when no
  create on that node is still in flight that could own it
  (:func:`workers.replicas.reports.ready_of_maybe`), or a late answer to the create
  itself: :func:`settle_vm` *adopts* it as an ordinary replica of the function when its
  address is known (the create's answer, or a READY sent by the guest from its own IP
  on a ``--replica-network`` of the node) and it is still wanted: its operation waits on
  it (a maybe with no replacement), or the function is below its target; never above
  its max. Otherwise the maybe ends Deleted with the vmid, and the VM is released (a part
  its operation still waited on then fails, with why).
* **No READY in time** - on a node whose guests report READY (:func:`reports_ready`: the
  function's readiness is ``guest``, or the registry has seen a READY from a recorded
  replica of the node, ``nodes.ready_seen_at``) a maybe's deadline is
  ``CORRAL_CREATE_TIMEOUT_S + CORRAL_READY_GRACE_S`` after it was made (shortened when
  a node is first seen to report: :func:`note_ready_node`); elsewhere it is
  ``CORRAL_CREATING_DEADLINE_S``. The reaper ends it Dead then, giving its slot back once
  (and failing the part its operation waited on it for, if any).

The operation finishes when its replicas do, not when its maybes do - except a maybe
without a replacement, which is the replica its operation waits for.
"""

from __future__ import annotations

import enum
import logging

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.errors import CapacityError
from workers.fleet.placement import free_node, reserve_gpu, reserve_node
from workers.operations import settle
from workers.replicas.lifecycle import born, lock_replica, ready_window, recount, transition
from workers.replicas.orphans import note as note_orphan
from workers.replicas.owners import Pending, owns
from workers.store.db import Database
from workers.store.models import (
    LIVE_STATES,
    OP_OPEN,
    Function,
    Node,
    Operation,
    Replica,
    ReplicaState,
)
from workers.store.states import move

log = logging.getLogger(__name__)

MARK = "~"  # a maybe's request id: the original, this, its row id
MAX_REQUEST_ID = 128  # replicas.request_id


class Replaced(enum.Enum):
    """What :func:`replace` did to a row."""

    REPLACED = "replaced"  # a maybe; a new Creating row has the request id, unowned, to send
    UNREPLACED = "not replaced"  # a maybe with no replacement: the request's part failed
    LOST = "lost"  # not this handler's row on that node any more: nothing changed


class Settled(enum.Enum):
    """What a VM that showed up did to a maybe (:func:`settle_vm`)."""

    ADOPTED = "adopted"  # an ordinary replica now (or adopted before)
    RELEASED = "released"  # the maybe ended Deleted: the caller releases the VM
    NOT_OURS = "not ours"  # not this row's VM (settled otherwise, or another row has it)


def maybe_request_id(request_id: str, replica_id: str) -> str:
    """The request id a maybe goes by, freeing the original for its replacement."""
    return f"{request_id[: MAX_REQUEST_ID - len(MARK) - len(replica_id)]}{MARK}{replica_id}"


def reports_ready(node: Node, fn: Function) -> bool:
    """Whether a VM of ``fn`` made on ``node`` is known to say READY when it boots."""
    return fn.readiness == "guest" or node.ready_seen_at is not None


def replace(  # noqa: PLR0913 - one row's replacement, its cap by name
    s: Session,
    settings: Settings,
    p: Pending,
    token: str,
    why: str,
    *,
    max_placements: int,
) -> Replaced:
    """Make a row this handler owns, sent with an unknown outcome, a maybe; place its replacement.

    The caller holds the locks of a move (:func:`workers.replicas.moves.lock_for_moves`).
    The move to Maybe gives the count back and hands the operation on (``maybe_of``); the
    replacement is counted again and waited on by that operation.
    """
    replica = lock_replica(s, p.replica_id)
    if replica is None or not owns(replica, token, p.node.id):
        return Replaced.LOST
    fn = replica.function
    request_id, op_id = replica.request_id, replica.operation_id
    replica.request_id = maybe_request_id(request_id, replica.id)
    replica.sent_at = replica.sent_at or now()
    transition(  # flushes: the request id is free for the replacement
        s,
        replica,
        ReplicaState.MAYBE,
        settings,
        error=f"maybe: its create on {p.node.name} went out, outcome unknown ({why})",
        reports_ready=reports_ready(p.node, fn),
    )
    log.warning("replica %s on %s is a maybe: %s", replica.id, p.node.name, why)
    if replica.placements >= max_placements:
        return _unreplaced(s, replica, op_id, f"tried {replica.placements} times")
    try:
        node = reserve_node(s, fn, fn.placement or settings.placement)
    except CapacityError as exc:
        return _unreplaced(s, replica, op_id, f"no node for a replacement: {exc}")
    row = Replica(
        request_id=request_id,
        function_id=fn.id,
        operation_id=op_id,
        build_version=fn.build_version,
        envs_total=fn.exec_envs,
        node_id=node.id,
        placements=replica.placements + 1,
        **born(ReplicaState.CREATING, settings, now()),
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
    recount(s, {fn.id: move(None, ReplicaState.CREATING).count})
    replica.error = f"{replica.error}; replaced by {row.id} on {node.name}"
    return Replaced.REPLACED


def _unreplaced(s: Session, replica: Replica, op_id: str | None, why: str) -> Replaced:
    """A maybe with no replacement: its operation waits on it until its VM shows up or its
    deadline passes (its count went with the move; adopting it counts it again)."""
    replica.error = f"{replica.error}; not replaced ({why})"
    replica.operation_id = op_id  # the part stays open: settled when the maybe settles
    s.flush()
    return Replaced.UNREPLACED


def settle_vm(
    db: Database, settings: Settings, replica_id: str, vmid: str, address: str | None
) -> Settled:
    """A VM showed up for a maybe: adopt it, or end the maybe for its VM's release.

    Adopted when ``address`` (where the VM answers) is known and the VM is wanted - its
    operation waits on the maybe, or the function is below its target (or min) - and the
    function is below its max; it is then an ordinary Idle replica, counted again (and
    the part its operation waited on is done). Otherwise the maybe ends Deleted with
    ``vmid``, giving its slot back (a part its operation waited on fails), and the
    caller releases the VM. When the row is no longer a maybe (settled already): adopted
    if it holds this VM as a replica, else not ours.
    """
    with db.transaction() as s:
        maybe = lock_replica(s, replica_id)
        if maybe is None or maybe.status != ReplicaState.MAYBE:
            held = maybe is not None and maybe.vmid == vmid and maybe.status in LIVE_STATES
            return Settled.ADOPTED if held else Settled.NOT_OURS
        held_by = s.scalar(
            select(Replica.id)
            .where(Replica.vmid == vmid)
            .limit(1)  # pragma: no mutate - None or 2: scalar() reads the first row alone
        )
        if held_by is not None:
            return Settled.NOT_OURS  # another row's VM (recorded since the caller looked)
        maybe.vmid = vmid
        wanted = _wanted(s, maybe)
        if address is not None and wanted:
            maybe.address = address
            maybe.error = None
            transition(s, maybe, ReplicaState.IDLE, settings)
            log.info("maybe %s: its VM %s showed up and is adopted", maybe.id, vmid)
            return Settled.ADOPTED
        why = (
            "where it answers is unknown (its agent reported it)"
            if wanted
            else "after its replacement, or with the function at its max"
        )
        # what made it a maybe stays: a deadline's cost is told from a kill's
        error = f"maybe: its VM {vmid} showed up {why}; released (it was a {maybe.error})"
        if maybe.operation_id:  # the part its operation waited on it for fails
            settle(
                s,
                maybe.operation_id,
                parts=[maybe.id],
                ok=False,  # pragma: no mutate - None: read as false, the same
                error=error,
            )
            # (not mutated: '' reads as no operation too, and the move clears it)
            maybe.operation_id = None  # pragma: no mutate
        # (not mutated: Deleted has no deadline and no idle clock: the settings are not read)
        transition(s, maybe, ReplicaState.DELETED, settings, error=error)  # pragma: no mutate
        if maybe.node_id is not None:  # kept until released (workers.replicas.orphans)
            note_orphan(s, settings, maybe.node_id, vmid)
        log.info("maybe %s: its VM %s showed up %s; releasing it", maybe.id, vmid, why)
        return Settled.RELEASED


def _wanted(s: Session, maybe: Replica) -> bool:
    """Whether a maybe's VM is wanted as a replica: its operation waits on it, or the
    function is below its target (or min); and the function is below its max.

    The function row is locked after the replica's: the single-replica order of
    :mod:`workers.locks`; the move to Idle then counts it.
    """
    row = s.execute(
        select(
            Function.replica_count, Function.target, Function.min_replicas, Function.max_replicas
        )
        .where(Function.id == maybe.function_id)
        .with_for_update(key_share=True)
    ).one_or_none()
    if row is None or row.replica_count >= row.max_replicas:
        return False
    if maybe.operation_id is not None:
        waiting = s.scalar(select(Operation.status).where(Operation.id == maybe.operation_id))
        if waiting in OP_OPEN:
            return True
    return row.target is not None and row.replica_count < max(row.target, row.min_replicas)


def note_ready_node(s: Session, settings: Settings, node_id: str) -> None:
    """A node's guest said READY for the first time: its maybes wait no longer than READY would."""
    at = now()
    first = s.connection().execute(
        update(Node)
        .where(Node.id == node_id, Node.ready_seen_at.is_(None))
        .values(ready_seen_at=at)
        .execution_options(synchronize_session=False)  # pragma: no mutate - None: same
    )
    if first.rowcount != 1:
        return
    until = at + ready_window(settings)
    s.execute(
        update(Replica)
        .where(
            Replica.node_id == node_id,
            Replica.status == int(ReplicaState.MAYBE),
            Replica.deadline_at > until,  # pragma: no mutate - '>=': set to what it is
        )
        .values(deadline_at=until)
        .execution_options(synchronize_session=False)  # pragma: no mutate - None: same
    )
