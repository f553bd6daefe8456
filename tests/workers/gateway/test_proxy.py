"""The gateway end to end: real HTTP, Redis broker, Celery worker, process agent."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable

import httpx
import pytest
import redis
from sqlalchemy import text

from testkit import httpcalls
from testkit.eventually import eventually
from tests.workers.gateway.conftest import Stack
from workers.autoscale import demand
from workers.store.models import FINAL_STATES, ReplicaState


def _metric(text: str, line_start: str) -> float:
    """The value of the first exposition line starting with ``line_start``."""
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric line {line_start!r} in:\n{text}")


def test_a_function_at_zero_replicas_is_answered_by_a_cold_start(stack: Stack) -> None:
    stack.deploy("hello", max=3)
    gw = stack.gateway()
    assert stack.replicas("hello") == []
    first = httpcalls.get(f"{gw.url}/function/hello", timeout=60)
    assert first.status_code == 200 and first.text == "hello from corral\n"
    assert stack.claims() == 1  # kept by the gateway for its next request...
    stack.settled()  # ...and given back after its keep window
    (replica,) = stack.replicas("hello")
    assert (replica.status, replica.envs_in_use) == (ReplicaState.IDLE, 0)
    second = httpcalls.get(f"{gw.url}/function/hello/any/path?x=1", timeout=60)
    assert second.status_code == 200
    assert len(stack.replicas("hello")) == 1 and stack.creates() == 1  # warm: no new replica

    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    assert _metric(text, 'corral_function_invocations_total{code="200",function="hello"}') == 2
    assert _metric(text, 'corral_cold_starts_total{function="hello"}') == 1
    assert _metric(text, 'corral_cold_start_seconds_count{function="hello"}') == 1
    assert _metric(text, 'corral_function_duration_seconds_count{function="hello"}') == 2
    assert _metric(text, 'corral_inflight{function="hello"}') == 0
    assert _metric(text, 'corral_queue_depth{function="hello"}') == 0


def test_method_path_query_headers_and_body_are_forwarded(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    answer = httpcalls.request(
        "PATCH",
        f"{gw.url}/function/reflect/a/b%20c?q=1&q=2&x=%2F",
        headers={"X-Custom": "yes", "Connection": "keep-alive"},
        content=b"payload",
        timeout=60,
    )
    assert answer.status_code == 200
    seen = json.loads(answer.content)
    assert seen["method"] == "PATCH"
    assert seen["path"] == "/a/b%20c"
    assert seen["query"] == "q=1&q=2&x=%2F"
    assert seen["body"] == "payload"
    assert seen["headers"]["x-custom"] == "yes"
    assert seen["headers"]["x-forwarded-for"] == "127.0.0.1"
    assert seen["headers"]["x-forwarded-host"] == gw.url.removeprefix("http://")
    assert answer.headers["x-reflect-vmid"] == seen["vmid"] != ""
    stack.finish()


def test_a_replicas_cookies_go_to_its_caller_only(stack: Stack) -> None:
    """The gateway's own HTTP client keeps no cookie: none reaches another caller."""
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway()
    first = httpcalls.get(f"{gw.url}/function/reflect?set-cookie=session=alice", timeout=60)
    assert first.status_code == 200
    assert first.headers["set-cookie"] == "session=alice; Path=/function/reflect"  # its caller
    second = httpcalls.get(f"{gw.url}/function/reflect", timeout=60)  # another caller
    assert second.status_code == 200
    assert "cookie" not in second.json()["headers"]
    third = httpcalls.get(f"{gw.url}/function/reflect", cookies={"mine": "1"}, timeout=60)
    assert third.json()["headers"]["cookie"] == "mine=1"  # a caller's own cookies go through


def test_two_hundred_concurrent_first_requests_start_at_most_max_replicas(stack: Stack) -> None:
    """Two gateways, one control plane: every request answered, never more than max replicas."""
    stack.deploy("echo", image="examples.echo", max=4, exec_envs=1)
    gateways = [stack.gateway(), stack.gateway()]

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{gateways[i % 2].url}/function/echo?delay=0.05",
                        content=f"request {i}".encode(),
                    )
                    for i in range(200)
                )
            )

    answers = asyncio.run(run())
    refused = {a.text for a in answers if a.status_code != 200}
    assert [a.status_code for a in answers] == [200] * 200, refused
    assert [a.text for a in answers] == [f"request {i}" for i in range(200)]
    # VMs the agent was asked for (cis232, two suites at once: a create past its deadline was
    # sent again with its request id, five calls for four VMs)
    assert 1 <= stack.vms_asked() <= 4
    stack.settled()
    made = [r for r in stack.replicas("echo") if r.status not in FINAL_STATES]
    assert len(made) == stack.vms_asked()
    assert all((r.status, r.envs_in_use) == (ReplicaState.IDLE, 0) for r in made)
    # A spawn two gateways asked for at once beyond max fails before any VM is made.
    failed = [r for r in stack.replicas("echo") if r.id not in {m.id for m in made}]
    assert all("max" in (r.error or "") for r in failed), [r.error for r in failed]


def test_a_client_that_goes_away_releases_its_claim(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo")
    # HAProxy closes a server unused for the keep window, and its calls go to the activator
    # again: a keep window of 5 s, so that a stall of this process between the warm-up and
    # the call (cis471, beside another suite: over the default 1.5 s) cannot take the
    # route away before the call comes
    keep = 5.0
    gw = stack.gateway(gateway_keep_s=keep)
    # warm: with HAProxy, until it routes echo (cis401: the next call came first, so the
    # activator, not HAProxy, carried it)
    stack.warm(gw, "echo")
    (replica,) = stack.replicas("echo")
    # HAProxy lets the replica finish what it was sent (the replica is busy with it until
    # then): there the environment comes back once it has answered, not at once
    delay = 4 if stack.haproxy else 20
    with pytest.raises(httpx.ReadTimeout):
        httpcalls.get(f"{gw.url}/function/echo?delay={delay}", timeout=1.0)  # gives up after 1 s
    # given back after its last use: HAProxy's once unused a whole window of its peaks (up
    # to two keep windows); the Python path's a keep window after the client went, long
    # before the replica would have answered, which it would have held the environment until
    stack.settled(delay + 2 * keep + 10 if stack.haproxy else 15)
    (row,) = stack.replicas("echo")
    assert (row.id, row.status, row.envs_in_use) == (replica.id, ReplicaState.IDLE, 0)
    stack.carried(gw, "echo", 1)
    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    if stack.haproxy:  # carried by HAProxy
        assert _metric(text, 'corral_warm_requests_total{function="echo"}') == 1
    else:
        assert _metric(text, 'corral_function_invocations_total{code="499",function="echo"}') == 1
    again = httpcalls.get(f"{gw.url}/function/echo", timeout=60)  # the environment serves again
    assert again.status_code == 200 and len(stack.replicas("echo")) == 1


def test_each_gateway_reports_its_demand_to_redis(stack: Stack) -> None:

    stack.deploy("echo", image="examples.echo", max=2)
    first, second = stack.gateway(), stack.gateway()
    client = redis.Redis.from_url(stack.env.settings.broker_url)

    async def load() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(
                # long enough to be seen busy by reports every 0.2 s, even on a loaded machine
                *(http.get(f"{gw.url}/function/echo?delay=3") for gw in (first, second, first))
            )

    def reported(inflight_and_queued: int) -> Callable[[], demand.Demand | None]:
        """A check: both gateways' reports (every 0.2 s) add up to this much demand."""

        def check() -> demand.Demand | None:
            seen = demand.read(client, ["echo"])["echo"]
            ok = seen is not None and seen.gateways == 2
            return seen if ok and seen.inflight + seen.queued == inflight_and_queued else None

        return check

    async def busy_then_read() -> demand.Demand:
        task = asyncio.ensure_future(load())
        # two environments busy, one request queued, as both gateways report while busy
        seen = await asyncio.to_thread(eventually, reported(3), 10, "the busy gateways' demand")
        await task
        assert seen is not None
        return seen

    seen = asyncio.run(busy_then_read())
    assert seen.concurrency > 0 and seen.last_request_at is not None
    after = eventually(reported(0), 10, "demand seen to fall")
    assert after is not None
    assert (after.inflight, after.queued, after.gateways) == (0, 0, 2)
    client.close()


def test_a_request_waiting_on_the_store_is_reported_while_it_waits(stack: Stack) -> None:
    """Demand reports have a thread of their own: on SQLite the store has one, and here it
    waits for the database's write lock (the test holds it) on behalf of a request. Behind
    it a report would land only once the lock is free, stale: the autoscaler saw no demand
    for 120 s under a steady load (test_through_the_gateway[sqlite])."""
    stack.deploy("echo", image="examples.echo", max=1)
    gw = stack.gateway()
    client = redis.Redis.from_url(stack.env.settings.broker_url)
    answers: list[int] = []

    def call() -> None:
        answers.append(httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code)

    def waiting_reported() -> demand.Demand | None:
        seen = demand.read(client, ["echo"])["echo"]
        return seen if seen.gateways == 1 and seen.inflight + seen.queued >= 1 else None

    caller = threading.Thread(target=call, daemon=True)
    # the write lock on SQLite (BEGIN IMMEDIATE), the function's row on PostgreSQL: the
    # request's claim waits for it (the store's busy timeout, 30 s, is longer than this)
    with stack.env.db.transaction() as s:
        s.execute(text("UPDATE functions SET target = target WHERE name = 'echo'"))
        caller.start()
        seen = eventually(waiting_reported, 10, "the waiting request in a fresh report")
        assert answers == [], "the request was answered while the store was locked"
    caller.join(60)
    assert answers == [200]
    assert seen is not None and seen.last_request_at is not None
    client.close()
