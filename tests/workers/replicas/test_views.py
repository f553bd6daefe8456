"""How replicas are shown and listed: live ones by default, oldest first, stale marked."""

from __future__ import annotations

import pytest

from tests.fixtures import Env
from tests.helpers import creating, deploy_fn
from workers.base import clock
from workers.base.errors import NotFound
from workers.fleet.nodes import upsert_node
from workers.replicas.lifecycle import lock_replica, transition
from workers.replicas.views import get_replica, list_replicas, replica_view
from workers.store.models import ReplicaState


def _three(env: Env) -> tuple[str, str, list[str]]:
    """``hello`` and ``other`` deployed, three Creating replicas (two of hello), oldest first."""
    hello, other = deploy_fn(env), deploy_fn(env, "other")
    with env.db.transaction() as s:
        node, _ = upsert_node(s, "127.0.0.1:50051", name="node1")
        node_id = node.id
    ids = []
    for fn_id, request_id in ((hello, "r1"), (other, "r2"), (hello, "r3")):
        ids.append(creating(env, fn_id, request_id, node_id).replica_id)
        clock.travel(1.0)  # created_at orders them
    return hello, other, ids


def test_a_replica_as_operators_see_it(store_env: Env) -> None:
    _, _, (first, _, _) = _three(store_env)
    with store_env.db.read() as s:
        view = replica_view(get_replica(s, first))
    assert (view["id"], view["function"], view["node"]) == (first, "hello", "node1")
    assert (view["status"], view["status_code"]) == ("creating", int(ReplicaState.CREATING))
    assert (view["request_id"], view["vmid"], view["gpu"], view["stale"]) == (
        "r1",
        None,
        None,
        False,
    )
    assert view["created_at"] is not None and view["created_at"].endswith("Z")
    deploy_fn(store_env)  # a new build of hello: the replica is stale from now on
    with store_env.db.read() as s:
        assert replica_view(get_replica(s, first))["stale"] is True


def test_listing_is_oldest_first_live_only_and_per_function(store_env: Env) -> None:
    hello, other, (r1, r2, r3) = _three(store_env)
    with store_env.db.transaction() as s:
        replica = lock_replica(s, r1)
        assert replica is not None
        transition(s, replica, ReplicaState.DEAD, store_env.settings, error="gone")
    with store_env.db.read() as s:
        assert [r.id for r in list_replicas(s)] == [r2, r3]
        assert [r.id for r in list_replicas(s, include_retired=True)] == [r1, r2, r3]
        assert [r.id for r in list_replicas(s, hello, include_retired=True)] == [r1, r3]
        assert [r.id for r in list_replicas(s, other)] == [r2]
        dead = replica_view(get_replica(s, r1))
    assert (dead["status"], dead["error"]) == ("dead", "gone")


def test_an_unknown_replica_is_not_found(store_env: Env) -> None:
    with pytest.raises(NotFound, match="unknown replica 'nosuch'"), store_env.db.read() as s:
        get_replica(s, "nosuch")
