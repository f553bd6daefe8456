"""The environments one gateway holds for a function between requests.

A claim is a lease (:mod:`workers.replicas.claims`): the gateway does not give an
environment back to the store after each request. A request that finishes returns its
claim to the function's :class:`Pool`; the next request takes it from there with no
store round trip. Only when the pool is empty does a request go to the store, and then
one store call claims an environment for every request of this gateway waiting for one
(:func:`workers.replicas.claims.claim_many`; :attr:`Pool.refilling` is that call while
it runs, so requests arriving meanwhile wait for it instead of making their own).

* **Idle claims** are a stack: the last one returned is the first taken again, so
  under light load the same few environments serve and the rest stay unused long
  enough to be released.
* **Waiting requests** are a FIFO of futures; a claim returned (or claimed) while
  someone waits goes straight to the first of them.
* **Keep window**: a claim unused for ``CORRAL_GATEWAY_KEEP_S`` is handed back to the
  store (:meth:`Pool.expired`), so the reaper, scale-down and other gateways see the
  environment free again.
* **Discarded** claims (their replica failed, is being deleted or is of an old
  build) never go back to the pool: :meth:`Pool.drop_replica` takes the idle ones
  out at once, and one in use is given back when its request ends.

The gateway's ledger (:class:`workers.gateway.ledger.Ledger`) renews every claim it holds,
idle or in use, in one store call per interval, and gives them all back when it
stops; a gateway that dies leaves leases that expire by themselves.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from workers.base.waiting import hand_over
from workers.replicas.claims import Claimed


class Pool:
    """One function's claims held by this gateway: idle ones, and requests waiting for one."""

    def __init__(self) -> None:
        self.idle: list[tuple[Claimed, float]] = []  # (claim, returned at), newest last
        self.waiting: deque[asyncio.Future[Claimed]] = deque()
        self.refilling: asyncio.Future[bool] | None = None  # the store call in flight

    def take(self) -> Claimed | None:
        """An idle claim (the newest), or None."""
        return self.idle.pop()[0] if self.idle else None

    def wait(self) -> asyncio.Future[Claimed]:
        """A place in line for the next claim returned or claimed."""
        place: asyncio.Future[Claimed] = asyncio.get_running_loop().create_future()
        self.waiting.append(place)
        return place

    def unwait(self, place: asyncio.Future[Claimed]) -> Claimed | None:
        """Leave the line; the claim the place was given meanwhile, if any (the caller's)."""
        if place.done():
            return None if place.cancelled() else place.result()
        place.cancel()
        self.waiting.remove(place)
        return None

    @property
    def wanted(self) -> int:
        """Requests in line not served yet."""
        return sum(1 for place in self.waiting if not place.done())

    def give(self, claimed: Claimed) -> None:
        """Hand a claim to the first request in line, else keep it idle."""
        if not hand_over(self.waiting, claimed):
            self.idle.append((claimed, time.monotonic()))

    def expired(self, keep_s: float) -> list[Claimed]:
        """Take out the idle claims unused for ``keep_s`` seconds (to be released)."""
        cutoff = time.monotonic() - keep_s
        old = [c for c, at in self.idle if at <= cutoff]
        if old:
            self.idle = [(c, at) for c, at in self.idle if at > cutoff]
        return old

    def drop(self, claim_ids: set[str]) -> list[Claimed]:
        """Take out these idle claims; those that were idle."""
        out = [c for c, _ in self.idle if c.claim_id in claim_ids]
        if out:
            self.idle = [(c, at) for c, at in self.idle if c.claim_id not in claim_ids]
        return out

    def drop_replica(self, replica_id: str) -> list[Claimed]:
        """Take out the idle claims of one replica (to be released)."""
        return self.drop({c.claim_id for c, _ in self.idle if c.replica_id == replica_id})

    def hand_out(self, replica_id: str, taker: Callable[[Claimed], bool]) -> None:
        """Offer the idle claims of one replica to ``taker``; those it refuses stay idle."""
        kept: list[tuple[Claimed, float]] = []
        for claimed, at in self.idle:
            if claimed.replica_id != replica_id or not taker(claimed):
                kept.append((claimed, at))
        self.idle = kept

    def drain(self) -> list[Claimed]:
        """Take out every idle claim."""
        out = [c for c, _ in self.idle]
        self.idle = []
        return out
