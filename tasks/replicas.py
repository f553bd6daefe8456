"""Replica tasks: spawn and delete a batch at a time, scale, and single-replica retries.

Each task loads its operation's inputs by id, calls the plain logic in
:mod:`workers.replicas` (``spawn``, ``delete``, ``scale``) with its time budget, and
queues whatever follow-up work the logic hands back: the other batches of a fan-out, a
batch's unsent rest, a replica to try alone with backoff (``spawn_replica``,
``delete_replica``). Every task may run twice, at once or late: the replica rows decide
who does what (:mod:`workers.replicas.owners`), never the message.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any

from celery import Signature

from workers import stages
from workers.celery import CorralTask, app
from workers.errors import TransientBackendError
from workers.redis_client import redis_client
from workers.replicas import delete as deleting
from workers.replicas import scale as scaling
from workers.replicas import spawn as spawning
from workers.replicas.outcomes import Next


@app.task(bind=True, name="corral.spawn")
def spawn(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Spawn an operation's replicas: the first batch here, the others as ``spawn_batch``."""
    with _timed(self, op_id) as timer:
        function_id, jobs = spawning.plan_spawn(self.db, op_id)
        timer.mark_planned()
        first = _fan_out(self, op_id, function_id, jobs)
    return {"op_id": op_id, "replicas": len(jobs), "states": first.tally()}


@app.task(bind=True, name="corral.spawn_batch")
def spawn_batch(self: CorralTask, op_id: str, function_id: str, jobs: list[Any]) -> dict[str, Any]:
    """Spawn up to ``SPAWN_BATCH`` replicas: rows in one transaction, VMs at once."""
    parsed = spawning.parse_jobs(jobs)
    nxt = spawning.run_batch(self.db, self.settings, op_id, function_id, parsed, self.budget)
    _follow(self, function_id, nxt)
    return {"op_id": op_id, "replicas": len(parsed), "states": nxt.tally()}


@app.task(bind=True, name="corral.spawn_replica")
def spawn_replica(
    self: CorralTask,
    op_id: str | None,
    request_id: str,
    function_id: str,
    node_id: str | None = None,
) -> dict[str, Any]:
    """Create one replica (row first, then the VM), retrying transport errors with backoff."""
    nxt = spawning.run_one(
        self.db, self.settings, op_id, request_id, function_id, node_id, self.budget
    )
    mine = nxt.retry_of(request_id)
    if mine is not None:
        self.retry_within_budget(request_id, mine.error)
        error = f"{mine.error} (gave up after {self.request.retries + 1} attempts)"
        nxt = spawning.give_up(
            self.db, self.settings, request_id, error, self.budget, failed_on=mine.node_id
        )
    _follow(self, function_id, nxt)
    return {"request_id": request_id, "state": nxt.state(request_id).value}


@app.task(bind=True, name="corral.delete_batch")
def delete_batch(self: CorralTask, op_id: str | None, replica_ids: list[Any]) -> dict[str, Any]:
    """Delete up to ``DELETE_BATCH`` replicas: mark, release at once, retire in one transaction."""
    out = deleting.delete_batch(self.db, self.settings, op_id, replica_ids, self.budget)
    _send(
        [
            delete_replica.si(rid, op_id).set(countdown=self.backoff(), retries=1)
            for rid in out.retry
        ]
        + ([delete_batch.si(op_id, out.rest)] if out.rest else [])
    )
    return {"op_id": op_id, "deleted": out.done, "retrying": len(out.retry), "left": len(out.rest)}


@app.task(bind=True, name="corral.delete_replica")
def delete_replica(self: CorralTask, replica_id: str, op_id: str | None = None) -> dict[str, Any]:
    """Release a replica's VM and retire its row; an already deleted replica is fine."""
    try:
        state, error = deleting.delete_one(self.db, self.settings, replica_id, op_id)
    except TransientBackendError as exc:
        self.retry_within_budget(replica_id, exc)
        state, error = deleting.delete_one(self.db, self.settings, replica_id, op_id, error=exc)
    return {"replica_id": replica_id, "state": state, "error": error}


@app.task(bind=True, name="corral.release_orphan")
def release_orphan(self: CorralTask, node_id: str, vmid: str) -> dict[str, Any]:
    """Release a VM no replica took (an orphan the registry found); retried with backoff."""
    try:
        state = deleting.release_orphan(self.db, self.settings, node_id, vmid)
    except TransientBackendError as exc:
        self.retry_within_budget(vmid, exc)
        state = f"not released: {exc}"
    return {"node_id": node_id, "vmid": vmid, "state": state}


@app.task(bind=True, name="corral.scale")
def scale(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Bring a function to its target: spawn the missing, delete surplus Idle replicas."""
    with _timed(self, op_id) as timer:
        plan = scaling.plan_scale(self.db, self.settings, op_id)
        timer.mark_planned()
        size = deleting.DELETE_BATCH
        _send(
            [
                delete_batch.si(op_id, plan.deletes[i : i + size])
                for i in range(0, len(plan.deletes), size)
            ]
        )
        _fan_out(self, op_id, plan.function_id, plan.spawns)
    return {
        "op_id": op_id,
        "spawn": len(plan.spawns),
        "delete": len(plan.deletes),
        "note": plan.note,
    }


def _timed(task: CorralTask, op_id: str) -> contextlib.AbstractContextManager[stages.SpawnTimer]:
    """Time this first task's spawn stages (:mod:`workers.stages`)."""
    sent_at = (task.request.headers or {}).get(stages.SENT_HEADER)
    return stages.timing(op_id, sent_at, redis_client(task.settings.broker_url))


def _fan_out(task: CorralTask, op_id: str, function_id: str, jobs: list[spawning.SpawnJob]) -> Next:
    """Queue a spawn's other batches, then work its first here; the first's outcome."""
    first, rest = spawning.split(jobs)
    _send([_batch(op_id, function_id, batch) for batch in rest])  # every worker, at once
    if not first:
        return Next()
    nxt = spawning.run_batch(task.db, task.settings, op_id, function_id, first, task.budget)
    _follow(task, function_id, nxt)
    return nxt


def _batch(op_id: str | None, function_id: str, jobs: list[spawning.SpawnJob]) -> Signature:
    return spawn_batch.si(op_id, function_id, [[j.request_id, j.node_id] for j in jobs])


def _follow(task: CorralTask, function_id: str, nxt: Next) -> None:
    """Queue what a spawn handler left: lone retries, moved replicas, the unsent rest."""
    rest: dict[str | None, list[spawning.SpawnJob]] = defaultdict(list)
    for r in nxt.rest:
        rest[r.operation_id].append(spawning.SpawnJob(r.request_id))
    _send(
        [
            spawn_replica.si(r.operation_id, r.request_id, function_id).set(
                countdown=task.backoff(), retries=1
            )
            for r in nxt.retry
        ]
        + [spawn_replica.si(r.operation_id, r.request_id, function_id) for r in nxt.again]
        + [_batch(op, function_id, jobs) for op, jobs in rest.items()]
    )


def _send(signatures: list[Signature]) -> None:
    """Queue child tasks (each to its own queue by route) over one producer connection."""
    if not signatures:
        return
    with app.producer_or_acquire() as producer:
        for signature in signatures:
            signature.apply_async(producer=producer)


@app.task(name="corral.noop")
def noop() -> None:
    """Do nothing (a quick check that a worker answers)."""
