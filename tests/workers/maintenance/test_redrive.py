"""A message the broker lost: the reap pass sends the operation's first task again.

A lost message is made by writing an operation record without queueing its task
(what a producer leaves behind when Redis drops the message after accepting it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import select

from corral import api
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import broker_drained, deploy_fn, one_agent, operation, result_of, spawn_ok
from workers.base import clock
from workers.base.kinds import OpKind
from workers.maintenance import redrive
from workers.operations import create_operation, settle
from workers.store.models import Operation, Replica, ReplicaState


@pytest.fixture(autouse=True)
def _clock() -> Iterator[None]:
    yield
    clock.reset()


def _lost(env: Env, kind: OpKind, params: dict[str, object], function_id: str | None) -> str:
    """An operation whose message never reached a worker."""
    with env.db.transaction() as s:
        return create_operation(s, kind, params, function_id=function_id).id


def test_a_lost_spawn_is_sent_again_by_the_reap_pass_and_only_once(
    thread_worker: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=thread_worker)
    function_id = deploy_fn(thread_worker)
    op_id = _lost(thread_worker, OpKind.SPAWN, {"function": "hello", "count": 2}, function_id)
    early = api.wait(api.reap(), timeout=30)
    assert result_of(early)["redriven"] == {}  # not yet: it may only be late
    assert operation(thread_worker, op_id).status == "pending"

    clock.travel(thread_worker.settings.redrive_after_s + 1)
    pass_view = api.wait(api.reap(), timeout=30)
    assert result_of(pass_view)["redriven"] == {op_id: "re-sent spawn (1 of 3)"}
    view = api.wait(op_id, timeout=30)
    assert view["status"] == "succeeded" and view["done"] == 2
    assert view["redrives"] == 1  # what `corral ops OP` shows
    assert len(agent.driver.list()) == 2

    # the original message turning up after all changes nothing
    before = operation(thread_worker, op_id).progress_at
    api.resend(redrive.Redrive(op_id, OpKind.SPAWN, {}, 2))
    eventually(
        lambda: operation(thread_worker, op_id).progress_at != before, 30, "the late spawn to run"
    )
    # and its per-replica tasks, which find their rows settled
    eventually(lambda: broker_drained(thread_worker), 30, "the late spawn's tasks to run")
    assert len(agent.driver.list()) == 2
    assert len(agent.agent.calls_of("CreateReplica")) == 2
    with thread_worker.db.read() as s:
        rows = list(s.scalars(select(Replica)))
    assert len(rows) == 2 and {r.status for r in rows} == {ReplicaState.IDLE}


def test_a_lost_delete_is_sent_again(thread_worker: Env, start_agents: StartAgents) -> None:
    agent = one_agent(thread_worker, start_agents)
    spawn_ok("hello", 1, timeout=30)
    with thread_worker.db.read() as s:
        replica = s.scalars(select(Replica)).one()
    op_id = _lost(thread_worker, OpKind.DELETE, {"replica": replica.id}, replica.function_id)
    clock.travel(thread_worker.settings.redrive_after_s + 1)
    api.wait(api.reap(), timeout=30)
    assert api.wait(op_id, timeout=30)["status"] == "succeeded"
    assert agent.driver.list() == []
    assert [c.vmid for c in agent.agent.calls_of("ReleaseVMSetup")] == [replica.vmid]


def test_re_sends_back_off_and_stop(corral_env: Env) -> None:
    settings = corral_env.settings
    after = settings.redrive_after_s
    function_id = deploy_fn(corral_env)
    stalled = _lost(corral_env, OpKind.SPAWN, {"function": "hello", "count": 1}, function_id)
    hogs = _lost(corral_env, OpKind.HOGS, {"action": "start", "n": 1, "node": None}, None)
    kinds = api.RESENDABLE

    def due() -> list[str]:
        return [d.op_id for d in redrive.due(corral_env.db, settings, kinds)]

    assert due() == []
    clock.travel(after + 1)
    assert due() == [stalled]  # hogs are never re-sent: a second start would add hogs
    assert due() == []  # stamped: not again at once
    clock.travel(after + 1)
    assert due() == []  # the second re-send waits twice as long
    clock.travel(after)
    assert due() == [stalled]
    clock.travel(4 * after + 1)
    assert due() == [stalled]
    clock.travel(8 * after - 1)
    assert due() == []  # three re-sends, then no more
    assert operation(corral_env, stalled).redrives == redrive.REDRIVE_MAX
    assert operation(corral_env, hogs).redrives == 0
    # never silently: each fails, with its reason - hogs (never re-sent) long unmoved,
    # the spawn once its third re-send has waited as long
    gave_up = redrive.give_up(corral_env.db, settings, kinds)
    assert set(gave_up) == {hogs}
    clock.travel(2)
    gave_up.update(redrive.give_up(corral_env.db, settings, kinds))
    assert set(gave_up) == {stalled, hogs}
    assert gave_up[stalled].startswith("no progress after 3 re-sends of its task")
    assert "a hogs task is never re-sent" in gave_up[hogs]
    for op_id in (stalled, hogs):
        op = operation(corral_env, op_id)
        assert (op.status, op.error) == ("failed", gave_up[op_id])
    assert redrive.give_up(corral_env.db, settings, kinds) == {}


def test_the_reap_pass_reports_an_operation_it_gave_up_on(corral_env: Env) -> None:
    function_id = deploy_fn(corral_env)
    stalled = _lost(corral_env, OpKind.SCALE, {"function": "hello", "target": 1}, function_id)
    with corral_env.db.transaction() as s:
        s.get(Operation, stalled).redrives = redrive.REDRIVE_MAX  # type: ignore[union-attr]
    clock.travel(corral_env.settings.redrive_after_s * 2**redrive.REDRIVE_MAX + 1)
    view = api.wait(api.reap(), timeout=30)
    reason = result_of(view)["redriven"][stalled]
    assert reason.startswith("failed: no progress after 3 re-sends")
    assert api.wait(stalled, timeout=5)["error"] == reason.removeprefix("failed: ")


def test_progress_and_finished_operations_are_left_alone(corral_env: Env) -> None:
    after = corral_env.settings.redrive_after_s
    function_id = deploy_fn(corral_env)
    moving = _lost(corral_env, OpKind.SPAWN, {"function": "hello", "count": 2}, function_id)
    done = _lost(corral_env, OpKind.SPAWN, {"function": "hello", "count": 1}, function_id)
    with corral_env.db.transaction() as s:
        for op_id, total in ((moving, 2), (done, 1)):
            s.get(Operation, op_id).total = total  # type: ignore[union-attr]
    clock.travel(after - 1)
    with corral_env.db.transaction() as s:
        settle(s, moving, parts=["a"], ok=True)  # one of two parts done: it moves
        settle(s, done, parts=["a"], ok=True)  # its only part: it finished
    assert operation(corral_env, done).status == "succeeded"
    clock.travel(2)
    assert redrive.due(corral_env.db, corral_env.settings, api.RESENDABLE) == []
    clock.travel(after)
    assert [d.op_id for d in redrive.due(corral_env.db, corral_env.settings, api.RESENDABLE)] == [
        moving
    ]
