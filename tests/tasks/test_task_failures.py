"""No exception leaves an operation open: a task that raises ends its operation failed.

Faults are made with the test-only hook ``CORRAL_FAULT_RAISE_IN`` (a task named
there raises before it runs), in eager mode and in a real worker.
"""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from corral import api
from corral.cli import main
from tasks.replicas import spawn
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, one_agent, spawn_ok
from workers.base.kinds import OpKind
from workers.operations import create_operation, describe_error, settle
from workers.store.models import OP_FINISHED, OP_OPEN, Function, Operation, OpStatus


def test_finished_is_one_definition_on_the_status_type() -> None:
    assert set(OP_FINISHED) == {"succeeded", "failed", "partial"}
    assert set(OP_OPEN) == {"pending", "running"}
    assert [s.finished for s in OpStatus] == [s.value in OP_FINISHED for s in OpStatus]
    assert OpStatus("partial").finished and not OpStatus("running").finished


@pytest.mark.timeout(60)
def test_a_raising_task_fails_its_operation_and_wait_returns_with_the_error(
    store_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    start_agents(1)
    deploy_fn(store_env)
    store_env.set(fault_raise_in="corral.scale")
    started = time.monotonic()
    assert main(["scale", "hello", "2", "--wait", "--timeout", "30"]) == 1
    assert time.monotonic() - started < 10
    assert "FaultInjected" in capsys.readouterr().err
    (op,) = api_ops(store_env)
    assert op.status == "failed" and op.kind == "scale"
    assert op.error == (
        "corral.scale: FaultInjected: fault injected in corral.scale (CORRAL_FAULT_RAISE_IN)"
    )
    assert main(["ops", op.id]) == 0
    assert "FaultInjected" in capsys.readouterr().out  # `corral ops` shows the cause


def api_ops(env: Env) -> list[Operation]:
    """Every operation, oldest first."""
    with env.db.read() as s:
        return list(s.scalars(select(Operation).order_by(Operation.created_at)))


@pytest.mark.timeout(90)
def test_in_a_real_worker_a_raising_task_ends_its_operation_failed_promptly(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    one_agent(thread_worker, start_agents)
    spawn_ok("hello", 1, timeout=30)
    thread_worker.set(fault_raise_in="corral.spawn,corral.delete_batch")
    started = time.monotonic()
    view = api.wait(api.spawn("hello", 1), timeout=30)
    assert time.monotonic() - started < 10
    assert view["status"] == "failed", view
    assert view["error"] == (
        "corral.spawn: FaultInjected: fault injected in corral.spawn (CORRAL_FAULT_RAISE_IN)"
    )
    # a task carrying part of a scale: the scale ends failed too, not open for good
    view = api.wait(api.scale("hello", 0), timeout=30)
    assert view["status"] == "failed", view
    assert "corral.delete_batch: FaultInjected" in (view["error"] or "")


def test_a_late_redelivery_leaves_a_partial_operation_partial(store_env: Env) -> None:
    function_id = deploy_fn(store_env)
    with store_env.db.transaction() as s:
        op_id = create_operation(
            s, OpKind.SPAWN, {"function": "hello", "count": 2}, function_id=function_id, total=2
        ).id
    with store_env.db.transaction() as s:
        settle(s, op_id, parts=["a"], ok=True)
        settle(s, op_id, parts=["b"], ok=False, error="node said no")
    before = api.operation(op_id)
    assert before["status"] == "partial" and before["error"] == "1 of 2 failed; first: node said no"
    store_env.set(fault_raise_in="corral.spawn")
    spawn.apply(args=[op_id])  # an unexpected error in a late delivery
    assert api.operation(op_id) == before
    store_env.set(fault_raise_in="")
    with store_env.db.transaction() as s:
        s.delete(s.get(Function, function_id))
    spawn.apply(args=[op_id])  # bad input in a late delivery (its function is gone)
    after = api.operation(op_id)
    assert (after["status"], after["error"]) == ("partial", before["error"])


def test_a_database_error_is_described_without_parameters_or_secrets(store_env: Env) -> None:
    deploy_fn(store_env, aws_access_key_id="AKIAABCDEFGHIJKLMNOP", aws_secret_access_key="s3cr3t")
    with pytest.raises(IntegrityError) as caught, store_env.db.transaction() as s:
        s.add(
            Function(
                name="hello",
                image="i",
                build_version="1",
                aws_access_key_id="AKIAABCDEFGHIJKLMNOP",
                aws_secret_access_key="s3cr3t",
            )
        )
    described = describe_error(caught.value)
    assert described.startswith("IntegrityError: ") and "\n" not in described
    for secret in ("s3cr3t", "AKIAABCDEFGHIJKLMNOP"):
        assert secret not in described
        assert secret not in str(caught.value)  # hide_parameters: not in logs either
    assert "password=***" in describe_error(RuntimeError("bad dsn password=hunter2"))
