"""Exactly one VM per replica under at-least-once delivery, with real prefork workers.

Each test runs ``celery -A workers worker`` processes against the session's Redis and
reference agents on loopback - agents that speak only the seed protocol (``--seed-only``:
no ``requestId``, no ``ListReplicas``, like faas-backend's) unless said otherwise - on
SQLite and PostgreSQL, and ends by comparing both sides: every VM an agent runs has
exactly one live row, every live row's VM runs, ``corral db check`` finds no drift, and
the operation ended with counts that match what happened to its replicas.
"""

from __future__ import annotations

import pytest
import redis
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import RunningAgent
from corral import api
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.faults.conftest import POOLS, SHORT, apply_limits
from tests.fixtures import Env, StartAgents
from tests.helpers import broker_drained, broker_state, deploy_fn, replicas
from workers.base import clock
from workers.maintenance.audit import audit
from workers.maintenance.reaper import reap
from workers.registry.service import RunningRegistry
from workers.store.models import LIVE_STATES, Node, ReplicaState


def _creates(agents: list[RunningAgent]) -> int:
    return sum(len(agent.agent.calls_of("CreateReplica")) for agent in agents)


def _fleet_agrees(env: Env, agents: list[RunningAgent]) -> None:
    """Every VM the agents run has exactly one live row, and every live row's VM runs.

    A maybe (a create whose outcome is unknown) has no VM known; it holds its node slot.
    """
    running = sorted(vm.vmid for agent in agents for vm in agent.driver.list())
    live = [r for r in replicas(env) if r.status in LIVE_STATES]
    assert running == sorted(str(r.vmid) for r in live if r.status != ReplicaState.MAYBE)
    with env.db.read() as s:
        found = audit(s, lock=False)
    assert found.drifts == [], [d.message for d in found.drifts]


@pytest.mark.timeout(120)
@POOLS
def test_a_spawn_message_delivered_twice_at_once_sends_each_create_once(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    redis_url: str,
    pool: str,
) -> None:
    apply_limits(broker_env, SHORT)
    agents = start_agents(2, env=broker_env, seed_only=True)
    for agent in agents:  # slow enough that both deliveries overlap
        agent.agent.inject("CreateReplica", *[Fault.delay(0.5)] * 6)
    deploy_fn(broker_env)
    op = api.spawn("hello", 6)  # queued; no worker runs yet
    client = redis.Redis.from_url(redis_url)
    queued = client.lrange("corral.spawn", 0, -1)
    assert len(queued) == 1, broker_state(redis_url)
    (message,) = queued
    client.rpush("corral.spawn", message)  # the broker hands the same message out twice
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=SHORT, pool=pool)
    worker_processes.append(worker.start())
    view = api.wait(op, timeout=60)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 6, 0), view
    eventually(lambda: broker_drained(broker_env), 30, "the second delivery to finish too")
    assert _creates(agents) == 6, worker.tail()  # 12 before: both deliveries sent them all
    rows = replicas(broker_env)
    assert len(rows) == 6 and {r.status for r in rows} == {ReplicaState.IDLE}
    _fleet_agrees(broker_env, agents)


@pytest.mark.timeout(150)
@POOLS
def test_a_worker_killed_with_rows_owned_but_unsent_ends_its_spawn_6_of_6_with_6_vms(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    registry: RunningRegistry,
    pool: str,
) -> None:
    """SIGKILLed with 2 creates sent and 6 rows owned (2 calls at a time per node).

    The killed worker marked sent only the two creates that held the node's slots, so
    the redelivered spawn makes those two maybes (the seed protocol cannot tell what the
    agent did), replaces them at once and sends the four never sent: 6 of 6. The two VMs
    the creates in flight made say READY before any row could take them, and the
    registry releases them; the maybes hold their slots until their deadline.
    """
    limits = {**SHORT, "CORRAL_NODE_MAX_INFLIGHT": "2"}
    apply_limits(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True, registry=registry.address)
    agent.agent.inject("CreateReplica", Fault.delay(2.0), Fault.delay(2.0))  # the two sent
    deploy_fn(broker_env)
    first = WorkerProcess(broker_env.tmp, concurrency=1, name="first", extra_env=limits, pool=pool)
    worker_processes.append(first.start())
    op = api.spawn("hello", 6)
    eventually(lambda: _creates([agent]) == 2, 20, "two creates to reach the agent")
    first.kill()  # their answers are lost; four more rows were owned, their calls not started
    second = WorkerProcess(
        broker_env.tmp, concurrency=2, name="second", extra_env=limits, pool=pool
    )
    worker_processes.append(second.start())
    view = api.wait(op, timeout=60)
    assert (view["status"], view["done"], view["failed"], view["total"]) == (
        "succeeded",
        6,
        0,
        6,
    ), (view, second.tail())
    rows = replicas(broker_env)
    idle = {str(r.vmid) for r in rows if r.status == ReplicaState.IDLE}
    assert len(idle) == 6 and _creates([agent]) == 8

    def six_vms() -> bool:  # the two VMs made for the killed worker's creates are released
        return {vm.vmid for vm in agent.driver.list()} == idle

    eventually(six_vms, 30, "exactly the 6 replicas' VMs to run")
    released = {r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")}
    assert len(released) == 2 and not released & idle
    _fleet_agrees(broker_env, [agent])
    # The maybes hold their slots (the node never over-commits) until their deadline: this
    # node's guests report READY (the replacements' did), so the READY window.
    # (6 before: the killed worker had marked its whole round sent before the first call)
    # (Or a maybe's VM said READY once no create was in flight and settled it: released.)
    maybes = api.operation(op)["maybes"]
    assert sum(maybes.values()) == 2 and set(maybes) <= {"open", "released"}, maybes

    def node() -> Node:
        with broker_env.db.read() as s:
            return s.scalars(select(Node)).one()

    def open_maybes_hold_their_slots() -> bool:  # (a maybe may settle between the reads)
        return node().live == 6 + api.operation(op)["maybes"].get("open", 0)

    eventually(open_maybes_hold_their_slots, 20, "6 slots and one for each open maybe")
    eventually(lambda: node().ready_seen_at is not None, 20, "a replacement's READY")
    settings = broker_env.settings
    clock.travel(settings.create_timeout_s + settings.ready_grace_s + 1)
    reap(broker_env.db, settings, holder="t")
    ended = api.operation(op)["maybes"]  # released by a READY (a loaded run: both), or ended
    assert sum(ended.values()) == 2 and set(ended) <= {"ended", "released"}, ended
    assert node().live == 6
    _fleet_agrees(broker_env, [agent])


@pytest.mark.timeout(120)
def test_a_batch_that_would_outlive_its_task_ends_in_time_and_hands_on_the_rest(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    """Creates of 2 s, two at a time: the batch of 8 would run past the 8 s soft limit.

    Each create's deadline (6 s) is 4 s past its delay: a seed agent's create cut off by
    its deadline on a loaded machine would make a maybe (and a ninth create).
    """
    limits = {
        "CORRAL_TASK_SOFT_TIME_LIMIT_S": "8",
        "CORRAL_TASK_TIME_LIMIT_S": "9",
        "CORRAL_VISIBILITY_TIMEOUT_S": "10",
        "CORRAL_CREATE_TIMEOUT_S": "6",
        "CORRAL_NODE_MAX_INFLIGHT": "2",
    }
    apply_limits(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    agent.agent.inject("CreateReplica", *[Fault.delay(2.0)] * 8)
    deploy_fn(broker_env)
    worker = WorkerProcess(broker_env.tmp, concurrency=1, extra_env=limits, pool="threads")
    worker_processes.append(worker.start())
    view = api.wait(api.spawn("hello", 8), timeout=90)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 8, 0), view
    assert _creates([agent]) == 8
    log = worker.tail(400)
    # no task ran into a limit: each stopped sending in time and queued the rest
    assert "soft time limit" not in log and "hard time limit" not in log.lower(), log
    assert log.count("corral.spawn_batch[") >= 2, log
    _fleet_agrees(broker_env, [agent])
