"""Asking for work through the TaskQueue port: the Celery queue, the in-process one, the gateway's.

The broker is the session's real Redis. Where no worker consumes it, a test reads the
messages Celery left in the queue a task is routed to; where a task is carried out in
this process, nothing reaches the broker but what the task itself queues (a retry).
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from sqlalchemy import select

from agents import Fault
from config.celery import ROUTES
from tasks.maintenance import QUEUE, first_task
from tasks.queues import CeleryQueue, HereFirst, InProcessQueue
from tests.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation, replicas
from workers import dispatch, stages
from workers.dispatch import TaskQueue, Work
from workers.errors import BrokerError, InputError
from workers.kinds import OpKind
from workers.operations import create_operation
from workers.replicas.requests import request_delete, request_spawn
from workers.store.models import Operation, OpStatus, ReplicaState

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("kind", "params", "task", "args", "kwargs"),
    [
        (OpKind.SPAWN, {"function": "f", "count": 2}, "corral.spawn", ("op1",), {}),
        (OpKind.SCALE, {"function": "f", "target": 0}, "corral.scale", ("op1",), {}),
        (OpKind.DELETE, {"replica": "r1"}, "corral.delete_replica", ("r1", "op1"), {}),
        (
            OpKind.HOGS,
            {"action": "start", "n": 2, "node": None},
            "corral.hogs",
            (),
            {"action": "start", "n": 2, "node": None, "op_id": "op1"},
        ),
        (
            OpKind.REAP,
            {"idle_timeout": 30.0},
            "corral.reap",
            (),
            {"idle_timeout": 30.0, "op_id": "op1"},
        ),
        (OpKind.RECONCILE, {}, "corral.reconcile", (), {"op_id": "op1"}),
    ],
)
def test_each_kind_has_its_first_task(
    kind: OpKind, params: dict[str, Any], task: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    call = first_task(Work(kind, "op1", params))
    assert (call.task.name, call.args, dict(call.kwargs)) == (task, args, kwargs)
    sig = call.signature()
    assert (sig.task, tuple(sig.args), dict(sig.kwargs), sig.immutable) == (
        task,
        args,
        kwargs,
        True,
    )
    assert task in ROUTES  # routed to a queue a worker consumes


def test_a_health_pass_has_no_task_to_resend() -> None:
    with pytest.raises(ValueError, match="no task carries out operations of kind 'health'"):
        first_task(Work(OpKind.HEALTH, "op1", {}))


def test_every_queue_is_a_task_queue() -> None:
    queues: list[TaskQueue] = [QUEUE, InProcessQueue(QUEUE.tasks), HereFirst(QUEUE, threads=0)]
    assert {type(q).__name__ for q in queues} == {"CeleryQueue", "InProcessQueue", "HereFirst"}


def test_workers_never_look_a_task_up_by_name() -> None:
    # lint-imports keeps Celery out of the logic; this keeps the lookups out of the glue too.
    lookup = re.compile(
        r"send_task|import_default_modules|app\.signature\(|\.tasks\[|\.tasks\.get\(|in app\.tasks:"
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "workers").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if lookup.search(line)
    ]
    assert found == []


def _queued(env: Env, queue: str) -> list[dict[str, Any]]:
    """The messages waiting in ``queue`` on the test broker, oldest first (kombu pushes on
    the left): each one's task, args, kwargs and headers."""
    client = redis.Redis.from_url(env.settings.broker_url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    out = []
    for item in reversed(raw):
        message = json.loads(item)
        body = json.loads(base64.b64decode(message["body"]))
        out.append(
            {
                "task": message["headers"]["task"],
                "args": body[0],
                "kwargs": body[1],
                "headers": message["headers"],
            }
        )
    return out


def _calls(messages: list[dict[str, Any]]) -> list[tuple[str, list[Any], dict[str, Any]]]:
    return [(m["task"], m["args"], m["kwargs"]) for m in messages]


def test_submit_writes_the_operation_then_queues_its_first_task(broker_env: Env) -> None:
    deploy_fn(broker_env)
    op_id = dispatch.submit(broker_env.db, QUEUE, lambda s: request_spawn(s, "hello", 2))
    op = operation(broker_env, op_id)
    assert (op.kind, op.status) == (OpKind.SPAWN, OpStatus.PENDING)
    (message,) = _queued(broker_env, "corral.spawn")
    assert _calls([message]) == [("corral.spawn", [op_id], {})]
    assert isinstance(message["headers"][stages.SENT_HEADER], float)  # its queue stage


def test_a_refused_request_writes_and_queues_nothing(broker_env: Env) -> None:
    deploy_fn(broker_env, max=1)
    with pytest.raises(InputError, match="above its max of 1"):
        dispatch.submit(broker_env.db, QUEUE, lambda s: request_spawn(s, "hello", 2))
    with broker_env.db.read() as s:
        assert s.scalars(select(Operation)).all() == []
    assert _queued(broker_env, "corral.spawn") == []


def test_work_the_queue_cannot_take_fails_its_operation(broker_env: Env) -> None:
    with broker_env.db.transaction() as s:
        op = create_operation(s, OpKind.HEALTH, {}, total=1)
    with pytest.raises(BrokerError, match="could not queue the task: ValueError"):
        dispatch.enqueue(broker_env.db, QUEUE, op)
    failed = operation(broker_env, op.id)
    assert failed.status == OpStatus.FAILED
    assert failed.error is not None and "no task carries out" in failed.error


def test_sends_go_to_their_queues_by_the_task_objects(broker_env: Env) -> None:
    with broker_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.DELETE, {"replica": "r1"}, total=1).id
    queue = CeleryQueue(QUEUE.tasks)
    queue.send(Work(OpKind.DELETE, op_id, {"replica": "r1"}))
    queue.run_here(Work(OpKind.DELETE, op_id, {"replica": "r1"}))  # nowhere here: sent
    queue.delete_replica("r2")
    queue.release_orphan("node1", "vm-9")
    assert _calls(_queued(broker_env, "corral.delete")) == [
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
    assert _queued(broker_env, "corral.spawn") == []


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
    (retry,) = _queued(broker_env, "corral.delete")
    assert _calls([retry]) == [("corral.delete_replica", [replica.id, op_id], {})]
    assert retry["headers"]["retries"] == 1 and retry["headers"]["eta"] is not None
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 1
    assert operation(broker_env, op_id).status not in (OpStatus.SUCCEEDED, OpStatus.FAILED)


def test_the_gateways_queue_carries_out_here_while_a_thread_is_free_and_sends_the_rest(
    broker_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    queue = HereFirst(QUEUE, threads=1)

    def spawn(here: bool) -> str:
        return dispatch.submit(
            broker_env.db, queue, lambda s: request_spawn(s, "hello", 1), here=here
        )

    first = spawn(here=True)  # takes the one thread at once
    second = spawn(here=True)  # none free: sent, saying when
    third = spawn(here=False)  # not asked to run here: sent
    eventually(lambda: queue.busy == 0, 20, "the spawn carried out here to end")
    assert operation(broker_env, first).status == OpStatus.SUCCEEDED
    assert _calls(_queued(broker_env, "corral.spawn")) == [
        ("corral.spawn", [second], {}),
        ("corral.spawn", [third], {}),
    ]
    fourth = spawn(here=True)  # the thread is free again
    eventually(lambda: queue.busy == 0, 20, "the second spawn carried out here to end")
    assert operation(broker_env, fourth).status == OpStatus.SUCCEEDED
    assert len(_queued(broker_env, "corral.spawn")) == 2
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
