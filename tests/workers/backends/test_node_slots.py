"""The per-node in-flight bound across processes: node slots leased in Redis.

``CORRAL_NODE_MAX_INFLIGHT`` is a promise to the agent, not to one worker process:
two prefork workers (four pool processes) spawning onto one agent that counts its
concurrent calls must keep it within the bound, and the slots a SIGKILLed worker
held must come back by themselves (workers.backends.node_slots).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from agents.fcdaemon import RunningAgent, serve_fcdaemon
from config.settings import get_settings
from corral import api
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from testkit.services import free_port
from tests.fixtures import Env, sqlite_only
from tests.workers.replicas.test_creates import Counter, CountingDriver
from workers.backends import inflight, node_slots
from workers.base.errors import PermanentBackendError, TransientBackendError
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.models import Node


def _one_counting_agent(env: Env, counter: Counter, seconds: float) -> tuple[RunningAgent, str]:
    agent = serve_fcdaemon("127.0.0.1:0", driver=CountingDriver(counter, seconds), max_workers=64)
    with env.db.transaction() as s:
        node_id = upsert_node(s, agent.address, name="counted", capacity=1000)[0].id
        deploy(
            s, spec_from(name="hello", image="examples.hello", kernel="/k", max=1000), env.settings
        )
    return agent, node_id


def test_slots_unavailable_say_nothing_was_sent() -> None:
    """A broker that is down fails the call before it goes out: a create on a seed agent may
    be sent again (it was left "outcome unknown" until its deadline before)."""
    slots = node_slots.RedisSlots(f"redis://127.0.0.1:{free_port()}/0", ttl_s=30)

    try:
        with pytest.raises(TransientBackendError, match="unavailable") as caught:
            inflight.run(slots.acquire("n1", 4, 1), timeout=30)
    finally:
        inflight.reset()
    assert caught.value.nothing_done is True


def test_leases_are_granted_in_chunks_up_to_the_bound_and_given_back(redis_url: str) -> None:
    slots = node_slots.RedisSlots(redis_url, ttl_s=30)
    client = redis.Redis.from_url(redis_url)

    async def scenario() -> tuple[int, int, int, int]:
        first = await slots.acquire("n1", 4, 10)  # asks for 10: the bound grants 4
        none = await slots.acquire("n1", 4, 3)
        await slots.release("n1", first[:2])
        again = await slots.acquire("n1", 4, 3)
        other = await slots.acquire("n2", 4, 1)  # nodes are counted apart
        return len(first), len(none), len(again), len(other)

    try:
        assert inflight.run(scenario(), timeout=30) == (4, 0, 2, 1)
        assert node_slots.held(client, "n1") == 4 and node_slots.held(client, "n2") == 1
        assert client.pttl(node_slots.key("n1")) > 25_000  # the set lapses with its leases
    finally:
        inflight.reset()
        client.close()


def test_a_call_that_may_still_run_keeps_its_slot_until_its_lease_lapses(redis_url: str) -> None:
    """An answer gives the slot back at once; a deadline or a cancel leaves the lease to lapse."""
    slots = node_slots.RedisSlots(redis_url, ttl_s=3.0)
    client = redis.Redis.from_url(redis_url)

    async def ends_with(exc: BaseException) -> None:
        with contextlib.suppress(type(exc)):
            async with inflight.slot("n1", 1, 8, slots):
                raise exc

    async def cancelled() -> None:
        async def call() -> None:
            async with inflight.slot("n2", 1, 8, slots):
                await asyncio.Event().wait()  # a call the agent never answers

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(call(), 0.1)

    def settled() -> None:  # the loop has run what the calls left behind (a release)
        inflight.run(asyncio.sleep(0.05), timeout=30)

    try:
        inflight.run(ends_with(PermanentBackendError("refused", node="n1")), timeout=30)
        settled()
        assert node_slots.held(client, "n1") == 0  # the agent answered: given back at once
        unanswered = TransientBackendError("deadline", node="n1", nothing_done=False)
        inflight.run(ends_with(unanswered), timeout=30)
        inflight.run(cancelled(), timeout=30)
        settled()
        assert node_slots.held(client, "n1") == 1  # may still run there: not given back
        assert node_slots.held(client, "n2") == 1
        eventually(lambda: node_slots.held(client, "n1") + node_slots.held(client, "n2") == 0)
    finally:
        inflight.reset()
        client.close()


@pytest.mark.long(20)
@pytest.mark.timeout(240)
def test_two_worker_processes_keep_one_agent_within_the_bound(
    broker_env: Env, worker_processes: list[WorkerProcess]
) -> None:
    broker_env.set(node_max_inflight="4")
    counter = Counter()
    agent, node_id = _one_counting_agent(broker_env, counter, 0.05)
    # The default deadlines, not FAST's 2 s: a slot is a lease that lapses at the longest
    # call timeout plus 2 s, and a worker stalled past that (6.7 s beside a second suite,
    # cis693: a peak of 5) lets its slot go while its call may still be at the agent - the
    # bound is then a lapse's, which the killed-worker test below is about.
    timeouts = {"CORRAL_CREATE_TIMEOUT_S": "30", "CORRAL_RPC_TIMEOUT_S": "10"}
    try:
        for name in ("w1", "w2"):
            worker = WorkerProcess(broker_env.tmp, concurrency=2, name=name, extra_env=timeouts)
            worker_processes.append(worker.start())
        # four batches of 100: each of the four pool processes sends its own at once
        view = api.wait(api.spawn("hello", 400), timeout=180)
        assert view["status"] == "succeeded", view
        assert len(agent.driver.list()) == 400
        peak = counter.peak[id(agent.driver)]
        assert 1 < peak <= 4, peak
        for worker in worker_processes:  # both workers took part
            assert "corral.spawn" in worker.tail(10_000)
        counter.peak.clear()
        assert api.wait(api.scale("hello", 0), timeout=180)["status"] == "succeeded"
        assert agent.driver.list() == []
        assert 1 < counter.peak[id(agent.driver)] <= 4
        client = redis.Redis.from_url(get_settings().broker_url)
        try:  # every lease given back, or lapsed (a call past its deadline: up to 32 s)
            eventually(lambda: node_slots.held(client, node_id) == 0, timeout=45)
        finally:
            client.close()
    finally:
        agent.stop(grace=0)


@sqlite_only  # the leases live in Redis; the store only holds the rows being spawned
@pytest.mark.timeout(240)
def test_the_slots_of_a_killed_worker_lapse_by_themselves(
    broker_env: Env, worker_processes: list[WorkerProcess]
) -> None:
    broker_env.set(node_max_inflight="3", create_timeout_s="4")
    settings = get_settings()
    counter = Counter()
    agent, node_id = _one_counting_agent(broker_env, counter, 3.0)
    with broker_env.db.transaction() as s:  # a proven node: no probation
        s.get(Node, node_id).last_create_ok_at = s.scalar(  # type: ignore[union-attr]
            select(Node.created_at).where(Node.id == node_id)
        )
    client = redis.Redis.from_url(settings.broker_url)
    try:
        worker = WorkerProcess(broker_env.tmp, concurrency=1, name="doomed").start()
        worker_processes.append(worker)
        api.spawn("hello", 5)
        deadline = time.monotonic() + 60
        while counter.total < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert counter.total == 3  # three creates in flight, the bound
        worker.kill()
        killed = time.monotonic()
        assert node_slots.held(client, node_id) == 3  # nobody gave them back
        slots = node_slots.source(settings)
        assert slots is not None and slots.ttl_s == 4 + node_slots.SLACK_S
        assert len(inflight.run(slots.acquire(node_id, 3, 3), timeout=10)) == 0
        while node_slots.held(client, node_id) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        lapsed_after = time.monotonic() - killed
        assert node_slots.held(client, node_id) == 0
        assert lapsed_after < slots.ttl_s + 5
        granted = inflight.run(slots.acquire(node_id, 3, 3), timeout=10)
        assert len(granted) == 3  # the node's slots are whole again
        inflight.run(slots.release(node_id, granted), timeout=10)
    finally:
        client.close()
        inflight.reset()
        agent.stop(grace=0)


def test_a_worker_started_again_frees_only_what_its_dead_processes_held(redis_url: str) -> None:
    """Leases name their holder: a dead process of the worker's name goes, the rest stay."""
    client = redis.Redis.from_url(redis_url)
    done = subprocess.Popen(["true"])
    done.wait()  # a process of this worker that ran and is gone
    killed = subprocess.Popen(["true"])  # one killed and not reaped yet: a zombie, not running
    stat = Path(f"/proc/{killed.pid}/stat")
    eventually(lambda: stat.read_text().rpartition(")")[2].split()[0] == "Z", 10, "a zombie")
    zombie = f"{killed.pid}.{stat.read_text().rpartition(')')[2].split()[19]}"
    me = f"{os.getpid()}.{node_slots._started(os.getpid())}"
    far = time.time() * 1000 + 60_000  # none of them lapses during the test
    held = {
        f"w1@h/1#{done.pid}.1:7": far,  # its dead pool process
        f"w1@h/0#{done.pid}.1:8": far,  # its dead main process
        f"w1@h/3#{zombie}:10": far,  # its killed pool process, not yet reaped
        f"w1@h/2#{me}:9": far,  # a process of that name that still runs (a duplicate name)
        f"w1@hx/0#{done.pid}.1:3": far,  # another worker whose name starts the same
        f"w2@h/0#{done.pid}.1:4": far,  # another worker
        "host:123:abc:5": far,  # a process that took no name
    }
    try:
        client.zadd(node_slots.key("n1"), held)
        client.zadd(node_slots.key("n2"), {f"w1@h/0#{done.pid}.1:11": far})
        assert node_slots.free_dead(redis_url, "w1@h") == 4
        members = client.zrange(node_slots.key("n1"), 0, -1)
        left = {m.decode() if isinstance(m, bytes) else str(m) for m in members}
        freed = {f"w1@h/1#{done.pid}.1:7", f"w1@h/0#{done.pid}.1:8", f"w1@h/3#{zombie}:10"}
        assert left == set(held) - freed
        assert client.zcard(node_slots.key("n2")) == 0
        # a pool process started again frees only what its own name held
        client.zadd(node_slots.key("n1"), {f"w1@h/1#{done.pid}.1:12": far})
        assert node_slots.free_dead(redis_url, "w1@h/2") == 0
        assert node_slots.free_dead(redis_url, "w1@h/1") == 1
    finally:
        killed.wait()
        client.close()
