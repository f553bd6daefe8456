"""A scale (workers/replicas/scale.py): planned once, from the rows and the open plans, to the
target; the surplus taken from unclaimed Idle replicas, old builds and longest idle first.

Scales racing spawns and each other are in tests/faults/test_races.py; here, the plan.
"""

from __future__ import annotations

import pytest
from sqlalchemy import delete, select, update

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation
from tests.workers.replicas.helpers import by_id, idle_on, no_drift
from workers.base.errors import InputError
from workers.base.kinds import OpKind
from workers.operations import create_operation
from workers.replicas import claims
from workers.replicas.scale import plan_scale, planned_requests, unplaced
from workers.replicas.spawn import plan_spawn
from workers.store.models import Function, Operation, Replica, ReplicaState

S = ReplicaState


def _scale_op(env: Env, fn_id: str, target: object) -> str:
    with env.db.transaction() as s:
        params = {"function": "hello", "target": target}
        return create_operation(s, OpKind.SCALE, params, function_id=fn_id).id


def _spawn_op(env: Env, fn_id: str, count: int) -> str:
    with env.db.transaction() as s:
        params = {"function": "hello", "count": count}
        return create_operation(s, OpKind.SPAWN, params, function_id=fn_id).id


def _target(env: Env) -> int | None:
    with env.db.read() as s:
        return s.scalar(select(Function.target))


def test_a_scale_up_spawns_the_difference_and_sets_the_target(corral_env: Env) -> None:
    fn_id = deploy_fn(corral_env, max=10)
    op_id = _scale_op(corral_env, fn_id, 3)
    plan = plan_scale(corral_env.db, corral_env.settings, op_id)
    assert plan.function_id == fn_id and plan.deletes == [] and plan.note is None
    assert [j.request_id for j in plan.spawns] == [f"{op_id}.{i}" for i in range(3)]
    assert _target(corral_env) == 3 and operation(corral_env, op_id).total == 3
    # every delivery works the same plan
    assert plan_scale(corral_env.db, corral_env.settings, op_id) == plan


def test_a_scale_counts_what_open_plans_will_add(corral_env: Env) -> None:
    fn_id = deploy_fn(corral_env, max=10)
    spawn = _spawn_op(corral_env, fn_id, 2)
    plan_spawn(corral_env.db, spawn)  # planned, none of its rows written yet
    with corral_env.db.read() as s:
        assert unplaced(s, fn_id) == 2 and unplaced(s, fn_id, exclude=spawn) == 0
        op = s.get(Operation, spawn)
        assert op is not None and planned_requests(op) == [f"{spawn}.0.0", f"{spawn}.1.0"]
    op_id = _scale_op(corral_env, fn_id, 3)
    plan = plan_scale(corral_env.db, corral_env.settings, op_id)
    assert len(plan.spawns) == 1  # 2 on their way already
    with corral_env.db.read() as s:
        scale = s.get(Operation, op_id)
        assert scale is not None and planned_requests(scale) == [f"{op_id}.0"]


def test_an_operation_before_its_plan_plans_no_requests(corral_env: Env) -> None:
    fn_id = deploy_fn(corral_env)
    op_id = _scale_op(corral_env, fn_id, 1)
    with corral_env.db.read() as s:
        op = s.get(Operation, op_id)
        assert op is not None and planned_requests(op) == []


def test_a_scale_to_what_there_is_finishes_at_once(corral_env: Env) -> None:
    fn_id = deploy_fn(corral_env, min=0)
    op_id = _scale_op(corral_env, fn_id, 0)
    plan = plan_scale(corral_env.db, corral_env.settings, op_id)
    assert (plan.spawns, plan.deletes) == ([], [])
    op = operation(corral_env, op_id)
    assert (op.status, op.total) == ("succeeded", 0) and _target(corral_env) == 0


def test_a_scale_down_takes_old_builds_first_then_the_longest_idle(
    corral_env: Env, start_agents: StartAgents
) -> None:
    _, idle = idle_on(corral_env, start_agents, 1, 3, max=10)
    fn_id = idle[0].function_id
    oldest, newer, newest = sorted(idle, key=lambda r: r.idle_since or 0)
    with corral_env.db.transaction() as s:  # the newest replica is of an older build
        s.execute(update(Replica).where(Replica.id == newest.id).values(build_version="old"))
    op_id = _scale_op(corral_env, fn_id, 1)
    plan = plan_scale(corral_env.db, corral_env.settings, op_id)
    assert plan.spawns == [] and plan.deletes == [newest.id, oldest.id]
    rows = by_id(corral_env)
    assert [rows[r].status for r in plan.deletes] == [S.DELETING, S.DELETING]
    assert rows[newer.id].status == S.IDLE
    no_drift(corral_env)


def test_a_scale_down_leaves_replicas_serving_requests_and_says_so(
    corral_env: Env, start_agents: StartAgents
) -> None:
    _, idle = idle_on(corral_env, start_agents, 1, 2, max=10)
    held = claims.claim(corral_env.db, corral_env.settings, "hello")
    fn_id = idle[0].function_id
    op_id = _scale_op(corral_env, fn_id, 0)
    plan = plan_scale(corral_env.db, corral_env.settings, op_id)
    assert len(plan.deletes) == 1 and held.replica_id not in plan.deletes
    assert plan.note == (
        "removed 1 of 2: the other replicas are serving requests or still starting"
    )


def test_a_target_outside_min_and_max_or_a_removed_function_is_refused(
    corral_env: Env,
) -> None:
    fn_id = deploy_fn(corral_env, max=5)
    with pytest.raises(InputError, match="target"):
        plan_scale(corral_env.db, corral_env.settings, _scale_op(corral_env, fn_id, 6))
    with pytest.raises(InputError, match="target must be an integer"):
        plan_scale(corral_env.db, corral_env.settings, _scale_op(corral_env, fn_id, "2"))
    gone = _scale_op(corral_env, fn_id, 1)
    with corral_env.db.transaction() as s:
        s.execute(delete(Function))
    with pytest.raises(InputError, match="the function of this scale no longer exists"):
        plan_scale(corral_env.db, corral_env.settings, gone)
