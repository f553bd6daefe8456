"""corral's Redis transport (:mod:`workers.broker`) against a real Redis.

The fault it fixes: a worker whose broker vanished closes a channel whose
transport was already detached from its connection, and kombu's own channel
then fails with ``AttributeError`` (fatal to the worker) instead of a connection
error (after which the worker reconnects). The end-to-end proof is
``test_broker_restart_mid_run_loses_nothing``; these tests pin the mechanism.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import pytest
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.transport import redis as kombu_redis

from testkit.services import RedisServer
from workers.broker import Transport
from workers.celery import app

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


def test_kombus_own_channel_still_has_the_bug(broker_url: str) -> None:
    """If this fails, kombu fixed it upstream and :mod:`workers.broker` can go."""
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
