"""The cold path's shortcuts: the spawn carried out in the gateway, claims told of ready replicas.

No Celery worker runs here: a cold start the gateway serves is one whose spawn the gateway
carried out itself, on a thread of its queue (:class:`tasks.queues.HereFirst`;
``CORRAL_GATEWAY_SPAWN_HERE``, on by default). With it off, or with every thread busy, the
spawn waits in the broker for a worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
import redis

from agents import ProcessDriver, RunningAgent, serve_fcdaemon
from corral import api
from tasks.maintenance import QUEUE
from tasks.queues import HERE_THREADS, HereFirst
from testkit import httpcalls
from tests.fixtures import Env
from tests.helpers import deploy_fn, replicas
from workers.fleet.nodes import upsert_node
from workers.gateway import serve_gateway
from workers.replicas import coldstarts
from workers.store.models import ReplicaState


@pytest.fixture
def no_worker(broker_env: Env) -> Iterator[RunningAgent]:
    """The session's Redis as broker, a store, a process agent as ``node1``: no worker."""
    agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver())
    with broker_env.db.transaction() as s:
        upsert_node(s, agent.address, name="node1", capacity=8)
    deploy_fn(broker_env, "hello", image="examples.hello")
    yield agent
    agent.stop(grace=0)


def test_the_gateway_carries_out_its_cold_start_and_is_told_when_it_is_ready(
    broker_env: Env,
    no_worker: RunningAgent,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The waiting claim's own looks are 30 s apart: only the notice can wake it in time.
    monkeypatch.setattr(coldstarts, "TOLD_POLL_S", 30.0)
    gateway = serve_gateway(
        broker_env.settings.model_copy(update={"gateway_cold_start_timeout_s": 20.0}),
        "127.0.0.1:0",
        queue=HereFirst(QUEUE),
    )
    try:
        started = time.monotonic()
        answer = httpcalls.get(f"{gateway.url}/function/hello", timeout=60)
        took = time.monotonic() - started
    finally:
        gateway.stop()
    assert answer.status_code == 200 and answer.text == "hello from corral\n"
    assert took < 15, f"{took:.1f}s: the claim was not told its replica was ready"
    (op,) = api.operations(settings=broker_env.settings)
    assert (op["kind"], op["status"], op["done"]) == ("spawn", "succeeded", 1)
    assert op["result"] is not None
    assert set(op["result"]["stages"]) >= {"plan", "placement", "agent_call", "record"}
    assert len(no_worker.agent.calls_of("CreateReplica")) == 1
    assert [r.status for r in replicas(broker_env, "hello")] == [ReplicaState.IDLE]


@pytest.mark.parametrize(
    ("spawn_here", "threads"),
    [(False, HERE_THREADS), (True, 0)],
    ids=["spawning-here-off", "threads-busy"],
)
def test_a_cold_start_not_carried_out_here_waits_in_the_broker_for_a_worker(
    broker_env: Env, no_worker: RunningAgent, spawn_here: bool, threads: int
) -> None:
    queue = HereFirst(QUEUE, threads=threads)  # threads 0: every one of them busy
    gateway = serve_gateway(
        broker_env.settings.model_copy(
            update={"gateway_spawn_here": spawn_here, "gateway_cold_start_timeout_s": 1.0}
        ),
        "127.0.0.1:0",
        queue=queue,
    )
    try:
        answer = httpcalls.get(f"{gateway.url}/function/hello", timeout=60)
    finally:
        gateway.stop()
    assert answer.status_code == 503  # its spawn's message waits for a worker
    (op,) = api.operations(settings=broker_env.settings)
    assert (op["kind"], op["status"]) == ("spawn", "pending")
    assert no_worker.agent.calls_of("CreateReplica") == []
    assert queue.busy == 0
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    try:
        (message,) = [json.loads(m) for m in client.lrange("corral.spawn", 0, -1)]
    finally:
        client.close()
    assert message["headers"]["task"] == "corral.spawn"
    assert message["headers"]["argsrepr"] == repr((op["id"],))
