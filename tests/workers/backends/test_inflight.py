"""One node's call slots in one process, against a lease source that is slow or fails."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence

import pytest

from workers.backends.inflight import Lease, _Gate


class SlowSource:
    """Grants what is free of the bound after ``delay_s``, like a Redis round trip; or fails."""

    need_s = 0.0

    def __init__(self, delay_s: float, fail: bool = False) -> None:
        self.delay_s, self.fail, self.held, self.asks = delay_s, fail, 0, 0

    async def acquire(self, node: Hashable, bound: int, want: int) -> list[Lease]:
        self.asks += 1
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("redis went away")
        k = min(want, bound - self.held)
        self.held += k
        return [Lease(f"t{self.held - i}") for i in range(k)]

    async def renew(self, node: Hashable, lease: Lease) -> bool:
        return True

    async def release(self, node: Hashable, leases: Sequence[Lease]) -> None:
        self.held -= len(leases)


def test_callers_who_come_during_a_grant_get_free_slots_at_once() -> None:
    async def scene() -> tuple[int, int]:
        gate, running, peak = _Gate("n1", SlowSource(0.005)), 0, 0

        async def call() -> None:
            nonlocal running, peak
            lease = await gate.take(10)
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.05)
            running -= 1
            gate.give(lease)

        first = asyncio.ensure_future(call())
        await asyncio.sleep(0.001)  # the first grant is on its way
        await asyncio.wait_for(asyncio.gather(first, *(call() for _ in range(9))), 5)
        return peak, gate.in_use

    peak, in_use = asyncio.run(scene())
    assert peak == 10  # a bound of 10 and 10 callers: none waits for another to finish
    assert in_use == 0


def test_a_failing_source_fails_every_waiter_also_those_who_came_meanwhile() -> None:
    async def scene() -> tuple[BaseException | Lease, BaseException | Lease]:
        gate = _Gate("n1", SlowSource(0.02, fail=True))
        first = asyncio.ensure_future(gate.take(4))
        await asyncio.sleep(0.002)  # the acquire is on its way
        second = asyncio.ensure_future(gate.take(4))
        return await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 2)

    outcomes = asyncio.run(scene())  # before the fix the second waited forever (timeout)
    assert [type(o) for o in outcomes] == [ConnectionError, ConnectionError]


@pytest.mark.parametrize("bound", [1, 3])
def test_no_more_than_the_bound_run_at_once(bound: int) -> None:
    async def scene() -> int:
        gate, running, peak = _Gate("n1", SlowSource(0.002)), 0, 0

        async def call() -> None:
            nonlocal running, peak
            lease = await gate.take(bound)
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0.005)
            running -= 1
            gate.give(lease)

        await asyncio.wait_for(asyncio.gather(*(call() for _ in range(12))), 5)
        return peak

    assert asyncio.run(scene()) == bound
