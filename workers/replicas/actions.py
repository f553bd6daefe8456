"""Spawning, deleting and scaling replicas: the logic the Celery tasks call.

Each operation is split at the network call so that no database transaction is
held open across an RPC, and works a batch at a time: rows in one transaction,
then every agent call of the batch in flight at once (:mod:`workers.backends.inflight`,
bounded per process, and per node across the fleet: :mod:`workers.backends.node_slots`),
then the results in one transaction - or a few: while slower creates still run,
the VMs that came in are recorded every ``FLUSH_S``, so a guest's READY finds its
vmid without waiting for the batch.

* spawn - :func:`place` writes replica rows as Creating (keyed by their
  request ids) and reserves a node slot and any GPU for each, a batch per
  transaction; :func:`pending_batch` reads back the rows still waiting for a VM;
  :func:`spawn_pending` asks their nodes for all of them at once and records the
  answers: a VM makes its replica Idle (or Starting, when the guest reports its
  own readiness); a transport error is handed back for that replica alone to be
  retried with backoff (and after its retries, :func:`give_up`); an answer that
  blames the node counts against it (:func:`workers.fleet.nodes.note_creates`) and moves
  the replica to another node, at most ``MAX_PLACEMENTS`` nodes in all, before it
  is marked Dead; an answer that blames the request (INVALID_ARGUMENT, HTTP 400:
  the function is misconfigured, every node would refuse it) marks it Dead at
  once. A redelivered batch finds its rows: finished ones are left alone, those
  still Creating ask the node again with the same request id, which an agent that
  knows the ``requestId`` extension answers with the VM it already made.
* delete - :func:`begin_deletes` marks replicas Deleting (so they can no longer
  be claimed), :func:`release_all` tears their VMs down at once (already gone
  counts as done), :func:`finish_deletes` retires the rows in one transaction.
  Deleting a deleted replica succeeds.
* scale - :func:`plan_scale` compares the target with the replicas that exist
  or are being created and decides, once per operation, which to add and which
  Idle ones to remove; the plan is stored on the operation so a redelivered
  scale repeats it instead of making a new one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, func, insert, select, update
from sqlalchemy.orm import Session, lazyload

from config.settings import Settings
from workers import backends
from workers.backends import inflight, node_slots
from workers.clock import now
from workers.errors import (
    BackendError,
    CapacityError,
    InputError,
    NotFound,
    PermanentBackendError,
    TransientBackendError,
)
from workers.fleet.nodes import note_creates, probation
from workers.fleet.placement import (
    free_node,
    reserve_gpu,
    reserve_node,
    reserve_nodes,
    spread_nodes,
)
from workers.functions import MAX_REPLICAS
from workers.locks import lock_gpus, lock_nodes
from workers.operations import finish, mark_running, maybe_finish, open_of, settle
from workers.replicas.lifecycle import (
    SETTLING,
    arrive,
    deadline_for,
    lock_replica,
    mark_deleting,
    retire_deleting,
    transition,
)
from workers.replicas.reports import apply_early_reports
from workers.store.db import Database
from workers.store.models import (
    FINAL_STATES,
    OP_FINISHED,
    Function,
    Node,
    Operation,
    Replica,
    ReplicaState,
)

log = logging.getLogger(__name__)

MAX_PLACEMENTS = 3  # nodes a replica is tried on before it is marked Dead
REQUEST_ERRORS = ("INVALID_ARGUMENT", "400")  # the request's fault, not the node's
FLUSH_S = 0.2  # while a batch runs, VMs that came in are recorded this often
MAX_ROUNDS = 2 * MAX_PLACEMENTS  # rounds of creates one call makes (moves start a new one)


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
    placements: int = 1  # nodes tried so far, this one included


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
            Operation.function_id == function_id, open_of("spawn", "scale")
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
        mark_running(op)
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
        _write_rows(s, settings, op_id, fn, todo, room=_count_toward_max(s, fn, len(todo)))
        return len(todo)


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


def _write_rows(
    s: Session, settings: Settings, op_id: str | None, fn: Function, todo: list[SpawnJob],
    *, room: int,
) -> None:
    """Insert the Creating rows of the first ``room`` jobs, each on a node (and GPU).

    The rest are written Dead (over max); a counted one that finds no node or GPU
    ends Dead through :func:`transition`, which frees what it held. Rows without a
    GPU go in one multi-row INSERT.
    """
    at = now()
    placed: list[dict[str, Any]] = []
    failed: list[tuple[Replica, str]] = []
    policy = fn.placement or settings.placement
    ready = _reserve_together(s, fn, policy, todo, room)
    for i, job in enumerate(todo):
        row: dict[str, Any] = {
            "request_id": job.request_id,
            "function_id": fn.id,
            "operation_id": op_id,
            "status": int(ReplicaState.CREATING),
            "build_version": fn.build_version,
            "envs_total": fn.exec_envs,
            "deadline_at": deadline_for(ReplicaState.CREATING, settings, at),
        }
        if i >= room:
            # Never counted, never placed: record why, without going through transition.
            error = f"{fn.name} is at its max of {fn.max_replicas} replicas"
            s.add(Replica(**{**row, "status": int(ReplicaState.DEAD), "retired_at": at,
                             "operation_id": None, "error": error}))
            if op_id:
                settle(s, op_id, ok=False, error=error)
            continue
        try:
            row["node_id"] = (ready[i] if i < len(ready)
                              else reserve_node(s, fn, policy, pinned=job.node_id)).id
            if fn.gpu_mem_mb:
                grant = reserve_gpu(s, fn, settings.gpu_fit)
                row.update(gpu_id=grant.gpu_id, gpu_slot=grant.slot, gpu_mem_mb=grant.mem_mb)
                s.add(Replica(**row))  # its slot must be visible to the next reserve_gpu
            else:
                placed.append(row)
        except CapacityError as exc:
            failed.append((Replica(**row), str(exc)))
    if placed:
        s.execute(insert(Replica), placed)
    s.add_all([replica for replica, _ in failed])
    s.flush()
    for replica, error in failed:  # counted, maybe holding a node: transition frees it
        transition(s, replica, ReplicaState.DEAD, settings, error=error)


def _reserve_together(
    s: Session, fn: Function, policy: str, todo: list[SpawnJob], room: int
) -> list[Node]:
    """Nodes for a batch's first replicas in one step, when placement allows it.

    Unpinned, least-loaded, no GPU, several replicas (so the caller holds the node
    locks): :func:`workers.fleet.placement.reserve_nodes`. Otherwise none, and each
    replica reserves its own.
    """
    if (len(todo) > 1 and room and policy in ("loadbalance", "spread")
            and not fn.gpu_mem_mb and all(job.node_id is None for job in todo)):
        return reserve_nodes(s, fn, room)
    return []


# Built once (see workers.replicas.lifecycle): the replicas of some requests still waiting for
# their VM, each with its node and its function.
_PENDING = (
    select(Replica.id, Replica.request_id, Node, Function, Replica.operation_id,
           Replica.placements)
    .join(Node, Node.id == Replica.node_id)
    .join(Function, Function.id == Replica.function_id)
    .where(
        Replica.request_id.in_(bindparam("request_ids", expanding=True)),
        Replica.status == int(ReplicaState.CREATING),
    )
)


def pending_batch(db: Database, request_ids: Sequence[str]) -> list[Pending]:
    """The replicas of these requests that still wait for their VM, with where to create them."""
    if not request_ids:
        return []
    with db.read() as s:
        rows = s.execute(_PENDING, {"request_ids": list(request_ids)}).all()
    return [Pending(r[0], r[1], r[2], r[3], r[4], r[5]) for r in rows]


def pending_spawn(db: Database, request_id: str) -> Pending | None:
    """The replica of a request if it still waits for its VM, with where to create it."""
    found = pending_batch(db, [request_id])
    return found[0] if found else None


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


def _late(s: Session, pending: Pending, vm: backends.Vm) -> tuple[str, bool]:
    """A VM for a replica that is no longer Creating: its state, and whether to release the VM."""
    replica = lock_replica(s, pending.replica_id)
    if replica is None:
        return "gone", True
    if replica.vmid == vm.vmid:  # a redelivery that the first delivery beat to it
        return replica.state.label, False
    if replica.vmid is None:
        replica.vmid, replica.address = vm.vmid, vm.address
    return replica.state.label, True


def _release_late(settings: Settings, late: list[tuple[Pending, backends.Vm]]) -> None:
    """Release VMs whose replica ended while they were created: nothing runs without a row."""
    for pending, vm in late:
        log.info("replica %s ended while its VM was created; releasing %s", pending.replica_id,
                 vm.vmid)
        try:
            backends.release_vm(pending.node, vm.vmid, settings)
        except BackendError as exc:
            log.warning("release of %s failed (reconcile will retry): %s", vm.vmid, exc)


def finish_spawn(db: Database, settings: Settings, pending: Pending, vm: backends.Vm) -> str:
    """Record the new VM; returns the replica's state label.

    If the replica was deleted or failed while the node was creating the VM, the
    VM is released at once so nothing is left running without a row.
    """
    with db.transaction() as s:
        arrived = arrive(s, pending.replica_id, pending.operation_id, (vm.vmid, vm.address),
                         pending.function, settings)
        if arrived is not None:  # the common case, in one statement
            if arrived == ReplicaState.STARTING and apply_early_reports(s, settings, [vm.vmid]):
                return ReplicaState.IDLE.label  # its guest said READY before we recorded it
            return arrived.label
        state, release = _late(s, pending, vm)
    if release:
        _release_late(settings, [(pending, vm)])
    return state


@dataclass
class Settled:
    """What a batch of creates came to."""

    states: dict[str, str] = field(default_factory=dict)  # request id -> state label
    # transport errors: each replica to be retried alone, with backoff
    retry: list[tuple[Pending, TransientBackendError]] = field(default_factory=list)
    tried: dict[str, list[str]] = field(default_factory=dict)  # request id -> node ids
    again: list[Pending] = field(default_factory=list)  # moved, not yet tried on their node


def request_error(exc: BaseException) -> bool:
    """Whether an agent refused the request itself (the function's fault, not the node's)."""
    return isinstance(exc, PermanentBackendError) and exc.code in REQUEST_ERRORS


def _blames_node(exc: BaseException) -> bool:
    return not request_error(exc)


def spawn_pending(db: Database, settings: Settings, pendings: Sequence[Pending]) -> Settled:
    """Create the VMs of waiting replicas, all at once, and record what happened to each.

    Replicas moved to another node are tried there in the same call (a round per
    placement); transport errors are returned in ``retry``, not waited out here.
    """
    settled = Settled()
    todo = list(pendings)
    for _ in range(MAX_ROUNDS):
        if not todo:
            break
        todo = pending_batch(db, _spawn_round(db, settings, todo, settled))
    settled.again = todo  # moved more often than one call tries: the caller sends them on
    return settled


def _spawn_round(
    db: Database, settings: Settings, pendings: list[Pending], settled: Settled
) -> list[str]:
    """One round: every create at once, then one transaction; returns the moved request ids."""
    nodes = {p.node.id: p.node for p in pendings}
    by_node: dict[str, list[Pending]] = defaultdict(list)
    for p in pendings:
        by_node[p.node.id].append(p)
    results, lanes, recorded = _send_creates(db, settings, by_node, nodes, settled)
    out = _sort_outcomes(by_node, lanes, results, recorded, settled)
    with db.transaction() as s:  # the common case: replicas, then their operations
        late = _arrivals(s, settings, out.arrivals, settled)
    _release_late(settings, late)
    notes = [(nodes[node_id], lane) for node_id, lane in lanes.items()
             if _needs_note(nodes[node_id], lane)]
    if not (notes or out.dead or out.move or out.elsewhere):
        return []
    return _settle_failures(db, settings, pendings, notes, out, settled)


def _send_creates(
    db: Database, settings: Settings, by_node: dict[str, list[Pending]],
    nodes: dict[str, Node], settled: Settled,
) -> tuple[dict[int, inflight.Result], dict[str, inflight.Lane], set[str]]:
    """Send every create, a lane per node; VMs that land are recorded as the batch goes.

    Returns the results (by ``id`` of each pending), the lanes, and the request ids
    already recorded. Recording happens every FLUSH_S at most, not only when the
    slowest create ends: a guest's READY must find its vmid (workers.registry.service).
    """
    calls = {p.request_id: backends.create_call(p.node, p.function, p.request_id, settings)
             for group in by_node.values() for p in group}

    def lane_of(node_id: str) -> inflight.Lane:
        node = nodes[node_id]
        return inflight.Lane(
            node_id, bound=settings.node_max_inflight,
            stop_after=max(1, settings.node_failures - node.create_failures),
            probation=probation(node, settings))

    async def call(p: Pending) -> backends.Vm:
        try:
            return await backends.send_create(calls[p.request_id], settings)
        except BackendError:
            raise
        except Exception as exc:  # a client bug must not take the batch down
            raise PermanentBackendError(f"CreateReplica failed: {type(exc).__name__}: {exc}",
                                        node=p.node.name) from None

    landed: queue.SimpleQueue[tuple[Pending, backends.Vm]] = queue.SimpleQueue()

    def on_result(p: Pending, result: inflight.Result) -> None:
        if result.error is None:
            landed.put((p, result.value))

    future = inflight.submit(inflight.lanes(
        by_node, lane_of, call, failed=_blames_node, total=settings.max_inflight,
        on_result=on_result, source=node_slots.source(settings)))
    recorded: set[str] = set()
    while True:
        try:
            results, lanes = future.result(timeout=FLUSH_S)
            return results, lanes, recorded
        except concurrent.futures.TimeoutError:
            early = _drain(landed)
            if early:
                _record_arrivals(db, settings, early, settled)
                recorded.update(p.request_id for p, _ in early)


@dataclass
class _Outcomes:
    """A round's creates sorted by what happens next to each replica."""

    arrivals: list[tuple[Pending, backends.Vm]] = field(default_factory=list)
    dead: list[tuple[Pending, str]] = field(default_factory=list)
    move: list[tuple[Pending, str, bool]] = field(default_factory=list)  # why, a placement?
    elsewhere: list[tuple[Pending, TransientBackendError]] = field(default_factory=list)


def _sort_outcomes(
    by_node: dict[str, list[Pending]], lanes: dict[str, inflight.Lane],
    results: dict[int, inflight.Result], recorded: set[str], settled: Settled,
) -> _Outcomes:
    """Sort each create: a VM to record, Dead, moved, not sent (else retried alone)."""
    out = _Outcomes()
    for node_id, group in by_node.items():
        lane = lanes[node_id]
        for p in group:
            result = results.get(id(p))
            if result is None:  # not sent: the node failed too often in this batch
                err = lane.last_error
                if isinstance(err, TransientBackendError):
                    out.elsewhere.append((p, err))
                else:
                    out.move.append((p, f"not sent: {err}", False))
            elif result.error is None:
                if p.request_id not in recorded:
                    out.arrivals.append((p, result.value))
            elif isinstance(result.error, TransientBackendError):
                settled.retry.append((p, result.error))
            elif request_error(result.error):
                out.dead.append((p, str(result.error)))
            else:
                out.move.append((p, str(result.error), True))
    return out


def _settle_failures(
    db: Database, settings: Settings, pendings: list[Pending],
    notes: list[tuple[Node, inflight.Lane]], out: _Outcomes, settled: Settled,
) -> list[str]:
    """Note the nodes' creates, end the Dead, move the rest; returns the moved request ids."""
    moved: list[str] = []
    with db.transaction() as s:
        held = _lock_for_moves(s, pendings, [p for p, *_ in out.dead + out.move + out.elsewhere])
        for node, lane in notes:
            _note_lane(s, settings, node, lane)
        for p, error in out.dead:
            if p.replica_id in held:
                _fail(s, settings, p.replica_id, error)
                settled.states[p.request_id] = "dead"
        for p, error, counted in out.move:
            if p.replica_id not in held:
                continue  # another transaction is moving it (a delete, say)
            tried = settled.tried.setdefault(p.request_id, [])
            tried.append(p.node.id)
            if _move(s, settings, p, error, counted=counted, avoid=tried) == "moved":
                moved.append(p.request_id)
            else:
                settled.states[p.request_id] = "dead"
        # A node that stopped answering: its unsent creates go to another node if one has
        # room, else they wait for it, retried alone with backoff.
        for p, exc in out.elsewhere:
            if p.replica_id not in held:
                continue
            outcome = _move(s, settings, p, f"not sent: {exc}", counted=False,
                            avoid=settled.tried.get(p.request_id, ()), or_stay=True)
            if outcome == "moved":
                moved.append(p.request_id)
            elif outcome == "stay":
                settled.retry.append((p, exc))
    return moved


def _lock_for_moves(s: Session, pendings: Sequence[Pending], failed: Sequence[Pending]) -> set[
        str]:
    """Lock what moving replicas touches, in the one order (workers.locks); the replicas held.

    Their functions and every node (and GPU) of their backends first, then the
    failed replicas with SKIP LOCKED: one another transaction holds is being moved
    by it (a delete, say) and is left alone.
    """
    fn_ids = sorted({p.function.id for p in pendings})
    s.execute(select(Function.id).where(Function.id.in_(fn_ids)).order_by(Function.name)
              .with_for_update(key_share=True)).all()
    for kind in sorted({p.node.kind for p in pendings}):
        lock_nodes(s, kind)
    if any(p.function.gpu_mem_mb for p in pendings):
        lock_gpus(s)
    ids = [p.replica_id for p in failed]
    if not ids:
        return set()
    return set(s.scalars(select(Replica.id).where(Replica.id.in_(ids))
                         .with_for_update(skip_locked=True)))


def _needs_note(node: Node, lane: inflight.Lane) -> bool:
    """Whether a batch's creates on ``node`` change what placement knows of it."""
    outcomes = _outcomes(lane)
    if not outcomes:
        return False
    return not (all(o is None for o in outcomes) and node.create_failures == 0
                and node.last_create_ok_at is not None)


def _outcomes(lane: inflight.Lane) -> list[str | None]:
    """A lane's creates that count for its node, in order (transport errors only after retries)."""
    return [None if e is None else str(e) for e in lane.log
            if e is None or (not isinstance(e, TransientBackendError) and _blames_node(e))]


def _drain(landed: queue.SimpleQueue[tuple[Pending, backends.Vm]]) -> list[
        tuple[Pending, backends.Vm]]:
    out = []
    while True:
        try:
            out.append(landed.get_nowait())
        except queue.Empty:
            return out


def _record_arrivals(
    db: Database, settings: Settings, arrivals: list[tuple[Pending, backends.Vm]],
    settled: Settled,
) -> None:
    """Record VMs that came in while the batch still runs, in one transaction."""
    with db.transaction() as s:
        late = _arrivals(s, settings, arrivals, settled)
    _release_late(settings, late)


def _arrivals(
    s: Session, settings: Settings, arrivals: list[tuple[Pending, backends.Vm]],
    settled: Settled,
) -> list[tuple[Pending, backends.Vm]]:
    """Record new VMs (operations counted once each); returns those whose replica ended."""
    late = []
    done: dict[str, int] = defaultdict(int)
    starting: list[str] = []
    for p, vm in arrivals:
        arrived = arrive(s, p.replica_id, p.operation_id, (vm.vmid, vm.address),
                         p.function, settings, settle_op=False)
        if arrived is None:
            state, release = _late(s, p, vm)
            settled.states[p.request_id] = state
            if release:
                late.append((p, vm))
            continue
        settled.states[p.request_id] = arrived.label
        if arrived == ReplicaState.STARTING:
            starting.append(vm.vmid)
        if p.operation_id and arrived in SETTLING:
            done[p.operation_id] += 1
    for op_id, n in done.items():
        settle(s, op_id, ok=True, n=n)
    if starting:  # guests that said READY before their VM was recorded: Idle now
        apply_early_reports(s, settings, starting)
    return late


def _note_lane(s: Session, settings: Settings, node: Node, lane: inflight.Lane) -> None:
    """Count a batch's creates on one node."""
    why = note_creates(s, settings, node.id, _outcomes(lane))
    if why:
        log.warning("node %s %s", node.name, why)


def _fail(s: Session, settings: Settings, replica_id: str, error: str) -> None:
    replica = lock_replica(s, replica_id)
    if replica is not None and replica.status == ReplicaState.CREATING:
        transition(s, replica, ReplicaState.DEAD, settings, error=error)


def _move(
    s: Session, settings: Settings, p: Pending, error: str, *, counted: bool,
    avoid: Sequence[str] = (), or_stay: bool = False,
) -> str:
    """Move a Creating replica off a node that failed it (and ``avoid``).

    Returns ``moved``, ``dead`` (marked Dead, or it had already ended), or with
    ``or_stay`` and no other node with room, ``stay`` (nothing changed).
    """
    replica = lock_replica(s, p.replica_id)
    if replica is None or replica.status != ReplicaState.CREATING:
        return "dead"
    if counted and replica.placements >= MAX_PLACEMENTS:
        tried = f" (tried on {replica.placements} nodes)" if replica.placements > 1 else ""
        transition(s, replica, ReplicaState.DEAD, settings, error=f"{error}{tried}")
        return "dead"
    fn = replica.function
    try:
        node = reserve_node(s, fn, fn.placement or settings.placement,
                            avoid=[p.node.id, *avoid])
    except CapacityError as exc:
        if or_stay:
            return "stay"
        transition(s, replica, ReplicaState.DEAD, settings,
                   error=f"{error}; no other node to try ({exc})")
        return "dead"
    free_node(s, p.node.id)
    replica.node_id = node.id
    replica.placements += int(counted)
    replica.deadline_at = deadline_for(ReplicaState.CREATING, settings, now())
    s.flush()
    log.info("replica %s moved from node %s to %s: %s", replica.id, p.node.name, node.name, error)
    return "moved"


def give_up(db: Database, settings: Settings, pending: Pending, error: str) -> bool:
    """A create whose retries are spent: count it against the node, move the replica.

    Returns True when the replica was moved to another node (create it there), False
    when it was marked Dead (or had already ended).
    """
    with db.transaction() as s:
        held = _lock_for_moves(s, [pending], [pending])
        why = note_creates(s, settings, pending.node.id, [error])
        if why:
            log.warning("node %s %s", pending.node.name, why)
        if pending.replica_id not in held:
            return False  # another transaction is moving it (a delete, say)
        return _move(s, settings, pending, error, counted=True) == "moved"


@dataclass(frozen=True)
class Doomed:
    """A replica being deleted: where its VM is, if it has one yet."""

    replica_id: str
    vmid: str | None
    node: Node | None


def _begin_delete(
    s: Session, settings: Settings, replica_id: str, op_id: str | None
) -> Doomed | None:
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
            select(Replica).options(lazyload(Replica.gpu))
            .where(Replica.id.in_(list(replica_ids))).with_for_update(of=Replica)
        ).all()
        found = {r.id: r for r in rows}
        for replica_id in replica_ids:
            replica = found.get(replica_id)
            if replica is None:
                if op_id:
                    settle(s, op_id, ok=True)  # a row that is gone is a delete that succeeded
                continue
            if replica.status == ReplicaState.DELETING and replica.operation_id in (None, op_id):
                out.append(Doomed(replica.id, replica.vmid, replica.node))  # marked by our plan
                continue
            doomed = _begin_delete(s, settings, replica_id, op_id)
            if doomed is not None:
                out.append(doomed)
    return out


def release_vm(settings: Settings, doomed: Doomed) -> bool:
    """Tear the VM down; False when there was none or the node says it is gone."""
    if doomed.vmid is None or doomed.node is None:
        return False
    return backends.release_vm(doomed.node, doomed.vmid, settings)


def release_all(settings: Settings, doomed: Sequence[Doomed]) -> dict[str, bool | BackendError]:
    """Tear down the VMs of many replicas at once, bounded per node.

    Replica id -> True (released), False (there was no VM, or it was already gone),
    or the error. After ``CORRAL_NODE_FAILURES`` transport errors in a row from one
    node its other releases are not sent: they get the same error.
    """
    out: dict[str, bool | BackendError] = {}
    work: dict[str, list[tuple[str, backends.Target, str]]] = defaultdict(list)
    for d in doomed:
        if d.vmid is None or d.node is None:
            out[d.replica_id] = False
        else:
            work[d.node.id].append((d.replica_id, backends.target(d.node), d.vmid))
    if not work:
        return out

    def lane_of(node_id: str) -> inflight.Lane:
        return inflight.Lane(node_id, bound=settings.node_max_inflight,
                             stop_after=settings.node_failures)

    async def call(item: tuple[str, backends.Target, str]) -> bool:
        _, t, vmid = item
        try:
            return await backends.send_release(t, vmid, settings)
        except BackendError:
            raise
        except Exception as exc:  # a client bug must not take the batch down
            raise PermanentBackendError(f"ReleaseVMSetup failed: {type(exc).__name__}: {exc}",
                                        node=t.name) from None

    results, lanes = inflight.run(inflight.lanes(
        work, lane_of, call, failed=lambda e: isinstance(e, TransientBackendError),
        total=settings.max_inflight, source=node_slots.source(settings)))
    for node_id, items in work.items():
        for item in items:
            result = results.get(id(item))
            if result is None:
                err = lanes[node_id].last_error
                assert isinstance(err, BackendError)
                out[item[0]] = err
            elif result.error is not None:
                err = result.error
                out[item[0]] = err if isinstance(err, BackendError) else PermanentBackendError(
                    str(err))
            else:
                out[item[0]] = bool(result.value)
    return out


def finish_delete(
    db: Database, settings: Settings, replica_id: str, error: str | None = None
) -> None:
    """Retire a Deleting replica: Deleted, or Dead with the error that stopped the release."""
    finish_deletes(db, settings, {replica_id: error})


def finish_deletes(db: Database, settings: Settings, errors: dict[str, str | None]) -> None:
    """Retire Deleting replicas in one transaction: Deleted, or Dead with their error."""
    if not errors:
        return
    with db.transaction() as s:
        retire_deleting(s, settings, errors)


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
        spawns = [SpawnJob(f"{op.id}.{i}") for i in range(target - counted)]
        deletes: list[str] = []
        note = None
        if target < counted:
            deletes = _mark_surplus(s, db, settings, fn, op.id, counted - target)
            if len(deletes) < counted - target:
                note = (
                    f"removed {len(deletes)} of {counted - target}: the other replicas are "
                    "serving requests or still starting"
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


def _mark_surplus(
    s: Session, db: Database, settings: Settings, fn: Function, op_id: str, want: int
) -> list[str]:
    """Mark up to ``want`` unclaimed Idle replicas Deleting, old builds and longest idle first."""
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
    mark_deleting(s, settings, idle, op_id)
    return [replica.id for replica in idle]


def check_target(fn: Function, target: int) -> None:
    """Refuse a target outside the function's [min, max]."""
    if target < 0:
        raise InputError(f"target must not be negative, got {target}")
    if target < fn.min_replicas or target > fn.max_replicas:
        raise InputError(
            f"target {target} is outside {fn.name}'s range "
            f"[{fn.min_replicas}, {fn.max_replicas}]"
        )


