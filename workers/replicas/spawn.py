"""Spawning replicas: plan once, write the rows first, then create their VMs batch by batch.

A spawn (or the growing half of a scale) is carried out in batches of up to
:data:`~workers.replicas.plan.SPAWN_BATCH` replicas. :func:`plan_spawn` fixes the
operation's request ids once (stored on the operation, so every delivery works the same
requests); :func:`workers.replicas.plan.fan_out` cuts them into batches: the handler
(:mod:`workers.replicas.handlers`) sends all but the first as ``spawn_batch`` messages,
then works the first itself, so a large spawn is shared by every worker process from its
start. A batch (:func:`run_batch`):

1. :func:`place` writes its replica rows as Creating - keyed by request id, each with a
   node slot (and GPU) reserved and counted toward the function's max - in one
   transaction, owned by this handler from the start and not yet marked sent; a
   redelivered batch finds its rows and writes nothing twice;
2. :func:`workers.replicas.creates.create` takes the rows no one else owns (those it
   wrote are its own already), sends their creates at once - each marked sent as its
   call takes its node's slot - and records what came back. A create is sent at most
   once per row to a node that cannot deduplicate it (:mod:`workers.replicas.owners`);
   one whose outcome is unknown there becomes a maybe, replaced at once
   (:mod:`workers.replicas.maybes`).

A replica whose create hit a transport error is tried alone (``spawn_replica`` ->
:func:`run_one`, retried with backoff); once its retries are spent :func:`give_up`
counts the failure against the node and moves the replica (or ends it Dead).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.errors import CapacityError, InputError, NotFound
from workers.fleet.health import note_failure
from workers.fleet.placement import reserve_gpu, reserve_node, reserve_nodes, spread_nodes
from workers.locks import lock_gpus, lock_nodes
from workers.operations import mark_running, settle
from workers.replicas.arrivals import record
from workers.replicas.checks import check_count
from workers.replicas.creates import create, replace_ambiguous
from workers.replicas.lifecycle import born, transition
from workers.replicas.moves import owned_move
from workers.replicas.outcomes import Next, Outcome, Request
from workers.replicas.owners import Budget, Owner, Pending, disown, owner_token, take
from workers.replicas.plan import SpawnJob, spawn_jobs
from workers.store.db import Database
from workers.store.models import (
    OP_FINISHED,
    Function,
    Node,
    Operation,
    Replica,
    ReplicaState,
    new_id,
)

log = logging.getLogger(__name__)


def lock_op(s: Session, op_id: str) -> tuple[Operation, Function | None]:
    """Lock an operation and its function in the documented order: function, then operation."""
    function_id = s.scalar(select(Operation.function_id).where(Operation.id == op_id))
    fn = s.get(Function, function_id, with_for_update=True) if function_id else None
    op = s.get(Operation, op_id, with_for_update=True)
    if op is None:
        raise NotFound(f"unknown operation {op_id!r}")
    return op, fn


def plan_spawn(db: Database, op_id: str) -> tuple[str, list[SpawnJob]]:
    """Decide the request ids of a spawn operation (the same ones on every delivery).

    The plan (the nodes of a ``spread`` spawn, the count) is stored on the operation
    the first time, so a redelivery repeats it even if nodes came or went since. A
    finished operation (failed when its task could not be queued, say) plans nothing.
    """
    with db.transaction() as s:
        op, fn = lock_op(s, op_id)
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
        mark_running(op)
        return fn.id, jobs


def run_batch(  # noqa: PLR0913 - one batch of one spawn
    db: Database,
    settings: Settings,
    op_id: str | None,
    function_id: str,
    jobs: list[SpawnJob],
    budget: Budget,
) -> Next:
    """Write the batch's rows (those missing), then create the VMs of those no one else owns."""
    owner = Owner(owner_token(), budget.own_until())
    written = place(db, settings, op_id, function_id, jobs, owner=owner)
    return create(db, settings, [j.request_id for j in jobs], budget, owner=owner, owned=written)


def run_one(  # noqa: PLR0913 - one create of one spawn
    db: Database,
    settings: Settings,
    op_id: str | None,
    request_id: str,
    function_id: str,
    node_id: str | None,
    budget: Budget,
) -> Next:
    """One replica: its row written first if missing, then its create, as a batch of one."""
    return run_batch(db, settings, op_id, function_id, [SpawnJob(request_id, node_id)], budget)


def give_up(  # noqa: PLR0913 - one create's end, where it failed by name
    db: Database,
    settings: Settings,
    request_id: str,
    error: str,
    budget: Budget,
    *,
    failed_on: str | None = None,
) -> Next:
    """A create whose retries are spent: count it against the node and move the replica.

    ``failed_on``: the node the create failed on; a replica no longer there was moved
    already (by another delivery of this give-up) and is left alone. ``Next.again``
    holds the replica when it moved (create it there) or was replaced (a handler sent it
    since and died: a maybe now); otherwise it was marked Dead, or is another handler's
    now (nothing changed).
    """
    nxt = Next()
    token = owner_token()
    taken = take(db, settings, [request_id], token, budget.own_until())
    if taken.landed:  # its create answered while the store was down: record that VM
        record(db, settings, taken.landed, nxt, budget)
        return nxt
    if taken.ambiguous:
        replaced = replace_ambiguous(db, settings, taken.ambiguous, token, nxt)
        nxt.again += [
            Request(p.operation_id, p.request_id)
            for p in taken.ambiguous
            if p.request_id in replaced
        ]
        return nxt
    if not taken.pending:
        nxt.states[request_id] = Outcome.OWNED_ELSEWHERE if taken.busy else Outcome.SETTLED
        return nxt
    (p,) = taken.pending
    if failed_on is not None and p.node.id != failed_on:
        with db.transaction() as s:
            disown(s, token, [p.replica_id])
        nxt.states[request_id] = Outcome.MOVED_ALREADY
        return nxt
    note_failure(db, settings, p.node.id, error)
    if owned_move(db, settings, p, token, error):
        nxt.again.append(Request(p.operation_id, request_id))
        nxt.states[request_id] = Outcome.MOVED
    else:
        nxt.states[request_id] = Outcome.DEAD
    return nxt


def place(  # noqa: PLR0913 - one batch of one spawn, its owner by name
    db: Database,
    settings: Settings,
    op_id: str | None,
    function_id: str,
    jobs: list[SpawnJob],
    *,
    owner: Owner | None = None,
) -> list[Pending]:
    """Write the Creating rows of ``jobs`` that have none yet, each with its node and GPU.

    One transaction for the whole batch: the function's count toward max is taken
    for as many as fit, then each replica reserves a node slot (and GPU) and all
    rows are inserted together, owned by ``owner`` if given. A job that does not fit
    is written Dead with the reason, and settles its operation as failed. Returns the
    Creating rows written (each :class:`Pending`, to be sent by ``owner``).
    """
    if not jobs:
        return []
    ids = [job.request_id for job in jobs]
    known_query = select(Replica.request_id).where(Replica.request_id.in_(ids))
    with db.transaction() as s:
        if set(s.scalars(known_query)) >= set(ids):
            return []  # a redelivery: every row is written already
        if op_id and s.scalar(select(Operation.status).where(Operation.id == op_id)) in OP_FINISHED:
            return []  # the operation ended (failed to queue, say): its leftovers do nothing
        # FOR NO KEY UPDATE on PostgreSQL: serializes the count with other spawns of this
        # function without blocking the key-share locks that replica INSERTs take.
        fn = s.get(Function, function_id, with_for_update={"key_share": True})
        # Read again under that lock: a second delivery of the same jobs that was
        # waiting for it now sees the first one's rows (PostgreSQL, READ COMMITTED).
        known = set(s.scalars(known_query))
        todo = [job for job in jobs if job.request_id not in known]
        if not todo:
            return []
        if fn is None:
            if op_id:  # parts with no row: counted once by their request ids
                settle(
                    s,
                    op_id,
                    parts=[job.request_id for job in todo],
                    ok=False,
                    error=f"function {function_id} was removed",
                )
            return []
        if len(todo) > 1:  # several reservations: every node (and GPU) first, in order
            lock_nodes(s, fn.backend)
            if fn.gpu_mem_mb:
                lock_gpus(s)
        room = _count_toward_max(s, fn, len(todo))
        return _write_rows(s, settings, op_id, fn, todo, room=room, owner=owner)


def _count_toward_max(s: Session, fn: Function, wanted: int) -> int:
    """Count as many of ``wanted`` new replicas as fit under the function's max; how many."""
    room = max(0, min(wanted, fn.max_replicas - fn.replica_count))
    if room:
        s.execute(
            update(Function)
            .where(Function.id == fn.id)
            .values(replica_count=Function.replica_count + room, updated_at=Function.updated_at)
            .execution_options(synchronize_session=False)
        )
    return room


def _write_rows(  # noqa: PLR0913 - one batch of one spawn
    s: Session,
    settings: Settings,
    op_id: str | None,
    fn: Function,
    todo: list[SpawnJob],
    *,
    room: int,
    owner: Owner | None,
) -> list[Pending]:
    """Insert the Creating rows of the first ``room`` jobs, each on a node (and GPU).

    The rest are written Dead (over max); a counted one that finds no node or GPU
    ends Dead through :func:`transition`, which frees what it held. Rows without a
    GPU go in one multi-row INSERT. Returns the Creating rows, as ``owner``'s.
    """
    at = now()
    placed: list[dict[str, Any]] = []
    written: list[Pending] = []
    mine = {"owner": owner.token, "owner_until": owner.until} if owner else {}
    failed: list[tuple[Replica, str]] = []
    over: list[Replica] = []
    policy = fn.placement or settings.placement
    ready = _reserve_together(s, fn, policy, todo, room)
    creating = born(ReplicaState.CREATING, settings, at)
    for i, job in enumerate(todo):
        row: dict[str, Any] = {
            "id": new_id(),
            "request_id": job.request_id,
            "function_id": fn.id,
            "operation_id": op_id,
            "build_version": fn.build_version,
            "envs_total": fn.exec_envs,
            **creating,
        }
        if i >= room:
            # Never counted, never placed: inserted Dead with why (the table's insert move).
            error = f"{fn.name} is at its max of {fn.max_replicas} replicas"
            dead = born(ReplicaState.DEAD, settings, at)
            over.append(Replica(**{**row, **dead, "error": error}))
            continue
        try:
            node = ready[i] if i < len(ready) else reserve_node(s, fn, policy, pinned=job.node_id)
            row["node_id"] = node.id
            if fn.gpu_mem_mb:
                grant = reserve_gpu(s, fn, settings.gpu_fit)
                row.update(gpu_id=grant.gpu_id, gpu_slot=grant.slot, gpu_mem_mb=grant.mem_mb)
                s.add(Replica(**row, **mine))  # its slot must be visible to the next reserve_gpu
            else:
                placed.append({**row, **mine})
            written.append(Pending(row["id"], job.request_id, node, fn, op_id))
        except CapacityError as exc:
            failed.append((Replica(**row), str(exc)))
    if placed:
        s.execute(insert(Replica), placed)
    s.add_all(over)
    s.add_all([replica for replica, _ in failed])
    s.flush()
    if op_id and over:
        settle(s, op_id, parts=[r.id for r in over], ok=False, error=over[0].error)
    for replica, error in failed:  # counted, maybe holding a node: transition frees it
        transition(s, replica, ReplicaState.DEAD, settings, error=error)
    return written


def _reserve_together(
    s: Session, fn: Function, policy: str, todo: list[SpawnJob], room: int
) -> list[Node]:
    """Nodes for a batch's first replicas in one step, when placement allows it.

    Unpinned, least-loaded, no GPU, several replicas (so the caller holds the node
    locks): :func:`workers.fleet.placement.reserve_nodes`. Otherwise none, and each
    replica reserves its own.
    """
    if (
        len(todo) > 1
        and room
        and policy in ("loadbalance", "spread")
        and not fn.gpu_mem_mb
        and all(job.node_id is None for job in todo)
    ):
        return reserve_nodes(s, fn, room)
    return []
