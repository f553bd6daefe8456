"""One function's held claims: the newest idle one first, waiters served in order, the keep
window, and claims of a failed replica taken out."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

from workers.gateway.pool import Pool
from workers.replicas.claims import Claimed


def _claim(claim_id: str, replica_id: str = "r1") -> Claimed:
    return Claimed(claim_id, replica_id, "http://127.0.0.1:9", "vm", "hello", datetime(2030, 1, 1))


def test_the_newest_idle_claim_is_taken_first() -> None:
    pool = Pool()
    assert pool.take() is None
    for cid in ("c1", "c2", "c3"):
        pool.give(_claim(cid))
    assert [c.claim_id for c in (pool.take(), pool.take())] == ["c3", "c2"]  # type: ignore[union-attr]
    assert [c.claim_id for c in pool.drain()] == ["c1"]
    assert pool.take() is None


def test_a_returned_claim_goes_to_the_first_waiter_not_the_idle_stack() -> None:
    async def scenario() -> None:
        pool = Pool()
        first, second = pool.wait(), pool.wait()
        assert pool.wanted == 2
        pool.give(_claim("c1"))
        assert first.result().claim_id == "c1" and not second.done()
        assert pool.wanted == 1 and pool.idle == []
        assert pool.unwait(second) is None  # leaves the line with nothing
        pool.give(_claim("c2"))
        assert [c.claim_id for c, _ in pool.idle] == ["c2"]

    asyncio.run(scenario())


def test_a_waiter_that_leaves_after_being_served_keeps_its_claim() -> None:
    async def scenario() -> None:
        pool = Pool()
        place = pool.wait()
        pool.give(_claim("c1"))
        kept = pool.unwait(place)
        assert kept is not None and kept.claim_id == "c1"  # the caller must give it back

    asyncio.run(scenario())


def test_the_keep_window_takes_out_only_claims_unused_that_long() -> None:
    pool = Pool()
    pool.give(_claim("old"))
    time.sleep(0.15)
    pool.give(_claim("new"))
    assert [c.claim_id for c in pool.expired(0.1)] == ["old"]
    assert [c.claim_id for c, _ in pool.idle] == ["new"]
    assert pool.expired(10.0) == []


def test_a_failed_replica_leaves_with_all_its_idle_claims() -> None:
    pool = Pool()
    for cid, rid in (("a1", "ra"), ("b1", "rb"), ("a2", "ra")):
        pool.give(_claim(cid, rid))
    assert sorted(c.claim_id for c in pool.drop_replica("ra")) == ["a1", "a2"]
    assert [c.claim_id for c, _ in pool.idle] == ["b1"]
    assert pool.drop({"b1", "zz"})[0].claim_id == "b1"
    assert pool.idle == []


def test_hand_out_offers_one_replicas_idle_claims_and_keeps_what_is_refused() -> None:
    pool = Pool()
    for cid, replica in (("a1", "r1"), ("b1", "r2"), ("a2", "r1")):
        pool.give(_claim(cid, replica))
    stamps = {c.claim_id: at for c, at in pool.idle}
    offered: list[str] = []

    def taker(claimed: Claimed) -> bool:
        offered.append(claimed.claim_id)
        return claimed.claim_id == "a1"  # takes one, refuses the other

    pool.hand_out("r1", taker)
    assert offered == ["a1", "a2"]  # only r1's
    assert [(c.claim_id, at) for c, at in pool.idle] == [("b1", stamps["b1"]), ("a2", stamps["a2"])]
