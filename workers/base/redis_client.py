"""One Redis client per process and URL, for corral's own keys on the broker's server.

The autoscaler's window state, the gateways' demand and the control plane's
shared counters live on the broker's Redis (``CORRAL_BROKER_URL``). redis-py's
connection pool notices a fork and reconnects in the child, so a client made
before a prefork worker forks is still safe to use after.
"""

from __future__ import annotations

import redis

_clients: dict[str, redis.Redis] = {}


def redis_client(url: str) -> redis.Redis | None:
    """A Redis client for ``url``, or None when the broker is not Redis (``memory://``)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5
        )
    return client
