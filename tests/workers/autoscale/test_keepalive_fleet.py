"""Adaptive keep-alive in the fleet: the reaper's idle selection and the autoscaler's pre-warm.

Real store (SQLite and PostgreSQL), real Redis, real agents; operations run eagerly.
Each function's idle times are recorded through :func:`workers.autoscale.idletimes.record`
as a gateway would, with its last activity set to put "now" where a test wants it in the
function's windows. ``tick`` is called every 10 minutes, each call a second long: its
idle times (9 min 59 s) are all in bin 9 of 1 minute, so its pre-warm window is 8.1 min
(bin 9's start, less 10%) and its keep-alive window 11 min (bin 9's end, plus 10%).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
import redis
from sqlalchemy import select, update

from corral import api
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, replicas
from tests.workers.observability.test_exporter import scrape, value
from tests.workers.replicas.helpers import spawn_idle
from workers.autoscale import idletimes
from workers.autoscale.idletimes import Activity, Shape, record
from workers.autoscale.passes import KEEPALIVE_KEY, ScaleFn, SpawnFn, run_pass
from workers.maintenance import reaper
from workers.maintenance.reap_report import ReapReport
from workers.observability.exporter import serve
from workers.store.models import Function, Operation, Replica, ReplicaState

PREWARM_S = 9 * 60 * 0.9
KEEP_S = 10 * 60 * 1.1


@pytest.fixture
def env(corral_env: Env, redis_url: str) -> Env:
    corral_env.set(broker_url=redis_url)
    return corral_env


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


def history(  # noqa: PLR0913 - a history's shape, by name
    client: redis.Redis,
    env: Env,
    name: str,
    *,
    every: float,
    calls: int,
    last_end: float,
) -> None:
    """``calls`` invocations ``every`` seconds apart, the last one ending at ``last_end``."""
    shape = Shape.from_settings(env.settings)
    start = last_end - every * (calls - 1)
    for i in range(calls):
        at = start + i * every
        record(client, shape, {name: Activity(arrivals=[at - 1], last=at)})


def idle_since(env: Env, name: str, seconds_ago: float) -> None:
    """Every Idle replica of ``name`` idle since ``seconds_ago`` (its reap_at too)."""
    at = datetime.fromtimestamp(time.time() - seconds_ago, UTC).replace(tzinfo=None)
    with env.db.transaction() as s:
        fid = s.scalar(select(Function.id).where(Function.name == name))
        s.execute(
            update(Replica)
            .where(Replica.function_id == fid, Replica.status == ReplicaState.IDLE)
            .values(idle_since=at)
        )


def idle(env: Env, name: str) -> int:
    return sum(1 for r in replicas(env, name) if r.status == ReplicaState.IDLE)


def due_tick(env: Env, start_agents: StartAgents, client: redis.Redis, n: int) -> float:
    """``tick`` with ``n`` Idle replicas and its next call due (30 s into its windows); now."""
    start_agents(1, env=env)
    deploy_fn(env, "tick", keep_alive="adaptive")
    spawn_idle(env, "tick", n)
    now = time.time()
    history(client, env, "tick", every=600, calls=8, last_end=now - PREWARM_S - 30)
    return now


def reap(env: Env, client: redis.Redis | None) -> ReapReport:
    return reaper.reap(env.db, env.settings, holder="test", idle_times=client)


# -- the reaper --------------------------------------------------------------------------------


def test_the_reaper_lets_a_replica_go_right_after_use_when_the_next_call_is_far(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "tick", keep_alive="adaptive")
    deploy_fn(env, "plain")  # the same calls, fixed keep-alive (10 min)
    spawn_idle(env, "tick", 1)
    spawn_idle(env, "plain", 1)
    now = time.time()
    for name in ("tick", "plain"):
        history(client, env, name, every=600, calls=8, last_end=now - 5)
        idle_since(env, name, 5)
    report = reap(env, client)
    assert [(d.function, d.reason) for d in report.deleted] == [("tick", "idle")]
    assert "the next call is not due" in report.deleted[0].detail
    assert report.keep_alive["tick"]["mode"] == "histogram"
    assert (idle(env, "tick"), idle(env, "plain")) == (0, 1)


def test_the_reaper_keeps_a_prewarmed_replica_until_the_tail(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    now = due_tick(env, start_agents, client, 1)
    idle_since(env, "tick", 20)  # pre-warmed 20 s ago, the call is due
    assert reap(env, client).deleted == []
    client.delete(idletimes.key("tick"))  # the same history, the last call longer ago
    history(client, env, "tick", every=600, calls=8, last_end=now - KEEP_S - 1)
    report = reap(env, client)  # past the tail: the call did not come
    assert [d.function for d in report.deleted] == ["tick"]


def test_past_its_keep_alive_window_a_replica_goes_even_inside_the_windows(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    now = due_tick(env, start_agents, client, 2)
    with env.db.transaction() as s:  # one idle for an hour (a cold start's extra), one fresh
        rows = s.scalars(select(Replica).where(Replica.status == ReplicaState.IDLE)).all()
        rows[0].idle_since = datetime.fromtimestamp(now - 3600, UTC).replace(tzinfo=None)
        rows[1].idle_since = datetime.fromtimestamp(now - 20, UTC).replace(tzinfo=None)
        old = rows[0].id
    assert [d.replica_id for d in reap(env, client).deleted] == [old]


def test_without_a_pattern_or_without_redis_the_fixed_timeout_holds(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "new", keep_alive="adaptive", idle_timeout=60)
    deploy_fn(env, "tick", keep_alive="adaptive", idle_timeout=60)
    spawn_idle(env, "new", 1)
    spawn_idle(env, "tick", 1)
    now = time.time()
    history(client, env, "new", every=600, calls=3, last_end=now - 5)  # 2 idle times: too few
    history(client, env, "tick", every=600, calls=8, last_end=now - 5)
    for name in ("new", "tick"):
        idle_since(env, name, 5)
    assert reap(env, None).deleted == []  # no Redis: both keep their 60 s
    report = reap(env, client)
    assert [d.function for d in report.deleted] == ["tick"]
    assert "new" not in report.keep_alive  # its fixed idle timeout decides
    with env.db.transaction() as s:  # 60 s later by its reap_at
        s.execute(
            update(Replica)
            .where(Replica.status == ReplicaState.IDLE)
            .values(reap_at=datetime.fromtimestamp(now - 1, UTC).replace(tzinfo=None))
        )
    assert [d.function for d in reap(env, client).deleted] == ["new"]


def test_the_reaper_never_takes_an_adaptive_function_below_its_min(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "tick", keep_alive="adaptive", min=1)
    spawn_idle(env, "tick", 2)
    history(client, env, "tick", every=600, calls=8, last_end=time.time() - 5)
    idle_since(env, "tick", 5)
    report = reap(env, client)
    assert len(report.deleted) == 1 and report.kept_for_min == {"tick": 1}


def test_an_operators_idle_timeout_overrides_the_windows(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    due_tick(env, start_agents, client, 1)
    idle_since(env, "tick", 20)
    report = reaper.reap(env.db, env.settings, holder="op", idle_timeout=10, idle_times=client)
    assert [d.function for d in report.deleted] == ["tick"] and report.keep_alive == {}


# -- the autoscaler pass: pre-warming ----------------------------------------------------------


def scaler(env: Env) -> ScaleFn:
    return lambda name, target: api.scale(name, target, settings=env.settings)


def spawner(env: Env, asked: list[str]) -> SpawnFn:
    """A pre-warm spawn that also notes what it was asked for."""

    def spawn(name: str) -> str:
        asked.append(name)
        return api.spawn(name, 1, settings=env.settings)

    return spawn


def test_a_pass_prewarms_a_function_whose_next_call_is_due(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "tick", keep_alive="adaptive")
    deploy_fn(env, "plain")
    now = time.time()
    for name in ("tick", "plain"):
        history(client, env, name, every=600, calls=8, last_end=now - 100)
    asked: list[str] = []
    early = run_pass(env.db, env.settings, client, scaler(env), spawner(env, asked), now=now)
    assert asked == [] and early.keep_alive["tick"]["warm"] is False
    assert set(early.keep_alive) == {"tick"}  # plain is not adaptive: not looked at
    due = now - 100 + PREWARM_S + 1
    report = run_pass(env.db, env.settings, client, scaler(env), spawner(env, asked), now=due)
    assert asked == ["tick"] and report.prewarmed["tick"]
    assert api.operation(report.prewarmed["tick"])["status"] == "succeeded"
    assert idle(env, "tick") == 1 and idle(env, "plain") == 0
    again = run_pass(env.db, env.settings, client, scaler(env), spawner(env, asked), now=due + 2)
    assert asked == ["tick"] and again.prewarmed == {}  # it has its replica
    published = client.hget(KEEPALIVE_KEY, "tick")
    assert isinstance(published, bytes) and b'"warm": true' in published


def test_no_prewarm_without_a_pattern_or_while_a_spawn_is_open(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "new", keep_alive="adaptive")
    deploy_fn(env, "tick", keep_alive="adaptive")
    now = time.time()
    history(client, env, "new", every=600, calls=3, last_end=now - 560)
    history(client, env, "tick", every=600, calls=8, last_end=now - 560)
    with env.db.transaction() as s:  # a cold start of tick is on its way already
        fid = s.scalar(select(Function.id).where(Function.name == "tick"))
        s.add(Operation(kind="spawn", function_id=fid, params={"count": 1}))
    asked: list[str] = []
    report = run_pass(env.db, env.settings, client, scaler(env), spawner(env, asked), now=now)
    assert asked == [] and report.keep_alive["new"]["mode"] == "fixed"
    assert report.keep_alive["tick"]["warm"] is True


def test_an_autoscaled_adaptive_function_is_prewarmed_from_zero_and_let_go_after(
    env: Env, start_agents: StartAgents, client: redis.Redis
) -> None:
    start_agents(1, env=env)
    deploy_fn(env, "tick", keep_alive="adaptive", autoscale=True, scale_to_zero_after=3600)
    with env.db.transaction() as s:
        s.execute(update(Function).values(target=0))  # the autoscaler had it at zero
    now = time.time()
    history(client, env, "tick", every=600, calls=8, last_end=now - 100)
    quiet = run_pass(env.db, env.settings, client, scaler(env), now=now)
    assert quiet.functions["tick"].decision.desired == 0
    due = run_pass(env.db, env.settings, client, scaler(env), now=now - 100 + PREWARM_S + 1)
    assert due.functions["tick"].action == "scaled" and idle(env, "tick") == 1
    late = run_pass(env.db, env.settings, client, scaler(env), now=now - 100 + KEEP_S + 1)
    assert late.functions["tick"].decision.desired == 0 and idle(env, "tick") == 0


def test_deploying_adaptive_keep_alive_and_its_bad_input(corral_env: Env) -> None:
    deploy_fn(corral_env, "a", keep_alive="adaptive")
    assert api.function("a")["keep_alive"] == "adaptive"
    deploy_fn(corral_env, "a", min=1)  # an update that does not say keeps it
    assert api.function("a")["keep_alive"] == "adaptive"
    deploy_fn(corral_env, "a", keep_alive="fixed")
    assert api.function("a")["keep_alive"] == "fixed"
    with pytest.raises(Exception, match="keep_alive"):
        deploy_fn(corral_env, "b", keep_alive="sometimes")
    with pytest.raises(Exception, match="needs --scale-to-zero-after"):
        deploy_fn(corral_env, "c", keep_alive="adaptive", autoscale=True)
    with corral_env.db.read() as s:
        assert [f.name for f in s.scalars(select(Function))] == ["a"]


def test_functions_show_gives_the_windows(env: Env, client: redis.Redis) -> None:
    deploy_fn(env, "tick", keep_alive="adaptive")
    deploy_fn(env, "plain")
    assert "keep_alive_windows" not in api.function("plain")
    fresh = api.function("tick")["keep_alive_windows"]
    assert fresh["mode"] == "fixed" and fresh["reason"] == "no idle times recorded"
    history(client, env, "tick", every=600, calls=8, last_end=time.time() - 100)
    shown = api.function("tick")["keep_alive_windows"]
    assert shown["mode"] == "histogram" and shown["idle_times"] == 7
    assert shown["prewarm_s"] == pytest.approx(PREWARM_S)
    assert shown["keep_s"] == pytest.approx(KEEP_S)
    assert shown["warm_now"] is False and 99 < shown["last_activity_s_ago"] < 200
    assert idletimes.load(client, Shape.from_settings(env.settings), ["tick"])["tick"].last


def test_the_windows_are_metrics(env: Env, client: redis.Redis) -> None:
    deploy_fn(env, "tick", keep_alive="adaptive")
    deploy_fn(env, "new", keep_alive="adaptive")
    now = time.time()
    history(client, env, "tick", every=600, calls=8, last_end=now - PREWARM_S - 10)
    run_pass(env.db, env.settings, client, scaler(env), now=now)
    exporter = serve(env.db, client, "127.0.0.1:0")
    try:
        got = scrape(exporter.url)
    finally:
        exporter.stop()
    assert value(got, "corral_keepalive_mode", function="tick", mode="histogram") == 1
    assert value(got, "corral_keepalive_mode", function="tick", mode="fixed") == 0
    assert value(got, "corral_keepalive_mode", function="new", mode="fixed") == 1
    assert value(got, "corral_keepalive_prewarm_seconds", function="tick") == pytest.approx(
        PREWARM_S
    )
    assert value(got, "corral_keepalive_window_seconds", function="tick") == pytest.approx(KEEP_S)
    assert value(got, "corral_keepalive_idle_times", function="tick") == 7
    assert value(got, "corral_keepalive_warm", function="tick") == 1
    assert ("corral_keepalive_window_seconds", frozenset({("function", "new")})) not in got
