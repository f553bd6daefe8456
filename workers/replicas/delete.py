"""Deleting replicas: mark them Deleting, release their VMs at once, retire the rows.

A delete is split at the network call like every other job, a batch of up to
:data:`~workers.replicas.plan.DELETE_BATCH` replicas at a time (:func:`delete_batch`):

1. :func:`begin_deletes` marks the replicas Deleting in one transaction, so no claim can
   take them and no other pass picks them; a replica already gone is a delete that
   succeeded;
2. :func:`release_all` tears their VMs down at once, bounded per node and per process
   (:mod:`workers.replicas.calls`: inside the task's time, cut cleanly by its soft time
   limit); a VM the node no longer has counts as released;
3. :func:`finish_deletes` retires the rows in one transaction: Deleted, or Dead with the
   error that stopped the release.

A release the node never got (its retries ran out on transport errors) is not given up
where nothing else would find the VM: on a node that cannot list its VMs, or has not
said it can (:func:`release_waits` - an agent of the seed protocol: reconcile cannot see
its orphans, and its guest said READY long ago), the row stays Deleting, holding the
slot its VM does hold, and the reaper's stuck sweep releases it once the node answers
(:func:`wait_for_node`; the delete's operation fails now, saying so). Elsewhere the row
ends Dead and reconcile destroys the VM as an orphan.

A release is safe to send twice (the second hears "already gone"), so two handlers of one
delete need no owner; what must not happen twice is the counting: each replica settles its
operation once (:func:`workers.operations.settle`'s parts), however many deliveries or
paths reach it. A transport error sends that replica alone to ``delete_replica``, retried
with backoff; a release the soft time limit cut off leaves its row Deleting for another
``delete_batch`` (or the reaper's stuck sweep) to finish.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, lazyload

from config.settings import Settings
from workers import backends
from workers.backends import inflight
from workers.base.errors import (
    BackendError,
    InputError,
    NotFound,
    PermanentBackendError,
    TransientBackendError,
)
from workers.fleet.health import note_failure
from workers.operations import settle
from workers.replicas import calls, orphans
from workers.replicas.lifecycle import lock_replica, retire_deleting, transition
from workers.replicas.owners import Budget
from workers.store.db import Database
from workers.store.models import FINAL_STATES, LIVE_STATES, Node, Replica, ReplicaState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Doomed:
    """A replica being deleted: where its VM is, if it has one yet."""

    replica_id: str
    vmid: str | None
    node: Node | None


#: A release's outcome: True (released), False (no VM, or already gone), the error, or
#: None when it was not done (cut off or never sent: the row stays Deleting).
Released = bool | BackendError | None


@dataclass
class Deleted:
    """What a delete batch came to, and what it leaves for other tasks."""

    done: int = 0  # rows retired (Deleted, or Dead with an error)
    retry: list[str] = field(default_factory=list)  # transport errors: alone, with backoff
    rest: list[str] = field(default_factory=list)  # not released in time: another batch


def _begin_delete(
    s: Session, settings: Settings, replica_id: str, op_id: str | None
) -> Doomed | None:
    replica = lock_replica(s, replica_id)
    if replica is None:
        raise NotFound(f"unknown replica {replica_id!r}")
    if replica.status in FINAL_STATES:
        if op_id:
            settle(s, op_id, parts=[replica.id], ok=True)  # counted once, however reached
        return None
    if replica.status != ReplicaState.DELETING:
        waiting = replica.operation_id
        replica.operation_id = op_id
        transition(s, replica, ReplicaState.DELETING, settings)
        if waiting and waiting != op_id:
            # A Creating or Starting replica is still owed to its spawn: that part
            # of the spawn fails now, or the spawn would wait for it for good.
            settle(
                s,
                waiting,
                parts=[replica.id],
                ok=False,
                error=f"replica {replica.id} was deleted before it was ready",
            )
    elif op_id and replica.operation_id not in (None, op_id):
        settle(s, op_id, parts=[replica.id], ok=True)  # another operation is deleting it
    return Doomed(replica.id, replica.vmid, replica.node)


def begin_delete(
    db: Database, settings: Settings, replica_id: str, op_id: str | None = None
) -> Doomed | None:
    """Mark a replica Deleting; None when it is already gone (a delete that succeeds)."""
    with db.transaction() as s:
        return _begin_delete(s, settings, replica_id, op_id)


def begin_deletes(
    db: Database, settings: Settings, replica_ids: Sequence[str], op_id: str | None = None
) -> list[Doomed]:
    """Mark replicas Deleting in one transaction; those already gone are left out."""
    out = []
    with db.transaction() as s:
        rows = s.scalars(
            select(Replica)
            .options(lazyload(Replica.gpu))
            .where(Replica.id.in_(list(replica_ids)))
            .with_for_update(of=Replica)
        ).all()
        found = {r.id: r for r in rows}
        gone = [rid for rid in replica_ids if rid not in found]
        if op_id and gone:  # a row that is gone is a delete that succeeded
            settle(s, op_id, parts=gone, ok=True)
        for replica_id in replica_ids:
            replica = found.get(replica_id)
            if replica is None:
                continue
            if replica.status == ReplicaState.DELETING and replica.operation_id in (None, op_id):
                out.append(Doomed(replica.id, replica.vmid, replica.node))  # marked by our plan
                continue
            doomed = _begin_delete(s, settings, replica_id, op_id)
            if doomed is not None:
                out.append(doomed)
    return out


def release_all(
    settings: Settings, doomed: Sequence[Doomed], budget: Budget | None = None
) -> dict[str, Released]:
    """Tear down the VMs of many replicas at once, bounded per node; the outcome of each.

    After ``CORRAL_NODE_FAILURES`` transport errors in a row from one node its other
    releases are not sent: they get the same error.
    """
    out: dict[str, Released] = {}
    work: dict[Hashable, list[tuple[str, backends.Target, str]]] = defaultdict(list)
    for d in doomed:
        if d.vmid is None or d.node is None:
            out[d.replica_id] = False
        else:
            work[d.node.id].append((d.replica_id, backends.target(d.node), d.vmid))
    if not work:
        return out

    def lane_of(node_id: Hashable) -> inflight.Lane:
        return inflight.Lane(
            node_id, bound=settings.node_max_inflight, stop_after=settings.node_failures
        )

    async def call(item: tuple[str, backends.Target, str]) -> bool:
        _, t, vmid = item
        try:
            return await backends.send_release(t, vmid, settings)
        except BackendError:
            raise
        except Exception as exc:  # a client bug must not take the batch down
            raise PermanentBackendError(
                f"ReleaseVMSetup failed: {type(exc).__name__}: {exc}", node=t.name
            ) from None

    ran = calls.run(
        settings,
        budget or Budget.of(settings),
        work,
        lane_of,
        call,
        failed=lambda e: isinstance(e, TransientBackendError),
    )
    for node_id, items in work.items():
        lane = ran.lanes.get(node_id)
        for item in items:
            result = ran.result(item)
            if result is None:
                err = lane.last_error if lane is not None and item in lane.untried else None
                out[item[0]] = err if isinstance(err, BackendError) else None
            elif result.error is not None:
                e = result.error
                out[item[0]] = e if isinstance(e, BackendError) else PermanentBackendError(str(e))
            else:
                out[item[0]] = bool(result.value)
    return out


def finish_deletes(db: Database, settings: Settings, errors: dict[str, str | None]) -> None:
    """Retire Deleting replicas in one transaction: Deleted, or Dead with their error."""
    if not errors:
        return
    with db.transaction() as s:
        retire_deleting(s, settings, errors)


#: Why a row whose release the node never got stays Deleting (:func:`wait_for_node`).
WAITS = "the node cannot list its VMs: the row stays Deleting until the node answers"


def release_waits(node: Node | None) -> bool:
    """Whether a release ``node`` never got must wait for it: nothing else would find the VM.

    True on a node that cannot list its VMs or has not said it can (``nodes.can_list``
    not true): reconcile finds no orphan there.
    """
    return node is not None and node.can_list is not True


def wait_for_node(db: Database, settings: Settings, errors: dict[str, str]) -> None:
    """Leave Deleting rows whose release the node never got Deleting, for the reaper.

    Each keeps its slot (its VM holds it) and gets a fresh deadline, past which the
    reaper's stuck sweep tries the release again once its node is healthy; the operation
    that waits on it fails now with its error.
    """
    with db.transaction() as s:
        for replica_id, error in errors.items():
            replica = lock_replica(s, replica_id)
            if replica is None or replica.status != ReplicaState.DELETING:
                continue
            transition(s, replica, ReplicaState.DELETING, settings, error=error)
            waiting, replica.operation_id = replica.operation_id, None
            if waiting:
                settle(s, waiting, parts=[replica.id], ok=False, error=error)


def delete_batch(
    db: Database, settings: Settings, op_id: str | None, replica_ids: list[str], budget: Budget
) -> Deleted:
    """Delete a batch of replicas: mark, release at once, retire in one transaction."""
    if (
        not isinstance(replica_ids, list | tuple)
        or not replica_ids
        or not all(isinstance(r, str) for r in replica_ids)
    ):
        raise InputError("replica_ids must be a non-empty list of replica ids")
    doomed = begin_deletes(db, settings, replica_ids, op_id)
    outcomes = release_all(settings, doomed, budget)
    out = Deleted()
    errors: dict[str, str | None] = {}
    for d in doomed:
        outcome = outcomes[d.replica_id]
        if outcome is None:
            out.rest.append(d.replica_id)
        elif isinstance(outcome, TransientBackendError):
            out.retry.append(d.replica_id)
        else:
            errors[d.replica_id] = str(outcome) if isinstance(outcome, BackendError) else None
    finish_deletes(db, settings, errors)
    out.done = len(errors)
    return out


def delete_one(
    db: Database,
    settings: Settings,
    replica_id: str,
    op_id: str | None,
    *,
    error: TransientBackendError | None = None,
) -> tuple[str, str | None]:
    """Release one replica's VM and retire its row; (state, error).

    With ``error`` (the transport error its retries could not get past) the release is
    not tried again: the row ends Dead with it, and the node is counted a miss.
    """
    doomed = begin_delete(db, settings, replica_id, op_id)
    if doomed is None:
        return "already gone", None
    if error is not None:
        if doomed.node is not None:
            note_failure(db, settings, doomed.node.id, str(error))
        if doomed.vmid is not None and release_waits(doomed.node):
            message = f"{error}; {WAITS}"
            wait_for_node(db, settings, {replica_id: message})
            return "deleting", message
        message = f"{error}; reconcile will destroy the VM once the node answers"
        finish_deletes(db, settings, {replica_id: message})
        return "dead", message
    if doomed.vmid is None or doomed.node is None:
        finish_deletes(db, settings, {replica_id: None})
        return "deleted", None
    try:
        backends.release_vm(doomed.node, doomed.vmid, settings)
    except TransientBackendError:
        raise
    except BackendError as exc:
        finish_deletes(db, settings, {replica_id: str(exc)})
        return "dead", str(exc)
    finish_deletes(db, settings, {replica_id: None})
    return "deleted", None


def release_orphan(db: Database, settings: Settings, node_id: str, vmid: str) -> str:
    """Release a VM no replica took, unless a live row on that node has it after all.

    Either way the kept orphan ends (:mod:`workers.replicas.orphans`); a release that
    raises leaves it for reconcile.
    """
    with db.read() as s:
        node = s.get(Node, node_id)
        taken = s.scalar(
            select(Replica.id).where(
                Replica.node_id == node_id, Replica.vmid == vmid, Replica.status.in_(LIVE_STATES)
            )
        )
    if node is None:
        return "no such node"  # its kept orphans went with it
    if taken is not None:
        orphans.end(db, node_id, vmid)
        return "taken"
    released = backends.release_vm(node, vmid, settings)  # TransientBackendError: retried
    orphans.end(db, node_id, vmid)
    log.warning("released orphan VM %s on %s", vmid, node.name)
    return "released" if released else "already gone"
