"""Spawning, deleting and scaling replicas: the logic the Celery tasks call.

Each operation is split at the network call so that no database transaction is
held open across an RPC:

* spawn - :func:`begin_spawn` writes the replica row as Creating (keyed by its
  request id) and reserves a node slot and any GPU in one transaction;
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

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers import backends
from workers.clock import now
from workers.errors import BackendError, CapacityError, InputError, NotFound
from workers.functions import MAX_REPLICAS
from workers.lifecycle import (
    deadline_for,
    fail_operation,
    finish,
    lock_replica,
    lock_replica_by_request,
    maybe_finish,
    settle,
    transition,
)
from workers.placement import reserve_gpu, reserve_node, spread_nodes
from workers.store.db import Database
from workers.store.models import (
    FINAL_STATES,
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


def check_count(count: object, what: str = "count") -> int:
    """``count`` as an int in 1..10,000, or a clear :class:`InputError`."""
    if isinstance(count, bool) or not isinstance(count, int):
        raise InputError(f"{what} must be an integer, got {count!r}")
    if count < 1 or count > MAX_REPLICAS:
        raise InputError(f"{what} must be between 1 and {MAX_REPLICAS}, got {count}")
    return count


def plan_spawn(db: Database, op_id: str) -> tuple[str, list[SpawnJob]]:
    """Decide the request ids of a spawn operation (the same ones on every delivery)."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None:
            raise NotFound(f"unknown operation {op_id!r}")
        fn = s.get(Function, op.function_id) if op.function_id else None
        if fn is None:
            raise InputError("the function of this spawn no longer exists")
        count = check_count(op.params.get("count"))
        nodes: list[str | None] = [None]
        if (fn.placement or "") == "spread":
            nodes = list(spread_nodes(s, fn)) or [None]
        jobs = [
            SpawnJob(f"{op.id}.{i}.{n}", node)
            for n, node in enumerate(nodes)
            for i in range(count)
        ]
        if op.status == OpStatus.PENDING.value:
            op.total = len(jobs)
            op.status = OpStatus.RUNNING.value
        return fn.id, jobs


def begin_spawn(
    db: Database,
    settings: Settings,
    op_id: str | None,
    request_id: str,
    function_id: str,
    node_id: str | None = None,
) -> Pending | None:
    """Write (or find) the replica row for a request and reserve its place; None if done."""
    with db.transaction() as s:
        replica = lock_replica_by_request(s, request_id)
        if replica is not None:
            if replica.status == ReplicaState.CREATING and replica.node is not None:
                return Pending(replica.id, request_id, replica.node, replica.function)
            return None
        fn = s.get(Function, function_id)
        if fn is None:
            if op_id:
                settle(s, op_id, ok=False, error=f"function {function_id} was removed")
            return None
        replica = Replica(
            request_id=request_id,
            function_id=fn.id,
            operation_id=op_id,
            status=int(ReplicaState.CREATING),
            build_version=fn.build_version,
            envs_total=fn.exec_envs,
            deadline_at=deadline_for(ReplicaState.CREATING, settings, now()),
        )
        s.add(replica)
        if not _count_in(s, fn):
            # Never counted, never placed: record why, without going through transition.
            replica.status = int(ReplicaState.DEAD)
            replica.error = f"{fn.name} is at its max of {fn.max_replicas} replicas"
            replica.retired_at, replica.operation_id = now(), None
            s.flush()
            if op_id:
                settle(s, op_id, ok=False, error=replica.error)
            return None
        s.flush()
        try:
            node = reserve_node(s, fn, fn.placement or settings.placement, pinned=node_id)
            replica.node_id = node.id
            if fn.gpu_mem_mb:
                grant = reserve_gpu(s, fn, settings.gpu_fit)
                replica.gpu_id, replica.gpu_slot, replica.gpu_mem_mb = (
                    grant.gpu_id,
                    grant.slot,
                    grant.mem_mb,
                )
            s.flush()
        except CapacityError as exc:
            transition(s, replica, ReplicaState.DEAD, settings, error=str(exc))
            return None
        return Pending(replica.id, request_id, node, fn)


def _count_in(session: Session, fn: Function) -> bool:
    """Count one more replica toward ``fn``'s max; False when it is already there."""
    return bool(
        session.execute(
            update(Function)
            .where(Function.id == fn.id, Function.replica_count < Function.max_replicas)
            .values(replica_count=Function.replica_count + 1)
            .execution_options(synchronize_session=False)
        ).rowcount
    )


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
        replica = lock_replica(s, pending.replica_id)
        if replica is None:
            release = True
            state = "gone"
        elif replica.status == ReplicaState.CREATING:
            replica.vmid, replica.address = vm.vmid, vm.address
            ready = replica.function.readiness != "guest"
            transition(
                s, replica, ReplicaState.IDLE if ready else ReplicaState.STARTING, settings
            )
            state = replica.state.label
        elif replica.vmid == vm.vmid:
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
            replica.operation_id = op_id
            transition(s, replica, ReplicaState.DELETING, settings)
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
    """Decide (once per operation) how to reach the operation's target."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None:
            raise NotFound(f"unknown operation {op_id!r}")
        stored = (op.result or {}).get("plan")
        if stored is not None:
            return ScalePlan(
                stored["function_id"],
                [SpawnJob(r) for r in stored["spawns"]],
                stored["deletes"],
                stored.get("note"),
            )
        fn = s.get(Function, op.function_id, with_for_update=True) if op.function_id else None
        if fn is None:
            raise InputError("the function of this scale no longer exists")
        target = op.params.get("target")
        if isinstance(target, bool) or not isinstance(target, int):
            raise InputError(f"target must be an integer, got {target!r}")
        check_target(fn, target)
        counted = fn.replica_count
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
                .with_for_update(skip_locked=not db.is_sqlite)
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
