"""Replica tasks: spawn and delete a batch at a time, scale, and single-replica retries.

A fan-out (``spawn``, or the growing half of ``scale``) splits its replicas into
batches of up to ``SPAWN_BATCH``: the fan-out task works the first batch itself
and queues a ``spawn_batch`` task for each other one, so every worker process
shares a large spawn. A batch writes its replica rows in one transaction - each
row Creating, with its node and GPU reserved - then asks the agents for all of
its VMs at once and records the answers as they come, in one transaction or a
few (:func:`workers.replicas.actions.spawn_pending`). Request ids are fixed by the operation,
so a redelivered batch writes nothing twice and creates no second VM.

A replica whose create hit a transport error is retried alone: the batch queues a
``spawn_replica`` task for it with backoff, which retries up to
``CORRAL_RETRY_MAX`` times in all (exponential backoff with jitter); after that
the failure counts against the node and the replica moves to another node (a
fresh ``spawn_replica``), or is marked Dead when it has been tried on
``MAX_PLACEMENTS`` nodes or no other node has room.

Deletes go the same way: ``delete_batch`` marks up to ``DELETE_BATCH`` replicas
Deleting in one transaction, releases their VMs at once and retires the rows in
one transaction; a transport error sends that replica alone to ``delete_replica``
with backoff. ``delete_replica`` is also the task of a single ``corral delete``.

Tasks are thin wrappers: each loads its operation's inputs by id and calls the
plain logic in :mod:`workers.replicas.actions`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery import Signature

from workers import dispatch
from workers.celery import CorralTask, app
from workers.errors import BackendError, InputError, TransientBackendError
from workers.fleet.health import note_failure
from workers.replicas import actions as replicas

log = logging.getLogger(__name__)

# Replicas per batch: rows written in one transaction and VMs asked for at once. Big
# enough that a batch keeps many calls in flight, small enough that a large spawn is
# shared by every worker process.
SPAWN_BATCH = 100
DELETE_BATCH = 100


@app.task(bind=True, name="corral.spawn")
def spawn(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Spawn an operation's replicas: the first batch here, the others as ``spawn_batch``."""
    function_id, jobs = replicas.plan_spawn(self.db, op_id)
    _spawn_all(self, op_id, function_id, jobs)
    return {"op_id": op_id, "replicas": len(jobs)}


def _spawn_all(
    task: CorralTask, op_id: str, function_id: str, jobs: list[replicas.SpawnJob]
) -> None:
    """Queue every batch but the first, then work the first one here."""
    if not jobs:
        return
    batches = [jobs[i : i + SPAWN_BATCH] for i in range(0, len(jobs), SPAWN_BATCH)]
    _send([
        spawn_batch.si(op_id, function_id, [[j.request_id, j.node_id] for j in batch])
        for batch in batches[1:]
    ])
    _spawn_jobs(task, op_id, function_id, batches[0])


def _spawn_jobs(
    task: CorralTask, op_id: str | None, function_id: str, jobs: Sequence[replicas.SpawnJob]
) -> dict[str, str]:
    """Write the batch's rows, create their VMs at once, queue lone retries; states by request."""
    replicas.place(task.db, task.settings, op_id, function_id, list(jobs))
    pending = replicas.pending_batch(task.db, [j.request_id for j in jobs])
    settled = replicas.spawn_pending(task.db, task.settings, pending)
    _send([
        spawn_replica.si(p.operation_id, p.request_id, function_id).set(
            countdown=task.backoff(), retries=1)
        for p, _ in settled.retry
    ] + [spawn_replica.si(p.operation_id, p.request_id, function_id) for p in settled.again])
    for p, exc in settled.retry:
        log.warning("spawn %s: %s; retrying it alone", p.request_id, exc)
        settled.states[p.request_id] = "retrying"
    return settled.states


@app.task(bind=True, name="corral.spawn_batch")
def spawn_batch(
    self: CorralTask, op_id: str, function_id: str, jobs: list[Any]
) -> dict[str, Any]:
    """Spawn up to ``SPAWN_BATCH`` replicas: rows in one transaction, VMs at once."""
    parsed = replicas.parse_jobs(jobs)
    states = _spawn_jobs(self, op_id, function_id, parsed)
    return {"op_id": op_id, "replicas": len(parsed), "states": _tally(states.values())}


def _tally(states: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for state in states:
        out[state] = out.get(state, 0) + 1
    return out


@app.task(bind=True, name="corral.spawn_replica")
def spawn_replica(
    self: CorralTask, op_id: str | None, request_id: str, function_id: str,
    node_id: str | None = None,
) -> dict[str, Any]:
    """Create one replica (row first, then the VM), retrying transport errors with backoff."""
    settings = self.settings
    pending = replicas.begin_spawn(self.db, settings, op_id, request_id, function_id, node_id)
    if pending is None:
        return {"request_id": request_id, "state": "settled"}
    settled = replicas.spawn_pending(self.db, settings, [pending])
    if settled.again:  # moved to another node more often than one call tries
        _send([spawn_replica.si(op_id, request_id, function_id)])
        return {"request_id": request_id, "state": "moved"}
    if not settled.retry:
        return {"request_id": request_id, "replica_id": pending.replica_id,
                "state": settled.states.get(request_id, "settled")}
    ((stuck, exc),) = settled.retry
    self.retry_within_budget(request_id, exc)
    error = f"{exc} (gave up after {self.request.retries + 1} attempts)"
    note_failure(self.db, settings, stuck.node.id, str(exc))
    if replicas.give_up(self.db, settings, stuck, error):
        _send([spawn_replica.si(op_id, request_id, function_id)])  # on its new node
        return {"request_id": request_id, "state": "moved", "error": error}
    return {"request_id": request_id, "state": "dead", "error": error}


@app.task(bind=True, name="corral.delete_batch")
def delete_batch(self: CorralTask, op_id: str | None, replica_ids: list[Any]) -> dict[str, Any]:
    """Delete up to ``DELETE_BATCH`` replicas: mark, release at once, retire in one transaction."""
    if not replica_ids or not all(isinstance(r, str) for r in replica_ids):
        raise InputError("replica_ids must be a non-empty list of replica ids")
    settings = self.settings
    doomed = replicas.begin_deletes(self.db, settings, replica_ids, op_id)
    outcomes = replicas.release_all(settings, doomed)
    errors: dict[str, str | None] = {}
    retry: list[str] = []
    for d in doomed:
        outcome = outcomes[d.replica_id]
        if isinstance(outcome, TransientBackendError):
            retry.append(d.replica_id)
        else:
            errors[d.replica_id] = str(outcome) if isinstance(outcome, BackendError) else None
    replicas.finish_deletes(self.db, settings, errors)
    _send([delete_replica.si(rid, op_id).set(countdown=self.backoff(), retries=1)
           for rid in retry])
    return {"op_id": op_id, "deleted": len(errors), "retrying": len(retry)}


@app.task(bind=True, name=dispatch.DELETE_REPLICA)
def delete_replica(self: CorralTask, replica_id: str, op_id: str | None = None) -> dict[str, Any]:
    """Release a replica's VM and retire its row; an already deleted replica is fine."""
    settings = self.settings
    doomed = replicas.begin_delete(self.db, settings, replica_id, op_id)
    if doomed is None:
        return {"replica_id": replica_id, "state": "already gone"}
    try:
        released = replicas.release_vm(settings, doomed)
    except TransientBackendError as exc:
        self.retry_within_budget(replica_id, exc)
        error = f"{exc}; reconcile will destroy the VM once the node answers"
        if doomed.node is not None:
            note_failure(self.db, settings, doomed.node.id, str(exc))
        replicas.finish_delete(self.db, settings, replica_id, error)
        return {"replica_id": replica_id, "state": "dead", "error": error}
    except BackendError as exc:
        replicas.finish_delete(self.db, settings, replica_id, str(exc))
        return {"replica_id": replica_id, "state": "dead", "error": str(exc)}
    replicas.finish_delete(self.db, settings, replica_id)
    return {"replica_id": replica_id, "state": "deleted", "released": released}


@app.task(bind=True, name="corral.scale")
def scale(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Bring a function to its target: spawn the missing, delete surplus Idle replicas."""
    plan = replicas.plan_scale(self.db, self.settings, op_id)
    _send([delete_batch.si(op_id, plan.deletes[i : i + DELETE_BATCH])
           for i in range(0, len(plan.deletes), DELETE_BATCH)])
    _spawn_all(self, op_id, plan.function_id, plan.spawns)
    return {"op_id": op_id, "spawn": len(plan.spawns), "delete": len(plan.deletes),
            "note": plan.note}


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
