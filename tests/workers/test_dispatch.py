"""Asking for work through the TaskQueue port: an operation written, then its first task sent.

The queues themselves (Celery's, the in-process one, the gateway's) are tested in
tests/tasks/test_queues.py.

The broker is the session's real Redis. Where no worker consumes it, a test reads the
messages Celery left in the queue a task is routed to; where a task is carried out in
this process, nothing reaches the broker but what the task itself queues (a retry).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from config.celery import ROUTES
from tasks.maintenance import QUEUE, first_task
from tests.fixtures import Env
from tests.helpers import calls, deploy_fn, operation, queued
from workers import dispatch
from workers.base.errors import BrokerError, InputError
from workers.base.kinds import OpKind
from workers.dispatch import Work
from workers.observability import stages
from workers.operations import create_operation
from workers.replicas.requests import request_spawn
from workers.store.models import Operation, OpStatus

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


def test_submit_writes_the_operation_then_queues_its_first_task(broker_env: Env) -> None:
    deploy_fn(broker_env)
    op_id = dispatch.submit(broker_env.db, QUEUE, lambda s: request_spawn(s, "hello", 2))
    op = operation(broker_env, op_id)
    assert (op.kind, op.status) == (OpKind.SPAWN, OpStatus.PENDING)
    (message,) = queued(broker_env, "corral.spawn")
    assert calls([message]) == [("corral.spawn", [op_id], {})]
    assert isinstance(message["headers"][stages.SENT_HEADER], float)  # its queue stage


def test_a_refused_request_writes_and_queues_nothing(broker_env: Env) -> None:
    deploy_fn(broker_env, max=1)
    with pytest.raises(InputError, match="above its max of 1"):
        dispatch.submit(broker_env.db, QUEUE, lambda s: request_spawn(s, "hello", 2))
    with broker_env.db.read() as s:
        assert s.scalars(select(Operation)).all() == []
    assert queued(broker_env, "corral.spawn") == []


def test_work_the_queue_cannot_take_fails_its_operation(broker_env: Env) -> None:
    with broker_env.db.transaction() as s:
        op = create_operation(s, OpKind.HEALTH, {}, total=1)
    with pytest.raises(BrokerError, match="could not queue the task: ValueError"):
        dispatch.enqueue(broker_env.db, QUEUE, op)
    failed = operation(broker_env, op.id)
    assert failed.status == OpStatus.FAILED
    assert failed.error is not None and "no task carries out" in failed.error
