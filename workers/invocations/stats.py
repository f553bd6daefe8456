"""What the control plane's exporter reads of calls: open calls from the store, totals in Redis.

Attempts run in many worker processes, so their verdicts are counted in one Redis hash
(:data:`KEY`) every process adds to (:func:`count`): ``succeeded``, ``retried``,
``dead``, ``redriven``, and callbacks ``delivered`` and ``failed``. The open calls are
read from the store when scraped (:func:`open_calls`): how many are queued, running
and retrying, and how long the oldest queued call has waited.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from workers.base.clock import now
from workers.store.models import CALL_OPEN, Call, CallStatus

KEY = "corral:metrics:calls"
#: Counted events (the verdicts of attempts, redrives, callbacks), as the exporter names them.
EVENTS = ("succeeded", "retried", "dead", "redriven", "callback_delivered", "callback_failed")
_VERDICTS = {"succeeded": "succeeded", "retry": "retried", "dead": "dead"}


def count(client: redis.Redis, event: str, n: int = 1) -> None:
    """Add ``n`` to one shared total (a verdict's name is taken for its event's)."""
    client.hincrby(KEY, _VERDICTS.get(event, event), n)


def totals(raw: Mapping[bytes | str, bytes | str]) -> dict[str, int]:
    """The shared totals as read from :data:`KEY` (every event, zeros included)."""
    got = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
    return {event: got.get(event, 0) for event in sorted(set(EVENTS) | set(got))}


@dataclass(frozen=True)
class OpenCalls:
    """Open calls now: how many per status, and the oldest queued one's wait in seconds."""

    by_status: dict[str, int]
    oldest_queued_s: float


def open_calls(session: Session) -> OpenCalls:
    """Count the open calls, and age the oldest queued one (0 when none waits)."""
    counts = dict.fromkeys(CALL_OPEN, 0)
    for status, n in session.execute(
        select(Call.status, func.count()).where(Call.status.in_(CALL_OPEN)).group_by(Call.status)
    ):
        counts[CallStatus(status).value] = int(n)
    oldest = session.scalar(
        select(func.min(Call.created_at)).where(Call.status == CallStatus.QUEUED.value)
    )
    age = max(0.0, (now() - oldest).total_seconds()) if oldest is not None else 0.0
    return OpenCalls(counts, age)
