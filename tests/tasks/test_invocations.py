"""The calls' tasks: what their messages carry on the broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import redis

from tasks.invocations import CALLS
from tests.fixtures import Env


@pytest.fixture
def client(broker_env: Env) -> Iterator[redis.Redis]:
    """The broker's Redis."""
    connection = redis.Redis.from_url(broker_env.settings.broker_url)
    yield connection
    connection.close()


def _etas(client: redis.Redis) -> list[float]:
    """Seconds from now to each waiting message's ``eta`` in the calls' queue."""
    now = datetime.now(UTC)
    out = []
    for raw in client.lrange("corral.invocations", 0, -1):
        eta = json.loads(raw)["headers"]["eta"]
        out.append((datetime.fromisoformat(eta) - now).total_seconds())
    return out


def test_a_countdown_is_never_longer_than_a_worker_may_hold_the_message(
    broker_env: Env, client: redis.Redis
) -> None:
    """A worker holds a message with a countdown unacknowledged until it runs: a wait past
    the visibility timeout (less the hard limit) would hand it to a second worker. A longer
    backoff is cut; the early attempt finds its call not due and sends itself again."""
    settings = broker_env.set(
        task_soft_time_limit_s=10, task_time_limit_s=20, visibility_timeout_s=40
    )
    assert settings.longest_countdown_s == 15
    CALLS.send("c-long", countdown=600)
    CALLS.send_callback("c-long", countdown=600)
    CALLS.send("c-short", countdown=3)
    short, *long = sorted(_etas(client))
    assert 0 < short <= 3
    assert len(long) == 2 and all(10 < eta <= 15 for eta in long), long
