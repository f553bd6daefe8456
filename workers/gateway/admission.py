"""Per-function admission: at most ``limit`` requests at once, a bounded queue behind them.

A function's ``limit`` is the most execution environments it can ever have
(``max_replicas x exec_envs``): more requests than that could only wait for an
environment inside the store, each holding a thread and a waiter row. So they wait
here instead, in arrival order, in a queue of at most ``queue`` requests; one more
is refused (429). A request leaving hands its place straight to the first in the
queue. The gate also keeps what the demand signal reports
(:class:`workers.autoscale.demand.Sample`): requests admitted and queued now, their
time-weighted mean since the last report, and the arrivals.

Requests the warm data plane carries (HAProxy: :mod:`workers.gateway.haproxy`) never
pass the gate, but take the same environments: the gate counts them too
(:attr:`Gate.outside`, as last read from HAProxy), so a request admitted here and one
there never add up to more than the limit and its queue; :meth:`Gate.poke` admits the
queue's first requests when the warm path's load has gone down.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from workers.autoscale.demand import Sample
from workers.base import clock


class QueueFull(Exception):
    """The function's queue is full: answer 429."""


class QueueTimeout(Exception):
    """A queued request got no place in time: answer 503."""


@dataclass
class Outside:
    """A function's requests the warm data plane carries now: in flight, and queued there."""

    active: int = 0
    queued: int = 0


class Gate:
    """One function's admission counter and queue."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit = limit
        self.queue = queue
        self.outside = Outside()
        self.active = 0
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.arrivals = 0
        self.last_used = time.monotonic()
        self._area = 0.0  # integral of (active + queued) dt since the last sample
        self._since = self._changed = time.monotonic()

    @property
    def queued(self) -> int:
        """Requests waiting for a place."""
        return len(self.waiting)

    @property
    def inflight(self) -> int:
        """Requests admitted here and in flight on the warm path."""
        return self.active + self.outside.active

    @property
    def backlog(self) -> int:
        """Requests queued here and on the warm path."""
        return len(self.waiting) + self.outside.queued

    def _tick(self) -> None:
        t = time.monotonic()
        self._area += (self.active + len(self.waiting)) * (t - self._changed)
        self._changed = t

    async def enter(self, timeout: float) -> None:
        """Take a place, waiting in the queue up to ``timeout`` seconds."""
        self._tick()
        self.arrivals += 1
        self.last_used = time.monotonic()
        if self.active + self.outside.active < self.limit and not self.waiting:
            self.active += 1
            return
        if len(self.waiting) + self.outside.queued >= self.queue:
            raise QueueFull(f"{len(self.waiting)} requests already queued")
        place: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        try:
            await asyncio.wait_for(asyncio.shield(place), timeout)
        except TimeoutError:
            if self._abandon(place):
                raise QueueTimeout(f"no free environment within {timeout:g}s") from None
        except BaseException:  # the request went away while queued
            if not self._abandon(place):
                self.leave()  # the place was handed over just now: pass it on
            raise

    def _abandon(self, place: asyncio.Future[None]) -> bool:
        """Leave the queue; False when the place was handed over already (we hold it)."""
        if place.done() and not place.cancelled():
            return False
        place.cancel()
        self._tick()
        self.waiting.remove(place)
        return True

    def leave(self) -> None:
        """Give the place back: to the first request in the queue, if any."""
        self._tick()
        self.last_used = time.monotonic()
        while self.waiting:
            nxt = self.waiting.popleft()
            if not nxt.done():
                nxt.set_result(None)  # the place passes on: active stays the same
                return
        self.active -= 1

    def resize(self, limit: int, queue: int) -> None:
        """Apply a function's new limits; extra room admits queued requests at once."""
        self.limit, self.queue = limit, queue
        self.poke()

    def poke(self) -> None:
        """Admit queued requests while there is room (the warm path's load may have gone)."""
        while self.waiting and self.active + self.outside.active < self.limit:
            nxt = self.waiting.popleft()
            if not nxt.done():
                self._tick()
                self.active += 1
                nxt.set_result(None)

    def sample(self) -> Sample:
        """The demand since the last sample, and start a new interval."""
        self._tick()
        t = time.monotonic()
        span = max(t - self._since, 1e-6)
        out = Sample(
            inflight=self.active,
            queued=len(self.waiting),
            concurrency=round(self._area / span, 3),
            requests=self.arrivals,
            at=clock.epoch(),
        )
        self._area, self._since, self.arrivals = 0.0, t, 0
        return out
