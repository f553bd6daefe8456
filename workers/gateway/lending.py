"""Claims the gateway lends another data plane (HAProxy), and what comes back from it.

The ledger (:mod:`workers.gateway.ledger`) holds every claim. With a *lender* - the warm
data plane (:class:`workers.gateway.haproxy.router.Router`) - a claim no request of the
gateway waits for is lent to it instead of kept idle in the pool, and the lender gives
claims back through :class:`Lending`: to the ledger (:meth:`Lending.give_back`: a
waiting request, or lent again), to the store (:meth:`Lending.release`), or dropped
(:meth:`Lending.forget`: the store no longer has them); a replica it saw fail is
retired as suspect (:meth:`Lending.retire_soon`); and once a replica's closing server
is gone, the claims of it the pool kept meanwhile are offered again
(:meth:`Lending.offer`). The ledger tells the lender what it must know: claims its
renewal found unusable or gone (:meth:`Lending.recall`), a replica the Python path
retired (:meth:`Lending.retired`), and a request that found nothing in the pool nor
Idle in the store, which asks for environments back first (:meth:`Lending.reclaimed`).
Without a lender every method is a no-op.

Everything here runs on the gateway's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from workers.gateway.pool import Pool
from workers.replicas.claims import Claimed

if TYPE_CHECKING:
    from workers.gateway.ledger import Ledger

RECLAIM_WAIT_S = 0.2  # a request waits this long for claims asked back from a lender


class Lender(Protocol):
    """Who else serves requests with the ledger's claims (the warm data plane, HAProxy)."""

    def lend(self, claimed: Claimed) -> bool:
        """Take a claim no request here waits for; False: the ledger keeps it."""

    def reclaim(self, function: str, count: int) -> int:
        """Ask for environments back (given back to the ledger when free); how many come."""

    def recall(self, claim_ids: Collection[str], *, release: bool) -> None:
        """Lent claims that must go: released to the store, or forgotten (gone from it)."""

    def retired(self, replica_id: str) -> None:
        """A replica failed here and is retired: stop sending it requests."""


class Lending:
    """The ledger's side of lending: its lender, if any, and what the lender gives back."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.lender: Lender | None = None

    # -- the ledger tells the lender --------------------------------------------------------

    def lend(self, claimed: Claimed) -> bool:
        """Lend a claim no request waits for; False: keep it in the pool."""
        return self.lender is not None and self.lender.lend(claimed)

    def retired(self, replica_id: str) -> None:
        """The Python path retired a replica: the lender stops using it."""
        if self.lender is not None:
            self.lender.retired(replica_id)

    def recall(self, bad: Collection[str], gone: Collection[str]) -> None:
        """The renewal's verdicts: lent claims of unusable replicas, and claims gone."""
        if self.lender is not None:
            self.lender.recall(bad, release=True)
            self.lender.recall(gone, release=False)

    async def reclaimed(self, pool: Pool, name: str, place: asyncio.Future[Claimed]) -> bool:
        """Ask the lender for environments back; True once this request was given one.

        A lender that holds none of the function's unused says so at once; one that does
        hands them back as they come free, and the request waits a moment for one before
        it goes to the store again (a cold start there would make a replica for nothing).
        """
        if self.lender is None or not self.lender.reclaim(name, pool.wanted):
            return False
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(RECLAIM_WAIT_S):
                await asyncio.shield(place)
        return place.done()

    # -- the lender gives back --------------------------------------------------------------

    def give_back(self, claimed: Claimed) -> None:
        """A claim the lender is done with: to a waiting request, else lent again or kept."""
        self.ledger.give_back(claimed)

    def offer(self, function: str, replica_id: str) -> None:
        """Lend again the idle claims of a replica whose old server the lender has closed.

        A claim given back while that server was still closing stayed in the pool (a
        lender takes none of a replica while its server closes); without this it waited
        there for a request of the Python path, and the function stayed off the warm path.
        """
        pool = self.ledger.pools.get(function)
        if self.lender is not None and pool is not None and not pool.wanted:
            pool.hand_out(replica_id, self.lender.lend)

    def release(self, claims: list[Claimed]) -> None:
        """Give these claims back to the store."""
        for claimed in claims:
            self.ledger._unpooled.pop(claimed.claim_id, None)
        self.ledger._release_soon(claims)

    def forget(self, claims: list[Claimed]) -> None:
        """Stop holding claims the store no longer has."""
        for claimed in claims:
            self.ledger._unpooled.pop(claimed.claim_id, None)
            self.ledger.held.pop(claimed.claim_id, None)
            self.ledger.cold.pop(claimed.claim_id, None)

    def retire_soon(self, claimed: Claimed, reason: str) -> None:
        """Retire the claim's replica as suspect, in the background (it failed the lender)."""
        self.ledger.background.soon(self.ledger.retire(claimed, reason))
