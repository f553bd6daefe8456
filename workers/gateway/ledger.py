"""The claims one gateway holds: who holds which environment, and when it goes back.

Every environment a request is served in is a claim (:mod:`workers.replicas.claims`:
a lease on one execution environment of one replica). The ledger is the gateway's
book of them:

* :attr:`Ledger.held` - every claim this gateway holds, idle or in use;
* :attr:`Ledger.pools` - per function, the idle ones and the requests waiting for one
  (:class:`workers.gateway.pool.Pool`);
* claims in use that must not go back to their pool when their request ends: their
  replica was retired or is unusable (given back to the store), or the store no longer
  has them (forgotten).

:meth:`Ledger.acquire` finds an environment for one request: an idle claim of the
function's pool (no store call at all); else one store call claims an environment for
every request of the function waiting in this gateway
(:func:`workers.replicas.claims.claim_many`); if the store has none Idle, each waiting
request runs a :class:`workers.replicas.coldstarts.ClaimAttempt` (a cold start shared with
every other waiter of the function, in this gateway or another; a spawn refused at the
function's max waits for a release), and an environment another request returns
meanwhile serves it first. Between two looks at the store a waiting claim sleeps until
it is told that a replica of its function is ready (:meth:`Ledger.wake`, on a notice:
:mod:`workers.replicas.notices`), or for its pause at most. It raises
:class:`workers.base.errors.NotFound` for a function the store does not know and
:class:`workers.replicas.claims.NoIdleReplica` when nothing is ready within the
cold-start timeout.

:meth:`Ledger.give_back` ends a request's use of a claim: back to the pool (kept for
``CORRAL_GATEWAY_KEEP_S``), or to the store. :meth:`Ledger.retire` gives back a
claim whose replica failed and has the replica deleted as *suspect*
(:func:`workers.replicas.claims.suspect`), with every other claim this gateway holds on it.
A cold start's spawn (written by its plan, :mod:`workers.replicas.coldstarts`) and a
suspect's delete are operations queued as the maintenance passes queue theirs
(:func:`workers.dispatch.enqueue`), not through the producer API, on the
:class:`~workers.dispatch.TaskQueue` the gateway is handed: a spawn is carried out in
this process when the queue can (``CORRAL_GATEWAY_SPAWN_HERE``; ``corral gateway``'s
queue has a few threads for it), else sent.
:meth:`Ledger.maintain` runs for the gateway's life: it gives back claims unused for
the keep window and renews every claim held (each is a lease of
``CORRAL_GATEWAY_CLAIM_TTL_S``), so a gateway that dies leaves leases that expire by
themselves. :meth:`Ledger.close` gives every claim back.

Everything here runs on the gateway's event loop (store calls in its threads): no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy.exc import DBAPIError

from config.settings import Settings
from workers import dispatch
from workers.base.clock import now
from workers.base.errors import CorralError
from workers.gateway.background import Background
from workers.gateway.lending import Lending
from workers.gateway.pool import Pool
from workers.gateway.traces import ColdStart
from workers.observability import tracing
from workers.replicas import claims
from workers.replicas.claims import Claimed, NoIdleReplica
from workers.replicas.coldstarts import ClaimAttempt
from workers.store.db import Database, is_transient
from workers.store.models import Operation

log = logging.getLogger(__name__)

CLAIM_BATCH = 16  # environments one store call claims at most
RENEW_MAX_S = 2.0  # held claims are renewed (and checked) at least this often
#: a claim step the store refused for now (a lock wait past ``lock_timeout``, a dropped
#: connection) is tried again after this pause, while the cold-start timeout allows
STORE_PAUSE_S = 0.2


async def _refused(exc: DBAPIError, name: str, until: float) -> None:
    """Pause before a claim step the store refused for now; ``exc`` again if not transient or
    ``until`` (monotonic) comes first."""
    if not is_transient(exc) or time.monotonic() + STORE_PAUSE_S > until:
        raise exc
    why = str(exc.orig).split("\n", 1)[0]
    log.info("gateway: claiming %s: the store refused for now (%s)", name, why)
    await asyncio.sleep(STORE_PAUSE_S)


def _attempt(ledger: Ledger, name: str) -> ClaimAttempt:
    """A claim attempt for one request of ``name``, on the gateway's timeouts."""
    settings = ledger.settings
    return ClaimAttempt(
        ledger.db,
        settings,
        name,
        cold_start_timeout=settings.gateway_cold_start_timeout_s,
        ttl_s=settings.gateway_claim_ttl_s,
        queue=ledger._queue_spawn,
        wait_at_max=True,
        tried=True,
        told=ledger.told,
    )


class Ledger:
    """Every claim this gateway holds, the function pools, and their upkeep."""

    def __init__(
        self,
        db: Database,
        settings: Settings,
        background: Background,
        queue: dispatch.TaskQueue,
        on_cold_start: Callable[[str, float], None] | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.background = background
        self.queue = queue
        self.on_cold_start = on_cold_start
        self.told = False  # notices of ready replicas reach wake() (the gateway listens)
        self.held: dict[str, Claimed] = {}
        self.pools: dict[str, Pool] = {}
        #: Claims cold starts brought, not yet used by a request (workers.gateway.traces).
        self.cold: dict[str, ColdStart] = {}
        # Per function, what its cold-start waiters wait on between looks: set by wake()
        self._told: dict[str, asyncio.Event] = {}
        # Claims in use kept from their pool: True = release at the request's end (retired,
        # unusable), False = forget them (the store no longer has them)
        self._unpooled: dict[str, bool] = {}
        self.lending = Lending(self)  # claims lent to a warm data plane (HAProxy), if any

    def pool(self, name: str) -> Pool:
        """The function's pool (made on first use)."""
        pool = self.pools.get(name)
        if pool is None:
            pool = self.pools[name] = Pool()
        return pool

    # -- taking an environment --------------------------------------------------------------

    async def acquire(self, name: str) -> Claimed:
        """An environment for one request: from the pool, else the store (cold start included)."""
        pool = self.pool(name)
        got = pool.take()
        if got is not None:
            return got
        if tracing.tracer is None:
            return await self._wait_for(pool, name)
        with tracing.span("claim", attributes={"corral.function": name}):
            return await self._wait_for(pool, name)

    async def _wait_for(self, pool: Pool, name: str) -> Claimed:
        """Wait in the pool's line while the store is asked (a cold start if need be)."""
        began, began_at = time.monotonic(), now()
        place = pool.wait()
        try:
            while not place.done():
                refill = pool.refilling or self._refill(pool, name)
                both: set[asyncio.Future[Any]] = {place, refill}
                await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
                # nothing Idle in the store (what a lender holds unused comes back first)
                nothing = not place.done() and refill.done() and not refill.result()
                if nothing and not await self.lending.reclaimed(pool, name, place):
                    return await self._claim_or_wait(name, place, began, began_at)
            return place.result()
        except BaseException:
            mine = pool.unwait(place)
            if mine is not None:
                self.give_back(mine)
            raise
        finally:
            pool.unwait(place)

    def _refill(self, pool: Pool, name: str) -> asyncio.Future[bool]:
        """One store call claiming an environment for each request in line; True: got them all."""
        count = max(1, min(CLAIM_BATCH, pool.wanted))

        async def run() -> bool:
            try:
                got = await self.background.store(
                    lambda: claims.claim_many(
                        self.db, self.settings, name, count, ttl_s=self.settings.gateway_claim_ttl_s
                    )
                )
            except NoIdleReplica:
                got = []
            finally:
                pool.refilling = None
            for claimed in got:
                self._adopt(claimed)
            return len(got) >= count

        task = self.background.soon(run())
        pool.refilling = task
        return task

    async def _claim_or_wait(
        self, name: str, place: asyncio.Future[Claimed], began: float, began_at: datetime
    ) -> Claimed:
        """Claim through the store (a cold start if need be) unless the pool serves us first."""
        work = self.background.soon(self._claim(name, began, began_at))
        try:
            both: set[asyncio.Future[Any]] = {place, work}
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            work.cancel()  # a claim it still makes goes to the pool
            raise
        if not place.done():
            return work.result()
        if not work.done():
            work.cancel()
        elif not work.cancelled() and work.exception() is None:
            self.give_back(work.result())  # both at once: the spare one goes to the pool
        return place.result()

    async def _claim(self, name: str, began: float, began_at: datetime) -> Claimed:
        """One request's claim attempt, cold start included, step by step in the threads."""
        settings = self.settings
        attempt = _attempt(self, name)
        cold = False
        got: Claimed | float | None = None
        try:
            while True:
                # Made before the step: a notice that comes while it runs is not missed.
                told = self._told.setdefault(name, asyncio.Event())
                try:
                    got = await self._step(attempt)
                except DBAPIError as exc:
                    await _refused(exc, name, began + settings.gateway_cold_start_timeout_s)
                    continue
                if isinstance(got, Claimed):
                    self.held[got.claim_id] = got
                    if cold:
                        self.cold[got.claim_id] = ColdStart(
                            name, got.replica_id, began, began_at, attempt.asked_at
                        )
                        if self.on_cold_start is not None:
                            self.on_cold_start(name, attempt.waited_s)
                    return got
                cold = True
                if got > 0 and not told.is_set():
                    with contextlib.suppress(TimeoutError):  # not told: look again anyway
                        async with asyncio.timeout(got):
                            await told.wait()
        finally:
            if attempt.waiting:
                try:
                    await self.background.shielded(attempt.close)
                except asyncio.CancelledError:
                    if isinstance(got, Claimed):  # cancelled with a claim in hand: keep it
                        self.give_back(got)
                    raise

    async def _step(self, attempt: ClaimAttempt) -> Claimed | float:
        """One claim step; a claim it makes after this request was cancelled goes to the pool.

        The step runs in this task's context (its spawn's span is then the claim's child).
        """
        step = asyncio.ensure_future(
            self.background.store(contextvars.copy_context().run, attempt.step)
        )
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:

            def orphan(done: asyncio.Future[Claimed | float]) -> None:
                if not done.cancelled() and done.exception() is None:
                    got = done.result()
                    if isinstance(got, Claimed):
                        self._adopt(got)

            step.add_done_callback(orphan)
            raise

    def wake(self, name: str) -> None:
        """A replica of ``name`` is ready (a notice): its waiting claims look at once."""
        told = self._told.pop(name, None)
        if told is not None:
            told.set()

    def _adopt(self, claimed: Claimed) -> None:
        """A claim this gateway got from the store: hold it and put it in its pool."""
        self.held[claimed.claim_id] = claimed
        self.pool(claimed.function).give(claimed)

    # -- giving it back ---------------------------------------------------------------------

    def give_back(self, claimed: Claimed) -> None:
        """A request is done with its environment: back to the pool, or released."""
        discard = self._unpooled.pop(claimed.claim_id, None)
        if claimed.claim_id not in self.held:
            return  # given back already (shutdown)
        if discard is False:
            del self.held[claimed.claim_id]  # the store no longer has it
            return
        pool = self.pool(claimed.function)
        if discard or (self.settings.gateway_keep_s <= 0 and not pool.wanted):
            self._release_soon([claimed])
        elif pool.wanted or not self.lending.lend(claimed):
            pool.give(claimed)

    async def retire(self, claimed: Claimed, reason: str) -> None:
        """Give back a failed replica's claim and delete the replica; drop its other claims."""
        log.warning(
            "gateway: replica %s of %s is suspect: %s", claimed.replica_id, claimed.function, reason
        )
        self.held.pop(claimed.claim_id, None)
        self.cold.pop(claimed.claim_id, None)
        self._unpooled.pop(claimed.claim_id, None)
        self._release_soon(self.pool(claimed.function).drop_replica(claimed.replica_id))
        for other in self.held.values():  # in use: given back when their requests end
            if other.replica_id == claimed.replica_id:
                self._unpooled[other.claim_id] = True
        self.lending.retired(claimed.replica_id)
        try:
            why = f"suspect: {reason}"
            await self.background.shielded(
                _suspect, self.db, self.settings, self.queue, claimed, why
            )
        except CorralError as exc:  # the broker is down: the stuck sweep finishes the delete
            log.warning("gateway: could not queue the delete of %s: %s", claimed.replica_id, exc)

    def _queue_spawn(self, op: Operation) -> str:
        """Queue the first task of a cold start's spawn, written already; the operation id.

        With ``CORRAL_GATEWAY_SPAWN_HERE`` it runs here, in the gateway, if the queue can.
        """
        return dispatch.enqueue(self.db, self.queue, op, here=self.settings.gateway_spawn_here)

    def _release_soon(self, released: list[Claimed]) -> None:
        """Stop holding these claims and give them back to the store in the background."""
        for claimed in released:
            self.held.pop(claimed.claim_id, None)
            self.cold.pop(claimed.claim_id, None)
        ids = [c.claim_id for c in released]
        if ids:
            self.background.soon(self._release_ids(ids))

    async def _release_ids(self, ids: list[str]) -> None:
        try:
            await self.background.store(claims.release_many, self.db, self.settings, ids)
        except Exception as exc:  # the store is away: the leases expire by themselves
            log.warning("gateway: could not give back %d claims: %s", len(ids), exc)

    # -- upkeep -----------------------------------------------------------------------------

    async def maintain(self) -> None:
        """Forever: give back claims unused for the keep window; renew the rest in time."""
        keep = self.settings.gateway_keep_s
        ttl = self.settings.gateway_claim_ttl_s
        renew_every = min(ttl / 3, RENEW_MAX_S)
        tick = min(renew_every, max(0.05, keep / 2)) if keep > 0 else renew_every
        renew_at = time.monotonic() + renew_every
        while True:
            await asyncio.sleep(tick)
            self._release_soon([c for pool in self.pools.values() for c in pool.expired(keep)])
            if time.monotonic() < renew_at or not self.held:
                continue
            renew_at = time.monotonic() + renew_every
            ids = list(self.held)
            try:
                usable = await self.background.store(claims.renew, self.db, ids, ttl)
            except Exception as exc:  # the store is away: try again next tick
                log.warning("gateway: could not renew %d claims: %s", len(ids), exc)
                renew_at = time.monotonic()
                continue
            self._apply_renewal(ids, usable)

    def _apply_renewal(self, ids: list[str], usable: dict[str, bool]) -> None:
        """Drop claims the store no longer has; give back those of unusable replicas."""
        gone = {cid for cid in ids if cid not in usable and cid in self.held}
        bad = {cid for cid, ok in usable.items() if not ok and cid in self.held}
        self.lending.recall(bad, gone)  # (lent ones come back when their lender is done)
        for pool in self.pools.values():
            for claimed in pool.drop(gone):
                del self.held[claimed.claim_id]
            self._release_soon(pool.drop(bad))
        for cid in gone & self.held.keys():  # in use: forget them when their request ends
            self._unpooled[cid] = False
        for cid in bad & self.held.keys():  # in use: give them back when their request ends
            self._unpooled[cid] = True
        if gone:
            log.warning("gateway: %d held claims were given back behind its back", len(gone))

    async def close(self) -> None:
        """Give back every claim held (the store away: their leases expire by themselves)."""
        for pool in self.pools.values():
            pool.drain()
        if not self.held:
            return
        held, self.held = list(self.held), {}
        try:
            await self.background.store(claims.release_many, self.db, self.settings, held)
        except Exception as exc:
            log.warning("gateway: could not give back %d claims at shutdown: %s", len(held), exc)


def _suspect(
    db: Database, settings: Settings, queue: dispatch.TaskQueue, claimed: Claimed, reason: str
) -> str | None:
    """Give the claim back, retire its replica and queue its delete; the operation id."""
    op = claims.suspect(db, settings, claimed.claim_id, reason)
    return dispatch.enqueue(db, queue, op) if op is not None else None
