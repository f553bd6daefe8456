"""Batched claims, renewals and releases (what a gateway holding claims uses), on both stores."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from tests.workers.replicas.helpers import at_once, by_id, one_node_idle
from workers.base import clock
from workers.base.errors import InputError, NotFound
from workers.replicas.claims import (
    Claimed,
    NoIdleReplica,
    claim_many,
    expire,
    release,
    release_many,
    renew,
    suspect,
)
from workers.store.models import ReplicaState


def test_one_call_claims_several_environments_each_a_claim_of_its_own(
    store_env: Env, start_agents: StartAgents
) -> None:
    idle = one_node_idle(store_env, start_agents, 3, exec_envs=2)
    got = claim_many(store_env.db, store_env.settings, "hello", 5, ttl_s=60)
    assert len(got) == 5 and len({c.claim_id for c in got}) == 5
    per_replica = Counter(c.replica_id for c in got)
    assert sorted(per_replica.values()) == [1, 2, 2]
    rows = by_id(store_env)
    for r in idle:
        assert rows[r.id].envs_in_use == per_replica[r.id]
        full = per_replica[r.id] == 2
        assert rows[r.id].status == (ReplicaState.ALLOCATED if full else ReplicaState.IDLE)
    assert all(c.address and c.function == "hello" for c in got)

    more = claim_many(store_env.db, store_env.settings, "hello", 4)  # only one is left
    assert len(more) == 1
    with pytest.raises(NoIdleReplica):
        claim_many(store_env.db, store_env.settings, "hello", 2)
    # Each is given back on its own: a second release of one changes nothing.
    assert release(store_env.db, store_env.settings, got[0].claim_id)["released"]
    assert not release(store_env.db, store_env.settings, got[0].claim_id)["released"]
    assert (
        release_many(
            store_env.db, store_env.settings, [c.claim_id for c in got] + [more[0].claim_id]
        )
        == 5
    )
    rows = by_id(store_env)
    assert all((rows[r.id].status, rows[r.id].envs_in_use) == (ReplicaState.IDLE, 0) for r in idle)
    assert all(rows[r.id].idle_since is not None for r in idle)


def test_bad_counts_and_names_change_nothing(store_env: Env, start_agents: StartAgents) -> None:
    one_node_idle(store_env, start_agents, 1)
    for count in (0, -1, 1.5, True, "2"):
        with pytest.raises(InputError):
            claim_many(store_env.db, store_env.settings, "hello", count)  # type: ignore[arg-type]
    with pytest.raises(NotFound):
        claim_many(store_env.db, store_env.settings, "ghost", 2)
    assert [(r.status, r.envs_in_use) for r in by_id(store_env).values()] == [
        (ReplicaState.IDLE, 0)
    ]


def test_renew_extends_held_claims_and_says_which_replicas_still_serve(
    store_env: Env, start_agents: StartAgents
) -> None:
    one_node_idle(store_env, start_agents, 2)
    a, b = claim_many(store_env.db, store_env.settings, "hello", 2, ttl_s=5)
    assert release(store_env.db, store_env.settings, b.claim_id)["released"]
    clock.travel(4)
    try:
        assert renew(store_env.db, [a.claim_id, b.claim_id], 60) == {a.claim_id: True}
        clock.travel(26)  # past the first expiry (5 s), inside the renewal (4 + 60 s)
        assert expire(store_env.db, store_env.settings) == 0
        assert renew(store_env.db, [], 60) == {}
        # A new build makes the replica stale: still held, no longer to be used.
        deploy_fn(store_env, "hello", image="examples.echo")
        assert renew(store_env.db, [a.claim_id], 60) == {a.claim_id: False}
        clock.travel(170)  # past the renewed expiry: given back
        assert expire(store_env.db, store_env.settings) == 1
        assert renew(store_env.db, [a.claim_id], 60) == {}
    finally:
        clock.reset()


def test_renew_reports_a_replica_being_deleted(store_env: Env, start_agents: StartAgents) -> None:
    one_node_idle(store_env, start_agents, 1, exec_envs=2)
    a, b = claim_many(store_env.db, store_env.settings, "hello", 2)
    # Another holder retires the replica (its delete operation not run yet: Deleting).
    assert suspect(store_env.db, store_env.settings, a.claim_id, "suspect: test") is not None
    assert renew(store_env.db, [a.claim_id, b.claim_id], 60) == {b.claim_id: False}


def test_sixteen_threads_claiming_batches_never_share_an_environment(
    store_env: Env, start_agents: StartAgents
) -> None:
    """Batches of three from sixteen threads at once: ten environments, each claimed once."""
    idle = one_node_idle(store_env, start_agents, 5, exec_envs=2)

    def one(_: int) -> list[Claimed]:
        try:
            return claim_many(store_env.db, store_env.settings, "hello", 3)
        except NoIdleReplica:
            return []

    got = [c for batch in at_once(16, one, timeout=60) for c in batch]
    assert len(got) == 10
    assert Counter(c.replica_id for c in got) == {r.id: 2 for r in idle}
    rows = by_id(store_env)
    assert all(
        (rows[r.id].status, rows[r.id].envs_in_use) == (ReplicaState.ALLOCATED, 2) for r in idle
    )
