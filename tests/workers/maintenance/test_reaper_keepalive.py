"""The reaper and adaptive keep-alive (workers/maintenance/reaper.py): which Idle replicas a
function's keep-alive windows let go, and the fixed rule when Redis cannot say.

The windows come from the idle times kept in Redis (``keep_alive_plans``; through a real
Redis in tests/workers/autoscale/test_keepalive_fleet.py). Here a pass is given plans made
by hand, so it runs on the store and real agents alone.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from sqlalchemy import select, update

from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, replicas
from tests.workers.autoscale.test_keepalive_fleet import history
from tests.workers.replicas.helpers import spawn_idle
from workers.autoscale.keepalive import Plan, Windows, fixed
from workers.base import clock
from workers.maintenance.reap_report import ReapReport
from workers.maintenance.reaper import _Limits, _run, reap
from workers.replicas.claims import claim
from workers.store.models import Function, Replica, ReplicaState

WINDOWS = Windows("histogram", prewarm_s=480.0, keep_s=660.0, idle_times=8, reason="a pattern")


def _pass(env: Env, plans: dict[str, Plan], batch: int = 10) -> ReapReport:
    """One pass with these plans (function name -> plan), in this order."""
    with env.db.read() as s:
        ids = {name: fid for name, fid in s.execute(select(Function.name, Function.id))}
    report = ReapReport(holder="test")
    limits = _Limits(batch, None, {ids[name]: plan for name, plan in plans.items()})
    _run(env.db, env.settings, report, limits)
    return report


def _idle_for(env: Env, seconds: float, *replica_ids: str) -> None:
    """These replicas idle since ``seconds`` ago, by the store's clock."""
    with env.db.transaction() as s:
        s.execute(
            update(Replica)
            .where(Replica.id.in_(replica_ids))
            .values(idle_since=clock.now() - timedelta(seconds=seconds))
        )


def _status(env: Env, name: str) -> dict[str, ReplicaState]:
    return {r.id: ReplicaState(r.status) for r in replicas(env, name)}


@pytest.fixture
def away_from_utc() -> Iterator[None]:
    """This process's local time five hours behind UTC (the store's clock stays UTC)."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = "Etc/GMT+5"
    time.tzset()
    try:
        yield
    finally:
        if before is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = before
        time.tzset()


def test_when_the_next_call_is_not_due_every_idle_replica_goes_at_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "plain", keep_alive="adaptive")  # no pattern yet: its fixed rule
    deploy_fn(corral_env, "tick", keep_alive="adaptive")
    (kept,) = spawn_idle(corral_env, "plain", 1)
    spawn_idle(corral_env, "tick", 3)
    busy = claim(corral_env.db, corral_env.settings, "tick").replica_id
    idle = [r.id for r in replicas(corral_env, "tick") if r.status == ReplicaState.IDLE]
    _idle_for(corral_env, 5, kept.id, *idle)
    last = clock.epoch() - 5  # the call ended 5 s ago; the next is due in 8 minutes
    # the plain function's plan comes first: one without windows is passed over, not the end
    report = _pass(corral_env, {"plain": Plan(fixed("too few"), last), "tick": Plan(WINDOWS, last)})
    assert sorted(d.replica_id for d in report.deleted) == sorted(idle)
    assert {(d.function, d.reason) for d in report.deleted} == {("tick", "idle")}
    for d in report.deleted:
        assert re.fullmatch(r"idle \d+s; keep-alive: the next call is not due", d.detail), d.detail
    assert _status(corral_env, "tick")[busy] == ReplicaState.ALLOCATED  # in use: never
    assert _status(corral_env, "plain") == {kept.id: ReplicaState.IDLE}


@pytest.mark.usefixtures("away_from_utc")
def test_inside_its_windows_a_replica_stays_until_its_keep_alive_window_is_over(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "tick", keep_alive="adaptive")
    deploy_fn(corral_env, "plain", idle_timeout=60)  # the fixed rule, in the same pass
    fresh, old = (r.id for r in spawn_idle(corral_env, "tick", 2))
    (plain,) = spawn_idle(corral_env, "plain", 1)
    _idle_for(corral_env, 20, fresh)  # pre-warmed 20 s ago: the call is due
    _idle_for(corral_env, 700, old)  # past the 660 s keep-alive window
    with corral_env.db.transaction() as s:  # every reap_at passed: only the windows keep one
        s.execute(update(Replica).values(reap_at=clock.now() - timedelta(seconds=1)))
    report = _pass(corral_env, {"tick": Plan(WINDOWS, clock.epoch() - 500)})
    assert sorted((d.function, d.replica_id) for d in report.deleted) == sorted(
        [("tick", old), ("plain", plain.id)]
    )
    (gone,) = (d for d in report.deleted if d.function == "tick")
    assert re.fullmatch(r"idle 7\d\ds; keep-alive: over 660s", gone.detail), gone.detail
    assert _status(corral_env, "tick")[fresh] == ReplicaState.IDLE


def test_a_batch_smaller_than_the_idle_replicas_takes_the_longest_idle_first(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "tick", keep_alive="adaptive")
    first, second = (r.id for r in spawn_idle(corral_env, "tick", 2))
    _idle_for(corral_env, 5, first)
    _idle_for(corral_env, 50, second)  # made later, idle longer
    report = _pass(corral_env, {"tick": Plan(WINDOWS, clock.epoch() - 5)}, batch=1)
    assert [d.replica_id for d in report.deleted] == [second] and report.more


def test_idle_times_redis_cannot_read_leave_the_fixed_rule_and_say_why(
    corral_env: Env, start_agents: StartAgents, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "tick", keep_alive="adaptive", idle_timeout=600)
    spawn_idle(corral_env, "tick", 1)
    nowhere = redis.Redis(unix_socket_path=str(tmp_path / "no-redis.sock"))
    with caplog.at_level(logging.WARNING, logger="workers.maintenance.reaper"):
        # an operator's idle timeout decides alone: the idle times are not even read
        reap(corral_env.db, corral_env.settings, holder="op", idle_timeout=600, idle_times=nowhere)
        assert caplog.records == []
        report = reap(corral_env.db, corral_env.settings, holder="test", idle_times=nowhere)
    assert report.deleted == [] and report.keep_alive == {}  # its 600 s hold
    (warning,) = [r for r in caplog.records if r.name == "workers.maintenance.reaper"]
    assert warning.getMessage().startswith(
        "reap: could not read idle times, keep-alive falls back to fixed: Error "
    )
    assert "no-redis.sock" in warning.getMessage()


def test_a_pass_reads_the_windows_from_redis_and_judges_the_others_by_their_timeout(
    corral_env: Env, start_agents: StartAgents, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "tick", keep_alive="adaptive")  # every 10 min: the next is far
    deploy_fn(corral_env, "plain", idle_timeout=60)
    deploy_fn(corral_env, "kept", idle_timeout=3600)
    (tick,) = spawn_idle(corral_env, "tick", 1)
    (plain,) = spawn_idle(corral_env, "plain", 1)
    (kept,) = spawn_idle(corral_env, "kept", 1)
    history(client, corral_env, "tick", every=600, calls=8, last_end=time.time() - 5)
    _idle_for(corral_env, 120, plain.id, kept.id)
    with corral_env.db.transaction() as s:  # plain's timeout passed; tick's fixed one did not
        s.execute(
            update(Replica)
            .where(Replica.id == plain.id)
            .values(reap_at=clock.now() - timedelta(seconds=1))
        )
    report = reap(corral_env.db, corral_env.settings, holder="test", idle_times=client)
    assert report.keep_alive["tick"]["mode"] == "histogram"
    assert sorted((d.function, d.reason) for d in report.deleted) == [
        ("plain", "idle"),
        ("tick", "idle"),
    ]
    assert _status(corral_env, "kept") == {kept.id: ReplicaState.IDLE}
    assert {tick.id, plain.id} == {d.replica_id for d in report.deleted}
