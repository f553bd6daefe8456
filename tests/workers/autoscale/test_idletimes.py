"""Idle times: the gateway's recorder, the shared histograms in a real Redis, the claim API.

The recorder is plain Python on a clock the test moves; the histograms are written by
the Lua script on the session's Redis and read back, and must agree with
:class:`workers.autoscale.keepalive.IdleHistogram` - the bench replays traces through
that class, the fleet through the script.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import pytest
import redis
from sqlalchemy import select

from agents import RunningAgent
from corral import api
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls
from tests.dataplanes import PLANE_PER_STORE, need
from tests.fixtures import NO_BROKER, Env, StartAgents
from tests.workers.replicas.helpers import deploy_fn
from workers.autoscale import idletimes
from workers.autoscale.idletimes import Activity, Recorder, Shape, key, load, record
from workers.autoscale.keepalive import RECENT_OOB, IdleHistogram
from workers.gateway import serve_gateway
from workers.gateway.haproxy.readings import POLL_S
from workers.store.models import Claim

SHAPE = Shape(bin_s=60.0, range_s=600.0, history=10_000)  # 10 bins of a minute


class Clock:
    def __init__(self, at: float = 1_700_000_000.0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


# -- the recorder (one gateway) ----------------------------------------------------------------


def test_the_recorder_counts_close_starts_locally_and_sends_the_rest() -> None:
    clock = Clock()
    rec = Recorder(60.0, clock)
    first = clock.at
    with rec.invocation("f"):  # the first ever: no previous activity here
        clock.at += 0.5
    clock.at += 10
    with rec.invocation("f"):  # 10 s after the last end: bin 0, counted here
        clock.at += 0.5
    clock.at += 300
    late = clock.at
    rec.started("f")  # 5 min of silence here: measured against every gateway's activity
    rec.started("f")  # while one runs: an idle time of 0
    clock.at += 1
    rec.ended("f")
    rec.ended("f")
    seen = rec.take()
    assert seen == {"f": Activity(short=2, arrivals=[first, late], last=clock.at)}
    assert rec.take() == {}  # nothing new


def test_while_an_invocation_runs_every_report_says_the_function_is_active() -> None:
    clock = Clock()
    rec = Recorder(60.0, clock)
    rec.started("slow")
    assert rec.take()["slow"].last == clock.at
    clock.at += 5
    assert rec.take() == {"slow": Activity(0, [], clock.at)}  # still running: active now
    clock.at += 5
    rec.ended("slow")
    end = clock.at
    clock.at += 5
    assert rec.take() == {"slow": Activity(0, [], end)}  # its end, once
    assert rec.take() == {}


def test_an_unmatched_end_is_harmless_and_pending_starts_are_bounded() -> None:
    clock = Clock()
    rec = Recorder(1.0, clock)
    rec.ended("ghost")  # never started here (e.g. a request admitted before a restart)
    assert rec.take() == {}
    for _ in range(idletimes.MAX_PENDING + 10):
        clock.at += 2
        with rec.invocation("g"):
            pass
    assert len(rec.take()["g"].arrivals) == idletimes.MAX_PENDING


# -- the shared histogram in Redis -------------------------------------------------------------


def test_recorded_idle_times_match_the_bench_histogram(client: redis.Redis) -> None:
    rng = random.Random(7)
    at = 1_700_000_000.0
    ends: list[float] = []
    idles: list[float] = []
    for _ in range(300):  # a mixture: most within the range, some beyond it
        idle = rng.choice([rng.uniform(0, 30), rng.uniform(60, 590), rng.uniform(600, 9000)])
        at += idle
        if ends:
            idles.append(idle)
        record(client, SHAPE, {"f": Activity(arrivals=[at])})
        at += rng.uniform(0.01, 2.0)
        record(client, SHAPE, {"f": Activity(last=at)})
        ends.append(at)
    got = load(client, SHAPE, ["f"])["f"]
    want = IdleHistogram.empty(SHAPE.bin_s, SHAPE.range_s)
    want.add_all(idles, SHAPE.history)
    assert got.histogram is not None
    assert got.histogram.counts == want.counts and got.histogram.oob == want.oob
    assert got.histogram.recent_oob == pytest.approx(want.recent_oob)
    assert len(want.recent_oob) == RECENT_OOB and got.last == pytest.approx(ends[-1])


def test_two_gateways_measure_against_what_both_saw(client: redis.Redis) -> None:
    t = 1_700_000_000.0
    record(client, SHAPE, {"f": Activity(arrivals=[t], last=t + 1)})  # gateway A, long ago
    # gateway B served the function 100 s later; A had not seen it since t + 1
    record(client, SHAPE, {"f": Activity(arrivals=[t + 100], last=t + 101)})
    record(client, SHAPE, {"f": Activity(arrivals=[t + 130], last=t + 131)})  # A again
    # B reports late, a start that came while A's ran: an idle time of 0, never negative
    record(client, SHAPE, {"f": Activity(arrivals=[t + 130.5], last=t + 132)})
    hist = load(client, SHAPE, ["f"])["f"].histogram
    assert hist is not None
    # 99 s (bin 1) and 29 s (bin 0, not the 129 s A alone would have measured), and 0
    assert hist.counts[:3] == [2, 1, 0] and hist.total == 3


def test_busy_reports_keep_the_function_active(client: redis.Redis) -> None:
    t = 1_700_000_000.0
    record(client, SHAPE, {"f": Activity(arrivals=[t], last=t + 200)})  # running at t + 200
    record(client, SHAPE, {"f": Activity(arrivals=[t + 210])})  # another gateway: 10 s
    hist = load(client, SHAPE, ["f"])["f"].histogram
    assert hist is not None and hist.counts[0] == 1 and hist.total == 1


def test_short_starts_and_the_history_bound(client: redis.Redis) -> None:
    shape = Shape(bin_s=60.0, range_s=600.0, history=100)
    t = 1_700_000_000.0
    record(client, shape, {"f": Activity(arrivals=[t], last=t)})
    record(client, shape, {"f": Activity(arrivals=[t + 200], last=t + 200)})  # bin 3
    record(client, shape, {"f": Activity(short=99, last=t + 210)})  # total 100: not yet
    hist = load(client, shape, ["f"])["f"].histogram
    assert hist is not None and hist.counts[0] == 99 and hist.counts[3] == 1
    record(client, shape, {"f": Activity(short=1, last=t + 220)})  # 101: halved
    hist = load(client, shape, ["f"])["f"].histogram
    assert hist is not None and hist.counts[0] == 50 and hist.counts[3] == 0
    assert hist.total == 50 and int(client.hget(key("f"), "total") or 0) == 50
    assert client.hget(key("f"), "c3") is None  # a count halved to 0 is gone: bounded
    bench = IdleHistogram.empty(60.0, 600.0)
    bench.add_all([200.0] + [0.0] * 100, 100)
    assert bench.counts == hist.counts


def test_another_shape_starts_the_history_again_and_keeps_the_last_activity(
    client: redis.Redis,
) -> None:
    t = 1_700_000_000.0
    record(client, SHAPE, {"f": Activity(arrivals=[t], last=t + 1)})
    record(client, SHAPE, {"f": Activity(arrivals=[t + 100], last=t + 101)})
    other = Shape(bin_s=30.0, range_s=600.0)
    assert load(client, other, ["f"])["f"] == idletimes.IdleRecord(None, t + 101)
    record(client, other, {"f": Activity(arrivals=[t + 150], last=t + 151)})
    hist = load(client, other, ["f"])["f"].histogram
    assert hist is not None and hist.total == 1 and hist.counts[1] == 1  # 49 s, bins of 30 s
    assert load(client, SHAPE, ["f"])["f"].histogram is None  # the old shape is gone


@pytest.mark.parametrize(
    "fields",
    [
        {"bin": "60.0", "n": "10", "c0": "x"},
        {"bin": "60.0", "n": "10", "c99": "1"},
        {"bin": "60.0", "n": "10", "c0": "-1"},
        {"bin": "60.0", "n": "10", "oob": "1", "recent": "nan"},
        {"bin": "sixty", "n": "10"},
        {"n": "10", "c0": "3"},
    ],
)
def test_a_malformed_histogram_is_no_history(client: redis.Redis, fields: dict[str, str]) -> None:
    row: dict[Any, str] = {**fields, "last": "1700000000.5"}  # redis: a field is any encodable
    client.hset(key("f"), mapping=row)
    assert load(client, SHAPE, ["f"])["f"] == idletimes.IdleRecord(None, 1_700_000_000.5)


def test_a_missing_histogram_is_no_history_and_keys_expire(client: redis.Redis) -> None:
    assert load(client, SHAPE, ["nobody"])["nobody"] == idletimes.IdleRecord(None, None)
    record(client, SHAPE, {"f": Activity(last=1.0)})
    assert 29 * 86_400 < client.ttl(key("f")) <= 30 * 86_400


def test_recording_without_redis_loses_only_the_statistic(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = redis.Redis.from_url(NO_BROKER, socket_connect_timeout=0.5)
    with pytest.raises(redis.ConnectionError):
        record(dead, SHAPE, {"f": Activity(last=1.0)})  # what record_quietly keeps quiet
    with caplog.at_level(logging.DEBUG, logger=idletimes.__name__):
        idletimes.record_quietly(dead, SHAPE, {"f": Activity(last=1.0)})  # no exception
        [said] = caplog.records  # the loss is said, once, at debug
        assert said.levelno == logging.DEBUG
        assert said.getMessage().startswith("could not record idle times: ")
        idletimes.record_quietly(None, SHAPE, {"f": Activity(last=1.0)})  # no Redis: nothing
    assert len(caplog.records) == 1


def test_a_release_without_redis_still_releases(corral_env: Env, start_agents: StartAgents) -> None:
    assert corral_env.settings.broker_url == NO_BROKER  # nothing listens: the statistic is lost
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "hello", min=1)
    api.spawn("hello")
    claim = api.claim("hello")
    assert api.release(claim["claim_id"])["released"]
    with corral_env.db.read() as s:
        assert s.scalars(select(Claim)).all() == []  # the environment is free again
    assert api.claim("hello")["replica_id"] == claim["replica_id"]


# -- the claim API -----------------------------------------------------------------------------


def test_claims_and_releases_are_invocations(
    corral_env: Env, start_agents: StartAgents, redis_url: str, client: redis.Redis
) -> None:
    corral_env.set(broker_url=redis_url, keepalive_bin_s="0.05", keepalive_range_s="3")
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "hello", min=1)
    api.spawn("hello")
    first = api.claim("hello")
    api.release(first["claim_id"])
    shape = Shape.from_settings(corral_env.settings)
    assert load(client, shape, ["hello"])["hello"].histogram is not None
    second = api.claim("hello")  # right after the release: bin 0 (under 50 ms)
    assert not api.release("0" * 32)["released"]  # a release of nothing records nothing
    api.release(second["claim_id"])
    got = load(client, shape, ["hello"])["hello"]
    assert got.histogram is not None and got.histogram.total == 1
    assert got.histogram.counts[0] + got.histogram.counts[1] == 1
    api.remove_function("hello", force=True)
    assert client.exists(key("hello")) == 0  # a removed function's history goes with it


# -- the gateway -------------------------------------------------------------------------------


@PLANE_PER_STORE
def test_requests_through_the_gateway_are_recorded(
    thread_worker: Env, agent: RunningAgent, client: redis.Redis, dataplane: str
) -> None:
    # HAProxy's calls are seen in its counters, read every POLL_S: their times are as
    # exact as that, and as the reading thread is on time (a read 77 ms late was seen at
    # load 27; a pause of 1.2 s counted at 1.6 s or more beside a CI run: twelve reads'
    # slack). Through the Python dataplane an idle time runs from one call's end to the
    # next call's admission: the gateway's own turn before admitting it is counted too
    # (a pause of 1.8 s was counted past 2.4 s beside another CI run). So each pause sits
    # 0.8 s above its bin's lower edge and 1.2 s below its upper one (keep-alive's bins
    # are a minute by default).
    slack = 12 * POLL_S if need(dataplane) == "haproxy" else 0.0
    late = 1.2  # the gateway's turn (and its readings') that an idle time may gain
    shape = Shape(bin_s=2.0, range_s=6.0)
    deploy_fn(thread_worker, "echo", image="examples.echo", max=2)
    gw = serve_gateway(
        thread_worker.settings.model_copy(
            update={
                "gateway_cold_start_timeout_s": 30.0,
                "gateway_report_interval_s": 0.1,
                "keepalive_bin_s": shape.bin_s,
                "keepalive_range_s": shape.range_s,
                "gateway_dataplane": dataplane,
            }
        ),
        "127.0.0.1:0",
        queue=HereFirst(QUEUE),
    )
    try:
        with httpcalls.client(timeout=60) as http:
            # the idle times between requests are what is measured (the gateway's monotonic
            # clock): these pauses are the test's input, in bin 1, then out of bounds
            for pause in (2.8, 6.8, 0.0):
                assert http.get(f"{gw.url}/function/echo").status_code == 200
                time.sleep(pause)
            assert http.get(f"{gw.url}/function/echo").status_code == 200
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            hist = load(client, shape, ["echo"])["echo"].histogram
            if hist is not None and hist.total == 3:
                break
            time.sleep(0.05)
    finally:
        gw.stop()
    assert hist is not None
    assert (hist.counts[0], hist.counts[1], hist.oob) == (1, 1, 1), hist
    assert 6.8 - slack <= hist.recent_oob[0] < 6.8 + late + slack
