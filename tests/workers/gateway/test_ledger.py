"""A gateway holds the claims it used between requests: reuse, keep window, renewal, drops.

Real HTTP, Redis broker, Celery worker and process agent, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import httpx
import redis

from corral import api
from testkit import httpcalls
from testkit.eventually import eventually
from tests.workers.gateway.conftest import Stack
from workers.autoscale import demand
from workers.base import clock
from workers.replicas import claims
from workers.store.models import Claim, ReplicaState


def _get_at_once(url: str, n: int) -> list[int]:
    """``n`` GETs of ``url`` at once; their status codes."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(client.get(url) for _ in range(n)))
            return [a.status_code for a in answers]

    return asyncio.run(run())


def _rows(stack: Stack) -> list[Claim]:
    with stack.env.db.read() as s:
        return list(s.query(Claim).order_by(Claim.created_at, Claim.id))


def test_a_second_request_reuses_the_held_claim_without_a_new_claim_row(stack: Stack) -> None:
    stack.deploy("hello", max=2)
    gw = stack.gateway(gateway_keep_s=5.0)
    assert httpcalls.get(f"{gw.url}/function/hello", timeout=60).status_code == 200
    (first,) = _rows(stack)
    for _ in range(5):
        assert httpcalls.get(f"{gw.url}/function/hello", timeout=60).status_code == 200
    (again,) = _rows(stack)
    assert (again.id, again.created_at) == (first.id, first.created_at)  # the same claim row
    assert set(gw.app.gateway.ledger.held) == {first.id}
    (replica,) = stack.replicas("hello")
    assert (replica.status, replica.envs_in_use) == (ReplicaState.ALLOCATED, 1)
    # Held but idle is not demand: the autoscaler sees nothing in flight (a report, every
    # 0.2 s, after the last request says so).
    client = redis.Redis.from_url(stack.env.settings.broker_url)

    def nothing_in_flight() -> bool:
        seen = demand.read(client, ["hello"])["hello"]
        return seen is not None and (seen.inflight, seen.queued) == (0, 0)

    try:
        eventually(nothing_in_flight, 10, "a demand report of nothing in flight (claim held)")
    finally:
        client.close()


def test_the_keep_window_gives_unused_environments_back(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo", max=1, exec_envs=4)
    # a keep window long enough that "right after" the four calls is within it also on a
    # busy machine (at 1 s a loaded run read the four claims, then an idle replica)
    gw = stack.gateway(gateway_keep_s=4.0)
    assert httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code == 200  # cold start
    assert _get_at_once(f"{gw.url}/function/echo?delay=0.3", 4) == [200] * 4
    assert stack.claims() == 4  # all four held right after
    (replica,) = stack.replicas("echo")
    assert (replica.status, replica.envs_in_use) == (ReplicaState.ALLOCATED, 4)
    # One request every 0.2 s keeps one environment in use; the other three go back once
    # their keep window (4 s, on the gateway's monotonic clock) has passed unused.
    ended = [0.0]

    def one_kept() -> set[str]:
        assert httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code == 200
        ended[0] = time.monotonic()
        kept = {c.id for c in _rows(stack)}
        return kept if len(kept) == 1 else set()

    kept = eventually(one_kept, 60, "three of four environments given back", poll=0.2)
    assert kept <= set(gw.app.gateway.ledger.held)
    stack.settled(10)
    # the last one was kept a while (4 s) after its call ended: load only makes this longer
    assert time.monotonic() - ended[0] > 3.0
    (replica,) = stack.replicas("echo")  # ...then given back: idle, its idle clock running
    assert (replica.status, replica.envs_in_use) == (ReplicaState.IDLE, 0)
    assert replica.idle_since is not None and replica.reap_at is not None
    assert gw.app.gateway.ledger.held == {}


def test_held_claims_are_renewed_past_their_ttl_in_use_and_idle(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo", max=1)
    gw = stack.gateway(gateway_claim_ttl_s=2.0, gateway_keep_s=60.0)

    async def slow_request_while_reaping() -> tuple[int, int]:
        async with httpx.AsyncClient(timeout=60) as client:
            call = asyncio.ensure_future(client.get(f"{gw.url}/function/echo?delay=5"))
            expired = 0
            while not call.done():  # the reaper's expiry sweep, again and again
                await asyncio.sleep(0.25)
                expired += await asyncio.to_thread(claims.expire, stack.env.db, stack.env.settings)
            return (await call).status_code, expired

    status, expired = asyncio.run(slow_request_while_reaping())
    assert (status, expired) == (200, 0)  # in use 5 s with a 2 s lease: never expired
    (held,) = _rows(stack)
    clock.travel(5.0)  # idle in the pool, more than twice its ttl...
    (still,) = eventually(  # ...renewed (every ttl/3) past that
        lambda: [c for c in _rows(stack) if c.expires_at > held.expires_at + timedelta(seconds=5)],
        10,
        "the idle claim's renewal after the clock moved on",
    )
    assert claims.expire(stack.env.db, stack.env.settings) == 0
    assert still.id == held.id
    assert httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code == 200
    assert {c.id for c in _rows(stack)} == {held.id}  # and it serves again


def test_a_failed_replica_leaves_the_pool_with_all_its_claims(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo", max=3, exec_envs=2)
    gw = stack.gateway(gateway_keep_s=60.0)
    assert api.wait(api.spawn("echo", 1), timeout=60)["status"] == "succeeded"
    (bad,) = stack.replicas("echo")
    assert _get_at_once(f"{gw.url}/function/echo?delay=0.5", 2) == [200, 200]
    assert [c.replica_id for c in _rows(stack)] == [bad.id, bad.id]  # both held, idle
    assert bad.vmid is not None
    stack.kill_vm(bad.vmid)
    answer = httpcalls.get(f"{gw.url}/function/echo", timeout=60)
    assert answer.status_code == 200  # tried on a pooled claim of bad, then elsewhere
    rows = {r.id: r for r in stack.replicas("echo")}
    assert rows[bad.id].status in (ReplicaState.DELETING, ReplicaState.DELETED)
    assert (rows[bad.id].error or "").startswith("suspect: ")
    eventually(  # its other, idle claim is given back too
        lambda: all(c.replica_id != bad.id for c in _rows(stack)), 10, "bad's idle claim back"
    )
    assert [c.replica_id for c in gw.app.gateway.ledger.held.values()] != []
    assert all(c.replica_id != bad.id for c in gw.app.gateway.ledger.held.values())


def test_a_replica_retired_elsewhere_leaves_the_pool_at_the_next_renewal(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect", max=3, exec_envs=2)
    gw = stack.gateway(gateway_keep_s=60.0, gateway_claim_ttl_s=1.5)
    first = httpcalls.get(f"{gw.url}/function/reflect", timeout=60)
    assert first.status_code == 200
    (replica,) = stack.replicas("reflect")
    other = api.claim("reflect")  # its second environment, claimed by someone else...
    assert other["replica_id"] == replica.id
    api.suspect(other["claim_id"], "suspect: seen failing elsewhere")  # ...who retires it
    # renewal (every 0.5 s) saw it Deleting or gone
    eventually(lambda: gw.app.gateway.ledger.held == {}, 10, "the retired replica's claim out")
    answer = httpcalls.get(f"{gw.url}/function/reflect", timeout=60)
    assert answer.status_code == 200
    assert answer.headers["x-reflect-vmid"] != first.headers["x-reflect-vmid"]


def test_stopping_the_gateway_gives_every_held_claim_back(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo", max=2, exec_envs=3)
    gw = stack.gateway(gateway_keep_s=600.0)
    assert _get_at_once(f"{gw.url}/function/echo?delay=0.5", 6) == [200] * 6
    assert stack.claims() >= 3  # held after their requests
    gw.stop()
    assert stack.claims() == 0  # given back as it stopped, not by the keep window
    assert all((r.status, r.envs_in_use) == (ReplicaState.IDLE, 0) for r in stack.replicas("echo"))
