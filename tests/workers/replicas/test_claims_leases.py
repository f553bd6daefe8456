"""Claims are leases, on SQLite and PostgreSQL: ids, stale and double releases, expiry, FINISHED."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import select, text

from corral import api
from tasks.maintenance import QUEUE
from tests.fixtures import Env, StartAgents
from tests.workers.replicas.helpers import at_once, by_id, one_node_idle
from workers.base import clock
from workers.base.errors import InputError
from workers.maintenance.reaper import reap
from workers.registry.service import FINISHED, KEEP_ALIVE, Registry
from workers.replicas.claims import claim, expire, release
from workers.replicas.lifecycle import lock_replica, transition
from workers.store.db import Database
from workers.store.migrate import alembic_config
from workers.store.models import Claim, ReplicaState


@pytest.fixture
def store(corral_env: Env) -> Env:
    """Eager Celery on SQLite, then on PostgreSQL (``corral_env`` runs on both)."""
    return corral_env


def _claims(env: Env) -> dict[str, str]:
    """Every claim row: claim id -> replica id."""
    with env.db.read() as s:
        return {c.id: c.replica_id for c in s.scalars(select(Claim))}


def test_a_stale_release_does_not_free_a_newer_claims_environment(
    store: Env, start_agents: StartAgents
) -> None:
    (replica,) = one_node_idle(store, start_agents)
    old = api.claim("hello")
    assert old["replica_id"] == replica.id and len(old["claim_id"]) == 32
    assert api.release(old["claim_id"])["released"]
    new = api.claim("hello")
    assert new["replica_id"] == replica.id and new["claim_id"] != old["claim_id"]

    stale = api.release(old["claim_id"])  # the first caller releases again, late
    assert not stale["released"] and "not held" in stale["detail"]
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.ALLOCATED, 1)  # still the new caller's
    assert _claims(store) == {new["claim_id"]: replica.id}
    with pytest.raises(Exception, match="no idle replica"):
        api.claim("hello")

    assert api.release(new["claim_id"])["released"]
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 0)
    assert _claims(store) == {}


def test_eight_concurrent_releases_of_one_claim_give_back_one_environment(
    store: Env, start_agents: StartAgents
) -> None:
    (replica,) = one_node_idle(store, start_agents, exec_envs=3)
    mine, other = (claim(store.db, store.settings, "hello") for _ in range(2))
    assert by_id(store)[replica.id].envs_in_use == 2

    results = at_once(8, lambda _: release(store.db, store.settings, mine.claim_id))
    assert sorted(r["released"] for r in results) == [False] * 7 + [True]
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 1)  # the other claim still holds
    assert _claims(store) == {other.claim_id: replica.id}


def test_an_expired_claim_is_given_back_by_the_reaper(
    store: Env, start_agents: StartAgents
) -> None:
    (replica,) = one_node_idle(store, start_agents, exec_envs=2, idle_timeout=30)
    short = api.claim("hello", ttl=30)
    long = api.claim("hello")  # the default CORRAL_CLAIM_TTL_S, 300 s
    assert by_id(store)[replica.id].status == ReplicaState.ALLOCATED
    ttl = (
        datetime.fromisoformat(long["expires_at"]) - datetime.fromisoformat(short["expires_at"])
    ).total_seconds()
    assert 269 < ttl <= 271

    # 10 s short of the expiry: the real time that passes meanwhile counts too (cis684, beside
    # another copy: 1 s short was not enough, the reap's select alone took 3 s)
    clock.travel(20)
    assert reap(store.db, store.settings, holder="early").claims_expired == 0
    assert by_id(store)[replica.id].envs_in_use == 2
    clock.travel(11)
    report = reap(store.db, store.settings, holder="p1")
    assert report.claims_expired == 1
    assert report.deleted == []  # busy with the long claim, and Idle again only now
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 1)
    assert _claims(store) == {long["claim_id"]: replica.id}
    late = api.release(short["claim_id"])  # its caller comes back after the expiry
    assert not late["released"]
    assert by_id(store)[replica.id].envs_in_use == 1

    clock.travel(290)  # the long claim expires too: the replica is idle from that moment
    assert reap(store.db, store.settings, holder="p2").claims_expired == 1
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 0)
    assert r.idle_since is not None and r.reap_at is not None
    assert (r.reap_at - r.idle_since).total_seconds() == 30


def test_release_and_expiry_racing_give_back_once(store: Env, start_agents: StartAgents) -> None:
    one_node_idle(store, start_agents, exec_envs=8, max=4)
    got = [claim(store.db, store.settings, "hello", ttl_s=5) for _ in range(6)]
    clock.travel(6)

    def one(i: int) -> int:
        if i % 2:
            return int(release(store.db, store.settings, got[i // 2].claim_id)["released"])
        return expire(store.db, store.settings)

    taken = at_once(6, one)
    assert sum(taken) == 6  # six expired claims, each given back exactly once
    assert _claims(store) == {}
    assert all(r.envs_in_use == 0 for r in by_id(store).values())


def test_finished_gives_back_the_replicas_oldest_claim(
    store: Env, start_agents: StartAgents
) -> None:
    (replica,) = one_node_idle(store, start_agents, exec_envs=2)
    first = claim(store.db, store.settings, "hello")
    clock.travel(1)
    second = claim(store.db, store.settings, "hello")
    registry = Registry(store.db, store.settings, QUEUE)  # a delete asked would run here
    assert replica.vmid is not None

    assert registry.update_status(replica.vmid, FINISHED) == KEEP_ALIVE
    assert _claims(store) == {second.claim_id: replica.id}
    assert not release(store.db, store.settings, first.claim_id)["released"]
    assert registry.update_status(replica.vmid, FINISHED) == KEEP_ALIVE
    assert registry.update_status(replica.vmid, FINISHED) == KEEP_ALIVE  # nothing left: no-op
    r = by_id(store)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 0)
    assert _claims(store) == {}


@pytest.mark.parametrize("bad", [0, -1, "soon", True, 86_401])
def test_a_bad_ttl_is_refused_and_claims_nothing(
    corral_env: Env, start_agents: StartAgents, bad: object
) -> None:
    (replica,) = one_node_idle(corral_env, start_agents)
    with pytest.raises(InputError, match="claim ttl"):
        api.claim("hello", ttl=bad)  # type: ignore[arg-type]
    assert by_id(corral_env)[replica.id].envs_in_use == 0
    assert _claims(corral_env) == {}


def test_upgrading_gives_environments_in_use_claim_rows(tmp_path: Path) -> None:
    """Environments claimed before claims had ids get rows, so the reaper can expire them."""

    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    command.upgrade(alembic_config(url), "0002")
    db = Database(url)
    try:
        with db.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO functions (id, name, backend, image, kernel, initrd, kernel_args,"
                    " vm_type, cpu, mem_mb, min_replicas, max_replicas, replica_count, labels, env,"
                    " image_storage, inet_dev, name_server, build_version, ports, readiness,"
                    " exec_envs, gpu_mem_mb, created_at, updated_at) VALUES ('f', 'fn', 'fcdaemon',"
                    " 'i', '', '', '', 'osv', 1, 512, 0, 5, 2, '{}', '{}', '', '', '', 'b', '[]',"
                    " 'agent', 2, 0, '2026-01-01', '2026-01-01')"
                )
            )
            for rid, used in (("r1", 2), ("r2", 0)):
                conn.execute(
                    text(
                        "INSERT INTO replicas (id, request_id, function_id, status, build_version,"
                        " envs_total, envs_in_use, gpu_mem_mb, created_at, updated_at) VALUES"
                        " (:id, :id, 'f', 1, 'b', 2, :used, 0, '2026-01-01', '2026-01-01')"
                    ),
                    {"id": rid, "used": used},
                )
        command.upgrade(alembic_config(url), "head")
        with db.read() as s:
            rows = list(s.scalars(select(Claim)))
        assert sorted(r.replica_id for r in rows) == ["r1", "r1"]
        assert all(r.function_id == "f" and r.expires_at > r.created_at for r in rows)
    finally:
        db.dispose()


def test_a_claim_on_a_replica_that_died_ends_with_it(store: Env, start_agents: StartAgents) -> None:
    (replica,) = one_node_idle(store, start_agents)
    got = claim(store.db, store.settings, "hello")
    with store.db.transaction() as s:  # its VM vanished: reconcile marks the row Dead
        row = lock_replica(s, replica.id)
        assert row is not None
        transition(s, row, ReplicaState.DEAD, store.settings, error="vanished")
    assert _claims(store) == {}  # its claims ended with it
    out = release(store.db, store.settings, got.claim_id)
    assert not out["released"] and "not held" in out["detail"]
    assert by_id(store)[replica.id].envs_in_use == 0
