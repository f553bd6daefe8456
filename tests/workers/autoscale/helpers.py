"""Helpers for the autoscaler's end-to-end tests (a real worker process behind them)."""

from __future__ import annotations

import time
from collections.abc import Callable

from tests.celery_workers import WorkerProcess


def wait_until(
    check: Callable[[], bool],
    timeout: float,
    what: str,
    worker: WorkerProcess,
    *,
    poll: float = 0.05,
) -> None:
    """Return once ``check()`` holds; fail with ``what`` and the worker's log after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(poll)
    raise AssertionError(f"{what} within {timeout:g}s\n{worker.tail()}")
