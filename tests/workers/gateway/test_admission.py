"""Per-function admission: ``limit`` at once, a bounded FIFO queue, places handed straight on."""

from __future__ import annotations

import asyncio
import time

import pytest

from workers.base.clock import epoch
from workers.gateway import admission
from workers.gateway.admission import Gate, Outside, QueueFull, QueueTimeout


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_up_to_the_limit_enter_at_once_then_the_queue_is_served_in_order() -> None:
    async def scenario() -> list[str]:
        gate = Gate(limit=2, queue=3)
        await gate.enter(1.0)
        await gate.enter(1.0)
        served: list[str] = []

        async def queued(name: str) -> None:
            await gate.enter(5.0)
            served.append(name)

        tasks = [asyncio.create_task(queued(n)) for n in ("a", "b", "c")]
        await _settle()
        assert (gate.active, gate.queued) == (2, 3)
        for _ in range(3):
            gate.leave()  # each place goes straight to the first in line: active stays 2
            await _settle()
            assert gate.active == 2
        await asyncio.gather(*tasks)
        gate.leave()
        gate.leave()
        assert (gate.active, gate.queued) == (0, 0)
        return served

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_full_queue_refuses_the_next_and_changes_nothing() -> None:
    async def scenario() -> None:
        gate = Gate(limit=1, queue=1)
        await gate.enter(1.0)
        waiter = asyncio.create_task(gate.enter(5.0))
        await _settle()
        with pytest.raises(QueueFull, match="1 requests already queued"):
            await gate.enter(5.0)
        assert (gate.active, gate.queued) == (1, 1)
        gate.leave()
        await waiter
        assert (gate.active, gate.queued) == (1, 0)

    asyncio.run(scenario())


def test_a_queued_request_that_waits_too_long_leaves_the_queue() -> None:
    async def scenario() -> None:
        gate = Gate(limit=1, queue=4)
        await gate.enter(1.0)
        started = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"no free environment within 0\.1s"):
            await gate.enter(0.1)
        assert time.monotonic() - started >= 0.1  # not before its time (after it: the load's)
        assert (gate.active, gate.queued) == (1, 0)
        gate.leave()
        assert gate.active == 0

    asyncio.run(scenario())


def test_a_request_that_goes_away_while_queued_gives_up_its_place() -> None:
    async def scenario() -> None:
        gate = Gate(limit=1, queue=4)
        await gate.enter(1.0)
        gone = asyncio.create_task(gate.enter(5.0))
        stays = asyncio.create_task(gate.enter(5.0))
        await _settle()
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert gate.queued == 1
        gate.leave()  # the place skips the one that left
        await stays
        assert (gate.active, gate.queued) == (1, 0)

    asyncio.run(scenario())


def test_a_place_handed_over_as_its_request_went_away_is_passed_on() -> None:
    async def scenario() -> None:
        gate = Gate(limit=1, queue=4)
        await gate.enter(1.0)
        first = asyncio.create_task(gate.enter(5.0))
        second = asyncio.create_task(gate.enter(5.0))
        await _settle()
        gate.leave()  # first's place is set...
        first.cancel()  # ...and first goes away before it runs again
        (ended,) = await asyncio.gather(first, return_exceptions=True)
        if not isinstance(ended, BaseException):  # it kept the place after all: its to give
            gate.leave()
        await asyncio.wait_for(second, 1.0)  # either way the place was not lost
        assert (gate.active, gate.queued) == (1, 0)

    asyncio.run(scenario())


def test_leaving_the_queue_keeps_a_place_handed_over_meanwhile() -> None:
    # The request's wait ended (timed out, or it went away) in the same turn of the loop
    # as a place was handed to it: the place is its own, not the queue's to take back.
    async def scenario() -> None:
        gate = Gate(limit=1, queue=4)
        await gate.enter(1.0)
        handed = asyncio.create_task(gate.enter(5.0))
        left = asyncio.create_task(gate.enter(5.0))
        await _settle()
        handed_place, left_place = gate.waiting
        gate.leave()  # the first in line gets the place
        assert handed_place.done() and gate.queued == 1
        assert gate._abandon(handed_place) is False  # kept: nothing changes
        assert (gate.active, gate.queued) == (1, 1)
        assert gate._abandon(left_place) is True  # still queued: it leaves the queue
        assert left_place.cancelled() and (gate.active, gate.queued) == (1, 0)
        await handed
        left.cancel()
        await asyncio.gather(left, return_exceptions=True)

    asyncio.run(scenario())


def test_more_room_admits_the_queue_at_once() -> None:
    async def scenario() -> None:
        gate = Gate(limit=1, queue=4)
        await gate.enter(1.0)
        waiting = [asyncio.create_task(gate.enter(5.0)) for _ in range(3)]
        await _settle()
        gate.resize(3, 4)
        await asyncio.wait_for(asyncio.gather(*waiting[:2]), 1.0)
        assert (gate.active, gate.queued) == (3, 1)
        gate.leave()
        await waiting[2]

    asyncio.run(scenario())


def test_a_sample_reports_now_and_the_time_weighted_mean_then_starts_afresh() -> None:
    async def scenario() -> None:
        gate = Gate(limit=2, queue=4)
        gate.sample()  # start an interval
        await gate.enter(1.0)
        await gate.enter(1.0)
        waiter = asyncio.create_task(gate.enter(5.0))
        await asyncio.sleep(0.2)  # 3 in the gate for the whole interval, near enough
        first = gate.sample()
        assert (first.inflight, first.queued, first.requests) == (2, 1, 3)
        assert 2.5 <= first.concurrency <= 3.0
        gate.leave()
        await waiter
        second = gate.sample()
        assert (second.inflight, second.queued, second.requests) == (2, 0, 0)

    asyncio.run(scenario())


class _Clock:
    """The gate's ``time.monotonic``, moved by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t


def test_a_fresh_gates_first_sample_weighs_admitted_and_queued_by_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(admission, "time", clock)  # the gate's clock only, not the loop's

    async def scenario() -> None:
        gate = Gate(limit=2, queue=4)
        assert gate.last_used == clock.t  # a new gate counts as just used
        clock.t += 5
        empty = gate.sample()  # nothing yet: nothing counted
        assert (empty.concurrency, empty.requests) == (0.0, 0)
        await gate.enter(1.0)
        assert gate.last_used == clock.t
        clock.t += 11  # one in the gate for 11 s
        await gate.enter(1.0)
        clock.t += 10  # two for 10 s
        waiter = asyncio.create_task(gate.enter(5.0))
        await _settle()
        clock.t += 10  # two, and one queued, for 10 s
        before = epoch()
        first = gate.sample()
        assert (first.inflight, first.queued, first.requests) == (2, 1, 3)
        assert first.concurrency == 1.968  # (11 + 20 + 30) / 31 s, to the thousandth
        assert before <= first.at <= epoch()  # when, on the wall clock
        gate.leave()
        await waiter
        assert gate.last_used == clock.t

    asyncio.run(scenario())


def test_the_warm_paths_requests_take_places_and_queue_room_here_too() -> None:
    async def scenario() -> None:
        gate = Gate(limit=2, queue=2)
        gate.outside = Outside(active=2, queued=1)  # HAProxy carries two, queues one
        waiter = asyncio.create_task(gate.enter(5.0))
        await _settle()
        assert (gate.active, gate.queued, gate.inflight, gate.backlog) == (0, 1, 2, 2)
        with pytest.raises(QueueFull):  # one here and one there fill the queue of 2
            await gate.enter(5.0)
        gate.poke()  # no room yet: the warm path holds both places
        await _settle()
        assert (gate.active, gate.queued) == (0, 1)
        gate.outside = Outside(active=1, queued=0)  # the warm path's load went down
        gate.poke()
        await waiter
        assert (gate.active, gate.queued, gate.inflight, gate.backlog) == (1, 0, 2, 0)

    asyncio.run(scenario())
