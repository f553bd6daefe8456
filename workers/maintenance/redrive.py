"""Re-sending the task of an operation whose message the broker lost.

The model
---------
An operation's record is written before its task is queued, and every task is
idempotent (keyed by operation and request ids), so the record, not the
message, is the request. The broker can still lose a message after accepting
it: Redis loses its last writes when it crashes between fsyncs, and kombu's
Redis transport takes a message off its queue and records it as unacknowledged
in two steps, so a message taken in the instant the broker goes down is gone.
No worker will run it, and its operation would stay open for ever.

So an open operation records when it last moved (``progress_at``: created, its
first task ran, a part settled). Each reap pass calls :func:`due`, which takes
the open operations that have not moved for ``CORRAL_REDRIVE_AFTER_S`` (doubled
after every re-send), stamps them as re-sent, and returns them; :func:`resend_due` (the
reap task's) sends each one's first task again through the queue it is handed
(:class:`workers.dispatch.TaskQueue`). If the first message was only late, the second
delivery finds the work done and does nothing more.

Only kinds whose first task is safe to repeat are passed in (not CPU hogs: a
second ``CreateCPUHogs`` would start more hogs).

No operation stays open for ever: :func:`give_up` (also run by each reap pass)
fails an open operation that is past hope - re-sent :data:`REDRIVE_MAX` times
and still not moving, or of a kind that is never re-sent - once it has not
moved for ``CORRAL_REDRIVE_AFTER_S`` x 2^REDRIVE_MAX, with the reason as its
error ("no progress after 3 re-sends of its task"). The reaper's stuck sweep
still retires its replica rows.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.kinds import OpKind
from workers.dispatch import TaskQueue, Work
from workers.operations import fail_operation
from workers.store.db import Database
from workers.store.models import OP_OPEN, Operation

log = logging.getLogger(__name__)

# Operations whose first task may run twice: everything it does is keyed by the
# operation and its request ids. Not CPU hogs: a second CreateCPUHogs starts more.
RESENDABLE = (OpKind.SPAWN, OpKind.SCALE, OpKind.DELETE, OpKind.REAP, OpKind.RECONCILE)
REDRIVE_MAX = 3  # re-sends per operation
SWEEP_LIMIT = 100  # operations re-sent per pass at most


@dataclass(frozen=True)
class Redrive:
    """An operation whose first task is to be sent again."""

    op_id: str
    kind: OpKind
    params: dict[str, Any]
    attempt: int  # 1 for the first re-send

    @property
    def work(self) -> Work:
        """The first task to send again."""
        return Work(self.kind, self.op_id, self.params)


def _stalled(s: Session, since: datetime, limit: int, *where: Any) -> Sequence[Operation]:
    """Open operations unmoved since ``since`` matching ``where``, oldest first, locked."""
    return s.scalars(
        select(Operation)
        .where(Operation.status.in_(OP_OPEN), Operation.progress_at <= since, *where)
        .order_by(Operation.progress_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()


def due(
    db: Database, settings: Settings, kinds: Collection[OpKind], *, limit: int = SWEEP_LIMIT
) -> list[Redrive]:
    """Open operations of ``kinds`` that stopped moving, each stamped as re-sent once more."""
    after = timedelta(seconds=settings.redrive_after_s)
    out: list[Redrive] = []
    with db.transaction() as s:
        at = now()  # inside: the transaction has measured the store's clock
        for op in _stalled(
            s, at - after, limit, Operation.kind.in_(list(kinds)), Operation.redrives < REDRIVE_MAX
        ):
            assert op.progress_at is not None  # noqa: S101 - narrows for mypy; the query's condition
            still = at - op.progress_at
            if still < after * (2**op.redrives):
                continue  # re-sent before and not yet due again
            op.redrives += 1
            op.progress_at = at
            out.append(Redrive(op.id, op.kind, dict(op.params or {}), op.redrives))
            log.warning(
                "operation %s (%s, %s) made no progress for %ds; re-sending its task (%d of %d)",
                op.id,
                op.kind,
                op.status,
                still.total_seconds(),
                op.redrives,
                REDRIVE_MAX,
            )
    return out


def resend_due(
    db: Database, settings: Settings, queue: TaskQueue, kinds: Collection[OpKind] = RESENDABLE
) -> dict[str, str]:
    """Fail the hopeless, re-send the first task of the rest that stopped moving; id -> outcome."""
    sent = {op_id: f"failed: {reason}" for op_id, reason in give_up(db, settings, kinds).items()}
    for redrive in due(db, settings, kinds):
        try:
            queue.send(redrive.work)
        except Exception as exc:  # the broker is down again: the next pass retries
            sent[redrive.op_id] = f"error: {type(exc).__name__}: {exc}"
        else:
            sent[redrive.op_id] = f"re-sent {redrive.kind} ({redrive.attempt} of {REDRIVE_MAX})"
    return sent


def give_up(
    db: Database, settings: Settings, resendable: Collection[OpKind], *, limit: int = SWEEP_LIMIT
) -> dict[str, str]:
    """Fail the open operations that stopped moving for good; op id -> the reason recorded.

    That is: re-sent :data:`REDRIVE_MAX` times (or of a kind not in ``resendable``,
    never re-sent) and unmoved for ``CORRAL_REDRIVE_AFTER_S`` x 2^REDRIVE_MAX since.
    """
    wait = timedelta(seconds=settings.redrive_after_s) * (2**REDRIVE_MAX)
    out: dict[str, str] = {}
    with db.transaction() as s:
        at = now()  # inside: the transaction has measured the store's clock
        hopeless = (Operation.redrives >= REDRIVE_MAX) | Operation.kind.not_in(list(resendable))
        for op in _stalled(s, at - wait, limit, hopeless):
            assert op.progress_at is not None  # noqa: S101 - narrows for mypy; the query's condition
            still = int((at - op.progress_at).total_seconds())
            if op.kind in resendable:
                reason = (
                    f"no progress after {op.redrives} re-sends of its task "
                    f"(last {still}s ago); gave up"
                )
            else:
                reason = (
                    f"no progress for {still}s, and a {op.kind} task is never re-sent "
                    "(not safe to repeat); gave up"
                )
            log.error("operation %s (%s, %s): %s", op.id, op.kind, op.status, reason)
            fail_operation(s, op.id, reason)
            out[op.id] = reason
    return out
