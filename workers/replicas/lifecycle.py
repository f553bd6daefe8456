"""Replica moves carried out, for one locked row or a batch, by the one table of moves.

The rules are :mod:`workers.store.states`: which moves are allowed (:data:`MOVES`) and
what each does. Here they are carried out, the same way for one row and for many:

* :func:`changes` - the columns a move writes (:attr:`Move.writes`, the same for every
  row it moves) and their values, one rule per column: the status, ``deadline_at``
  stamped or cleared, the idle clock (``idle_since``, ``reap_at``) started at the move
  when a replica becomes Idle with no request in progress and cleared otherwise,
  ``ready_at`` the first time it is ready, the create's owner gone when it leaves
  Creating (and its sent mark when it moves to another node), the waiting operation
  cleared when settled or handed on (``maybe_of``), and ``retired_at`` with no
  environment or GPU slot held in a final state;
* :func:`transition` - one replica, on a row locked for the transaction
  (:func:`lock_replica`): those columns, then the rest of the move - the function's
  ``replica_count`` moved by :attr:`Move.count`; a final state ends the replica's
  claims and gives back its node slot and GPU reservation (exactly once: a final state
  is never left, and a move the table does not list is refused); the operation
  waiting on the replica counts one more part done or failed, and finishes when all
  its parts have;
* the batch paths, each one statement for its rows built once from the move's
  :attr:`Move.writes` and conditional on its source state, with values from
  :func:`changes`, and the same count, give-back and operation steps per batch:

  - :func:`arrive` - a Creating replica gets its VM (Idle, or Starting for guest
    readiness): one conditional ``UPDATE``, also conditional on the node the create
    went to and on the VM not being known as an orphan already released
    (:func:`tombstone_name`): a create answered after its replica moved, or after the
    registry gave its VM up, records nothing, and the caller releases the VM;
  - :func:`mark_deleting` - Idle replicas become Deleting: one ``UPDATE`` for the
    rows and one per function for its count;
  - :func:`retire_deleting` - Deleting replicas become Deleted (or Dead with their
    error): the rows, one ``UPDATE`` for the node slots
    (:func:`workers.fleet.placement.free_nodes`), one per operation; replicas holding a
    GPU go through :func:`transition`;
  - :mod:`workers.replicas.claims` - taking an environment (Idle -> Idle or Allocated)
    and giving one back (-> Idle) are one statement each; a release whose replica an
    operation waits on goes through :func:`transition`;
  - a row is inserted in the state its insert move gives (:func:`born`): Creating when
    placed (:mod:`workers.replicas.spawn`, a maybe's replacement), or Dead past the
    function's max - never counted and never placed, it holds nothing to give back,
    and its part of the operation is settled failed.

``tests/workers/replicas/test_lifecycle.py`` checks the table against the code: every
move the code makes is listed, an illegal one is refused and changes nothing, and each
move's bookkeeping, one row and a batch, on SQLite and PostgreSQL.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BindParameter, Update, bindparam, delete, exists, func, select, update
from sqlalchemy.orm import Session, lazyload
from sqlalchemy.orm.attributes import set_committed_value

from config.settings import Settings
from workers.base.clock import now
from workers.fleet.placement import free_gpu, free_node, free_nodes
from workers.functions import idle_timeout
from workers.leases import keyed_name
from workers.locks import lock_gpus
from workers.operations import settle
from workers.store.models import Claim, Function, Lease, Node, Replica, ReplicaState
from workers.store.states import MOVES, RULES, Deadline, Move, OnOperation, move

_S = ReplicaState

# The statements are built once: building a SQLAlchemy statement costs more than
# running it on SQLite. The UPDATEs run on the session's connection (Core), which costs
# half of the ORM's bulk-update path; like the ORM with ``synchronize_session=False``
# they leave loaded objects as they were (settle reloads the operation when it finishes
# it), and they do not autoflush: transition flushes the replica itself. Transitions
# need the replica and its function; node and GPU rows are loaded only when touched.
_LOCK_REPLICA = (
    select(Replica)
    .options(lazyload(Replica.node), lazyload(Replica.gpu))
    .where(Replica.id == bindparam("replica_id"))
    .with_for_update(of=Replica)
)
_RECOUNT = (
    update(Function)
    .where(Function.id == bindparam("function_id"))
    .values(replica_count=Function.replica_count + bindparam("n"), updated_at=Function.updated_at)
    .execution_options(synchronize_session=False)
)


def lock_replica(session: Session, replica_id: str) -> Replica | None:
    """The replica row, locked until the transaction ends (FOR UPDATE on PostgreSQL)."""
    return session.scalars(_LOCK_REPLICA, {"replica_id": replica_id}).first()


def ready_window(settings: Settings) -> timedelta:
    """How long after a maybe is made its READY may still come (on a node that reports)."""
    return timedelta(seconds=settings.create_timeout_s + settings.ready_grace_s)


def deadline_for(
    state: ReplicaState, settings: Settings, at: datetime, *, reports_ready: bool = False
) -> datetime | None:
    """When a replica that entered ``state`` at ``at`` counts as stuck (None: never).

    ``reports_ready``: a maybe's node is known to report READY (it waits as long as a
    READY may still come, else the creating deadline).
    """
    kind = RULES[state].deadline
    if kind == Deadline.MAYBE and reports_ready:
        return at + ready_window(settings)
    if kind in (Deadline.CREATE, Deadline.MAYBE):
        return at + timedelta(seconds=settings.creating_deadline_s)
    if kind == Deadline.BOOT:
        return at + timedelta(seconds=settings.boot_deadline_s)
    return None


def changes(  # noqa: PLR0913 - the move, and what its values depend on by name
    m: Move,
    settings: Settings,
    at: datetime,
    *,
    reap_after_s: float | None = None,
    busy: bool = False,
    operation_id: str | None = None,
    reports_ready: bool = False,
) -> dict[str, Any]:
    """The columns ``m`` writes (:attr:`Move.writes`) and their values, for a move at ``at``.

    ``reap_after_s``: the function's idle timeout (needed by a move that starts the idle
    clock); ``busy``: the replica still serves a request after the move (no idle
    clock); ``operation_id``: the operation waiting on it (a move to Maybe hands it
    on); ``reports_ready``: as for :func:`deadline_for`.
    """
    idle = RULES[m.target].idle_clock and not busy
    if idle and reap_after_s is None:
        raise ValueError(f"{m.target.label}: the function's idle timeout is needed")
    every = {
        "status": int(m.target),
        "deadline_at": deadline_for(m.target, settings, at, reports_ready=reports_ready),
        "idle_since": at if idle else None,
        "reap_at": at + timedelta(seconds=reap_after_s or 0) if idle else None,
        "ready_at": at,
        "owner": None,
        "owner_until": None,
        "sent_at": None,
        "operation_id": None,
        "maybe_of": operation_id,
        "retired_at": at,
        "envs_in_use": 0,
        "gpu_slot": None,
    }
    return {column: every[column] for column in m.writes}


def born(state: ReplicaState, settings: Settings, at: datetime) -> dict[str, Any]:
    """The columns of a row inserted in ``state`` (Creating when placed, Dead past max)."""
    return changes(move(None, state), settings, at)


def batch_values(m: Move) -> dict[str, BindParameter[Any]]:
    """A batch statement's values for ``m``: one parameter per column it writes."""
    return {column: bindparam(f"new_{column}") for column in m.writes}


def batch_params(values: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters of :func:`batch_values` for one row, from :func:`changes`."""
    return {f"new_{column}": value for column, value in values.items()}


def recount(session: Session, per_function: Mapping[str, int]) -> None:
    """Move functions' ``replica_count`` by these amounts (one statement)."""
    params = [{"function_id": fid, "n": n} for fid, n in per_function.items() if n]
    if params:
        session.connection().execute(_RECOUNT, params)


def transition(  # noqa: PLR0913 - the move, and its details by name
    session: Session,
    replica: Replica,
    to: ReplicaState,
    settings: Settings,
    *,
    error: str | None = None,
    reports_ready: bool = False,
) -> Move:
    """Move a locked replica to ``to`` and do the bookkeeping the table says; the move.

    A move the table does not list raises :class:`~workers.store.states.IllegalMove`
    and changes nothing.
    """
    m = move(ReplicaState(replica.status), ReplicaState(to))
    at = now()
    waiting = replica.operation_id
    if m.retires:
        _give_back(session, replica)
    values = changes(
        m,
        settings,
        at,
        reap_after_s=idle_timeout(replica.function, settings) if RULES[to].idle_clock else None,
        busy=replica.envs_in_use > 0,
        operation_id=waiting,
        reports_ready=reports_ready,
    )
    for column, value in values.items():
        setattr(replica, column, value)
    if error is not None:
        replica.error = error
    recount(session, {replica.function_id: m.count})
    session.flush()
    if waiting and m.operation in (OnOperation.DONE, OnOperation.FAILED):
        ok = m.operation == OnOperation.DONE
        settle(session, waiting, parts=[replica.id], ok=ok, error=replica.error)
    return m


def _give_back(session: Session, replica: Replica) -> None:
    """A final state: end its claims and give back its node slot and GPU reservation."""
    if replica.envs_in_use:
        # Claims end with their replica: ``envs_in_use`` counts claim rows, and a row
        # left behind would make its release (or expiry) count below zero.
        session.execute(
            delete(Claim)
            .where(Claim.replica_id == replica.id)
            .execution_options(synchronize_session=False)
        )
    if replica.node_id is not None:
        free_node(session, replica.node_id)
    if replica.gpu_id is not None and replica.gpu_slot is not None:
        free_gpu(session, replica.gpu_id, replica.gpu_mem_mb)


TOMBSTONE = "gone:"  # a VM released as an orphan: a create answered late records nothing


def tombstone_name(vmid: str) -> str:
    """The lease row that marks ``vmid`` as an orphan corral released (never to be recorded)."""
    return keyed_name(TOMBSTONE, vmid)


def _arrival(m: Move) -> Update:
    assert m.source is not None  # noqa: S101 - an arrival moves an existing row
    return (
        update(Replica)
        .where(
            Replica.id == bindparam("replica_id"),
            Replica.status == int(m.source),
            Replica.node_id == bindparam("on_node"),
            Replica.vmid.is_(None),
            ~exists().where(Lease.name == bindparam("tombstone")),
        )
        .values(vmid=bindparam("vmid"), address=bindparam("address"), **batch_values(m))
        .execution_options(synchronize_session=False)
    )


_ARRIVE = {to: _arrival(MOVES[(_S.CREATING, to)]) for to in (_S.IDLE, _S.STARTING)}


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
    count: bool = True,
) -> ReplicaState | None:
    """Record the VM ``(vmid, address)`` that ``node_id`` made for a Creating replica.

    Idle, or Starting for guest readiness: the move from Creating, in one statement.
    Returns the new state, or None when nothing changed: the row is no longer Creating,
    or no longer on that node, or has a VM, or the VM was released as an orphan. With
    ``settle_op=False`` the caller settles the operation itself, with ``count=False`` it
    moves the function's count itself (a batch does each for all its arrivals in one
    statement).
    """
    to = _S.STARTING if fn.readiness == "guest" else _S.IDLE
    m = MOVES[(_S.CREATING, to)]
    values = changes(m, settings, now(), reap_after_s=idle_timeout(fn, settings))
    done = session.connection().execute(
        _ARRIVE[to],
        {
            "replica_id": replica_id,
            "on_node": node_id,
            "tombstone": tombstone_name(vm[0]),
            "vmid": vm[0],
            "address": vm[1],
            **batch_params(values),
        },
    )
    if done.rowcount != 1:
        return None
    if count:
        recount(session, {fn.id: m.count})
    if settle_op and operation_id and m.operation == OnOperation.DONE:
        settle(session, operation_id, parts=[replica_id], ok=True)
    return to


_TO_DELETING = MOVES[(_S.IDLE, _S.DELETING)]
_MARK_DELETING = (
    update(Replica)
    .where(
        Replica.id.in_(bindparam("ids", expanding=True)),
        Replica.status == int(_S.IDLE),
    )
    .values(**batch_values(_TO_DELETING), operation_id=bindparam("attach"))
    .execution_options(synchronize_session=False)
)


def mark_deleting(
    session: Session, settings: Settings, replicas: Sequence[Replica], operation_id: str | None
) -> None:
    """Move locked Idle replicas to Deleting for ``operation_id``, as :func:`transition` would.

    Two statements: the rows, then the functions' counts.
    """
    idle = [r for r in replicas if r.status == _S.IDLE]
    if not idle:
        return
    session.flush()
    values = changes(_TO_DELETING, settings, now())
    session.connection().execute(
        _MARK_DELETING,
        {"ids": [r.id for r in idle], "attach": operation_id, **batch_params(values)},
    )
    values["operation_id"] = operation_id
    per_function: dict[str, int] = defaultdict(int)
    for r in idle:
        per_function[r.function_id] += _TO_DELETING.count
        for column, value in values.items():  # what the UPDATE wrote: the objects agree
            set_committed_value(r, column, value)
    recount(session, per_function)


_DELETING = select(
    Replica.id,
    Replica.node_id,
    Replica.gpu_id,
    Replica.operation_id,
    Replica.envs_in_use,
    Replica.function_id,
).where(Replica.id.in_(bindparam("ids", expanding=True)), Replica.status == int(_S.DELETING))
# Counter rows before replicas (workers.locks): the batch's nodes by name, then the
# replicas, skipping any another transaction holds (it is moving them: left to it).
_LOCK_NODES = (
    select(Node.id)
    .where(Node.id.in_(bindparam("ids", expanding=True)))
    .order_by(Node.name)
    .with_for_update(key_share=True)
)
_LOCK_DELETING = _DELETING.with_for_update(skip_locked=True)


def _retirement(m: Move) -> Update:
    return (
        update(Replica)
        .where(Replica.id == bindparam("rid"), Replica.status == int(_S.DELETING))
        .values(error=func.coalesce(bindparam("error"), Replica.error), **batch_values(m))
        .execution_options(synchronize_session=False)
    )


_RETIRE = {to: _retirement(MOVES[(_S.DELETING, to)]) for to in (_S.DELETED, _S.DEAD)}


def retire_deleting(session: Session, settings: Settings, errors: dict[str, str | None]) -> int:
    """Retire Deleting replicas: Deleted, or Dead with their error; returns how many.

    The same moves as :func:`transition`, a few statements for the batch.
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
    batch = _Retiring(settings, now())
    for rid, node_id, gpu_id, op_id, envs_in_use, function_id in rows:
        error = errors[rid]
        to = _S.DEAD if error else _S.DELETED
        if gpu_id is None:
            batch.add(rid, to, error, node_id=node_id, op_id=op_id, claimed=bool(envs_in_use))
            batch.counts[function_id] += MOVES[(_S.DELETING, to)].count
            continue
        replica = lock_replica(session, rid)  # GPU grants are freed one by one, by transition
        if replica is not None:
            transition(session, replica, to, settings, error=error)
    batch.write(session)
    return len(rows)


@dataclass
class _Retiring:
    """What :func:`retire_deleting` writes for its rows: a few statements for the batch."""

    settings: Settings
    at: datetime
    params: dict[ReplicaState, list[dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    slots: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    counts: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    settled: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    failed: list[tuple[str, str, str | None]] = field(default_factory=list)
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
        """Count one replica's move: its row, node slot, claims and operation."""
        m = MOVES[(_S.DELETING, to)]
        values = batch_params(changes(m, self.settings, self.at))
        self.params[to].append({"rid": rid, "error": error, **values})
        if m.retires and claimed:
            self.claimed.append(rid)
        if m.retires and node_id is not None:
            self.slots[node_id] += 1
        if op_id and m.operation == OnOperation.FAILED:
            self.failed.append((op_id, rid, error))
        elif op_id and m.operation == OnOperation.DONE:
            self.settled[op_id].append(rid)

    def write(self, session: Session) -> None:
        """Run the batch's statements and settle its operations."""
        for to, params in self.params.items():
            session.connection().execute(_RETIRE[to], params)
        if self.claimed:  # claims end with their replica, as in transition
            session.execute(
                delete(Claim)
                .where(Claim.replica_id.in_(self.claimed))
                .execution_options(synchronize_session=False)
            )
        free_nodes(session, self.slots)
        recount(session, self.counts)
        for op_id, rids in self.settled.items():
            settle(session, op_id, parts=rids, ok=True)
        for op_id, rid, error in self.failed:
            settle(session, op_id, parts=[rid], ok=False, error=error)
