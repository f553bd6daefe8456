"""What a producer asks of replicas: checked in the caller's transaction, written as an
operation; bad input writes nothing. On SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from tests.fixtures import Env
from tests.helpers import creating, deploy_fn
from workers.base.errors import InputError, NotFound
from workers.base.kinds import OpKind
from workers.fleet.nodes import upsert_node
from workers.replicas.requests import request_delete, request_scale, request_spawn
from workers.store.models import Operation, OpStatus


def _operations(env: Env) -> int:
    with env.db.read() as s:
        return int(s.scalar(select(func.count()).select_from(Operation)) or 0)


def test_a_spawn_is_a_pending_operation_of_its_function(store_env: Env) -> None:
    fn_id = deploy_fn(store_env, max=5)
    with store_env.db.transaction() as s:
        op = request_spawn(s, "hello", 3)
        op_id = op.id
    with store_env.db.read() as s:
        row = s.get(Operation, op_id)
        assert row is not None
        assert (row.kind, row.status, row.function_id) == (OpKind.SPAWN, OpStatus.PENDING, fn_id)
        assert row.params == {"function": "hello", "count": 3}


@pytest.mark.parametrize(
    ("count", "error"),
    [
        (0, "count must be between 1 and"),
        (-1, "count must be between 1 and"),
        (True, "count must be an integer, got True"),
        ("2", "count must be an integer, got '2'"),
        (6, "spawning 6 would give hello 6 replicas, above its max of 5"),
    ],
)
def test_a_bad_spawn_is_refused_and_writes_nothing(
    store_env: Env, count: object, error: str
) -> None:
    deploy_fn(store_env, max=5)
    with pytest.raises(InputError, match=error), store_env.db.transaction() as s:
        request_spawn(s, "hello", count)  # type: ignore[arg-type]
    assert _operations(store_env) == 0


def test_a_spread_spawn_counts_every_healthy_node_against_the_max(store_env: Env) -> None:
    deploy_fn(store_env, max=5, placement="spread")
    with store_env.db.transaction() as s:
        for i in range(3):
            upsert_node(s, f"127.0.0.1:{50051 + i}", name=f"node{i}")
    with store_env.db.transaction() as s:
        request_spawn(s, "hello", 1)  # 3 replicas: within the max
    with (
        pytest.raises(InputError, match="spawning 6 would give hello 6 replicas"),
        store_env.db.transaction() as s,
    ):
        request_spawn(s, "hello", 2)  # 2 on each of 3 nodes
    assert _operations(store_env) == 1


def test_spawning_an_unknown_function_is_refused(store_env: Env) -> None:
    with pytest.raises(NotFound, match="nosuch"), store_env.db.transaction() as s:
        request_spawn(s, "nosuch", 1)
    assert _operations(store_env) == 0


def test_a_scale_sets_a_target_within_min_and_max(store_env: Env) -> None:
    fn_id = deploy_fn(store_env, min=1, max=4)
    with store_env.db.transaction() as s:
        op_id = request_scale(s, "hello", 4).id
    for bad, error in (
        (5, r"target 5 is outside hello's range \[1, 4\]"),
        (0, r"target 0 is outside hello's range \[1, 4\]"),
        (-1, "target must not be negative"),
        (2.5, "target must be an integer"),
    ):
        with pytest.raises(InputError, match=error), store_env.db.transaction() as s:
            request_scale(s, "hello", bad)  # type: ignore[arg-type]
    with store_env.db.read() as s:
        ops = list(s.scalars(select(Operation)))
    assert [(o.id, o.kind, o.function_id, o.params) for o in ops] == [
        (op_id, OpKind.SCALE, fn_id, {"function": "hello", "target": 4})
    ]


def test_a_delete_names_its_replica_and_counts_one_part(store_env: Env) -> None:
    fn_id = deploy_fn(store_env)
    with store_env.db.transaction() as s:
        node, _ = upsert_node(s, "127.0.0.1:50051", name="node1")
        node_id = node.id
    replica_id = creating(store_env, fn_id, "req-1", node_id).replica_id
    with store_env.db.transaction() as s:
        op = request_delete(s, replica_id)
        assert (op.kind, op.total, op.function_id) == (OpKind.DELETE, 1, fn_id)
        assert op.params == {"replica": replica_id}
    with pytest.raises(NotFound, match="unknown replica 'gone'"), store_env.db.transaction() as s:
        request_delete(s, "gone")
    assert _operations(store_env) == 1
