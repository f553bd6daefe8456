"""The suite's one way to wait: poll a condition until it holds, or fail saying what was awaited.

Tests wait on conditions, never on fixed sleeps: a sleep long enough for a loaded CI
machine is wasted on a quiet one, and one short enough for a quiet machine fails on a
loaded one. :func:`eventually` returns the condition's first truthy value as soon as
there is one, and after ``timeout`` fails the test with ``what`` (and ``detail()``, a
worker's log tail say, when given).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    check: Callable[[], T],
    timeout: float = 10.0,
    what: str = "condition",
    *,
    poll: float = 0.01,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll ``check`` until it returns something truthy (returned); fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(poll)
