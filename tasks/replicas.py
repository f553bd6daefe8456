"""Replica tasks: spawn fan-out, one task per replica, delete, scale.

A fan-out (``spawn``, or the growing half of ``scale``) splits its replicas into
``spawn_batch`` tasks of up to 50, so every worker process shares the work of a
large spawn. A batch writes its replica rows in one transaction - each row
Creating, with its node and GPU reserved - and then queues one ``spawn_replica``
task per row. Each of those asks the node for the VM and records it; a
``spawn_replica`` whose row is missing (a message sent by hand) writes it first,
the same way. Request ids are fixed by the operation, so a redelivered batch
writes nothing twice.

Thin wrappers: each loads its operation's inputs by id, calls the plain logic in
:mod:`workers.replicas`, and decides retries. Only transport errors
(:class:`~workers.errors.TransientBackendError`) are retried, with exponential
backoff and jitter, up to ``CORRAL_RETRY_MAX`` times; after that, or on a
permanent error, the replica is marked Dead with the error and its reservations
are freed.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Signature

from workers import replicas
from workers.app import CorralTask, app
from workers.errors import BackendError, TransientBackendError
from workers.health import note_failure

log = logging.getLogger(__name__)

# Rows written per transaction by a fan-out: big enough to amortize a transaction,
# small enough that the first VMs are asked for while later rows are still written.
PLACE_BATCH = 50


@app.task(bind=True, name="corral.spawn")
def spawn(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Fan a spawn operation out into one ``spawn_replica`` task per replica."""
    function_id, jobs = replicas.plan_spawn(self.db, op_id)
    _spawn_all(self, op_id, function_id, jobs)
    return {"op_id": op_id, "replicas": len(jobs)}


def _spawn_all(
    task: CorralTask, op_id: str, function_id: str, jobs: list[replicas.SpawnJob]
) -> None:
    """Place and queue ``jobs`` here if they fit one batch, else as ``spawn_batch`` tasks."""
    if len(jobs) <= PLACE_BATCH:
        _place_and_queue(task, op_id, function_id, jobs)
        return
    _send([
        spawn_batch.si(op_id, function_id,
                       [[j.request_id, j.node_id] for j in jobs[i : i + PLACE_BATCH]])
        for i in range(0, len(jobs), PLACE_BATCH)
    ])


def _place_and_queue(
    task: CorralTask, op_id: str, function_id: str, jobs: list[replicas.SpawnJob]
) -> None:
    replicas.place(task.db, task.settings, op_id, function_id, jobs)
    _send([spawn_replica.si(op_id, j.request_id, function_id, j.node_id) for j in jobs])


@app.task(bind=True, name="corral.spawn_batch")
def spawn_batch(
    self: CorralTask, op_id: str, function_id: str, jobs: list
) -> dict[str, Any]:
    """Write the rows of up to 50 replicas in one transaction, then queue their spawns."""
    parsed = replicas.parse_jobs(jobs)
    _place_and_queue(self, op_id, function_id, parsed)
    return {"op_id": op_id, "replicas": len(parsed)}


@app.task(bind=True, name="corral.spawn_replica")
def spawn_replica(
    self: CorralTask, op_id: str | None, request_id: str, function_id: str,
    node_id: str | None = None,
) -> dict[str, Any]:
    """Create one replica: row first, then the VM, then Idle."""
    settings = self.settings
    pending = replicas.begin_spawn(self.db, settings, op_id, request_id, function_id, node_id)
    if pending is None:
        return {"request_id": request_id, "state": "settled"}
    try:
        vm = replicas.create_vm(settings, pending)
    except TransientBackendError as exc:
        self.retry_within_budget(request_id, exc)
        error = f"{exc} (gave up after {self.request.retries + 1} attempts)"
        note_failure(self.db, settings, pending.node.id, str(exc))
        replicas.fail_spawn(self.db, settings, request_id, error)
        return {"request_id": request_id, "state": "dead", "error": error}
    except BackendError as exc:
        replicas.fail_spawn(self.db, settings, request_id, str(exc))
        return {"request_id": request_id, "state": "dead", "error": str(exc)}
    state = replicas.finish_spawn(self.db, settings, pending, vm)
    return {"request_id": request_id, "replica_id": pending.replica_id, "state": state}


@app.task(bind=True, name="corral.delete_replica")
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
    _send([delete_replica.si(rid, op_id) for rid in plan.deletes])
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
    """Do nothing: the baseline the spawn benchmark is measured against."""
