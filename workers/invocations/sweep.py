"""The calls' sweep (beat, every ``CORRAL_CALLS_SWEEP_INTERVAL_S``): lost messages sent again.

A call's message can be lost: a broker that restarts without the last second of its
log, a worker killed holding a retry's delayed message, a worker killed mid-attempt
(its message comes back only after the visibility timeout). Every open call therefore
has a ``resend_at`` - when it should have moved by, if its message arrived: its
acceptance or retry plus ``CORRAL_CALLS_RESEND_S``, or its attempt's lease - and the
sweep sends the message of each call past it again (and moves ``resend_at`` on), as
the callbacks of finished calls past their ``callback_at``. A message sent twice starts
one attempt (:func:`workers.invocations.attempts.begin`), so the sweep errs on the side
of sending - but not into a backlog: a queued call's message is most likely still
waiting in ``corral.invocations``, so of the queued calls past their ``resend_at`` it
sends only as many as the queue's length cannot account for (queued calls minus
messages waiting), oldest first. A backlog that outlasts ``CORRAL_CALLS_RESEND_S`` is
then not sent a second time, which under overload would double the work of every
worker; a message really lost shows as a call the queue has no message for. It also
purges finished calls past ``CORRAL_CALLS_KEEP_S`` and beyond
``CORRAL_CALLS_KEEP_MAX`` (a few batches a pass). Several sweeps at once only send
some messages twice: the rows are taken with ``SKIP LOCKED`` and moved on before the
messages go out.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import InstrumentedAttribute

from config.settings import Settings
from workers.base.clock import now
from workers.invocations.queue import CallQueue
from workers.invocations.records import purge
from workers.store.db import Database, store_now
from workers.store.models import Call, CallStatus

log = logging.getLogger(__name__)

RESEND_BATCH = 1000  # messages one pass sends at most, of each kind
PURGE_BATCHES = 5  # purge batches (of records.PURGE_BATCH) one pass runs at most


@dataclass(frozen=True)
class SweepReport:
    """What one pass did."""

    resent: int
    callbacks_resent: int
    purged: int
    error: str | None = None

    @property
    def changed(self) -> bool:
        """Whether the pass sent or removed anything."""
        return bool(self.resent or self.callbacks_resent or self.purged)

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping."""
        return asdict(self)


def _due(
    db: Database, settings: Settings, column: InstrumentedAttribute[Any], *where: Any
) -> list[str]:
    """Take up to a batch of calls past ``column`` and move it on; their ids."""
    later = now() + timedelta(seconds=settings.calls_resend_s)
    with db.transaction() as s:
        ids = list(
            s.scalars(
                select(Call.id)
                .where(column < store_now(), *where)
                .order_by(column)
                .limit(RESEND_BATCH)
                .with_for_update(skip_locked=True)
            )
        )
        if ids:
            s.execute(update(Call).where(Call.id.in_(ids)).values({column.key: later}))
    return ids


def _missing(db: Database, queue: CallQueue, overdue: int) -> int:
    """How many of the queued calls' messages may be lost: the queued calls the backlog of
    ``corral.invocations`` cannot account for (all ``overdue`` when it cannot be read)."""
    if not overdue:
        return 0
    try:
        waiting = queue.backlog()
    except Exception:
        waiting = None
    if waiting is None:
        return overdue
    with db.read() as s:
        queued = s.scalar(select(func.count()).where(Call.status == CallStatus.QUEUED.value)) or 0
    return max(0, min(overdue, int(queued) - waiting))


def sweep(db: Database, settings: Settings, queue: CallQueue) -> SweepReport:
    """One pass: send lost messages of calls and callbacks again, purge old calls."""
    resent = callbacks = 0
    error = None
    try:
        moving = Call.status.in_((CallStatus.RUNNING.value, CallStatus.RETRYING.value))
        queued = _due(db, settings, Call.resend_at, Call.status == CallStatus.QUEUED.value)
        for call_id in queued[: _missing(db, queue, len(queued))]:  # oldest first
            queue.send(call_id)
            resent += 1
        for call_id in _due(db, settings, Call.resend_at, moving):
            queue.send(call_id)
            resent += 1
        for call_id in _due(db, settings, Call.callback_at, Call.callback_state == "pending"):
            queue.send_callback(call_id)
            callbacks += 1
    except Exception as exc:  # the broker is away: the next pass sends them (resend_at moved)
        error = f"could not send: {type(exc).__name__}: {exc}"
        log.warning("calls' sweep: %s", error)
    purged = purge(db, settings, keep_max=settings.calls_keep_max, batches=PURGE_BATCHES)
    if resent or callbacks:
        log.info("calls' sweep: sent %d calls and %d callbacks again", resent, callbacks)
    return SweepReport(resent, callbacks, purged, error)
