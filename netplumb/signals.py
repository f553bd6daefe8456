"""A server's main thread, waiting for SIGINT or SIGTERM whichever thread the kernel hands it.

Python runs a signal's handler in the main thread, at its next bytecode. The kernel
may deliver the signal to any thread that does not block it: gRPC's, an event loop's.
Then a main thread blocked in a wait without a timeout is never woken, and the handler
never runs: a ``corral registry`` given SIGTERM right after it started waited so for
good. So :func:`wait_for` wakes every :data:`WAKE_S` seconds, and a pending handler runs
then.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

WAKE_S = 0.5  # the longest a signal waits for its handler

log = logging.getLogger(__name__)


@contextmanager
def until_signalled() -> Iterator[threading.Event]:
    """Yield an Event set by SIGINT/SIGTERM; restore the previous handlers afterwards."""
    stop = threading.Event()

    def _handler(signum: int, frame: FrameType | None) -> None:
        log.info("received %s; stopping", signal.Signals(signum).name)
        stop.set()

    previous: dict[signal.Signals, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def wait_for(stop: threading.Event) -> None:
    """Block until ``stop`` is set, waking often enough for a pending handler to run."""
    while not stop.wait(WAKE_S):
        pass
