"""A line of asyncio waiters, served first come, first served.

Whoever cannot have a thing yet (a node's call slot, a held claim) puts a future at the
back of a ``deque`` and awaits it. Whoever frees one hands it to the front of the line.
A waiter that gave up (timed out, was cancelled) leaves its future done in the line, so
handing over skips done futures until one takes the value.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TypeVar

T = TypeVar("T")


def hand_over(line: deque[asyncio.Future[T]], value: T) -> bool:
    """Give ``value`` to the first waiter still waiting; False if nobody is."""
    while line:
        waiter = line.popleft()
        if not waiter.done():
            waiter.set_result(value)
            return True
    return False
