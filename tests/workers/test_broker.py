"""corral's Redis transport (:mod:`workers.broker`) against a real Redis.

The fault it fixes: a worker whose broker vanished closes a channel whose
transport was already detached from its connection, and kombu's own channel
then fails with ``AttributeError`` (fatal to the worker) instead of a connection
error (after which the worker reconnects). The end-to-end proof is
``test_broker_restart_mid_run_loses_nothing``; these tests pin the mechanism.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.transport import redis as kombu_redis

from config.celery import celery_config
from config.settings import get_settings, reset_settings
from tasks.replicas import noop
from testkit.services import RedisServer
from tests.fixtures import Env
from workers.broker import PublishOutOfTime, Transport
from workers.celery import app, budgeted, configure
from workers.replicas.owners import Budget

DB = 13  # a database of its own on the session's Redis


@pytest.fixture
def broker_url(redis_server: RedisServer) -> Iterator[str]:
    """An empty Redis database for one test."""
    client = redis_server.client(DB)
    client.flushdb()
    yield redis_server.url_for(DB)
    client.flushdb()


def _channel_holding_one_message(connection: Connection) -> object:
    """A channel that has taken one message from ``q`` and not acknowledged it."""
    queue = Queue("q", Exchange("x", type="direct"), routing_key="q")
    channel = connection.channel()
    queue(channel).declare()
    producer = connection.Producer(channel)
    producer.publish({"n": 1}, exchange=queue.exchange, routing_key="q", declare=[queue])
    message = channel.basic_get("q", no_ack=False)
    assert message is not None
    return channel


def _detach(channel: object) -> None:
    """Detach the channel's transport from its connection, as ``Connection.collect`` does."""
    channel.connection.client = None  # type: ignore[attr-defined]


def test_closing_a_detached_channel_is_a_connection_error(
    broker_url: str, redis_server: RedisServer
) -> None:
    with Connection(broker_url, transport=Transport) as connection:
        channel = _channel_holding_one_message(connection)
        errors = connection.connection_errors
        _detach(channel)
        with pytest.raises(errors, match="already closed"):
            channel.close()  # type: ignore[attr-defined]
    unacked = redis_server.client(DB).hgetall("unacked")
    assert len(unacked) == 1  # the message is kept for the visibility-timeout sweep
    (payload, _exchange, _routing_key) = json.loads(next(iter(unacked.values())))
    assert json.loads(base64.b64decode(payload["body"])) == {"n": 1}


@pytest.mark.parametrize("poll", [1.0, 0.1])
def test_the_broker_poll_is_the_brpop_timeout_of_the_redis_transport(poll: float) -> None:
    # the most a warm stop waits for the BRPOP in flight: kombu takes it from polling_interval
    settings = get_settings().model_copy(update={"broker_poll_s": poll})
    options = celery_config(settings)["broker_transport_options"]
    with Connection("redis://127.0.0.1:1/0", transport_options=options) as connection:
        assert connection.transport.brpop_timeout == poll


def test_kombus_own_channel_still_has_the_bug(broker_url: str) -> None:
    """If this fails, kombu fixed it and the detached-transport check in ``_connparams`` can go."""
    with Connection(broker_url, transport=kombu_redis.Transport) as connection:
        channel = _channel_holding_one_message(connection)
        _detach(channel)
        with pytest.raises(AttributeError, match="hostname"):
            channel.close()  # type: ignore[attr-defined]


def test_redis_urls_keep_their_scheme_and_use_corrals_transport() -> None:
    with app.connection_for_write() as connection:
        assert isinstance(connection.transport, Transport)
        # the scheme stays redis://: Flower picks its broker client by it
        assert connection.as_uri().startswith("redis://")
    with Connection("rediss://127.0.0.1:1/0") as tls:
        assert tls.transport_cls == "rediss"
        assert issubclass(type(tls.transport), Transport)
    with Connection("memory://") as memory:
        assert not isinstance(memory.transport, Transport)


# -- a running task's publishes end before its hard limit ----------------------------------

HARD_S = 12.0  # the task's hard limit: above one attempt (5 s), below two plus kombu's waits


@pytest.fixture
def own_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RedisServer]:
    """A Redis of the test's own (it is stopped or frozen), corral's app publishing to it."""
    with RedisServer(tmp_path / "redis") as server:
        env = Env(monkeypatch, tmp_path)
        env.set(broker_url=server.url, database_url=f"sqlite:///{tmp_path}/s.db", eager="0")
        try:
            yield server
        finally:
            reset_settings()
            configure(get_settings())


def test_a_tasks_publish_to_a_frozen_broker_gives_up_before_its_hard_limit(
    own_broker: RedisServer,
) -> None:
    # A broker that stopped answering without closing its sockets (a frozen process, a
    # partition): kombu's retries, a socket timeout each, used to outlast any hard limit
    # (past 150 s), and the supervisor then killed the worker with every task on it.
    noop.apply_async()  # the producer's connection is made: the freeze hits a publish
    budget = Budget(time.monotonic(), get_settings().task_soft_time_limit_s, HARD_S, 1.0)

    def publish() -> float:
        with budgeted(budget), pytest.raises(PublishOutOfTime, match="hard time limit"):
            noop.apply_async()
        return time.monotonic() - budget.started

    with own_broker.frozen(), concurrent.futures.ThreadPoolExecutor(1) as pool:
        took = pool.submit(publish)
        # unanswered by the hard limit (and a margin): the bound did not hold
        done, _ = concurrent.futures.wait([took], timeout=HARD_S + 10)
        assert done, "the publish was still blocked past the task's hard limit"
    assert took.result() < HARD_S
    noop.apply_async()  # the broker is back: publishing works again


# -- a publish whose queue declare lost the broker -----------------------------------------


def _broker_back_on_first_failure(
    server: RedisServer, seen: list[str]
) -> Callable[[Exception, float], None]:
    """A retry policy's errback that starts the stopped broker the first time kombu reports."""

    def errback(exc: Exception, interval: float) -> None:
        seen.append(type(exc).__name__)
        if not server.is_running():
            server.start()

    return errback


def test_a_publish_whose_queue_declare_lost_the_broker_is_sent_once_when_it_is_back(
    own_broker: RedisServer,
) -> None:
    # cis672's partition run: a scale's fan-out failed with AttributeError ('NoneType' object
    # has no attribute 'client') when the broker was cut during the queue declare of its
    # connection's first publish; kombu's declare retry reconnected and closed the channel
    # the publish went on with.
    seen: list[str] = []
    policy = {"max_retries": 5, "errback": _broker_back_on_first_failure(own_broker, seen)}
    with app.producer_or_acquire() as producer:
        assert producer.channel is not None  # made: the broker answered its ping
        own_broker.stop()  # the publish's first command is its queue's declare
        noop.apply_async(producer=producer, retry_policy=policy)
    queue = app.amqp.router.route({}, noop.name)["queue"].name
    assert own_broker.client().llen(queue) == 1  # sent, and once
    assert seen == ["ConnectionError", "ConnectionError"]  # the declare's loss, the closed channel


def test_kombus_own_channel_still_publishes_on_the_channel_its_declare_closed(
    tmp_path: Path,
) -> None:
    """If this fails, kombu fixed it and the closed-channel check in ``_connparams`` can go."""
    queue = Queue("q", Exchange("q", type="direct"), routing_key="q")
    with (
        RedisServer(tmp_path / "redis") as server,
        Connection(server.url, transport=kombu_redis.Transport) as connection,
    ):
        producer = connection.Producer()
        assert producer.channel is not None
        server.stop()
        seen: list[str] = []
        policy = {"max_retries": 5, "errback": _broker_back_on_first_failure(server, seen)}
        with pytest.raises(AttributeError, match="client"):
            # Celery's publish of a task: the default exchange, the queue declared
            producer.publish(
                {}, exchange="", routing_key="q", declare=[queue], retry=True, retry_policy=policy
            )
        assert server.client().llen("q") == 0
        assert seen == ["ConnectionError"]  # one loss, then the closed channel's AttributeError
