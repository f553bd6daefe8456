"""One Redis client per process and URL, for corral's own keys on the broker's server.

The autoscaler's window state, the gateways' demand and the control plane's
shared counters live on the broker's Redis (``CORRAL_BROKER_URL``). redis-py's
connection pool notices a fork and reconnects in the child, so a client made
before a prefork worker forks is still safe to use after.

Each command is tried once (said outright: redis-py's own default depends on how a
client is made), and waits :data:`TIMEOUT_S` at most to connect and as long for its
answer: the callers either do without (a statistic) or fail and are tried again as a
whole (a task). It was 5 s: a scale recording its cold-start stages after its broker
went away waited that long with 2.3 s left before its hard limit (the partition run).
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

TIMEOUT_S = 3.0  # to connect, and for an answer: Redis answers in milliseconds

_clients: dict[str, redis.Redis] = {}


def redis_client(url: str) -> redis.Redis | None:
    """A Redis client for ``url``, or None when the broker is not Redis (``memory://``)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(
            url,
            socket_timeout=TIMEOUT_S,
            socket_connect_timeout=TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
    return client
