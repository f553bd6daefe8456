"""Replica state transitions, and the bookkeeping that rides on them.

:func:`transition` moves one replica, on a row locked for the transaction
(:func:`lock_replica`), and is the reference for what a move must do. It:

* gives back the node slot and GPU reservation when a replica reaches a final
  state (Dead or Deleted) - exactly once, because a final state is never left -
  and ends its claims (their rows go, ``envs_in_use`` is 0);
* keeps ``functions.replica_count`` equal to the function's replicas in
  ``COUNTED_STATES`` (one less when a replica leaves them);
* stamps the clocks: ``ready_at`` and ``idle_since`` when a replica becomes Idle,
  ``reap_at`` (idle since + the function's idle timeout) for the reaper's index,
  ``deadline_at`` for Creating / Starting / Deleting, which the sweep enforces;
* settles the operation waiting on the replica (``operation_id``): when the
  replica reaches Idle, Allocated, Dead or Deleted, that operation counts one
  more done or failed, and finishes when all its parts have.

The hot paths do not go through it. Each moves a whole batch (or one claim) in a
few statements instead of a flush per replica, doing the same bookkeeping:

* :func:`arrive` - a Creating replica gets its VM: one conditional ``UPDATE``
  that stamps the same clocks and settles the same operation. It is also
  conditional on the node the create went to and on the VM not being known as an
  orphan already released (:func:`tombstone_name`): a create answered after its
  replica moved, or after the registry gave its VM up, records nothing, and the
  caller releases the VM;
* :func:`mark_deleting` - Idle replicas become Deleting: one ``UPDATE`` for the
  rows and one per function for its count;
* :func:`retire_deleting` - Deleting replicas become Deleted (or Dead with their
  error): the rows, one ``UPDATE`` for the node slots
  (:func:`workers.fleet.placement.free_nodes`), one per operation. Replicas
  holding a GPU go through :func:`transition`;
* :mod:`workers.replicas.claims` - taking an environment (Idle -> Idle or
  Allocated) and giving one back (-> Idle) are one statement each; a release
  whose replica an operation waits on goes through :func:`transition`;
* a create whose outcome is unknown becomes a maybe (:func:`workers.replicas.maybes.replace`):
  it keeps its node slot and GPU, its count passes to the replacement placed with it;
  a maybe leaves through :func:`transition` (adopted: Idle, counted again; or Dead /
  Deleted, its slot given back);
* a spawn's rows past the function's max are inserted Dead
  (:mod:`workers.replicas.spawn`): never counted and never placed, they hold
  nothing to give back, and their part of the operation is settled failed.

``tests/workers/replicas/test_lifecycle.py`` checks that :func:`arrive`,
:func:`mark_deleting` and :func:`retire_deleting` leave the same rows, counters
and operation counts as :func:`transition`, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import bindparam, delete, exists, func, select, update
from sqlalchemy.orm import Session, lazyload
from sqlalchemy.orm.attributes import set_committed_value

from config.settings import Settings
from workers.clock import now
from workers.fleet.placement import free_gpu, free_node, free_nodes
from workers.functions import idle_timeout
from workers.leases import keyed_name
from workers.locks import lock_gpus
from workers.operations import settle
from workers.store.models import (
    COUNTED_STATES,
    FINAL_STATES,
    Claim,
    Function,
    Lease,
    Node,
    Replica,
    ReplicaState,
)

SETTLING = (ReplicaState.IDLE, ReplicaState.ALLOCATED, ReplicaState.DEAD, ReplicaState.DELETED)


# The statements on the spawn path are built once: building a SQLAlchemy statement
# costs more than running it on SQLite. The UPDATEs run on the session's
# connection (Core), which costs half of the ORM's bulk-update path; like the
# ORM with ``synchronize_session=False`` they leave loaded objects as they were
# (settle reloads the operation when it finishes it), and they do not autoflush:
# transition flushes the replica itself. Transitions need the replica and its
# function; node and GPU rows are loaded only when touched.
_LOCK_REPLICA = (
    select(Replica)
    .options(lazyload(Replica.node), lazyload(Replica.gpu))
    .where(Replica.id == bindparam("replica_id"))
    .with_for_update(of=Replica)
)
_UNCOUNT = (
    update(Function)
    .where(Function.id == bindparam("function_id"))
    .values(replica_count=Function.replica_count - 1, updated_at=Function.updated_at)
    .execution_options(synchronize_session=False)
)


TOMBSTONE = "gone:"  # a VM released as an orphan: a create answered late records nothing


def tombstone_name(vmid: str) -> str:
    """The lease row that marks ``vmid`` as an orphan corral released (never to be recorded)."""
    return keyed_name(TOMBSTONE, vmid)


_ARRIVE = (
    update(Replica)
    .where(
        Replica.id == bindparam("replica_id"),
        Replica.status == int(ReplicaState.CREATING),
        Replica.node_id == bindparam("on_node"),
        Replica.vmid.is_(None),
        ~exists().where(Lease.name == bindparam("tombstone")),
    )
    .values(
        vmid=bindparam("vmid"),
        address=bindparam("address"),
        status=bindparam("to"),
        deadline_at=bindparam("deadline_at"),
        ready_at=bindparam("ready_at"),
        idle_since=bindparam("ready_at"),
        reap_at=bindparam("reap_at"),
        operation_id=bindparam("operation_id"),
        owner=None,
        owner_until=None,
    )
    .execution_options(synchronize_session=False)
)


def arrive(  # noqa: PLR0913 - one arrival's parts, the rest by name
    session: Session,
    replica_id: str,
    operation_id: str | None,
    vm: tuple[str, str],
    fn: Function,
    settings: Settings,
    *,
    node_id: str,
    settle_op: bool = True,
) -> ReplicaState | None:
    """Record the VM ``(vmid, address)`` that ``node_id`` made for a Creating replica.

    Idle, or Starting for guest readiness: the same move as :func:`transition` from
    Creating, in one statement. Returns the new state, or None when nothing changed:
    the row is no longer Creating, or no longer on that node, or has a VM, or the VM
    was released as an orphan. With ``settle_op=False`` the caller settles the
    operation itself (a batch counts all its arrivals in one statement).
    """
    at = now()
    to = ReplicaState.STARTING if fn.readiness == "guest" else ReplicaState.IDLE
    idle = to == ReplicaState.IDLE
    done = session.connection().execute(
        _ARRIVE,
        {
            "replica_id": replica_id,
            "on_node": node_id,
            "tombstone": tombstone_name(vm[0]),
            "vmid": vm[0],
            "address": vm[1],
            "to": int(to),
            "deadline_at": deadline_for(to, settings, at),
            "ready_at": at if idle else None,
            "reap_at": at + timedelta(seconds=idle_timeout(fn, settings)) if idle else None,
            "operation_id": None if to in SETTLING else operation_id,
        },
    )
    if done.rowcount != 1:
        return None
    if settle_op and operation_id and to in SETTLING:
        settle(session, operation_id, parts=[replica_id], ok=True)
    return to


def lock_replica(session: Session, replica_id: str) -> Replica | None:
    """The replica row, locked until the transaction ends (FOR UPDATE on PostgreSQL)."""
    return session.scalars(_LOCK_REPLICA, {"replica_id": replica_id}).first()


def deadline_for(state: ReplicaState, settings: Settings, at: datetime) -> datetime | None:
    """When a replica left in ``state`` counts as stuck."""
    if state in (ReplicaState.CREATING, ReplicaState.DELETING):
        return at + timedelta(seconds=settings.creating_deadline_s)
    if state == ReplicaState.STARTING:
        return at + timedelta(seconds=settings.boot_deadline_s)
    return None


def transition(
    session: Session,
    replica: Replica,
    to: ReplicaState,
    settings: Settings,
    *,
    error: str | None = None,
) -> None:
    """Move a locked replica to ``to`` and do the bookkeeping that goes with it."""
    at = now()
    before = ReplicaState(replica.status)
    if before in FINAL_STATES:
        raise ValueError(f"replica {replica.id} is {before.label}; final states are never left")
    replica.status = ReplicaState(to)
    replica.deadline_at = deadline_for(to, settings, at)
    if to != ReplicaState.CREATING:
        replica.owner = replica.owner_until = None  # no create of it can be out any more
    if error is not None:
        replica.error = error
    _stamp_idle(replica, to, settings, at)
    if before in COUNTED_STATES and to not in COUNTED_STATES:
        session.connection().execute(_UNCOUNT, {"function_id": replica.function_id})
    if to in FINAL_STATES:
        _retire(session, replica, at)
    waiting_op = replica.operation_id if to in SETTLING else None
    if waiting_op:
        replica.operation_id = None  # before the flush below: one UPDATE of the row
    session.flush()
    if waiting_op:
        settle(
            session, waiting_op, parts=[replica.id], ok=to != ReplicaState.DEAD, error=replica.error
        )


def _stamp_idle(replica: Replica, to: ReplicaState, settings: Settings, at: datetime) -> None:
    """Stamp the Idle clocks (ready, idle since, reap at), or clear them when leaving Idle."""
    if to != ReplicaState.IDLE:
        replica.idle_since = None
        replica.reap_at = None
        return
    if replica.ready_at is None:
        replica.ready_at = at
    if replica.envs_in_use == 0:
        replica.idle_since = replica.last_used_at or replica.ready_at
        replica.reap_at = replica.idle_since + timedelta(
            seconds=idle_timeout(replica.function, settings)
        )


def _retire(session: Session, replica: Replica, at: datetime) -> None:
    """A final state: end its claims and give back its node slot and GPU reservation."""
    replica.retired_at = at
    if replica.envs_in_use:
        # Claims end with their replica: ``envs_in_use`` counts claim rows, and a row
        # left behind would make its release (or expiry) count below zero.
        session.execute(
            delete(Claim)
            .where(Claim.replica_id == replica.id)
            .execution_options(synchronize_session=False)
        )
    replica.envs_in_use = 0
    if replica.node_id is not None:
        free_node(session, replica.node_id)
    if replica.gpu_id is not None and replica.gpu_slot is not None:
        free_gpu(session, replica.gpu_id, replica.gpu_mem_mb)
        replica.gpu_slot = None


_MARK_DELETING = (
    update(Replica)
    .where(
        Replica.id.in_(bindparam("ids", expanding=True)), Replica.status == int(ReplicaState.IDLE)
    )
    .values(
        status=int(ReplicaState.DELETING),
        deadline_at=bindparam("deadline_at"),
        idle_since=None,
        reap_at=None,
        operation_id=bindparam("operation_id"),
    )
    .execution_options(synchronize_session=False)
)
_UNCOUNT_MANY = (
    update(Function)
    .where(Function.id == bindparam("function_id"))
    .values(replica_count=Function.replica_count - bindparam("n"), updated_at=Function.updated_at)
    .execution_options(synchronize_session=False)
)


def mark_deleting(
    session: Session, settings: Settings, replicas: Sequence[Replica], operation_id: str | None
) -> None:
    """Move locked Idle replicas to Deleting, as :func:`transition` would, in two statements."""
    idle = [r for r in replicas if r.status == ReplicaState.IDLE]
    if not idle:
        return
    session.flush()
    at = now()
    deadline = deadline_for(ReplicaState.DELETING, settings, at)
    session.connection().execute(
        _MARK_DELETING,
        {"ids": [r.id for r in idle], "deadline_at": deadline, "operation_id": operation_id},
    )
    per_function: dict[str, int] = defaultdict(int)
    for r in idle:
        per_function[r.function_id] += 1
        # what the UPDATE wrote, so the loaded objects agree with the rows
        for key, value in (
            ("status", int(ReplicaState.DELETING)),
            ("deadline_at", deadline),
            ("idle_since", None),
            ("reap_at", None),
            ("operation_id", operation_id),
        ):
            set_committed_value(r, key, value)
    session.connection().execute(
        _UNCOUNT_MANY, [{"function_id": fid, "n": n} for fid, n in per_function.items()]
    )


_DELETING = select(
    Replica.id, Replica.node_id, Replica.gpu_id, Replica.operation_id, Replica.envs_in_use
).where(
    Replica.id.in_(bindparam("ids", expanding=True)), Replica.status == int(ReplicaState.DELETING)
)
# Counter rows before replicas (workers.locks): the batch's nodes by name, then the
# replicas, skipping any another transaction holds (it is moving them: left to it).
_LOCK_NODES = (
    select(Node.id)
    .where(Node.id.in_(bindparam("ids", expanding=True)))
    .order_by(Node.name)
    .with_for_update(key_share=True)
)
_LOCK_DELETING = _DELETING.with_for_update(skip_locked=True)
_RETIRE = (
    update(Replica)
    .where(Replica.id == bindparam("rid"), Replica.status == int(ReplicaState.DELETING))
    .values(
        status=bindparam("to"),
        error=func.coalesce(bindparam("error"), Replica.error),
        retired_at=bindparam("at"),
        envs_in_use=0,
        deadline_at=None,
        idle_since=None,
        reap_at=None,
        operation_id=None,
    )
    .execution_options(synchronize_session=False)
)


def retire_deleting(session: Session, settings: Settings, errors: dict[str, str | None]) -> int:
    """Retire Deleting replicas: Deleted, or Dead with their error; returns how many.

    The same bookkeeping as :func:`transition`, a few statements for the batch.
    """
    if not errors:
        return 0
    seen = session.execute(_DELETING, {"ids": list(errors)}).all()
    node_ids = sorted({row[1] for row in seen if row[1] is not None})
    if node_ids:
        session.execute(_LOCK_NODES, {"ids": node_ids}).all()
    if any(row[2] is not None for row in seen):
        lock_gpus(session)
    rows = session.execute(_LOCK_DELETING, {"ids": list(errors)}).all()
    batch = _Retiring(now())
    for rid, node_id, gpu_id, op_id, envs_in_use in rows:
        error = errors[rid]
        to = ReplicaState.DEAD if error else ReplicaState.DELETED
        if gpu_id is None:
            batch.add(rid, to, error, node_id=node_id, op_id=op_id, claimed=bool(envs_in_use))
            continue
        replica = lock_replica(session, rid)  # GPU grants are freed one by one, by transition
        if replica is not None:
            transition(session, replica, to, settings, error=error)
    batch.write(session)
    return len(rows)


@dataclass
class _Retiring:
    """What :func:`retire_deleting` writes for its rows: a few statements for the batch."""

    at: datetime
    params: list[dict[str, object]] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    settled: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    failed: list[tuple[str, str, str]] = field(default_factory=list)
    claimed: list[str] = field(default_factory=list)

    def add(  # noqa: PLR0913 - one row's retirement, the rest by name
        self,
        rid: str,
        to: ReplicaState,
        error: str | None,
        *,
        node_id: str | None,
        op_id: str | None,
        claimed: bool,
    ) -> None:
        """Count one replica's retirement: its row, node slot, claims and operation."""
        self.params.append({"rid": rid, "to": int(to), "error": error, "at": self.at})
        if claimed:
            self.claimed.append(rid)
        if node_id is not None:
            self.slots[node_id] += 1
        if op_id and error:
            self.failed.append((op_id, rid, error))
        elif op_id:
            self.settled[op_id].append(rid)

    def write(self, session: Session) -> None:
        """Run the batch's statements and settle its operations."""
        if self.params:
            session.connection().execute(_RETIRE, self.params)
        if self.claimed:  # claims end with their replica, as in transition
            session.execute(
                delete(Claim)
                .where(Claim.replica_id.in_(self.claimed))
                .execution_options(synchronize_session=False)
            )
        free_nodes(session, self.slots)
        for op_id, rids in self.settled.items():
            settle(session, op_id, parts=rids, ok=True)
        for op_id, rid, error in self.failed:
            settle(session, op_id, parts=[rid], ok=False, error=error)
