"""One node's call slots in one process, against a lease source that is slow or fails."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Hashable, Sequence

import pytest

from workers.backends import inflight
from workers.backends.inflight import Lease, _Gate
from workers.base import timelimits
from workers.base.timelimits import Deadline, OutOfTime


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


class _Call:
    """A call that takes ``seconds``, noting whether it started, finished or was cancelled."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.finished = False

    async def run(self) -> str:
        self.started.set()
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished = True
        return "answered"


def test_a_call_outlasting_the_tasks_soft_limit_is_cancelled_there_and_the_task_wraps_up() -> None:
    call = _Call(30)
    deadline = Deadline(time.monotonic() + 0.2, hard_at=time.monotonic() + 30)
    began = time.monotonic()
    with timelimits.running(deadline), pytest.raises(OutOfTime, match="past its soft time"):
        inflight.run(call.run())
    assert time.monotonic() - began < 5  # at the soft limit, not the call's 30 s
    assert call.cancelled.wait(5) and not call.finished
    assert deadline.wrapping_up  # delivered: the way out goes ahead


def test_wrapping_up_a_call_may_run_until_just_before_the_hard_limit() -> None:
    now = time.monotonic()
    deadline = Deadline(now - 1, hard_at=now + 0.3 + timelimits.WAY_OUT_S, wrapping_up=True)
    with timelimits.running(deadline):
        assert inflight.run(_Call(0.05).run()) == "answered"  # the way out's calls go ahead
        call = _Call(30)
        with pytest.raises(OutOfTime, match="near its hard time limit"):
            inflight.run(call.run())
    assert time.monotonic() - now < 5 and call.cancelled.wait(5)


def test_past_the_soft_limit_a_call_is_refused_before_it_starts() -> None:
    call = _Call(0)
    past = Deadline(time.monotonic() - 0.001, hard_at=time.monotonic() + 30)
    with timelimits.running(past), pytest.raises(OutOfTime, match="an agent call not started"):
        inflight.run(call.run())
    assert not call.started.is_set()


def test_outside_a_task_a_call_runs_to_its_end_or_its_own_timeout() -> None:
    assert inflight.run(_Call(0.3).run()) == "answered"
    call = _Call(30)
    with pytest.raises(concurrent.futures.TimeoutError):
        inflight.run(call.run(), timeout=0.1)
    assert call.cancelled.wait(5)
