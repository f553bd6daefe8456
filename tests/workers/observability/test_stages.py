"""A spawn's cold-start stages, stored on its operation once (workers.observability.stages)."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import select

import tasks.replicas
from corral import api
from corral.cli import main
from tasks.maintenance import QUEUE
from testkit.services import RedisServer
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, one_agent, operation, record_vm, result_of, spawn_ok
from workers.backends import Vm
from workers.base import clock, timelimits
from workers.base.kinds import OpKind
from workers.base.redis_client import TIMEOUT_S
from workers.fleet.nodes import upsert_node
from workers.observability import stages
from workers.operations import create_operation
from workers.registry.service import OK, READY, Registry
from workers.store.models import Replica

WORKER_STAGES = {"queue", "plan", "placement", "agent_call", "record"}


def test_a_spawns_stages_are_on_its_operation_and_a_second_delivery_keeps_them(
    corral_env: Env,
    start_agents: StartAgents,
    capsys: pytest.CaptureFixture[str],
) -> None:
    one_agent(corral_env, start_agents)
    op_id = spawn_ok("hello", 1)["id"]
    capsys.readouterr()
    assert main(["ops", op_id, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    stored = shown["result"]["stages"]
    assert set(stored) == WORKER_STAGES  # agent readiness: no READY stage
    assert all(isinstance(v, float) and 0 <= v < 30 for v in stored.values())
    (replica,) = api.replicas("hello")
    assert shown["result"]["timed"]["replica"] == replica["id"]
    assert "trace" not in shown["result"]  # tracing is off
    tasks.replicas.spawn.apply(args=(op_id,))  # delivered again: nothing to do, nothing kept
    assert result_of(operation(corral_env, op_id))["stages"] == stored


def _timed_spawn(env: Env) -> tuple[str, object]:
    """A guest-readiness replica Creating under a spawn operation: (op id, pending row)."""
    fn_id = deploy_fn(env, "g", readiness="guest")
    with env.db.transaction() as s:
        node, _ = upsert_node(s, "127.0.0.1:50051", name="n1")
        node_id = node.id
        op_id = create_operation(s, OpKind.SPAWN, {"count": 1}, function_id=fn_id, total=1).id
    return op_id, creating(env, fn_id, "req-1", node_id, op_id)


def _record_timed(env: Env, op_id: str, pending: object, vmid: str) -> str:
    """Record the VM inside a timed task, as a spawn's task does; what became of the row."""
    with stages.timing(op_id, None, None) as timer:
        timer.mark_planned()
        timer.sent("req-1", "n1")
        timer.answered("req-1")
        return record_vm(env, pending, Vm(vmid, "http://127.0.0.1:20001"))  # type: ignore[arg-type]


def test_a_ready_after_the_record_is_timed_from_the_record(store_env: Env) -> None:
    op_id, pending = _timed_spawn(store_env)
    assert _record_timed(store_env, op_id, pending, "vm-1") == "starting"
    stored = result_of(operation(store_env, op_id))["stages"]
    assert set(stored) == WORKER_STAGES - {"queue"}  # no message header here: no queue stage
    clock.travel(0.25)  # the guest boots
    registry = Registry(store_env.db, store_env.settings, QUEUE)
    assert registry.update_status("vm-1", READY, "127.0.0.1") == OK
    ready = result_of(operation(store_env, op_id))["stages"]["ready"]
    assert 0.25 <= ready < 5
    assert registry.update_status("vm-1", READY, "127.0.0.1") == OK  # again: stored once
    assert result_of(operation(store_env, op_id))["stages"]["ready"] == ready


def test_a_ready_that_came_before_the_record_is_a_ready_stage_of_zero(store_env: Env) -> None:
    op_id, pending = _timed_spawn(store_env)
    registry = Registry(store_env.db, store_env.settings, QUEUE)
    assert registry.update_status("vm-2", READY, "127.0.0.1") == OK  # remembered: too early
    assert _record_timed(store_env, op_id, pending, "vm-2") == "idle"  # applied on record
    stored = result_of(operation(store_env, op_id))["stages"]
    assert stored["ready"] == 0.0 and set(stored) == (WORKER_STAGES - {"queue"}) | {"ready"}
    with store_env.db.read() as s:
        assert s.scalar(select(Replica.vmid)) == "vm-2"


def test_a_task_near_its_hard_limit_does_not_wait_on_redis_for_a_statistic(
    redis_server: RedisServer,
) -> None:
    # A scale whose broker went away recorded its stages in its last 2.3 s, and Redis's
    # 5 s read timeout carried it past its hard limit (the partition run).
    client = redis_server.client(5)
    client.delete(stages.KEY)
    now = time.monotonic()
    near = timelimits.Deadline(now - 1, hard_at=now + TIMEOUT_S)  # less than two timeouts
    with timelimits.running(near):
        stages.observe_quietly(client, {"ask": 0.01})
    assert client.hgetall(stages.KEY) == {}  # not waited on: not counted
    far = timelimits.Deadline(now + 60, hard_at=now + 90)
    with timelimits.running(far):
        stages.observe_quietly(client, {"ask": 0.01})
    assert client.hgetall(stages.KEY) != {}
    client.delete(stages.KEY)
