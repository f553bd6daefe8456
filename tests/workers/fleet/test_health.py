"""Node health: a node that misses its probes is marked unhealthy, placement skips it, and it
comes back when it answers again. Real agents on loopback, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from agents.fcdaemon import serve_fcdaemon
from corral import api
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, passes_until_heard
from workers.fleet.health import check_health
from workers.replicas.lost import mark_lost
from workers.store.models import Node


@pytest.mark.timeout(30)
def test_health_marks_a_dead_node_after_misses_and_back_when_it_answers(
    store_env: Env, start_agents: StartAgents
) -> None:
    store_env.set(health_misses="2", node_dead_grace_s="0")
    a, b = start_agents(2)
    with store_env.db.transaction() as s:  # they list their VMs (reconcile learns it), so
        s.execute(update(Node).values(can_list=True))  # a lost node's rows end Dead
    deploy_fn(store_env)
    api.wait(api.spawn("hello", 2), timeout=10)  # one on each node
    port = a.port
    a.stop(grace=0)
    first = check_health(store_env.db, store_env.settings)
    assert first.missed == ["node1"] and first.became_unhealthy == []
    second = check_health(store_env.db, store_env.settings)
    assert second.became_unhealthy == ["node1"]
    assert mark_lost(store_env.db, store_env.settings) == 1  # grace 0: its replica is Dead
    assert mark_lost(store_env.db, store_env.settings) == 0  # and only once
    with store_env.db.read() as s:
        nodes = {n.name: n for n in s.scalars(select(Node))}
    assert not nodes["node1"].healthy and nodes["node1"].live == 0
    view = api.wait(api.spawn("hello", 2), timeout=10)
    assert view["status"] == "succeeded"
    assert len(b.driver.list()) == 3  # placement skipped the unhealthy node
    back = serve_fcdaemon(f"127.0.0.1:{port}")
    try:
        passes = passes_until_heard(
            lambda: check_health(store_env.db, store_env.settings), lambda p: p.missed
        )
        assert passes[-1].recovered == ["node1"], passes
        assert all(p.recovered == [] and p.missed == ["node1"] for p in passes[:-1]), passes
    finally:
        back.stop(grace=0)
