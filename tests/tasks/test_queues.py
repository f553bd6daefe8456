"""The task queues (tasks/queues.py): Celery's sends, the in-process one carries out here,
the gateway's carries out here while a thread is free and sends the rest.

The broker is the session's real Redis. Where no worker consumes it, a test reads the
messages Celery left in the queue a task is routed to; where a task is carried out in
this process, nothing reaches the broker but what the task itself queues (a retry).
"""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from agents import Fault
from tasks.maintenance import QUEUE
from tasks.queues import Call, CeleryQueue, HereFirst, InProcessQueue, carry_out
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import calls, deploy_fn, operation, queued, replicas
from workers import dispatch
from workers.base.kinds import OpKind
from workers.dispatch import TaskQueue, Work
from workers.operations import create_operation
from workers.replicas.requests import request_delete, request_spawn
from workers.store.models import OpStatus, ReplicaState


def test_every_queue_is_a_task_queue() -> None:
    queues: list[TaskQueue] = [QUEUE, InProcessQueue(QUEUE.tasks), HereFirst(QUEUE, threads=0)]
    assert {type(q).__name__ for q in queues} == {"CeleryQueue", "InProcessQueue", "HereFirst"}


def test_sends_go_to_their_queues_by_the_task_objects(broker_env: Env) -> None:
    with broker_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.DELETE, {"replica": "r1"}, total=1).id
    queue = CeleryQueue(QUEUE.tasks)
    queue.send(Work(OpKind.DELETE, op_id, {"replica": "r1"}))
    queue.run_here(Work(OpKind.DELETE, op_id, {"replica": "r1"}))  # nowhere here: sent
    queue.delete_replica("r2")
    queue.release_orphan("node1", "vm-9")
    assert calls(queued(broker_env, "corral.delete")) == [
        ("corral.delete_replica", ["r1", op_id], {}),
        ("corral.delete_replica", ["r1", op_id], {}),
        ("corral.delete_replica", ["r2"], {}),
        ("corral.release_orphan", ["node1", "vm-9"], {}),
    ]


def test_the_in_process_queue_carries_a_spawn_out_here_and_queues_nothing(
    broker_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    here = InProcessQueue(QUEUE.tasks)
    op_id = dispatch.submit(broker_env.db, here, lambda s: request_spawn(s, "hello", 2))
    # Done when submit returns: carried out in this thread, no worker consumes the broker.
    op = operation(broker_env, op_id)
    assert (op.status, op.done) == (OpStatus.SUCCEEDED, 2)
    assert [r.status for r in replicas(broker_env, "hello")] == [ReplicaState.IDLE] * 2
    assert queued(broker_env, "corral.spawn") == []


def test_a_retry_of_a_task_carried_out_here_is_queued_not_run_again_at_once(
    broker_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    here = InProcessQueue(QUEUE.tasks)
    dispatch.submit(broker_env.db, here, lambda s: request_spawn(s, "hello", 1))
    (replica,) = replicas(broker_env, "hello")
    agent.agent.inject("ReleaseVMSetup", Fault.abort(grpc.StatusCode.UNAVAILABLE, "down"))
    op_id = dispatch.submit(broker_env.db, here, lambda s: request_delete(s, replica.id))
    # The release failed with a transport error: the retry is a message, with its backoff,
    # for a worker; this thread did not run the task a second time.
    (retry,) = queued(broker_env, "corral.delete")
    assert calls([retry]) == [("corral.delete_replica", [replica.id, op_id], {})]
    assert retry["headers"]["retries"] == 1 and retry["headers"]["eta"] is not None
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 1
    assert operation(broker_env, op_id).status not in (OpStatus.SUCCEEDED, OpStatus.FAILED)


def test_the_gateways_queue_carries_out_here_while_a_thread_is_free_and_sends_the_rest(
    broker_env: Env, start_agents: StartAgents
) -> None:
    broker_env.set(create_timeout_s="30")  # the first spawn's create is held below
    (agent,) = start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    queue = HereFirst(QUEUE, threads=1)
    held = threading.Event()  # the first spawn holds the thread until the others are sent
    agent.agent.inject("CreateReplica", Fault.delay(60, until=held))

    def spawn(here: bool) -> str:
        return dispatch.submit(
            broker_env.db, queue, lambda s: request_spawn(s, "hello", 1), here=here
        )

    try:
        first = spawn(here=True)  # takes the one thread at once
        second = spawn(here=True)  # none free: sent, saying when
        third = spawn(here=False)  # not asked to run here: sent
    finally:
        held.set()
    eventually(lambda: queue.busy == 0, 20, "the spawn carried out here to end")
    assert operation(broker_env, first).status == OpStatus.SUCCEEDED
    assert calls(queued(broker_env, "corral.spawn")) == [
        ("corral.spawn", [second], {}),
        ("corral.spawn", [third], {}),
    ]
    fourth = spawn(here=True)  # the thread is free again
    eventually(lambda: queue.busy == 0, 20, "the second spawn carried out here to end")
    assert operation(broker_env, fourth).status == OpStatus.SUCCEEDED
    assert len(queued(broker_env, "corral.spawn")) == 2
    assert operation(broker_env, second).status == OpStatus.PENDING  # no worker took it


def test_a_task_that_crashed_here_before_it_ran_goes_to_the_broker(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    """A first task that fails before it runs here (issue 36: Celery's lazy set-up, out of
    descriptors) did nothing: it is sent to the broker, and a worker carries it out."""
    start_agents(1, env=thread_worker)
    deploy_fn(thread_worker)
    queue = HereFirst(QUEUE, threads=1)
    thread_worker.set(fault_raise_in="corral.spawn@here")  # raises here, before the task runs
    spawned = dispatch.submit(
        thread_worker.db, queue, lambda s: request_spawn(s, "hello", 1), here=True
    )
    eventually(
        lambda: operation(thread_worker, spawned).status == OpStatus.SUCCEEDED,
        30,
        "the spawn, carried out by the worker",
    )
    assert queue.busy == 0
    (replica,) = replicas(thread_worker, "hello")
    assert replica.status == ReplicaState.IDLE


def test_the_celery_queue_reaches_a_real_worker(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=thread_worker)
    deploy_fn(thread_worker)
    spawned = dispatch.submit(thread_worker.db, QUEUE, lambda s: request_spawn(s, "hello", 1))
    eventually(
        lambda: operation(thread_worker, spawned).status == OpStatus.SUCCEEDED,
        30,
        "the worker's spawn",
    )
    (replica,) = replicas(thread_worker, "hello")
    deleted = dispatch.submit(thread_worker.db, QUEUE, lambda s: request_delete(s, replica.id))
    eventually(
        lambda: operation(thread_worker, deleted).status == OpStatus.SUCCEEDED,
        30,
        "the worker's delete",
    )
    assert [r.status for r in replicas(thread_worker, "hello")] == [ReplicaState.DELETED]


def test_the_gateways_queue_refuses_a_kind_no_task_carries_out_before_anything(
    broker_env: Env,
) -> None:
    queue = HereFirst(QUEUE, threads=1)
    with pytest.raises(ValueError, match="no task carries out operations of kind 'health'"):
        queue.run_here(Work(OpKind.HEALTH, "op1", {}))
    assert queue.busy == 0 and queued(broker_env, "corral.maintenance") == []


def test_the_gateways_queue_sends_deletes_and_releases(broker_env: Env) -> None:
    queue = HereFirst(QUEUE, threads=1)
    queue.delete_replica("r2")
    queue.release_orphan("node1", "vm-9")
    assert queue.busy == 0
    assert calls(queued(broker_env, "corral.delete")) == [
        ("corral.delete_replica", ["r2"], {}),
        ("corral.release_orphan", ["node1", "vm-9"], {}),
    ]


def test_carry_out_returns_what_the_task_returned_and_says_when_it_failed(
    corral_env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = QUEUE.tasks.release
    gone = carry_out(Call(task, ("no-such-node", "vm-1")))
    assert gone == {"node_id": "no-such-node", "vmid": "vm-1", "state": "no such node"}

    def broken(node_id: str, vmid: str) -> None:
        raise RuntimeError(f"cannot release {vmid}")

    monkeypatch.setattr(task, "run", broken)
    with caplog.at_level(logging.WARNING, logger="tasks.queues"):
        failed = carry_out(Call(task, ("n1", "vm-2")))  # raised in the task, not here
    assert str(failed.exception) == "cannot release vm-2"  # celery's ExceptionInfo
    # the sender thread's first connection may warn of the test's absent broker meanwhile
    # (cis170, two suites at once): count the failure's own record
    failure = f"task {task.name} carried out here failed: "
    (said,) = [r for r in caplog.records if r.name == "tasks.queues" and failure in r.getMessage()]
    assert said.getMessage().startswith(failure)
    assert "RuntimeError: cannot release vm-2" in said.getMessage()
