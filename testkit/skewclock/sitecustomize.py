"""A wall clock off by an offset read from a file: the partition run's clock skew.

A process started with this directory first on ``PYTHONPATH`` and ``PT_CLOCK_FILE``
set reads its wall clock (``time.time``, ``time.time_ns``: what Celery, kombu and
logging read) as the real one plus the seconds in that file (``+0`` none, ``+600``,
``-8``), read again at most once a second; the monotonic clock is left alone, as a
host's wall clock stepped by hand or a broken NTP leaves it. (libfaketime would be the
outside way, but its ``clock_nanosleep`` fails every Python ``time.sleep`` with EINVAL
when the monotonic clock is not faked, and faking it makes the skew a monotonic jump.)
``datetime.now`` reads the C clock and is not moved.
"""

from __future__ import annotations

import os
import time

_FILE = os.environ.get("PT_CLOCK_FILE")
_state = [0.0, -1e9]  # the offset (s), and when it was read (monotonic)


def _offset() -> float:
    now = time.monotonic()
    if now - _state[1] >= 1.0:
        _state[1] = now
        try:
            with open(str(_FILE)) as f:
                _state[0] = float(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
    return _state[0]


if _FILE:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _offset()
    time.time_ns = lambda: _time_ns() + int(_offset() * 1e9)
