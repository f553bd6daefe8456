"""The control-plane exporter, scraped over HTTP against a real store and Redis with known rows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, update

from corral import api
from testkit import httpcalls
from testkit.services import free_port
from tests.fixtures import Env, StartAgents
from workers.autoscale.decision import Window
from workers.autoscale.passes import run_pass, state_key
from workers.base import clock
from workers.base.errors import InputError
from workers.base.redis_client import redis_client
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.invocations import attempts, records
from workers.invocations import stats as call_stats
from workers.invocations.records import StoredRequest
from workers.observability import clock_offsets, logs
from workers.observability.exporter import RunningExporter, count_reaped, serve
from workers.store.models import Call, Function, Node, Operation, Replica, ReplicaState

ROOT = Path(__file__).resolve().parents[3]
T0 = datetime(2026, 11, 30, 12, 0, 0)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str, **kw: object) -> Samples:
    reply = httpcalls.get(url, timeout=10, **kw)
    assert reply.status_code == 200, reply.text
    out: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture
def env(corral_env: Env, redis_url: str) -> Env:
    """Each store, with the session's Redis."""
    corral_env.set(broker_url=redis_url)
    return corral_env


@pytest.fixture
def exporter(env: Env, redis_url: str) -> Iterator[RunningExporter]:
    running = serve(env.db, redis.Redis.from_url(redis_url), "127.0.0.1:0")
    yield running
    running.stop()


def known_rows(env: Env) -> None:
    with env.db.transaction() as s:
        alpha, _ = deploy(s, spec_from(name="alpha", image="i", kernel="/k"), env.settings)
        deploy(s, spec_from(name="beta", image="i", kernel="/k"), env.settings)
        a, _ = upsert_node(s, "127.0.0.1:1", name="node-a", capacity=10)
        upsert_node(s, "127.0.0.1:2", name="node-b", capacity=5)
        s.flush()
        s.execute(update(Node).where(Node.name == "node-a").values(live=3))
        s.execute(update(Node).where(Node.name == "node-b").values(healthy=False))
        ops = {
            "spawned": Operation(kind="spawn", status="succeeded", created_at=T0),
            "scaling": Operation(kind="scale", status="running", created_at=T0),
            "r1": Operation(kind="reap", status="failed", created_at=T0),
            "r2": Operation(kind="reap", status="failed", created_at=T0),
            "d": Operation(kind="delete", status="pending", created_at=T0),
        }
        s.add_all(ops.values())
        s.flush()
        sp, sc = ops["spawned"].id, ops["scaling"].id

        def replica(request: str, status: ReplicaState, ready_after: float | None) -> Replica:
            return Replica(
                request_id=request,
                function_id=alpha.id,
                node_id=a.id,
                status=int(status),
                build_version=alpha.build_version,
                ready_at=None if ready_after is None else T0 + timedelta(seconds=ready_after),
            )

        s.add_all(
            [
                replica(f"{sp}.0.0", ReplicaState.IDLE, 0.3),
                replica(f"{sp}.1.0", ReplicaState.ALLOCATED, 4.0),
                replica(f"{sp}.2.0", ReplicaState.DELETED, 20.0),  # gone now, but it did spawn
                replica(f"{sc}.0", ReplicaState.CREATING, None),  # not ready yet
                replica("by-hand-without-operation", ReplicaState.IDLE, 1.0),  # no enqueue time
            ]
        )


def test_a_scrape_reports_the_store_and_redis_as_they_are(
    env: Env, exporter: RunningExporter, redis_url: str
) -> None:
    known_rows(env)
    client = redis.Redis.from_url(redis_url)
    count_reaped(client, {"idle": 3, "stuck": 1, "stale": 0})
    count_reaped(client, {"idle": 3, "stuck": 1, "stale": 0})  # a second pass adds up
    client.lpush("corral.spawn", "m1", "m2", "m3")
    client.lpush("corral.spawn\x06\x163", "m4")  # kombu's priority-3 list of the queue
    client.lpush("corral.delete", "m5")
    client.hset("unacked", mapping={"tag1": "x", "tag2": "y"})

    got = scrape(exporter.url)

    assert value(got, "corral_replicas", function="alpha", state="idle") == 2
    assert value(got, "corral_replicas", function="alpha", state="allocated") == 1
    assert value(got, "corral_replicas", function="alpha", state="creating") == 1
    assert value(got, "corral_replicas", function="beta", state="idle") == 0
    assert (
        "corral_replicas",
        frozenset({("function", "alpha"), ("state", "deleted")}),
    ) not in got  # only live states

    # enqueue -> Idle of the three replicas spawned by a known operation: 0.3, 4 and 20 s
    assert value(got, "corral_spawn_seconds_count") == 3
    assert value(got, "corral_spawn_seconds_sum") == pytest.approx(24.3, abs=0.01)
    for le, n in (
        ("0.25", 0),
        ("0.5", 1),
        ("2.5", 1),
        ("5.0", 2),
        ("10.0", 2),
        ("30.0", 3),
        ("+Inf", 3),
    ):
        assert value(got, "corral_spawn_seconds_bucket", le=le) == n, le

    assert value(got, "corral_node_healthy", node="node-a") == 1
    assert value(got, "corral_node_healthy", node="node-b") == 0
    assert value(got, "corral_node_replicas", node="node-a") == 3
    assert value(got, "corral_node_capacity", node="node-b") == 5

    assert value(got, "corral_operations_total", kind="spawn", status="succeeded") == 1
    assert value(got, "corral_operations_total", kind="reap", status="failed") == 2
    assert value(got, "corral_operations_open", kind="scale", status="running") == 1
    assert value(got, "corral_operations_open", kind="delete", status="pending") == 1
    assert (
        "corral_operations_total",
        frozenset({("kind", "scale"), ("status", "running")}),
    ) not in got

    assert value(got, "corral_reaped_total", reason="idle") == 6
    assert value(got, "corral_reaped_total", reason="stuck") == 2
    assert value(got, "corral_reaped_total", reason="stale") == 0

    assert value(got, "corral_queue_length", queue="corral.spawn") == 4
    assert value(got, "corral_queue_length", queue="corral.delete") == 1
    assert value(got, "corral_queue_length", queue="corral.scale") == 0
    assert value(got, "corral_queue_unacked") == 2
    assert value(got, "corral_exporter_source_up", source="store") == 1
    assert value(got, "corral_exporter_source_up", source="redis") == 1

    # computed at scrape time: a change shows in the next scrape
    client.delete("corral.spawn")
    with env.db.transaction() as s:
        s.execute(update(Node).where(Node.name == "node-b").values(healthy=True))
    again = scrape(exporter.url)
    assert value(again, "corral_queue_length", queue="corral.spawn") == 1
    assert value(again, "corral_node_healthy", node="node-b") == 1


def test_the_reaper_and_the_autoscaler_feed_their_metrics(
    env: Env, exporter: RunningExporter, start_agents: StartAgents, redis_url: str
) -> None:
    start_agents(1, env=env)
    with env.db.transaction() as s:
        deploy(s, spec_from(name="hello", image="i", kernel="/k", autoscale=True), env.settings)
        deploy(s, spec_from(name="plain", image="i", kernel="/k"), env.settings)
    assert api.wait(api.spawn("hello", 3), timeout=30)["status"] == "succeeded"
    assert api.wait(api.spawn("plain", 2), timeout=30)["status"] == "succeeded"
    client = redis.Redis.from_url(redis_url)
    with env.db.read() as s:
        fid = s.scalars(select(Function.id).where(Function.name == "hello")).one()
    # the autoscaler has been running (a fresh window would start in panic, holding the 3)
    client.set(state_key(fid), Window([(time.time() - 10, 0.0)]).to_json())
    run_pass(
        env.db,
        env.settings,
        client,
        lambda name, target: api.scale(name, target, settings=env.settings),
    )
    assert api.wait(api.reap(idle_timeout=0), timeout=30)["status"] == "succeeded"
    got = scrape(exporter.url)
    # no demand: the autoscaler wants 1 of hello (no scale to zero) and the reaper leaves
    # it that one; plain is not autoscaled, so the reaper deleted both its idle replicas
    assert value(got, "corral_autoscale_desired_replicas", function="hello") == 1
    assert value(got, "corral_autoscale_panic", function="hello") == 0
    assert value(got, "corral_reaped_total", reason="idle") == 2
    assert value(got, "corral_replicas", function="hello", state="idle") == 1
    assert value(got, "corral_spawn_seconds_count") == 5
    assert value(got, "corral_operations_total", kind="scale", status="succeeded") == 1


def test_a_source_that_does_not_answer_is_reported_not_fatal(env: Env) -> None:
    # the client `corral metrics` passes (one attempt), for a port nobody listens on
    dead = redis_client(f"redis://127.0.0.1:{free_port()}/0")
    running = serve(env.db, dead, "127.0.0.1:0")
    try:
        got = scrape(running.url)
    finally:
        running.stop()
    assert value(got, "corral_exporter_source_up", source="redis") == 0
    assert value(got, "corral_exporter_source_up", source="store") == 1
    assert ("corral_spawn_seconds_count", frozenset()) in got


def test_a_token_guards_every_request(corral_env: Env) -> None:
    running = serve(corral_env.db, None, "127.0.0.1:0", token="s3cret-token")
    try:
        assert httpcalls.get(running.url, timeout=30).status_code == 401
        wrong = httpcalls.get(running.url, headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401 and "s3cret" not in wrong.text
        got = scrape(running.url, headers={"Authorization": "Bearer s3cret-token"})
        assert value(got, "corral_exporter_source_up", source="store") == 1
        other = running.url.replace("/metrics", "/other")
        bearer = {"Authorization": "Bearer s3cret-token"}
        assert httpcalls.get(other, headers=bearer, timeout=30).status_code == 404
    finally:
        running.stop()


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "192.0.2.1:9808"])
def test_off_loopback_is_refused_without_a_token(corral_env: Env, listen: str) -> None:
    with pytest.raises(InputError, match="without a token"):
        serve(corral_env.db, None, listen)


@pytest.mark.parametrize("listen", ["9808", "host:", ":80", "h:99999", "h:x"])
def test_a_malformed_listen_address_is_refused(corral_env: Env, listen: str) -> None:
    with pytest.raises(InputError, match="HOST:PORT"):
        serve(corral_env.db, None, listen)


@pytest.mark.timeout(60)
def test_corral_metrics_command_serves_until_terminated(env: Env, redis_url: str) -> None:
    known_rows(env)
    environ = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run(
        [sys.executable, "-m", "corral.cli", "metrics", "--listen", "0.0.0.0:0"],
        env=environ,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 1 and "CORRAL_METRICS_TOKEN" in refused.stderr
    proc = subprocess.Popen(
        # port 0: it says the port it bound (a port found free here may be taken by
        # another process before it binds it: it once ended at once, saying nothing)
        [sys.executable, "-m", "corral.cli", "metrics", "--listen", "127.0.0.1:0"],
        env=environ,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        said = re.fullmatch(
            r"metrics listening on (http://127\.0\.0\.1:\d+/metrics)",
            proc.stdout.readline().strip(),
        )
        if said is None:  # it ended (its stdout closed): its stderr says why
            proc.wait(20)
            pytest.fail(f"corral metrics did not start: {proc.stderr.read()[-2000:]}")
        got = scrape(said[1])
        assert value(got, "corral_replicas", function="alpha", state="idle") == 2
        assert value(got, "corral_exporter_source_up", source="redis") == 1
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


def test_hosts_clock_offsets_and_dropped_log_records_are_exported(
    env: Env, exporter: RunningExporter, redis_url: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    clock.skew_host(8)  # this host's clock runs 8 s ahead of the store's
    with env.db.read():  # a transaction measures the store's clock
        pass
    assert clock_offsets.publish(client, host="fast-host")
    assert not clock_offsets.publish(client, host="fast-host")  # once per measurement
    client.hset(clock_offsets.KEY, "gone-host", '{"offset_s": 3, "at": 0}')  # long silent
    client.incrby(logs.DROPPED_KEY, 7)
    got = scrape(exporter.url)
    assert 7.5 < value(got, "corral_clock_offset_seconds", host="fast-host") < 8.5
    assert ("corral_clock_offset_seconds", frozenset({("host", "gone-host")})) not in got
    assert value(got, "corral_log_records_dropped_total") == 7


def test_asynchronous_calls_are_counted_and_the_oldest_queued_aged(
    env: Env, exporter: RunningExporter, redis_url: str
) -> None:
    with env.db.transaction() as s:
        deploy(s, spec_from(name="fn", image="i", kernel="/k"), env.settings)
    request = StoredRequest("POST", "", "", (), b"")
    oldest = records.accept(env.db, env.settings, "fn", request).call_id
    clock.travel(30)
    records.accept(env.db, env.settings, "fn", request)
    running = records.accept(env.db, env.settings, "fn", request).call_id
    attempts.begin(env.db, env.settings, running, clock.now() + timedelta(seconds=60))
    client = redis.Redis.from_url(redis_url)
    call_stats.count(client, "succeeded", 4)
    call_stats.count(client, "retry")  # an attempt's verdict counts as its event
    call_stats.count(client, "callback_delivered", 2)
    samples = scrape(exporter.url)
    assert value(samples, "corral_calls_open", status="queued") == 2
    assert value(samples, "corral_calls_open", status="running") == 1
    assert value(samples, "corral_calls_open", status="retrying") == 0
    assert 30 <= value(samples, "corral_calls_queue_age_seconds") < 60
    assert value(samples, "corral_calls_total", outcome="succeeded") == 4
    assert value(samples, "corral_calls_total", outcome="retried") == 1
    assert value(samples, "corral_calls_total", outcome="dead") == 0
    assert value(samples, "corral_callbacks_total", outcome="delivered") == 2
    with env.db.read() as s:
        assert s.get(Call, oldest) is not None
