"""Spawning, deleting and scaling replicas: the logic the Celery tasks call.

Each operation is split at the network call so that no database transaction is
held open across an RPC:

* spawn - :func:`place` writes replica rows as Creating (keyed by their
  request ids) and reserves a node slot and any GPU for each, a batch per
  transaction; :func:`begin_spawn` finds one (placing it first if missing);
  :func:`create_vm` asks the node; :func:`finish_spawn` records the vmid and
  address and makes the replica Idle (or Starting, when the guest reports its own
  readiness). A redelivered request finds its row: a finished one is left alone,
  one still Creating asks the node again with the same request id, which an
  agent that knows the ``requestId`` extension answers with the VM it already
  made.
* delete - :func:`begin_delete` marks the replica Deleting (so it can no longer
  be claimed), :func:`release_vm` tears the VM down (already gone counts as
  done), :func:`finish_delete` retires the row. Deleting a deleted replica
  succeeds.
* scale - :func:`plan_scale` compares the target with the replicas that exist
  or are being created and decides, once per operation, which to add and which
  Idle ones to remove; the plan is stored on the operation so a redelivered
  scale repeats it instead of making a new one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers import backends
from workers.clock import now
from workers.errors import BackendError, CapacityError, InputError, NotFound
from workers.functions import MAX_REPLICAS
from workers.lifecycle import (
    arrive,
    deadline_for,
    fail_operation,
    finish,
    lock_replica,
    lock_replica_by_request,
    maybe_finish,
    settle,
    transition,
)
from workers.locks import lock_gpus, lock_nodes
from workers.placement import reserve_gpu, reserve_node, spread_nodes
from workers.reports import apply_early_reports
from workers.store.db import Database
from workers.store.models import (
    FINAL_STATES,
    OP_FINISHED,
    OP_OPEN,
    Function,
    Node,
    Operation,
    OpStatus,
    Replica,
    ReplicaState,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpawnJob:
    """What one spawn_replica task needs: its request id and, for ``spread``, a node."""

    request_id: str
    node_id: str | None = None


@dataclass(frozen=True)
class Pending:
    """A replica row waiting for its VM: where to create it and for which function."""

    replica_id: str
    request_id: str
    node: Node
    function: Function
    operation_id: str | None  # the operation waiting for this replica


def parse_jobs(raw: object) -> list[SpawnJob]:
    """``[[request_id, node_id or null], ...]`` from a task message, or :class:`InputError`."""
    if not isinstance(raw, list) or not raw:
        raise InputError(f"jobs must be a non-empty list, got {type(raw).__name__}")
    jobs = []
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not (item[1] is None or isinstance(item[1], str))
        ):
            raise InputError(f"malformed job {item!r}: expected [request_id, node_id or null]")
        jobs.append(SpawnJob(item[0], item[1]))
    return jobs


def check_count(count: object, what: str = "count") -> int:
    """``count`` as an int in 1..10,000, or a clear :class:`InputError`."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise InputError(f"{what} must be an integer, got {count!r}")
    if count < 1 or count > MAX_REPLICAS:
        raise InputError(f"{what} must be between 1 and {MAX_REPLICAS}, got {count}")
    return count


def _lock_op(s: Session, op_id: str) -> tuple[Operation, Function | None]:
    """Lock an operation and its function in the documented order: function, then operation."""
    function_id = s.scalar(select(Operation.function_id).where(Operation.id == op_id))
    fn = s.get(Function, function_id, with_for_update=True) if function_id else None
    op = s.get(Operation, op_id, with_for_update=True)
    if op is None:
        raise NotFound(f"unknown operation {op_id!r}")
    return op, fn


def spawn_jobs(op_id: str, plan: dict[str, Any]) -> list[SpawnJob]:
    """The jobs of a stored spawn plan: ``count`` replicas on each planned node."""
    nodes: list[str | None] = plan.get("nodes") or [None]
    return [
        SpawnJob(f"{op_id}.{i}.{n}", node)
        for n, node in enumerate(nodes)
        for i in range(int(plan.get("count", 0)))
    ]


def planned_requests(op: Operation) -> list[str]:
    """The request ids a spawn or scale operation planned to create (none before its plan)."""
    plan = (op.result or {}).get("plan")
    if not isinstance(plan, dict):
        return []
    if op.kind == "scale":
        return list(plan.get("spawns") or [])
    return [job.request_id for job in spawn_jobs(op.id, plan)]


def unplaced(s: Session, function_id: str, *, exclude: str | None = None) -> int:
    """Replicas that open spawn/scale plans of a function will add but have not written yet.

    ``functions.replica_count`` counts rows; a plan's replicas become rows only when
    its fan-out places them. Anything sizing a function against a target adds these.
    """
    ops = s.scalars(
        select(Operation).where(
            Operation.function_id == function_id,
            Operation.kind.in_(("spawn", "scale")),
            Operation.status.in_(OP_OPEN),
        )
    ).all()
    missing = 0
    for op in ops:
        if op.id == exclude:
            continue
        wanted = planned_requests(op)
        written = 0
        for i in range(0, len(wanted), 1000):
            chunk = wanted[i : i + 1000]
            written += int(s.scalar(
                select(func.count()).select_from(Replica).where(Replica.request_id.in_(chunk))
            ) or 0)
        missing += max(0, len(wanted) - written)
    return missing


def plan_spawn(db: Database, op_id: str) -> tuple[str, list[SpawnJob]]:
    """Decide the request ids of a spawn operation (the same ones on every delivery).

    The plan (the nodes of a ``spread`` spawn, the count) is stored on the operation
    the first time, so a redelivery repeats it even if nodes came or went since. A
    finished operation (failed when its task could not be queued, say) plans nothing.
    """
    with db.transaction() as s:
        op, fn = _lock_op(s, op_id)
        op.progress_at = now()  # its task ran (a late one, too)
        if op.status in OP_FINISHED:
            return op.function_id or "", []
        stored = (op.result or {}).get("plan")
        if isinstance(stored, dict):
            return stored["function_id"], spawn_jobs(op.id, stored)
        if fn is None:
            raise InputError("the function of this spawn no longer exists")
        count = check_count(op.params.get("count"))
        nodes: list[str | None] = [None]
        if (fn.placement or "") == "spread":
            nodes = list(spread_nodes(s, fn)) or [None]
        plan = {"function_id": fn.id, "nodes": nodes, "count": count}
        jobs = spawn_jobs(op.id, plan)
        op.result = {**(op.result or {}), "plan": plan}
        op.total = len(jobs)
        if op.status == OpStatus.PENDING.value:
            op.status = OpStatus.RUNNING.value
        return fn.id, jobs


def place(
    db: Database,
    settings: Settings,
    op_id: str | None,
    function_id: str,
    jobs: list[SpawnJob],
) -> int:
    """Write the Creating rows of ``jobs`` that have none yet, each with its node and GPU.

    One transaction for the whole batch: the function's count toward max is taken
    for as many as fit, then each replica reserves a node slot (and GPU) and all
    rows are inserted together. A job that does not fit is written Dead with the
    reason, and settles its operation as failed. Returns how many rows were written.
    """
    if not jobs:
        return 0
    ids = [job.request_id for job in jobs]
    known_query = select(Replica.request_id).where(Replica.request_id.in_(ids))
    with db.transaction() as s:
        if set(s.scalars(known_query)) >= set(ids):
            return 0  # a redelivery: every row is written already
        if op_id and s.scalar(select(Operation.status).where(Operation.id == op_id)) in OP_FINISHED:
            return 0  # the operation ended (failed to queue, say): its leftovers do nothing
        # FOR NO KEY UPDATE on PostgreSQL: serializes the count with other spawns of this
        # function without blocking the key-share locks that replica INSERTs take.
        fn = s.get(Function, function_id, with_for_update={"key_share": True})
        # Read again under that lock: a second delivery of the same jobs that was
        # waiting for it now sees the first one's rows (PostgreSQL, READ COMMITTED).
        known = set(s.scalars(known_query))
        todo = [job for job in jobs if job.request_id not in known]
        if not todo:
            return 0
        if fn is None:
            for _ in todo:
                if op_id:
                    settle(s, op_id, ok=False, error=f"function {function_id} was removed")
            return 0
        if len(todo) > 1:  # several reservations: every node (and GPU) first, in order
            lock_nodes(s, fn.backend)
            if fn.gpu_mem_mb:
                lock_gpus(s)
        room = max(0, min(len(todo), fn.max_replicas - fn.replica_count))
        if room:
            s.execute(
                update(Function)
                .where(Function.id == fn.id)
                .values(replica_count=Function.replica_count + room,
                        updated_at=Function.updated_at)
                .execution_options(synchronize_session=False)
            )
        at = now()
        placed: list[Replica] = []
        failed: list[tuple[Replica, str]] = []
        policy = fn.placement or settings.placement
        for i, job in enumerate(todo):
            replica = Replica(
                request_id=job.request_id,
                function_id=fn.id,
                operation_id=op_id,
                status=int(ReplicaState.CREATING),
                build_version=fn.build_version,
                envs_total=fn.exec_envs,
                deadline_at=deadline_for(ReplicaState.CREATING, settings, at),
            )
            if i >= room:
                # Never counted, never placed: record why, without going through transition.
                replica.status, replica.retired_at, replica.operation_id = (
                    int(ReplicaState.DEAD), at, None)
                replica.error = f"{fn.name} is at its max of {fn.max_replicas} replicas"
                s.add(replica)
                if op_id:
                    settle(s, op_id, ok=False, error=replica.error)
                continue
            try:
                replica.node_id = reserve_node(s, fn, policy, pinned=job.node_id).id
                if fn.gpu_mem_mb:
                    grant = reserve_gpu(s, fn, settings.gpu_fit)
                    replica.gpu_id, replica.gpu_slot, replica.gpu_mem_mb = (
                        grant.gpu_id, grant.slot, grant.mem_mb)
                    s.add(replica)  # its slot must be visible to the next reserve_gpu
                placed.append(replica)
            except CapacityError as exc:
                failed.append((replica, str(exc)))
        s.add_all(placed + [replica for replica, _ in failed])
        s.flush()
        for replica, error in failed:  # counted, maybe holding a node: transition frees it
            transition(s, replica, ReplicaState.DEAD, settings, error=error)
        return len(todo)


# Built once (see workers.lifecycle): the replica's id, its node and its function.
_PENDING = (
    select(Replica.id, Node, Function, Replica.operation_id)
    .join(Node, Node.id == Replica.node_id)
    .join(Function, Function.id == Replica.function_id)
    .where(
        Replica.request_id == bindparam("request_id"),
        Replica.status == int(ReplicaState.CREATING),
    )
)


def pending_spawn(db: Database, request_id: str) -> Pending | None:
    """The replica of a request if it still waits for its VM, with where to create it."""
    with db.read() as s:
        row = s.execute(_PENDING, {"request_id": request_id}).first()
        if row is None:
            return None
        return Pending(row[0], request_id, row[1], row[2], row[3])


def begin_spawn(
    db: Database,
    settings: Settings,
    op_id: str | None,
    request_id: str,
    function_id: str,
    node_id: str | None = None,
) -> Pending | None:
    """The replica row of a request, written (and placed) first if missing; None if done.

    A redelivered request, or a retry after a transport error, finds its row and
    gets the same node back.
    """
    pending = pending_spawn(db, request_id)
    if pending is not None:
        return pending
    if place(db, settings, op_id, function_id, [SpawnJob(request_id, node_id)]):
        return pending_spawn(db, request_id)
    return None


def create_vm(settings: Settings, pending: Pending) -> backends.Vm:
    """Ask the node for the VM (may raise :class:`BackendError`)."""
    return backends.create_vm(pending.node, pending.function, pending.request_id, settings)


def finish_spawn(db: Database, settings: Settings, pending: Pending, vm: backends.Vm) -> str:
    """Record the new VM; returns the replica's state label.

    If the replica was deleted or failed while the node was creating the VM, the
    VM is released at once so nothing is left running without a row.
    """
    release = False
    with db.transaction() as s:
        arrived = arrive(s, pending.replica_id, pending.operation_id, (vm.vmid, vm.address),
                         pending.function, settings)
        if arrived is not None:  # the common case, in one statement
            if arrived == ReplicaState.STARTING and apply_early_reports(s, settings, [vm.vmid]):
                return ReplicaState.IDLE.label  # its guest said READY before we recorded it
            return arrived.label
        replica = lock_replica(s, pending.replica_id)
        if replica is None:
            release = True
            state = "gone"
        elif replica.vmid == vm.vmid:  # a redelivery that the first delivery beat to it
            state = replica.state.label
        else:
            release = True
            state = replica.state.label
            if replica.vmid is None:
                replica.vmid, replica.address = vm.vmid, vm.address
    if release:
        log.info("replica %s ended while its VM was created; releasing %s", pending.replica_id,
                 vm.vmid)
        try:
            backends.release_vm(pending.node, vm.vmid, settings)
        except BackendError as exc:
            log.warning("release of %s failed (reconcile will retry): %s", vm.vmid, exc)
    return state


def fail_spawn(db: Database, settings: Settings, request_id: str, error: str) -> None:
    """Mark a replica whose VM could not be created Dead, freeing what it held."""
    with db.transaction() as s:
        replica = lock_replica_by_request(s, request_id)
        if replica is not None and replica.status == ReplicaState.CREATING:
            transition(s, replica, ReplicaState.DEAD, settings, error=error)


@dataclass(frozen=True)
class Doomed:
    """A replica being deleted: where its VM is, if it has one yet."""

    replica_id: str
    vmid: str | None
    node: Node | None


def begin_delete(
    db: Database, settings: Settings, replica_id: str, op_id: str | None = None
) -> Doomed | None:
    """Mark a replica Deleting; None when it is already gone (a delete that succeeds)."""
    with db.transaction() as s:
        replica = lock_replica(s, replica_id)
        if replica is None:
            raise NotFound(f"unknown replica {replica_id!r}")
        if replica.status in FINAL_STATES:
            if op_id:
                settle(s, op_id, ok=True)
            return None
        if replica.status != ReplicaState.DELETING:
            waiting = replica.operation_id
            replica.operation_id = op_id
            transition(s, replica, ReplicaState.DELETING, settings)
            if waiting and waiting != op_id:
                # A Creating or Starting replica is still owed to its spawn: that part
                # of the spawn fails now, or the spawn would wait for it for good.
                settle(s, waiting, ok=False,
                       error=f"replica {replica.id} was deleted before it was ready")
        elif op_id and replica.operation_id not in (None, op_id):
            settle(s, op_id, ok=True)  # another operation is already deleting it
        return Doomed(replica.id, replica.vmid, replica.node)


def release_vm(settings: Settings, doomed: Doomed) -> bool:
    """Tear the VM down; False when there was none or the node says it is gone."""
    if doomed.vmid is None or doomed.node is None:
        return False
    return backends.release_vm(doomed.node, doomed.vmid, settings)


def finish_delete(
    db: Database, settings: Settings, replica_id: str, error: str | None = None
) -> None:
    """Retire a Deleting replica: Deleted, or Dead with the error that stopped the release."""
    with db.transaction() as s:
        replica = lock_replica(s, replica_id)
        if replica is not None and replica.status == ReplicaState.DELETING:
            to = ReplicaState.DEAD if error else ReplicaState.DELETED
            transition(s, replica, to, settings, error=error)


@dataclass(frozen=True)
class ScalePlan:
    """What a scale operation does: spawns to add, replicas to delete."""

    function_id: str
    spawns: list[SpawnJob]
    deletes: list[str]
    note: str | None = None


def plan_scale(db: Database, settings: Settings, op_id: str) -> ScalePlan:
    """Decide (once per operation) how to reach the operation's target.

    Plans of one function are serialised on its row lock, and each counts what the
    others planned but have not placed yet (:func:`unplaced`), so two scales (or a
    scale and a top-up) never plan the same missing replicas twice. A finished
    operation plans nothing.
    """
    with db.transaction() as s:
        op, fn = _lock_op(s, op_id)
        stored = (op.result or {}).get("plan")
        op.progress_at = now()  # its task ran (a late one, too)
        if op.status in OP_FINISHED:
            return ScalePlan(op.function_id or "", [], [], None)
        if stored is not None:
            return ScalePlan(
                stored["function_id"],
                [SpawnJob(r) for r in stored["spawns"]],
                stored["deletes"],
                stored.get("note"),
            )
        if fn is None:
            raise InputError("the function of this scale no longer exists")
        target = op.params.get("target")
        if isinstance(target, bool) or not isinstance(target, int):
            raise InputError(f"target must be an integer, got {target!r}")
        check_target(fn, target)
        counted = fn.replica_count + unplaced(s, fn.id, exclude=op.id)
        spawns: list[SpawnJob] = []
        deletes: list[str] = []
        note = None
        if target > counted:
            spawns = [SpawnJob(f"{op.id}.{i}") for i in range(target - counted)]
        elif target < counted:
            want = counted - target
            idle = s.scalars(
                select(Replica)
                .where(
                    Replica.function_id == fn.id,
                    Replica.status == ReplicaState.IDLE,
                    Replica.envs_in_use == 0,
                )
                .order_by(
                    (Replica.build_version == fn.build_version).asc(),
                    Replica.idle_since.asc(),
                )
                .limit(want)
                # OF replicas: the eagerly joined function/node/GPU are outer joins,
                # whose nullable side PostgreSQL refuses to lock.
                .with_for_update(of=Replica, skip_locked=not db.is_sqlite)
            ).all()
            for replica in idle:
                replica.operation_id = op.id
                transition(s, replica, ReplicaState.DELETING, settings)
                deletes.append(replica.id)
            if len(deletes) < want:
                note = (
                    f"removed {len(deletes)} of {want}: the other replicas are serving "
                    "requests or still starting"
                )
        fn.target = target
        op.total = len(spawns) + len(deletes)
        op.result = {
            "plan": {
                "function_id": fn.id,
                "spawns": [j.request_id for j in spawns],
                "deletes": deletes,
                "note": note,
            },
            "before": counted,
            "target": target,
        }
        if op.total == 0:
            finish(op, failed=0, total=0)
        else:
            maybe_finish(op)
        return ScalePlan(fn.id, spawns, deletes, note)


def check_target(fn: Function, target: int) -> None:
    """Refuse a target outside the function's [min, max]."""
    if target < 0:
        raise InputError(f"target must not be negative, got {target}")
    if target < fn.min_replicas or target > fn.max_replicas:
        raise InputError(
            f"target {target} is outside {fn.name}'s range "
            f"[{fn.min_replicas}, {fn.max_replicas}]"
        )


def fail_op(db: Database, op_id: str, error: str) -> None:
    """Mark a whole operation failed with a one-line reason."""
    with db.transaction() as s:
        fail_operation(s, op_id, error)
