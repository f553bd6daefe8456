"""Queueing a task by its name: how logic (and the producer API) asks for work without importing it.

``tasks`` (the task wrappers, the producer API and the CLI) sits above ``workers``, and
an import never goes up. A worker-side module that needs a replica deleted - reconcile
draining a node, the registry answering DESTROY - sends the task by the name it is
registered under, as a signature: where the task is registered in this process (a
worker) that is the task's own ``apply_async``, elsewhere (the registry, the CLI)
``send_task``; either way Celery routes it by name to its queue
(``config.celery.ROUTES``) exactly as it routes ``delay()``. In eager mode the task
runs in this process, so the app's task modules are loaded first (:func:`_task`), as a
worker loads them when it starts: nothing has to import them just in case.

Every operation is carried out by a *first task*, named here by the operation's kind
(:data:`FIRST_TASKS`) and built from the operation's stored params (:func:`first_task`).
:func:`submit` writes an operation and queues its first task - the producer API's
one way of asking for work, and the maintenance tasks' way of asking for spawns and
scales; :func:`resend` sends the first task of an operation that stopped moving again
(:mod:`workers.maintenance.redrive`). A first task's message says when it was sent
(:data:`workers.stages.SENT_HEADER`): its ``queue`` stage.

A caller that waits for the work itself - the gateway's cold start - may have the first
task carried out *here*, in this process (``submit(..., here=True)``): on one of
:data:`HERE_THREADS` threads, Celery's ``apply`` runs the task as a worker would, its
follow-up tasks queued as usual; the broker hop is saved. When those threads are all
busy the task is queued instead. Nothing else changes: the operation was written first,
so a process that dies mid-task leaves what a killed worker leaves (an open operation
that redrive sends again, rows whose owner's lease lapses).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Signature
from sqlalchemy.orm import Session

from workers import stages
from workers.backends import inflight
from workers.celery import app
from workers.errors import BrokerError, CorralError
from workers.kinds import OpKind
from workers.operations import fail_op
from workers.store.db import Database
from workers.store.models import Operation

log = logging.getLogger(__name__)

DELETE_REPLICA = "corral.delete_replica"
HERE_THREADS = 4  # first tasks one process carries out itself at once; more are queued
RELEASE_ORPHAN = "corral.release_orphan"

# The task that carries out an operation of each kind.
FIRST_TASKS = {
    OpKind.SPAWN: "corral.spawn",
    OpKind.SCALE: "corral.scale",
    OpKind.DELETE: DELETE_REPLICA,
    OpKind.HOGS: "corral.hogs",
    OpKind.REAP: "corral.reap",
    OpKind.RECONCILE: "corral.reconcile",
}


def _task(name: str, **options: Any) -> Signature:
    """The signature of task ``name``; in eager mode its module is loaded to run it here."""
    if app.conf.task_always_eager and name not in app.tasks:
        app.loader.import_default_modules()  # the app's ``include``: tasks.replicas, ...
    return app.signature(name, **options)


def delete_replica(replica_id: str) -> None:
    """Queue the delete of one replica (already marked Deleting by the caller)."""
    _task(DELETE_REPLICA, args=(replica_id,)).apply_async()


def release_orphan(node_id: str, vmid: str) -> None:
    """Queue the release of a VM no replica took (an orphan) on one node."""
    _task(RELEASE_ORPHAN, args=(node_id, vmid)).apply_async()


def first_task(kind: OpKind, op_id: str, params: dict[str, Any]) -> Signature:
    """The task that carries out an operation of ``kind``, built from its stored params."""
    name = FIRST_TASKS.get(kind)
    if name is None:
        raise ValueError(f"no task carries out operations of kind {str(kind)!r}")
    match kind:
        case OpKind.DELETE:
            return _task(name, args=(params["replica"], op_id), immutable=True)
        case OpKind.HOGS:
            kwargs = {
                "action": params["action"],
                "n": params["n"],
                "node": params["node"],
                "op_id": op_id,
            }
        case OpKind.REAP:
            kwargs = {"idle_timeout": params.get("idle_timeout"), "op_id": op_id}
        case OpKind.RECONCILE:
            kwargs = {"op_id": op_id}
        case _:  # spawn, scale: everything else is in the operation row
            return _task(name, args=(op_id,), immutable=True)
    return _task(name, kwargs=kwargs, immutable=True)


def resend(kind: OpKind, op_id: str, params: dict[str, Any]) -> None:
    """Send the first task of an operation again (one that stopped moving)."""
    first_task(kind, op_id, params).apply_async(headers=stages.sent_header())


class _Here:
    """A few threads that carry out first tasks in this process (made after any fork)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._pid = 0
        self._busy = 0

    def offer(self, signature: Signature) -> bool:
        """Start ``signature`` on a free thread here (in this context); False if none is free."""
        with self._lock:
            if self._busy >= HERE_THREADS:
                return False
            if self._pool is None or self._pid != os.getpid():
                self._pool = ThreadPoolExecutor(HERE_THREADS, thread_name_prefix="first-task")
                self._pid, self._busy = os.getpid(), 0
            self._busy += 1
            pool = self._pool
        pool.submit(contextvars.copy_context().run, self._run, signature)
        return True

    def _run(self, signature: Signature) -> None:
        try:
            if signature.task not in app.tasks:  # the app's include, as a worker loads it
                app.loader.import_default_modules()
            result = signature.apply(headers=stages.sent_header())
            if result.failed():  # the task ended its operation failed, and said why
                log.warning("task %s carried out here failed: %s", signature.task, result.result)
        except Exception:  # nothing escapes a thread unseen
            log.exception("task %s carried out here crashed", signature.task)
        finally:
            with self._lock:
                self._busy -= 1


_here = _Here()


def ready_here() -> None:
    """Ahead of time, what a first task carried out here needs: the app's task modules, and
    the event loop that sends agent calls (:mod:`workers.backends.inflight`)."""
    if "corral.spawn" not in app.tasks:
        app.loader.import_default_modules()
    inflight.run(asyncio.sleep(0))


def enqueue(db: Database, op: Operation, *, here: bool = False) -> str:
    """Queue the first task of a freshly written operation; fail the operation if we cannot.

    ``here``: carry it out in this process if a thread is free (the broker hop saved).
    """
    op_id = op.id
    try:
        signature = first_task(op.kind, op_id, op.params)
        if here and _here.offer(signature):
            return op_id
        signature.apply_async(headers=stages.sent_header())
    except CorralError:
        raise
    except Exception as exc:  # kombu/redis raise many types when the broker is down
        reason = f"could not queue the task: {type(exc).__name__}: {exc}"
        fail_op(db, op_id, reason)
        raise BrokerError(reason) from None
    return op_id


def submit(db: Database, write: Callable[[Session], Operation], *, here: bool = False) -> str:
    """Write an operation (``write``, in one transaction) and queue its first task; its id.

    ``here``: carry the task out in this process if a thread is free (:func:`enqueue`).
    """
    with db.transaction() as s:
        op = write(s)
    return enqueue(db, op, here=here)
