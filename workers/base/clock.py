"""The one clock corral reads: the database's, as naive UTC ``datetime`` values.

Leases, claims, deadlines, redrive's ``progress_at`` and the orphan grace are times one
host writes and another judges: a reaper whose host runs 31 s ahead would re-lend a
claim a gateway still holds, a beat host 120 s ahead would re-send every open
operation. So every process reads one clock, the store's, and never this host's wall
clock:

* :func:`now` is the database's time at the last measurement plus the
  ``time.monotonic()`` seconds elapsed since. A process measures when it first opens a
  transaction and again every :data:`SYNC_EVERY_S` (one ``SELECT`` of the server's
  time, taken as halfway through the round trip; :mod:`workers.store.db` does it).
  Between two measurements only the monotonic clock moves it, so a step of this host's
  wall clock (an NTP correction, an operator's ``date -s``) changes nothing: a lease
  another process holds for 60 s is still held 59 s later, whatever the wall clock says.
  The next measurement reads the database again.
* On PostgreSQL the database's clock is the server's, the same for every host. On
  SQLite the store is a file on this host and its clock is this host's: a step of the
  wall clock is a step of the store's clock there, seen at the next measurement.
* Before its first measurement a process counts from this host's wall clock.

Expiries that decide who owns something are judged in SQL on the database's own clock
where they can (:func:`workers.store.db.store_now`: named leases, claims, the owners of
creates, the reaper's stuck sweep). Times kept in
Redis for other hosts to judge (the gateways' demand samples and idle times) are
stamped with :func:`epoch`, the same clock; the node call slots' leases use Redis's own
``TIME``.

Tests move time with :func:`travel` (every reading in this process shifts, and so does
:func:`~workers.store.db.store_now`), pretend this host's clock has been wrong all along
with :func:`skew_host` (the next measurement cancels it out), and step this host's wall
clock between two measurements with :func:`step_host` (nothing reads it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

SYNC_EVERY_S = 30.0

_offset = timedelta(0)  # clock.travel: tests moving time
_host_skew = timedelta(0)  # skew_host / step_host: tests pretending this host's clock is off
_synced_at: float | None = None  # time.monotonic() of the last measurement
_sync_lock = threading.Lock()
_measured: tuple[int, float] | None = None  # (measurement number, host clock - store's, s)
_measurements = 0  # in this process, ever (numbers are never reused)


def _host() -> datetime:
    """This host's wall clock, naive UTC (read only before a process measures the store's)."""
    return datetime.now(UTC).replace(tzinfo=None) + _host_skew


def _anchor_at(base: datetime, mono: float) -> tuple[float, datetime, float]:
    """The clock's anchor: ``base`` (naive UTC) was the time at ``time.monotonic()`` ``mono``."""
    return (mono, base, base.replace(tzinfo=UTC).timestamp())


# (time.monotonic(), the store's time then, the same as seconds since the epoch): one
# tuple, replaced whole, so a reader never pairs one measurement's time with another's.
_anchor = _anchor_at(_host(), time.monotonic())


def now() -> datetime:
    """The current time on the store's clock, naive UTC, shifted by any test offset."""
    mono, base, _ = _anchor
    return base + timedelta(seconds=time.monotonic() - mono) + _offset


def epoch() -> float:
    """:func:`now` as seconds since the epoch (for timestamps kept outside the store, in Redis)."""
    # The same reading as now(), without building a datetime (the gateway stamps each request).
    mono, _, base = _anchor
    return base + (time.monotonic() - mono) + _offset.total_seconds()


def offset_s() -> float:
    """Seconds tests moved this process's clock by (:func:`travel`); 0 otherwise."""
    return _offset.total_seconds()


def sync_due() -> bool:
    """Whether this process should measure the database's clock again."""
    return _synced_at is None or time.monotonic() - _synced_at >= SYNC_EVERY_S


def synced() -> bool:
    """Whether this process has measured the database's clock at least once."""
    return _synced_at is not None


def sync(read_db_time: Callable[[], datetime], wait_s: float = -1) -> timedelta | None:
    """Measure the database's clock (``read_db_time`` asks it once); its distance to ours.

    It also notes how far this host's wall clock is from the store's (:func:`host_offset`).
    One thread measures at a time; another waits for it ``wait_s`` at most (-1: as long as
    it takes), then measures, or goes on with the estimate it has: None.
    """
    if not _sync_lock.acquire(timeout=wait_s):
        return None
    try:
        return _measure(read_db_time)
    finally:
        _sync_lock.release()


def _measure(read_db_time: Callable[[], datetime]) -> timedelta:
    """One measurement of the database's clock, under the sync lock."""
    global _anchor, _synced_at, _measured, _measurements
    before = time.monotonic()
    db_time = read_db_time()
    after = time.monotonic()
    host = _host()
    mid = (before + after) / 2
    mono, base, _ = _anchor
    drift = db_time - (base + timedelta(seconds=mid - mono))
    _anchor = _anchor_at(db_time, mid)
    _synced_at = after
    offset = (host - timedelta(seconds=after - mid) - db_time).total_seconds()
    _measurements += 1
    _measured = (_measurements, offset)
    return drift


def host_offset() -> tuple[int, float] | None:
    """The last measurement of this host's wall clock against the store's: (its number, s ahead).

    None before the first. Nothing in corral reads the host's clock; an operator watches
    this (``corral_clock_offset_seconds``).
    """
    return _measured


def travel(seconds: float) -> None:
    """Move this process's clock forward (or back) by ``seconds``."""
    global _offset
    _offset += timedelta(seconds=seconds)


def skew_host(seconds: float) -> None:
    """Pretend this host's clock has run ``seconds`` ahead all along (tests); a sync corrects it."""
    global _host_skew, _anchor, _synced_at
    _host_skew = timedelta(seconds=seconds)
    _anchor = _anchor_at(_host(), time.monotonic())
    _synced_at = None


def step_host(seconds: float) -> None:
    """Step this host's wall clock by ``seconds`` now, between two syncs (tests)."""
    global _host_skew
    _host_skew += timedelta(seconds=seconds)


def reset() -> None:
    """Undo every :func:`travel`, :func:`skew_host` and :func:`step_host`."""
    global _offset, _host_skew, _anchor, _synced_at, _measured
    _measured = None
    _offset = timedelta(0)
    _host_skew = timedelta(0)
    _anchor = _anchor_at(_host(), time.monotonic())
    _synced_at = None


def iso(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 UTC, or None."""
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"
