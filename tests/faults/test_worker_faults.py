"""Faults with real processes: a worker SIGKILLed mid-spawn, an agent down, the broker restarted.

Each test runs real ``celery -A workers worker`` processes (or an in-process
worker) against the session's Redis and asserts the final state of both the
rows and the agents.
"""

from __future__ import annotations

import time

import grpc
import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import serve_fcdaemon
from corral import api
from stack.supervisor import stop_process
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from testkit.services import RedisServer
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, one_agent
from workers.fleet.health import check_health
from workers.replicas.owners import probe_dedup
from workers.store.models import Node, Replica, ReplicaState

SHORT = {  # a short visibility timeout so redelivery happens within the test
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "4",
    "CORRAL_TASK_TIME_LIMIT_S": "5",
    "CORRAL_VISIBILITY_TIMEOUT_S": "6",
}


def _rows(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica)))


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(120)
def test_worker_killed_mid_spawn_completes_with_exactly_one_vm(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    broker_env.set(**{k[len("CORRAL_") :].lower(): v for k, v in SHORT.items()})
    agent = one_agent(broker_env, start_agents)
    # Learn now, as the first reconcile pass would, that the node deduplicates creates: the
    # redelivery then sends its create again. Left to the second worker, a probe slower than
    # the tests' 2 s RPC deadline (a fresh process on a loaded machine) makes the row a maybe
    # and places a replacement - safe, but another path (tests/workers/replicas/test_owners.py).
    with broker_env.db.read() as s:
        node = s.scalars(select(Node)).one()
    eventually(  # (its own call has the tests' 2 s deadline too: cis621 missed it once)
        lambda: probe_dedup(broker_env.db, broker_env.settings, node),
        30,
        "the node to say it deduplicates creates",
    )
    agent.agent.inject("CreateReplica", Fault.delay(2.0))  # a slow agent
    first = WorkerProcess(broker_env.tmp, concurrency=1, name="first", extra_env=SHORT)
    worker_processes.append(first.start())
    op = api.spawn("hello", 1)
    _wait_for(lambda: agent.agent.calls_of("CreateReplica"), 20, "the CreateReplica call")
    first.kill()  # SIGKILL the whole worker while it waits on the agent
    (row,) = _rows(broker_env)
    assert row.status == ReplicaState.CREATING and row.vmid is None
    second = WorkerProcess(broker_env.tmp, concurrency=1, name="second", extra_env=SHORT)
    worker_processes.append(second.start())
    view = api.wait(op, timeout=60)
    assert view["status"] == "succeeded", (view, second.tail())
    vms = agent.driver.list()
    assert len(vms) == 1  # the redelivered request found its row and the agent its VM
    (row,) = _rows(broker_env)
    assert row.status == ReplicaState.IDLE
    assert row.vmid == vms[0].vmid
    assert len(agent.agent.calls_of("CreateReplica")) == 2
    assert {c.requestId for c in agent.agent.calls_of("CreateReplica")} == {row.request_id}


@pytest.mark.timeout(90)
def test_agent_down_then_back_within_the_retry_window(
    thread_worker: Env, start_agents: StartAgents, caplog: pytest.LogCaptureFixture
) -> None:
    thread_worker.set(retry_backoff_s="0.4", retry_backoff_max_s="2", retry_max="6")
    (agent,) = start_agents(1, env=thread_worker)
    port = agent.port
    deploy_fn(thread_worker)
    agent.stop(grace=0)
    op = api.spawn("hello", 1)
    eventually(lambda: "; retry 2 of 6" in caplog.text, 30, "a couple of failed attempts")
    back = serve_fcdaemon(f"127.0.0.1:{port}")
    try:
        view = api.wait(op, timeout=60)
        assert view["status"] == "succeeded", view
        assert len(back.driver.list()) == 1
        (row,) = _rows(thread_worker)
        assert row.status == ReplicaState.IDLE and row.vmid == back.driver.list()[0].vmid
    finally:
        back.stop(grace=0)


@pytest.mark.timeout(90)
def test_agent_down_for_good_moves_the_replica_to_a_node_that_answers(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    thread_worker.set(retry_max="2", health_misses="2")
    dead, alive = start_agents(2, env=thread_worker)
    deploy_fn(thread_worker)
    dead.stop(grace=0)
    view = api.wait(api.spawn("hello", 1), timeout=60)  # loadbalance picks node1 first
    assert view["status"] == "succeeded", view
    (row,) = _rows(thread_worker)
    assert row.status == ReplicaState.IDLE and row.placements == 2
    assert [vm.vmid for vm in alive.driver.list()] == [row.vmid]
    with thread_worker.db.read() as s:
        nodes = {n.name: n for n in s.scalars(select(Node))}
    # its retries spent, the create counted against node1 (and as a health miss)
    assert nodes["node1"].create_failures == 1 and nodes["node1"].misses == 1
    assert "UNAVAILABLE" in (nodes["node1"].last_error or "")
    assert nodes["node1"].live == 0 and nodes["node2"].live == 1

    check_health(thread_worker.db, thread_worker.settings)  # second miss
    with thread_worker.db.read() as s:
        assert s.scalars(select(Node).where(Node.name == "node1")).one().healthy is False
    view = api.wait(api.spawn("hello", 2), timeout=60)
    assert view["status"] == "succeeded", view
    assert len(alive.driver.list()) == 3


@pytest.mark.timeout(150)
def test_broker_restart_mid_run_loses_nothing(
    broker_env: Env,
    redis_server: RedisServer,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
) -> None:
    """Workers reconnect; a message Redis dropped as it went down is sent again.

    kombu takes a message off its Redis list and records it as unacknowledged in two
    steps, so a message taken at the instant Redis stops can vanish; the reap pass
    (beat, every second here) re-sends the task of an operation that stopped moving.
    """
    redrive = {**SHORT, "CORRAL_REDRIVE_AFTER_S": "3", "CORRAL_REAP_INTERVAL_S": "1"}
    broker_env.set(**{k[len("CORRAL_") :].lower(): v for k, v in redrive.items()})
    agent = one_agent(broker_env, start_agents)
    agent.agent.inject("CreateReplica", *[Fault.delay(0.1)] * 20)
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=redrive)
    worker_processes.append(worker.start())
    beat = start_beat(broker_env.tmp, "restart", redrive)
    try:
        op = api.spawn("hello", 20)
        _wait_for(lambda: len(agent.agent.calls_of("CreateReplica")) >= 3, 30, "spawns under way")
        redis_server.restart()  # appendonly: queued messages survive
        try:
            view = api.wait(op, timeout=90)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{worker.tail()}") from None
    finally:
        stop_process(beat, 20)
    assert view["status"] == "succeeded", (view, worker.tail())
    assert worker.proc is not None and worker.proc.poll() is None  # it reconnected
    rows = _rows(broker_env)
    assert len(rows) == 20
    assert {r.status for r in rows} == {ReplicaState.IDLE}
    assert len(agent.driver.list()) == 20  # no duplicate VM, none lost
    assert sorted(r.vmid or "" for r in rows) == sorted(vm.vmid for vm in agent.driver.list())
    with broker_env.db.read() as s:
        assert s.scalars(select(Node)).one().live == 20


@pytest.mark.timeout(60)
def test_agent_unavailable_is_retried_by_a_real_worker(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    agent = one_agent(thread_worker, start_agents)
    agent.agent.inject("CreateReplica", *[Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy")] * 2)
    view = api.wait(api.spawn("hello", 1), timeout=30)
    assert view["status"] == "succeeded"
    assert len(agent.agent.calls_of("CreateReplica")) == 3
