"""The one clock corral reads: the database's, as naive UTC ``datetime`` values.

Leases, claims, deadlines, redrive's ``progress_at`` and the orphan grace are times one
host writes and another judges: a reaper whose host runs 31 s ahead would re-lend a
claim a gateway still holds, a beat host 120 s ahead would re-send every open
operation. So every process reads one clock, the store's: :func:`now` is this host's
clock plus the difference to the database's clock, measured when a process first
opens a transaction and again every :data:`SYNC_EVERY_S` (one ``SELECT`` of the
server's time, halfway through the round trip; :mod:`workers.store.db` does it). On
SQLite the store is a file on this host, so the difference is the host's own (none);
on PostgreSQL it is the server's clock, whatever each host's says. Times kept in Redis
for other hosts to judge (the gateways' demand samples and idle times) are stamped with
:func:`epoch`, the same clock; the node call slots' leases use Redis's own ``TIME``.

Tests move time with :func:`travel` (every process-local reading shifts) and pretend
this host's clock is wrong with :func:`skew_host` (the next sync cancels it out).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

SYNC_EVERY_S = 30.0

_offset = timedelta(0)  # clock.travel: tests moving time
_host_skew = timedelta(0)  # clock.skew_host: tests pretending this host's clock is off
_to_db = timedelta(0)  # the database's clock minus this host's, as last measured
_synced_at: float | None = None  # time.monotonic() of the last measurement
_sync_lock = threading.Lock()


def _host() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None) + _host_skew


def now() -> datetime:
    """The current time on the store's clock, naive UTC, shifted by any test offset."""
    return _host() + _to_db + _offset


def epoch() -> float:
    """:func:`now` as seconds since the epoch (for timestamps kept outside the store, in Redis)."""
    # The same reading as now(), without building a datetime (the gateway stamps each request).
    return time.time() + (_host_skew + _to_db + _offset).total_seconds()


def sync_due() -> bool:
    """Whether this process should measure its distance to the database's clock again."""
    return _synced_at is None or time.monotonic() - _synced_at >= SYNC_EVERY_S


def sync(read_db_time: Callable[[], datetime]) -> timedelta:
    """Measure the database's clock against this host's (``read_db_time`` asks it once)."""
    global _to_db, _synced_at
    with _sync_lock:
        before = _host()
        db_time = read_db_time()
        after = _host()
        _to_db = db_time - (before + (after - before) / 2)
        _synced_at = time.monotonic()
        return _to_db


def travel(seconds: float) -> None:
    """Move this process's clock forward (or back) by ``seconds``."""
    global _offset
    _offset += timedelta(seconds=seconds)


def skew_host(seconds: float) -> None:
    """Pretend this host's clock runs ``seconds`` ahead (tests); the next sync corrects it."""
    global _host_skew, _synced_at
    _host_skew = timedelta(seconds=seconds)
    _synced_at = None


def reset() -> None:
    """Undo every :func:`travel` and :func:`skew_host`."""
    global _offset, _host_skew, _to_db, _synced_at
    _offset = timedelta(0)
    _host_skew = timedelta(0)
    _to_db = timedelta(0)
    _synced_at = None


def iso(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 UTC, or None."""
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"
