"""A wall clock off by an offset read from a file: the partition run's clock skew.

A process started with this directory first on ``PYTHONPATH`` and ``PT_CLOCK_FILE``
set reads its wall clock (``time.time``, ``time.time_ns``: what Celery, kombu and
logging read) as the real one plus the seconds in that file (``+0`` none, ``+600``,
``-8``), read again at most once a second; the monotonic clock is left alone, as a
host's wall clock stepped by hand or a broken NTP leaves it. (libfaketime would be the
outside way, but its ``clock_nanosleep`` fails every Python ``time.sleep`` with EINVAL
when the monotonic clock is not faked, and faking it makes the skew a monotonic jump.)
``datetime.now`` reads the C clock and is not moved.

gRPC's Python code is not moved either: it turns a call's timeout into a deadline with
``time.time()`` and hands it to its C core, which judges it by the C clock. On a host
whose clock is off both are off together and the timeout stands; with Python's clock
alone moved, every deadline would be off by the skew - 8 s behind, every call with a
shorter timeout fails at once (DEADLINE_EXCEEDED), 600 s ahead, a call to an agent that
never answers waits 600 s more - which no real host does.
"""

from __future__ import annotations

import os
import sys
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


def _skewed(caller_depth: int = 2) -> float:
    """The offset, for a reader other than gRPC's own Python (which reads the C clock's)."""
    module = sys._getframe(caller_depth).f_globals.get("__name__", "")
    return 0.0 if module == "grpc" or module.startswith("grpc.") else _offset()


if _FILE:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skewed()
    time.time_ns = lambda: _time_ns() + int(_skewed() * 1e9)
