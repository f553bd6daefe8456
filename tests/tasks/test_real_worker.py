"""The pipeline through a real Redis broker and real Celery workers."""

from __future__ import annotations

import uuid

import pytest
import redis
from sqlalchemy import select

from agents import serve_fcdaemon
from corral import api
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.agents.helpers import MeetingDriver
from tests.fixtures import Env, StartAgents
from tests.helpers import broker_drained, deploy_fn, one_agent, spawn_ok
from workers.base.kinds import OpKind
from workers.celery import app
from workers.fleet.nodes import upsert_node
from workers.functions import get_function
from workers.operations import create_operation
from workers.replicas import plan as spawn_plan
from workers.store.models import Replica, ReplicaState


def _live(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica).where(Replica.status == ReplicaState.IDLE)))


@pytest.mark.timeout(60)
def test_spawn_scale_delete_through_a_thread_worker(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    a, b = start_agents(2, env=thread_worker)
    deploy_fn(thread_worker)
    view = api.wait(api.spawn("hello", 6), timeout=30)
    assert view["status"] == "succeeded", view
    assert len(_live(thread_worker)) == 6
    assert len(a.driver.list()) + len(b.driver.list()) == 6
    assert api.wait(api.scale("hello", 2), timeout=30)["status"] == "succeeded"
    assert len(_live(thread_worker)) == 2
    assert len(a.driver.list()) + len(b.driver.list()) == 2


@pytest.mark.timeout(60)
def test_a_spawns_other_batches_start_while_its_first_is_in_flight(
    thread_worker: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn queues its other batches before it works the first one, not after."""
    monkeypatch.setattr(spawn_plan, "SPAWN_BATCH", 2)
    driver = MeetingDriver(4)  # each create waits until all four are under way at once
    agent = serve_fcdaemon("127.0.0.1:0", driver=driver)
    try:
        with thread_worker.db.transaction() as s:
            upsert_node(s, agent.address, name="node1", capacity=8)
        deploy_fn(thread_worker)
        view = api.wait(api.spawn("hello", 4), timeout=30)
        # before: the second batch was queued once the first batch's creates had come
        # back, which they never did: the first two timed out and were sent again
        assert view["status"] == "succeeded", view
        assert len(agent.agent.calls_of("CreateReplica")) == 4  # none failed and sent again
        assert not driver.meeting.broken and len(driver.list()) == 4
    finally:
        agent.stop(grace=0)


def _publish_raw(env: Env, task: str, args: list[object], queue: str) -> str:
    """Put a task message on a queue by hand, as a second delivery of the same request would."""
    task_id = uuid.uuid4().hex
    app.send_task(task, args=args, queue=queue, task_id=task_id, ignore_result=True)
    return task_id


@pytest.mark.timeout(60)
def test_same_spawn_and_delete_messages_twice_create_and_release_one_vm(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    agent = one_agent(thread_worker, start_agents)
    # An operation of one replica, and its spawn_replica message published twice.
    with thread_worker.db.transaction() as s:
        fn = get_function(s, "hello")
        op = create_operation(
            s, OpKind.SPAWN, {"function": "hello", "count": 1}, function_id=fn.id, total=1
        )
        fn_id = fn.id
    for _ in range(2):
        _publish_raw(
            thread_worker,
            "corral.spawn_replica",
            [op.id, f"{op.id}.0.0", fn_id, None],
            "corral.spawn",
        )
    view = api.wait(op.id, timeout=30)
    assert view["status"] == "succeeded", view
    assert (view["done"], view["failed"]) == (1, 0)
    # the second delivery ran too: then count VMs
    eventually(lambda: broker_drained(thread_worker), 30, "the second delivery to run")
    assert len(agent.driver.list()) == 1
    (replica,) = _live(thread_worker)

    # the same delete message twice: the VM is released once, no error. Two deliveries
    # running at the same moment may both ask; the second hears NOT_FOUND (already gone).
    with thread_worker.db.transaction() as s:
        delete_op = create_operation(s, OpKind.DELETE, {"replica": replica.id}, total=1)
    for _ in range(2):
        _publish_raw(
            thread_worker, "corral.delete_replica", [replica.id, delete_op.id], "corral.delete"
        )
    view = api.wait(delete_op.id, timeout=30)
    assert view["status"] == "succeeded" and view["error"] is None, view
    eventually(lambda: broker_drained(thread_worker), 30, "the second delivery to run")
    assert {r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")} == {replica.vmid}
    assert agent.driver.list() == []
    with thread_worker.db.read() as s:
        assert s.get(Replica, replica.id).status == ReplicaState.DELETED  # type: ignore[union-attr]
    assert api.operation(delete_op.id)["done"] == 1  # the second delivery counted nothing


@pytest.mark.timeout(60)
def test_malformed_task_message_fails_the_operation_and_worker_lives(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    one_agent(thread_worker, start_agents)
    with thread_worker.db.transaction() as s:
        op = create_operation(s, OpKind.SPAWN, {"function": "hello", "count": 1}, total=1)
    _publish_raw(thread_worker, "corral.spawn_replica", [op.id, 42], "corral.spawn")
    view = api.wait(op.id, timeout=15)
    assert view["status"] == "failed"
    assert "corral.spawn_replica" in (view["error"] or "") and "missing" in (view["error"] or "")
    # a wrong type fails its operation too, naming the argument (no coercion of 7 to "7")
    with thread_worker.db.transaction() as s:
        typed = create_operation(s, OpKind.SPAWN, {"function": "hello", "count": 1}, total=1)
    _publish_raw(thread_worker, "corral.spawn_replica", [typed.id, 7, "x", None], "corral.spawn")
    view = api.wait(typed.id, timeout=15)
    assert view["status"] == "failed"
    assert "argument 'request_id' must be str, got int" in (view["error"] or ""), view
    # the worker still serves real work afterwards
    spawn_ok("hello", 1, timeout=15)


@pytest.mark.timeout(90)
def test_prefork_worker_process_spawns_and_keeps_secrets_out_of_messages_and_logs(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
) -> None:
    agent = one_agent(
        broker_env,
        start_agents,
        aws_access_key_id="AKIASECRETID0001",
        aws_secret_access_key="s3cr3t/KEY",
    )
    # Publish while no worker consumes, so the queued messages can be read as sent.
    op = api.spawn("hello", 4)
    r = redis.Redis.from_url(broker_env.settings.broker_url)
    queued = [
        raw for key in r.keys("corral.*") if r.type(key) == b"list" for raw in r.lrange(key, 0, -1)
    ]
    assert queued, "the spawn message should be waiting in its queue"
    for raw in queued:
        assert b"AKIASECRETID0001" not in raw and b"s3cr3t" not in raw
    worker = WorkerProcess(broker_env.tmp, concurrency=2, pool="prefork")
    worker_processes.append(worker.start())
    view = api.wait(op, timeout=30)
    assert view["status"] == "succeeded", (view, worker.tail())
    assert len(agent.driver.list()) == 4
    (req, *_) = agent.agent.calls_of("CreateReplica")
    assert req.awsAccessKeyID == "AKIASECRETID0001"  # the agent gets them; nothing else does
    log = worker.log_path.read_text()
    assert "spawn_replica" in log and "AKIASECRETID0001" not in log and "s3cr3t" not in log
