"""corral's own Redis client (:mod:`workers.base.redis_client`) against a real Redis."""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path

import pytest
import redis

from testkit.services import RedisServer
from workers.base.redis_client import TIMEOUT_S, redis_client


def test_a_command_to_a_frozen_redis_fails_after_one_attempt(tmp_path: Path) -> None:
    # redis-py retries a command ten times by default, each attempt its socket timeout:
    # more than half a minute on a Redis that stopped answering, past a task's hard limit.
    with RedisServer(tmp_path / "redis") as server:
        client = redis_client(server.url_for(3))
        assert client is not None and client.ping()

        def ping() -> float:
            started = time.monotonic()
            with pytest.raises(redis.TimeoutError):
                client.ping()
            return time.monotonic() - started

        with server.frozen(), concurrent.futures.ThreadPoolExecutor(1) as pool:
            took = pool.submit(ping)
            done, _ = concurrent.futures.wait([took], timeout=4 * TIMEOUT_S)
            assert done, "the command was still waiting after four of its timeouts"
        assert took.result() < 2 * TIMEOUT_S
        assert client.ping()  # answered again once Redis is
