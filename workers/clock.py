"""The one clock corral reads: naive UTC ``datetime`` values, replaceable in tests.

Every timestamp written to the store and every deadline compared against comes
from :func:`now`, so a test can move time (``clock.travel(seconds)``) and see
the reaper or the stuck-replica sweep act without sleeping.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

_offset = timedelta(0)


def now() -> datetime:
    """The current time, naive UTC, shifted by any test offset."""
    return datetime.now(UTC).replace(tzinfo=None) + _offset


def travel(seconds: float) -> None:
    """Move this process's clock forward (or back) by ``seconds``."""
    global _offset
    _offset += timedelta(seconds=seconds)


def reset() -> None:
    """Undo every :func:`travel`."""
    global _offset
    _offset = timedelta(0)


def iso(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 UTC, or None."""
    return None if value is None else value.isoformat(timespec="milliseconds") + "Z"
