"""Replica tasks: spawn and delete a batch at a time, scale, and single-replica retries.

Each task makes one call to :mod:`workers.replicas`' face (a handler per task) and
returns what it returns. The handler works the task's part and asks the task, through a
:class:`~workers.replicas.Port`, to send the messages the plan made of the rest - the
other batches of a fan-out, a batch's unsent rest, a replica to try alone with backoff
(:mod:`workers.replicas.plan`) - and to retry the task itself. Here each such message
becomes its task's signature, one to one. Every task may run twice, at once or late: the
replica rows decide who does what (:mod:`workers.replicas.owners`), never the message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from celery import Signature

from workers import replicas
from workers.base.redis_client import redis_client
from workers.celery import CorralTask, app
from workers.observability import stages


@app.task(bind=True, name="corral.spawn")
def spawn(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Spawn an operation's replicas: the first batch here, the others as ``spawn_batch``."""
    with _timed(self, op_id):
        return replicas.spawn_operation(_context(self), op_id)


@app.task(bind=True, name="corral.spawn_batch")
def spawn_batch(self: CorralTask, op_id: str, function_id: str, jobs: list[Any]) -> dict[str, Any]:
    """Spawn up to ``SPAWN_BATCH`` replicas: rows in one transaction, VMs at once."""
    return replicas.spawn_batch(_context(self), op_id, function_id, jobs)


@app.task(bind=True, name="corral.spawn_replica")
def spawn_replica(
    self: CorralTask,
    op_id: str | None,
    request_id: str,
    function_id: str,
    node_id: str | None = None,
) -> dict[str, Any]:
    """Create one replica (row first, then the VM), retrying transport errors with backoff."""
    return replicas.spawn_replica(_context(self), op_id, request_id, function_id, node_id)


@app.task(bind=True, name="corral.delete_batch")
def delete_batch(self: CorralTask, op_id: str | None, replica_ids: list[Any]) -> dict[str, Any]:
    """Delete up to ``DELETE_BATCH`` replicas: mark, release at once, retire in one transaction."""
    return replicas.delete_batch(_context(self), op_id, replica_ids)


@app.task(bind=True, name="corral.delete_replica")
def delete_replica(self: CorralTask, replica_id: str, op_id: str | None = None) -> dict[str, Any]:
    """Release a replica's VM and retire its row; an already deleted replica is fine."""
    return replicas.delete_replica(_context(self), replica_id, op_id)


@app.task(bind=True, name="corral.release_orphan")
def release_orphan(self: CorralTask, node_id: str, vmid: str) -> dict[str, Any]:
    """Release a VM no replica took (an orphan the registry found); retried with backoff."""
    return replicas.release_orphan(_context(self), node_id, vmid)


@app.task(bind=True, name="corral.scale")
def scale(self: CorralTask, op_id: str) -> dict[str, Any]:
    """Bring a function to its target: spawn the missing, delete surplus Idle replicas."""
    with _timed(self, op_id):
        return replicas.scale_operation(_context(self), op_id)


def _timed(task: CorralTask, op_id: str) -> contextlib.AbstractContextManager[stages.SpawnTimer]:
    """Time this first task's spawn stages (:mod:`workers.observability.stages`)."""
    sent_at = (task.request.headers or {}).get(stages.SENT_HEADER)
    return stages.timing(op_id, sent_at, redis_client(task.settings.broker_url))


class _Port:
    """The running task as its handler sees it: messages sent as tasks, retries as Celery's."""

    def __init__(self, task: CorralTask) -> None:
        self.task = task

    def send(self, messages: Sequence[replicas.Message]) -> None:
        """Queue each message as its task, in order."""
        _send([self._signature(m) for m in messages])

    def retry(self, what: str, error: Exception) -> int:
        """Retry the task after its backoff (raises) while retries remain; else attempts made."""
        self.task.retry_within_budget(what, error)
        return int(self.task.request.retries) + 1

    def _signature(self, m: replicas.Message) -> Signature:
        """A message's task signature (a retry's: after this task's backoff, its first retry)."""
        if isinstance(m, replicas.SpawnBatch):
            return spawn_batch.si(m.op_id, m.function_id, m.wire_jobs())
        if isinstance(m, replicas.SpawnOne):
            one = spawn_replica.si(m.op_id, m.request_id, m.function_id)
            return one.set(countdown=self.task.backoff(), retries=1) if m.after_backoff else one
        if isinstance(m, replicas.DeleteBatch):
            return delete_batch.si(m.op_id, list(m.replica_ids))
        return delete_replica.si(m.replica_id, m.op_id).set(
            countdown=self.task.backoff(), retries=1
        )


def _context(task: CorralTask) -> replicas.Context:
    """What a handler works with: this task's store, settings, time and port."""
    return replicas.Context(task.db, task.settings, task.budget, _Port(task))


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
