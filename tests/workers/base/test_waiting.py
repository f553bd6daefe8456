"""Handing a value to the first waiter in line that still waits."""

from __future__ import annotations

import asyncio
from collections import deque

from workers.base.waiting import hand_over


def test_the_first_waiter_still_waiting_gets_the_value() -> None:
    async def scene() -> None:
        loop = asyncio.get_running_loop()
        gone, served, next_up = loop.create_future(), loop.create_future(), loop.create_future()
        gone.cancel()  # this one gave up: handing over skips it
        line: deque[asyncio.Future[str]] = deque([gone, served, next_up])
        assert hand_over(line, "slot-1")
        assert served.result() == "slot-1"
        assert list(line) == [next_up] and not next_up.done()
        assert hand_over(line, "slot-2")
        assert next_up.result() == "slot-2"
        assert not hand_over(line, "slot-3")  # nobody left: the caller keeps it
        assert not line

    asyncio.run(scene())
