"""Leases on SQLite: one winner, renewal, expiry and takeover."""

from __future__ import annotations

import pytest

from tests.fixtures import Env
from tests.workers.replicas.helpers import race_for_lease
from workers import leases
from workers.base import clock
from workers.base.errors import InputError


def test_acquire_renew_release(corral_env: Env) -> None:
    db = corral_env.db
    assert leases.acquire(db, "reap", "a", 60)
    assert not leases.acquire(db, "reap", "b", 60)
    first = leases.current(db, "reap")
    assert first is not None and first.holder == "a"
    clock.travel(30)
    assert leases.acquire(db, "reap", "a", 60)  # renewal by the holder
    second = leases.current(db, "reap")
    assert second is not None and second.expires_at > first.expires_at
    assert not leases.release(db, "reap", "b")  # not b's to give back
    assert leases.release(db, "reap", "a")
    assert leases.current(db, "reap") is None
    assert leases.acquire(db, "reap", "b", 60)


def test_expired_lease_is_taken_over(corral_env: Env) -> None:
    db = corral_env.db
    assert leases.acquire(db, "reap", "crashed", 10)
    clock.travel(9)
    assert not leases.acquire(db, "reap", "next", 10)
    clock.travel(2)
    assert leases.current(db, "reap") is None
    assert leases.acquire(db, "reap", "next", 10)
    assert not leases.release(db, "reap", "crashed")  # the old holder lost it
    info = leases.current(db, "reap")
    assert info is not None and info.holder == "next"


def test_race_has_one_winner(corral_env: Env) -> None:
    assert len(race_for_lease(corral_env.db)) == 1


@pytest.mark.parametrize(
    ("name", "holder", "ttl"), [("", "a", 1), ("x" * 65, "a", 1), ("n", "", 1), ("n", "a", 0)]
)
def test_bad_arguments(corral_env: Env, name: str, holder: str, ttl: float) -> None:
    with pytest.raises(InputError):
        leases.acquire(corral_env.db, name, holder, ttl)
