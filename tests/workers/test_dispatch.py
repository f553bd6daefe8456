"""Queueing work by task name: each operation kind's first task, and what lands on the broker.

The broker is the session's real Redis (no worker consumes it here), so each test reads
the messages Celery left in the queue the task is routed to.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
import redis
from sqlalchemy import select

from config.celery import ROUTES
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from workers import dispatch, stages
from workers.errors import InputError
from workers.kinds import OpKind
from workers.operations import create_operation
from workers.replicas.requests import request_spawn
from workers.store.models import Operation, OpStatus


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
    sig = dispatch.first_task(kind, "op1", params)
    assert (sig.task, tuple(sig.args), dict(sig.kwargs), sig.immutable) == (
        task,
        args,
        kwargs,
        True,
    )
    assert task in ROUTES  # routed to a queue a worker consumes


def test_a_health_pass_has_no_task_to_resend() -> None:
    with pytest.raises(ValueError, match="no task carries out operations of kind 'health'"):
        dispatch.first_task(OpKind.HEALTH, "op1", {})


def _queued(env: Env, queue: str) -> list[dict[str, Any]]:
    """The messages waiting in ``queue`` on the test broker, oldest first (kombu pushes on
    the left): each one's task, args and kwargs."""
    client = redis.Redis.from_url(env.settings.broker_url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    out = []
    for item in reversed(raw):
        message = json.loads(item)
        body = json.loads(base64.b64decode(message["body"]))
        out.append({"task": message["headers"]["task"], "args": body[0], "kwargs": body[1]})
    return out


def test_submit_writes_the_operation_then_queues_its_first_task(broker_env: Env) -> None:
    deploy_fn(broker_env)
    op_id = dispatch.submit(broker_env.db, lambda s: request_spawn(s, "hello", 2))
    with broker_env.db.read() as s:
        op = s.get(Operation, op_id)
        assert op is not None and (op.kind, op.status) == (OpKind.SPAWN, OpStatus.PENDING)
    assert _queued(broker_env, "corral.spawn") == [
        {"task": "corral.spawn", "args": [op_id], "kwargs": {}}
    ]


def test_a_refused_request_writes_and_queues_nothing(broker_env: Env) -> None:
    deploy_fn(broker_env, max=1)
    with pytest.raises(InputError, match="above its max of 1"):
        dispatch.submit(broker_env.db, lambda s: request_spawn(s, "hello", 2))
    with broker_env.db.read() as s:
        assert s.scalars(select(Operation)).all() == []
    assert _queued(broker_env, "corral.spawn") == []


def test_resend_queues_the_first_task_again_and_deletes_go_by_name(broker_env: Env) -> None:
    with broker_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.DELETE, {"replica": "r1"}, total=1).id
    dispatch.resend(OpKind.DELETE, op_id, {"replica": "r1"})
    dispatch.delete_replica("r2")
    dispatch.release_orphan("node1", "vm-9")
    assert _queued(broker_env, "corral.delete") == [
        {"task": "corral.delete_replica", "args": ["r1", op_id], "kwargs": {}},
        {"task": "corral.delete_replica", "args": ["r2"], "kwargs": {}},
        {"task": "corral.release_orphan", "args": ["node1", "vm-9"], "kwargs": {}},
    ]


def test_a_first_task_carried_out_here_needs_no_worker_and_one_with_no_thread_is_queued(
    broker_env: Env,
    start_agents: StartAgents,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    start_agents(1, env=broker_env)
    deploy_fn(broker_env)
    op_id = dispatch.submit(broker_env.db, lambda s: request_spawn(s, "hello", 1), here=True)
    deadline = time.monotonic() + 20
    while True:  # carried out on a thread of this process: no worker consumes the queue
        with broker_env.db.read() as s:
            op = s.get(Operation, op_id)
            assert op is not None
            if op.status == OpStatus.SUCCEEDED:
                break
        assert time.monotonic() < deadline, f"the spawn did not finish here: {op.status}"
        time.sleep(0.05)
    assert _queued(broker_env, "corral.spawn") == []
    # Every thread busy (none at all here): queued as any first task, saying when it was sent.
    monkeypatch.setattr(dispatch, "HERE_THREADS", 0)
    second = dispatch.submit(broker_env.db, lambda s: request_spawn(s, "hello", 1), here=True)
    assert _queued(broker_env, "corral.spawn") == [
        {"task": "corral.spawn", "args": [second], "kwargs": {}}
    ]
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    try:
        headers = json.loads(client.lindex("corral.spawn", 0))["headers"]  # type: ignore[arg-type]
    finally:
        client.close()
    assert isinstance(headers[stages.SENT_HEADER], float)
