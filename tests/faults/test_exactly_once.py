"""Exactly one VM per replica under at-least-once delivery, with real prefork workers.

Each test runs ``celery -A workers worker`` processes against the session's Redis and
reference agents on loopback - agents that speak only the seed protocol (``--seed-only``:
no ``requestId``, no ``ListReplicas``, like faas-backend's) unless said otherwise - on
SQLite and PostgreSQL, and ends by comparing both sides: every VM an agent runs has
exactly one live row, every live row's VM runs, ``corral db check`` finds no drift, and
the operation ended with counts that match what happened to its replicas.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from agents.faults import Fault
from agents.fcdaemon import RunningAgent
from tasks import api
from tests.celery_workers import WorkerProcess
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, replicas
from workers import clock
from workers.maintenance.audit import audit
from workers.maintenance.reaper import reap
from workers.registry.service import RunningRegistry, serve_registry
from workers.store.models import LIVE_STATES, ReplicaState

# Short limits so redelivery happens within a test: a task's creates must end within its
# soft limit (calls of 2 s), its ownership of a row lapses at its hard limit.
SHORT = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "4",
    "CORRAL_TASK_TIME_LIMIT_S": "5",
    "CORRAL_VISIBILITY_TIMEOUT_S": "6",
}


def _env(env: Env, extra: dict[str, str]) -> None:
    env.set(**{k[len("CORRAL_") :].lower(): v for k, v in extra.items()})


def _wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _creates(agents: list[RunningAgent]) -> int:
    return sum(len(agent.agent.calls_of("CreateReplica")) for agent in agents)


def _fleet_agrees(env: Env, agents: list[RunningAgent]) -> None:
    """Every VM the agents run has exactly one live row, and every live row's VM runs."""
    running = sorted(vm.vmid for agent in agents for vm in agent.driver.list())
    live = sorted(str(r.vmid) for r in replicas(env) if r.status in LIVE_STATES)
    assert running == live
    with env.db.read() as s:
        found = audit(s, lock=False)
    assert found.drifts == [], [d.message for d in found.drifts]


@pytest.fixture
def registry(broker_env: Env) -> Iterator[RunningRegistry]:
    """corral's registry on loopback, for agents to register with and report READY to."""
    running = serve_registry(broker_env.settings, "127.0.0.1:0")
    yield running
    running.stop(grace=0)


POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])  # the default, and prefork


@pytest.mark.timeout(120)
@POOLS
def test_a_spawn_message_delivered_twice_at_once_sends_each_create_once(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    redis_url: str,
    pool: str,
) -> None:
    _env(broker_env, SHORT)
    agents = start_agents(2, env=broker_env, seed_only=True)
    for agent in agents:  # slow enough that both deliveries overlap
        agent.agent.inject("CreateReplica", *[Fault.delay(0.5)] * 6)
    deploy_fn(broker_env)
    op = api.spawn("hello", 6)  # queued; no worker runs yet
    client = redis.Redis.from_url(redis_url)
    (message,) = client.lrange("corral.spawn", 0, -1)
    client.rpush("corral.spawn", message)  # the broker hands the same message out twice
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=SHORT, pool=pool)
    worker_processes.append(worker.start())
    view = api.wait(op, timeout=60)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 6, 0), view
    time.sleep(1.0)  # let the second delivery finish too
    assert _creates(agents) == 6, worker.tail()  # 12 before: both deliveries sent them all
    rows = replicas(broker_env)
    assert len(rows) == 6 and {r.status for r in rows} == {ReplicaState.IDLE}
    _fleet_agrees(broker_env, agents)


@pytest.mark.timeout(150)
@POOLS
def test_a_worker_killed_mid_create_leaves_no_orphan_on_seed_agents(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    registry: RunningRegistry,
    pool: str,
) -> None:
    _env(broker_env, SHORT)
    agents = start_agents(2, env=broker_env, seed_only=True, registry=registry.address)
    for agent in agents:  # the creates take a while; their guests then report READY
        agent.agent.inject("CreateReplica", *[Fault.delay(2.0)] * 6)
    deploy_fn(broker_env)
    first = WorkerProcess(broker_env.tmp, concurrency=1, name="first", extra_env=SHORT, pool=pool)
    worker_processes.append(first.start())
    op = api.spawn("hello", 6)
    _wait_for(lambda: _creates(agents) == 6, 20, "every create to reach an agent")
    first.kill()  # SIGKILL while every create is in flight: their answers are lost
    second = WorkerProcess(broker_env.tmp, concurrency=2, name="second", extra_env=SHORT, pool=pool)
    worker_processes.append(second.start())
    # The agents make the VMs anyway and their guests say READY; no row can take them (the
    # seed protocol cannot say which request a VM is for), so the registry has them released.
    made: set[str] = set()

    def all_made() -> bool:
        made.update(vm.vmid for a in agents for vm in a.driver.list())
        return len(made) == 6

    _wait_for(all_made, 20, "the agents to finish the creates they were sent")
    _wait_for(lambda: not any(a.driver.list() for a in agents), 60, "the orphans' release")
    released = {r.vmid for a in agents for r in a.agent.calls_of("ReleaseVMSetup")}
    assert made <= released  # each VM went because corral released it
    assert _creates(agents) == 6, second.tail()  # the redelivery sent nothing again
    rows = replicas(broker_env)
    assert {r.status for r in rows} == {ReplicaState.CREATING}
    # At their deadline the rows end Dead, each giving its slot and count back once.
    clock.travel(broker_env.settings.creating_deadline_s + 1)
    reap(broker_env.db, broker_env.settings, holder="t")
    assert {r.status for r in replicas(broker_env)} == {ReplicaState.DEAD}
    view = api.wait(op, timeout=10)
    assert (view["status"], view["done"], view["failed"], view["total"]) == ("failed", 0, 6, 6), (
        view
    )
    _fleet_agrees(broker_env, agents)


@pytest.mark.timeout(120)
def test_a_batch_that_would_outlive_its_task_ends_in_time_and_hands_on_the_rest(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    """Creates of 1 s, two at a time: the batch of 8 would run past the 4 s soft limit."""
    limits = {**SHORT, "CORRAL_NODE_MAX_INFLIGHT": "2"}
    _env(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    agent.agent.inject("CreateReplica", *[Fault.delay(1.0)] * 8)
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
