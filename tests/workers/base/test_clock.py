"""One clock: expiries judged on the store's clock, whatever this host's clock says.

``clock.skew_host`` makes this process's host clock run ahead, as a badly synced host's
would; the first transaction measures the store's clock again and cancels the skew out.
``clock.step_host`` steps it between two measurements: nothing reads it there.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import redis
from sqlalchemy import select, text

from corral import api
from tests.fixtures import Env, StartAgents
from tests.helpers import one_agent, operation
from tests.workers.replicas.helpers import spawn_idle
from workers import leases
from workers.autoscale import demand
from workers.base import clock
from workers.base.kinds import OpKind
from workers.maintenance import redrive
from workers.maintenance.reaper import reap
from workers.replicas.claims import claim
from workers.store.db import store_now
from workers.store.models import Claim, Operation, OpStatus


def _server_time(env: Env) -> datetime:
    with env.db.read() as s:
        if env.db.is_sqlite:
            return datetime.fromisoformat(
                s.scalar(text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')"))
            )
        value = s.scalar(text("SELECT clock_timestamp() AT TIME ZONE 'UTC'"))
        assert isinstance(value, datetime)
        return value


def test_the_clock_is_the_stores_even_on_a_host_31_s_ahead(corral_env: Env) -> None:
    clock.skew_host(31)
    with corral_env.db.read():
        pass  # the first transaction measures the store's clock
    server = _server_time(corral_env)
    ours = clock.now()
    assert abs(ours - server) < timedelta(seconds=1)


def test_a_reaper_on_a_host_31_s_ahead_does_not_re_lend_a_held_claim(
    corral_env: Env, start_agents: StartAgents
) -> None:
    one_agent(corral_env, start_agents)
    spawn_idle(corral_env, "hello", 1)
    held = claim(corral_env.db, corral_env.settings, "hello", ttl_s=30)  # a gateway's lease
    clock.skew_host(31)  # the reaper's host thinks the lease lapsed a second ago
    report = reap(corral_env.db, corral_env.settings, holder="skewed")
    assert report.claims_expired == 0
    with corral_env.db.read() as s:
        assert s.get(Claim, held.claim_id) is not None
    clock.travel(31)  # real time passes: now it has lapsed, on every host
    assert reap(corral_env.db, corral_env.settings, holder="later").claims_expired == 1


def test_a_beat_host_120_s_ahead_re_sends_nothing_that_still_moves(
    corral_env: Env, start_agents: StartAgents
) -> None:
    one_agent(corral_env, start_agents)
    op_id = api.spawn("hello", 1)
    assert operation(corral_env, op_id).status == "succeeded"
    with corral_env.db.transaction() as s:  # an open operation that just moved
        op = s.get(Operation, op_id)
        assert op is not None
        op.status = OpStatus.RUNNING
        op.progress_at = clock.now()
    clock.skew_host(corral_env.settings.redrive_after_s)
    assert redrive.due(corral_env.db, corral_env.settings, [OpKind.SPAWN]) == []
    assert leases.acquire(corral_env.db, "reap", "a", 60)
    clock.skew_host(120)
    assert not leases.acquire(corral_env.db, "reap", "b", 60)  # a's lease has not lapsed


def test_a_gateway_on_a_host_20_s_behind_reports_demand_the_autoscaler_counts(
    corral_env: Env, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    clock.skew_host(-20)  # the gateway's host; its store transactions measure the clock
    with corral_env.db.read():
        pass
    sample = demand.Sample(inflight=3, queued=0, concurrency=3.0, requests=5, at=clock.epoch())
    demand.report(client, "gw-behind", {"hello": sample})
    clock.skew_host(0)  # the autoscaler's host
    with corral_env.db.read():
        pass
    seen = demand.read(client, ["hello"], stale_after_s=10)["hello"]
    assert (seen.gateways, seen.inflight) == (1, 3)  # fresh: judged on one clock


def test_a_step_of_the_host_clock_between_two_syncs_changes_nothing(corral_env: Env) -> None:
    with corral_env.db.read():
        pass  # measured
    before = clock.now()
    assert leases.acquire(corral_env.db, "reap", "a", 60)
    clock.step_host(600)  # an NTP step, an operator's `date -s`: the wall clock jumps
    assert clock.now() - before < timedelta(seconds=5)
    assert abs(clock.epoch() - before.replace(tzinfo=UTC).timestamp()) < 5
    assert not leases.acquire(corral_env.db, "reap", "b", 60)  # a's lease has not lapsed
    clock.sync(lambda: _server_time(corral_env))  # the next measurement: the store again
    assert clock.now() - before < timedelta(seconds=5)


def test_the_stores_clock_in_sql_is_the_servers_and_follows_travel(corral_env: Env) -> None:
    with corral_env.db.read() as s:
        stored = s.scalar(select(store_now()))
    assert isinstance(stored, datetime)
    assert abs(stored - _server_time(corral_env)) < timedelta(seconds=1)
    assert leases.acquire(corral_env.db, "reap", "a", 60)
    clock.travel(59)
    assert not leases.acquire(corral_env.db, "reap", "b", 60)
    clock.travel(2)  # past the lease, on the database's clock moved as the test's
    assert leases.acquire(corral_env.db, "reap", "b", 60)
    with corral_env.db.read() as s:
        travelled = s.scalar(select(store_now()))
    assert isinstance(travelled, datetime)
    assert abs(travelled - _server_time(corral_env) - timedelta(seconds=61)) < timedelta(seconds=1)


def test_a_thread_finding_the_store_clock_measured_by_another_goes_on_at_once() -> None:
    # With the store away, a measurement waits on it (a connect timeout): every other
    # thread's transaction queued behind it, one timeout after another, past their
    # tasks' hard limits (the partition run). Once the clock was measured, they go on.
    started, release = threading.Event(), threading.Event()

    def slow_store() -> datetime:
        started.set()
        release.wait(10)
        return datetime.now(UTC).replace(tzinfo=None)

    clock.sync(lambda: datetime.now(UTC).replace(tzinfo=None))  # measured once
    assert clock.synced()
    measuring = threading.Thread(target=clock.sync, args=(slow_store,))
    measuring.start()
    try:
        assert started.wait(10)
        t0 = time.monotonic()
        assert clock.sync(slow_store, 0.0) is None  # not measured: the estimate stands
        assert time.monotonic() - t0 < 5  # not the slow store's 10 s (slack for a loaded box)
        t0 = time.monotonic()
        assert clock.sync(slow_store, 0.2) is None  # a wait given: that long at most
        assert 0.2 <= time.monotonic() - t0 < 5
    finally:
        release.set()
        measuring.join(10)
        clock.reset()
