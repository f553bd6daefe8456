"""Asking for work: the :class:`TaskQueue` port, and writing an operation before queueing it.

``tasks`` (the task wrappers, the producer API and the CLI) sits above ``workers``, and
an import never goes up; so the logic never sends a task itself, by object or by name.
What needs work done - the gateway's cold start, the registry answering DESTROY,
reconcile draining a node, the maintenance passes - is *handed* a :class:`TaskQueue`
by whoever starts it (``corral gateway`` / ``corral registry`` in :mod:`corral.cli`, the
Celery tasks, tests) and asks it for one of four things:

* :meth:`TaskQueue.send` - queue the first task of an operation written already;
* :meth:`TaskQueue.run_here` - carry that task out in this process if the queue can (a
  caller that waits for the work itself: the gateway's cold start), else queue it;
* :meth:`TaskQueue.delete_replica` - delete one replica (marked Deleting by the caller);
* :meth:`TaskQueue.release_orphan` - release a VM no replica took.

The implementations live where the tasks live (:mod:`tasks.queues`): the Celery queue,
which holds the task objects and routes each message to its queue
(``config.celery.ROUTES``), and the in-process one, which carries a task out in the
caller's thread, inline (:func:`workers.celery.inline`: no hard limit, a deadline).

Every operation is carried out by a *first task* chosen by the operation's kind, built
from its stored params: what the queue is given is that, a :class:`Work`. :func:`submit`
writes an operation and queues its first task - the producer API's one way of asking
for work, and the maintenance passes' way of asking for spawns and scales;
:func:`enqueue` queues the first task of an operation written already (a cold start's
spawn, a suspect's delete). Either fails the operation, with the reason, when the
queue cannot take it (the broker is down), and raises :class:`BrokerError`. The
operation is written first, so a process that dies before or while its task runs
leaves an open operation that redrive sends again (:mod:`workers.maintenance.redrive`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.orm import Session

from workers.base.errors import BrokerError, CorralError
from workers.base.kinds import OpKind
from workers.operations import fail_op
from workers.store.db import Database
from workers.store.models import Operation


@dataclass(frozen=True)
class Work:
    """An operation's first task to carry out: the operation's kind, id and stored params."""

    kind: OpKind
    op_id: str
    params: Mapping[str, Any]

    @classmethod
    def of(cls, op: Operation) -> Work:
        """The work of an operation row (read while it is at hand: a plain value after)."""
        return cls(OpKind(op.kind), op.id, dict(op.params or {}))


class TaskQueue(Protocol):
    """Where the logic asks for work; each call returns once the work is queued (or done)."""

    def send(self, work: Work) -> None:
        """Queue the first task of an operation written already."""

    def run_here(self, work: Work) -> None:
        """Carry the first task out in this process if this queue can, else queue it."""

    def delete_replica(self, replica_id: str) -> None:
        """Have a replica deleted (the caller marked it Deleting)."""

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Have a VM no replica took (an orphan) released on its node."""


def enqueue(db: Database, queue: TaskQueue, op: Operation, *, here: bool = False) -> str:
    """Queue the first task of a freshly written operation; fail the operation if we cannot.

    ``here``: have the queue carry it out in this process if it can (the broker hop saved).
    """
    work = Work.of(op)
    try:
        if here:
            queue.run_here(work)
        else:
            queue.send(work)
    except CorralError:
        raise
    except Exception as exc:  # kombu/redis raise many types when the broker is down
        reason = f"could not queue the task: {type(exc).__name__}: {exc}"
        fail_op(db, work.op_id, reason)
        raise BrokerError(reason) from None
    return work.op_id


def submit(
    db: Database, queue: TaskQueue, write: Callable[[Session], Operation], *, here: bool = False
) -> str:
    """Write an operation (``write``, in one transaction) and queue its first task; its id."""
    with db.transaction() as s:
        op = write(s)
    return enqueue(db, queue, op, here=here)
