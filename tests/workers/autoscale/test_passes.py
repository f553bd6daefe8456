"""One autoscaler pass against a real store (SQLite and PostgreSQL), real Redis and agents.

Scale operations run eagerly here (``corral_env`` / ``pg_env``), so each pass's
``scale`` is carried out before the next pass looks.
"""

from __future__ import annotations

import time

import pytest
import redis
from sqlalchemy import select

from corral import api
from tests.fixtures import Env, StartAgents
from workers.autoscale import demand
from workers.autoscale.passes import LOCK_KEY, ScaleFn, run_pass, state_key
from workers.base.errors import InputError
from workers.functions import deploy, function_view, spec_from
from workers.store.models import Function, Operation, Replica, ReplicaState

FAST = {"autoscale_stable_window_s": "10", "autoscale_panic_window_s": "2"}


@pytest.fixture
def env(corral_env: Env, redis_url: str) -> Env:
    """Eager scale operations on each store, with the session's Redis for demand and state."""
    corral_env.set(broker_url=redis_url, **FAST)
    return corral_env


def scaler(env: Env) -> ScaleFn:
    return lambda name, target: api.scale(name, target, settings=env.settings)


def fn_deploy(env: Env, name: str, **kw: object) -> None:
    with env.db.transaction() as s:
        deploy(s, spec_from(name=name, image="examples.hello", kernel="/k", **kw), env.settings)


def live(env: Env, name: str) -> int:
    with env.db.read() as s:
        fid = s.scalar(select(Function.id).where(Function.name == name))
        return len(
            s.scalars(
                select(Replica).where(
                    Replica.function_id == fid, Replica.status == ReplicaState.IDLE
                )
            ).all()
        )


def report(client: redis.Redis, name: str, concurrency: float, at: float) -> None:
    demand.report(
        client,
        "gw-test",
        {
            name: demand.Sample(
                inflight=int(concurrency),
                queued=0,
                concurrency=concurrency,
                requests=int(concurrency > 0),
                at=at,
            )
        },
    )


def test_a_pass_scales_only_autoscaled_functions_and_keeps_its_window_in_redis(
    env: Env, start_agents: StartAgents, redis_url: str
) -> None:
    start_agents(1, env=env)
    fn_deploy(env, "auto", autoscale=True, min=0, max=8)
    fn_deploy(env, "plain", min=0, max=8)
    client = redis.Redis.from_url(redis_url)
    t = time.time()
    report(client, "auto", 2.8, t)  # asks for 4
    report(client, "plain", 2.8, t)  # not autoscaled: ignored
    result = run_pass(env.db, env.settings, client, scaler(env), now=t)
    assert set(result.functions) == {"auto"}
    out = result.functions["auto"]
    assert out.action == "scaled" and out.decision.desired == 4 and out.op_id
    assert api.operation(out.op_id)["status"] == "succeeded"
    assert live(env, "auto") == 4 and live(env, "plain") == 0
    with env.db.read() as s:
        assert s.scalar(select(Function.target).where(Function.name == "plain")) is None
        fid = s.scalars(select(Function.id).where(Function.name == "auto")).one()
    kept = client.get(state_key(fid))
    assert isinstance(kept, bytes) and b"samples" in kept

    # the same demand again: the target is already 4, no new operation
    again = run_pass(env.db, env.settings, client, scaler(env), now=t + 2)
    assert again.functions["auto"].action == "kept"
    with env.db.read() as s:
        assert len(s.scalars(select(Operation).where(Operation.kind == "scale")).all()) == 1

    # demand gone: the window (10 s) holds 4 until the peak has left it, then down at the
    # scale-down rate (halving: 2, then 1; no zero without --scale-to-zero-after)
    report(client, "auto", 0.0, t + 4)
    held = run_pass(env.db, env.settings, client, scaler(env), now=t + 4)
    assert held.functions["auto"].decision.desired == 4
    for at, want in ((t + 12, 2), (t + 14, 1)):  # the pass at t + 2 still saw 2.8
        report(client, "auto", 0.0, at)
        down = run_pass(env.db, env.settings, client, scaler(env), now=at)
        assert down.functions["auto"].action == "scaled"
        assert down.functions["auto"].decision.desired == want
        assert live(env, "auto") == want


def test_no_second_scale_while_one_is_open(
    env: Env, start_agents: StartAgents, redis_url: str
) -> None:
    start_agents(1, env=env)
    fn_deploy(env, "auto", autoscale=True, max=8)
    client = redis.Redis.from_url(redis_url)
    asked: list[tuple[str, int]] = []

    def record(name: str, target: int) -> str:  # a scale whose operation stays open
        asked.append((name, target))
        with env.db.transaction() as s:
            fid = s.scalar(select(Function.id).where(Function.name == name))
            op = Operation(kind="scale", function_id=fid, params={"target": target})
            s.add(op)
            s.flush()
            return op.id

    t = time.time()
    report(client, "auto", 1.4, t)
    first = run_pass(env.db, env.settings, client, record, now=t)
    assert first.functions["auto"].action == "scaled" and asked == [("auto", 2)]
    report(client, "auto", 4.2, t + 2)
    second = run_pass(env.db, env.settings, client, record, now=t + 2)
    assert second.functions["auto"].action == "waiting"
    assert asked == [("auto", 2)]


def test_a_pass_is_skipped_while_another_holds_the_lock(env: Env, redis_url: str) -> None:
    fn_deploy(env, "auto", autoscale=True)
    client = redis.Redis.from_url(redis_url)
    client.set(LOCK_KEY, "someone else", px=5000)
    assert run_pass(env.db, env.settings, client, scaler(env)).skipped
    assert client.get(LOCK_KEY) == b"someone else"  # not released by the skipped pass
    client.delete(LOCK_KEY)
    assert not run_pass(env.db, env.settings, client, scaler(env)).skipped
    assert client.get(LOCK_KEY) is None


def one_request(
    env: Env, start_agents: StartAgents, redis_url: str, after: float
) -> tuple[redis.Redis, float]:
    """A function ``zero`` that may go to zero ``after`` seconds; one pass saw a request."""
    start_agents(1, env=env)
    fn_deploy(env, "zero", autoscale=True, min=0, max=4, scale_to_zero_after=after)
    client = redis.Redis.from_url(redis_url)
    t = time.time()
    report(client, "zero", 0.5, t)
    run_pass(env.db, env.settings, client, scaler(env), now=t)
    assert live(env, "zero") == 1
    return client, t


def test_scale_to_zero_after_no_requests(
    env: Env, start_agents: StartAgents, redis_url: str
) -> None:
    client, t = one_request(env, start_agents, redis_url, 15)
    for dt in (2, 6, 12, 14):  # window over after 10 s, but the last request was < 15 s ago
        report(client, "zero", 0.0, t + dt)  # the gateway sees no load (and no requests)
        r = run_pass(env.db, env.settings, client, scaler(env), now=t + dt)
        assert r.functions["zero"].decision.desired == 1
    report(client, "zero", 0.0, t + 16)
    r = run_pass(env.db, env.settings, client, scaler(env), now=t + 16)
    assert r.functions["zero"].action == "scaled" and r.functions["zero"].decision.desired == 0
    assert live(env, "zero") == 0


def test_deploy_options_and_their_bad_input(corral_env: Env) -> None:
    fn_deploy(corral_env, "a", autoscale=True, scale_to_zero_after=30.0)
    with corral_env.db.read() as s:
        view = function_view(s.scalars(select(Function)).one())
    assert view["autoscale"] is True and view["scale_to_zero_after"] == 30.0
    fn_deploy(corral_env, "a", scale_to_zero_after=0.0)  # 0 turns it off, autoscale stays
    with corral_env.db.read() as s:
        fn = s.scalars(select(Function)).one()
        assert fn.autoscale and fn.scale_to_zero_after_s is None
    with pytest.raises(InputError, match="needs --autoscale"):
        fn_deploy(corral_env, "b", scale_to_zero_after=10.0)
    with pytest.raises(InputError, match="scale_to_zero_after"):
        fn_deploy(corral_env, "c", autoscale=True, scale_to_zero_after=-1.0)
    with corral_env.db.read() as s:
        assert [f.name for f in s.scalars(select(Function))] == ["a"]


@pytest.mark.parametrize("lose", ["delete", "malformed"])
def test_a_lost_window_keeps_the_ready_replicas(
    env: Env, start_agents: StartAgents, redis_url: str, lose: str
) -> None:
    start_agents(1, env=env)
    fn_deploy(env, "auto", autoscale=True, min=0, max=8)
    client = redis.Redis.from_url(redis_url)
    t = time.time()
    report(client, "auto", 2.8, t)
    assert (
        run_pass(env.db, env.settings, client, scaler(env), now=t)
        .functions["auto"]
        .decision.desired
        == 4
    )
    assert live(env, "auto") == 4
    with env.db.read() as s:
        fid = s.scalars(select(Function.id).where(Function.name == "auto")).one()
    if lose == "delete":  # Redis lost it, or it expired while beat was down
        client.delete(state_key(fid))
    else:
        client.set(state_key(fid), b"\x00garbage")
    report(client, "auto", 0.5, t + 2)  # momentarily little demand: one sample asks for 1
    after = run_pass(env.db, env.settings, client, scaler(env), now=t + 2).functions["auto"]
    assert after.decision.fresh and after.decision.panicking
    assert after.decision.desired == 4 and after.action == "kept"
    assert live(env, "auto") == 4
    kept = client.get(state_key(fid))
    assert isinstance(kept, bytes) and b'"panic_pods": 4' in kept  # a new window, in panic


def test_a_function_at_zero_is_not_woken_when_its_state_is_lost(
    env: Env, start_agents: StartAgents, redis_url: str
) -> None:
    client, t = one_request(env, start_agents, redis_url, 5)
    report(client, "zero", 0.0, t + 12)
    gone = run_pass(env.db, env.settings, client, scaler(env), now=t + 12)
    assert gone.functions["zero"].decision.desired == 0 and live(env, "zero") == 0
    client.flushall()  # the window, the last-request key, the demand: all lost
    for dt in (14, 16, 30):
        r = run_pass(env.db, env.settings, client, scaler(env), now=t + dt)
        assert r.functions["zero"].decision.desired == 0
        assert r.functions["zero"].action == "kept"
    assert live(env, "zero") == 0
    with env.db.read() as s:
        assert len(s.scalars(select(Operation).where(Operation.kind == "scale")).all()) == 2
    report(client, "zero", 0.5, t + 32)  # a request: woken at once
    r = run_pass(env.db, env.settings, client, scaler(env), now=t + 32)
    assert r.functions["zero"].decision.desired == 1 and live(env, "zero") == 1
