"""Claims on SQLite: concurrency, multi-environment replicas, release, stale builds."""

from __future__ import annotations

from datetime import timedelta

import pytest

from corral import api
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from tests.workers.replicas.helpers import by_id, claim_race, one_node_idle, spawn_idle
from workers.base import clock
from workers.base.errors import InputError, NotFound
from workers.replicas.claims import NoIdleReplica, claim, release
from workers.replicas.delete import begin_delete
from workers.store.models import ReplicaState


def test_sixteen_threads_ten_idle_replicas(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(2)
    deploy_fn(corral_env)
    idle = spawn_idle(corral_env, "hello", 10)
    assert len(idle) == 10
    got, errors = claim_race(corral_env, "hello", 16)
    assert len(got) == 10
    assert len({c.replica_id for c in got}) == 10
    assert {c.replica_id for c in got} == {r.id for r in idle}
    assert all(c.address and c.vmid and c.function == "hello" for c in got)
    assert errors == ["no idle replica of hello"] * 6
    rows = by_id(corral_env)
    for c in got:
        r = rows[c.replica_id]
        assert (r.status, r.envs_in_use) == (ReplicaState.ALLOCATED, 1)
        assert r.last_used_at is not None
        assert r.idle_since is None and r.reap_at is None


def test_two_envs_serve_two_claims_then_allocated(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (replica,) = one_node_idle(corral_env, start_agents, exec_envs=2, idle_timeout=60)
    assert replica.idle_since is not None and replica.reap_at is not None

    first = claim(corral_env.db, corral_env.settings, "hello")
    r = by_id(corral_env)[replica.id]
    assert first.replica_id == replica.id
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 1)
    assert r.idle_since is None and r.reap_at is None  # busy: off the reaper's index

    second = claim(corral_env.db, corral_env.settings, "hello")
    r = by_id(corral_env)[replica.id]
    assert second.replica_id == replica.id
    assert (r.status, r.envs_in_use) == (ReplicaState.ALLOCATED, 2)
    with pytest.raises(NoIdleReplica, match="no idle replica of hello"):
        claim(corral_env.db, corral_env.settings, "hello")

    assert first.claim_id != second.claim_id
    clock.travel(30)
    out = release(corral_env.db, corral_env.settings, first.claim_id)
    assert out["released"] and out["replica_id"] == replica.id
    assert (out["status"], out["envs_in_use"]) == ("idle", 1)
    r = by_id(corral_env)[replica.id]
    assert r.status == ReplicaState.IDLE and r.idle_since is None  # one env still busy
    first_release = r.last_used_at
    assert first_release is not None and r.ready_at is not None
    assert first_release > r.ready_at + timedelta(seconds=29)

    clock.travel(5)
    assert release(corral_env.db, corral_env.settings, second.claim_id)["released"]
    r = by_id(corral_env)[replica.id]
    assert (r.status, r.envs_in_use) == (ReplicaState.IDLE, 0)
    assert r.last_used_at is not None and r.last_used_at > first_release
    assert r.idle_since == r.last_used_at
    assert r.reap_at == r.last_used_at + timedelta(seconds=60)

    again = release(corral_env.db, corral_env.settings, second.claim_id)
    assert not again["released"] and "not held" in again["detail"]
    assert by_id(corral_env)[replica.id].envs_in_use == 0
    # The released replica can be claimed again.
    assert claim(corral_env.db, corral_env.settings, "hello").replica_id == replica.id


def test_release_unknown_or_malformed(corral_env: Env) -> None:
    assert not release(corral_env.db, corral_env.settings, "0" * 32)["released"]
    assert api.release("f" * 32) == {
        "claim_id": "f" * 32,
        "released": False,
        "detail": f"claim {'f' * 32} is not held (already released, or expired and given "
        "back): nothing changed",
    }
    with pytest.raises(InputError, match="malformed claim id"):
        api.release("nope")


def test_claim_unknown_function(corral_env: Env) -> None:
    with pytest.raises(NotFound, match="unknown function 'ghost'"):
        api.claim("ghost")


def test_stale_replicas_are_never_handed_out(corral_env: Env, start_agents: StartAgents) -> None:
    old = one_node_idle(corral_env, start_agents, 2)
    deploy_fn(corral_env, env={"V": "2"})  # a new build: the two replicas are stale
    with pytest.raises(NoIdleReplica):
        claim(corral_env.db, corral_env.settings, "hello")
    fresh = [r for r in spawn_idle(corral_env, "hello", 1) if r.id not in {o.id for o in old}]
    assert len(fresh) == 1
    got = api.claim("hello")
    assert got["replica_id"] == fresh[0].id
    assert got["spawned"] == []
    rows = by_id(corral_env)
    assert all(rows[o.id].status == ReplicaState.IDLE for o in old)  # left for the reaper


def test_release_of_a_replica_being_deleted_counts_the_env_back(
    corral_env: Env, start_agents: StartAgents
) -> None:
    one_node_idle(corral_env, start_agents)
    got = claim(corral_env.db, corral_env.settings, "hello")
    begin_delete(corral_env.db, corral_env.settings, got.replica_id)
    out = release(corral_env.db, corral_env.settings, got.claim_id)
    assert (out["status"], out["envs_in_use"]) == ("deleting", 0)


@pytest.mark.parametrize("bad", [-1, "soon", float("inf"), True])
def test_bad_cold_start_timeout_is_refused(corral_env: Env, bad: object) -> None:
    deploy_fn(corral_env)
    with pytest.raises(InputError, match="cold-start timeout"):
        api.claim("hello", cold_start_timeout=bad)  # type: ignore[arg-type]
