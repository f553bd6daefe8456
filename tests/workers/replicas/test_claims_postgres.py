"""On PostgreSQL: processes and threads racing for replicas, reaper passes and leases."""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from tests.workers.replicas.helpers import (
    at_once,
    by_id,
    claim_race,
    one_node_idle,
    race_for_lease,
    released,
    spawn_idle,
)
from tests.workers.replicas.pg_child import THREADS, claimer
from workers import leases
from workers.base import clock
from workers.maintenance.reaper import reap
from workers.store.models import ReplicaState

PROCESSES = 4


def test_four_processes_of_four_threads_share_ten_replicas(
    pg_env: Env, start_agents: StartAgents
) -> None:
    start_agents(2)
    deploy_fn(pg_env)
    idle = spawn_idle(pg_env, "hello", 10)
    assert len(idle) == 10
    pg_env.db.dispose()  # nothing of ours crosses into the children

    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Barrier(PROCESSES + 1)
    out = ctx.Queue()
    url = pg_env.settings.database_url
    procs = [ctx.Process(target=claimer, args=(url, "hello", ready, out)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    ready.wait(timeout=60)
    results = [r for _ in procs for r in out.get(timeout=60)]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0

    assert [r for r in results if r[0] == "error"] == []
    ok = [rid for kind, rid in results if kind == "ok"]
    assert len(results) == PROCESSES * THREADS
    assert len(ok) == 10
    assert set(ok) == {r.id for r in idle}  # ten distinct replicas, each exactly once
    assert [msg for kind, msg in results if kind == "none"] == ["no idle replica of hello"] * 6
    rows = by_id(pg_env)
    assert all(rows[rid].status == ReplicaState.ALLOCATED for rid in ok)
    assert all(rows[rid].envs_in_use == 1 for rid in ok)


def test_two_env_replicas_under_sixteen_threads(pg_env: Env, start_agents: StartAgents) -> None:
    """A locked replica with a free environment is waited for, not skipped and missed."""
    idle = one_node_idle(pg_env, start_agents, 5, exec_envs=2)
    claims, misses = claim_race(pg_env, "hello", 16, timeout=60)
    got = [c.replica_id for c in claims]
    assert len(got) == 10 and len(misses) == 6
    assert Counter(got) == {r.id: 2 for r in idle}
    rows = by_id(pg_env)
    assert all(
        (rows[r.id].status, rows[r.id].envs_in_use) == (ReplicaState.ALLOCATED, 2) for r in idle
    )


def test_reaper_passes_without_the_lease_still_delete_each_replica_once(
    pg_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row locks (FOR UPDATE SKIP LOCKED, then Deleting) alone keep passes apart."""
    agents = start_agents(2)
    deploy_fn(pg_env, idle_timeout=10)
    idle = spawn_idle(pg_env, "hello", 12)
    monkeypatch.setattr(leases, "acquire", lambda *a, **k: True)
    clock.travel(11)
    reports = at_once(4, lambda i: reap(pg_env.db, pg_env.settings, holder=f"p{i}"))
    assert not any(r.skipped for r in reports)
    assert sum(len(r.deleted) for r in reports) == 12
    assert released(agents) == {r.vmid: 1 for r in idle}


def test_lease_race_has_one_winner(pg_env: Env) -> None:
    wins = race_for_lease(pg_env.db)
    assert len(wins) == 1
    info = leases.current(pg_env.db, "race")
    assert info is not None and info.holder == wins[0]
