"""The Redis broker transport: kombu's, with one fix for losing the broker mid-poll.

When the broker goes away, a Celery worker drops its connection in two steps:
``Connection.collect()`` closes the channels and then detaches the transport from
the connection (``transport.client = None``), and ``Connection.close()`` closes
the default channel again. If the first close failed early (the channel was
waiting in ``BRPOP`` and reading the dead socket raised), the second close goes
on to put the unacknowledged messages back, needs a new Redis pool for that,
and kombu builds the pool from ``transport.client``, which is now ``None``. The
``AttributeError`` that follows is not a connection error, so the worker treats
it as fatal and exits instead of reconnecting (kombu 5.7, redis-py 8).

This transport raises a connection error there instead. kombu and Celery
expect that and carry on: the worker reconnects, and the messages it held stay
in Redis's unacked set, so kombu's sweep puts them back after the visibility
timeout (tasks are idempotent, so a redelivery is harmless).

:func:`install` (called when the Celery app is created) maps the ``redis`` and
``rediss`` URL schemes to this transport in kombu's alias table, so broker URLs
stay ``redis://...`` everywhere (logs, ``celery inspect``, Flower's broker
page, which picks its Redis client by URL scheme).
"""

from __future__ import annotations

from typing import Any

import redis
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

__all__ = ["Channel", "Transport", "install"]

SCHEMES = ("redis", "rediss")


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, which never opens a pool for a closed transport."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection.client is None:
            raise redis.exceptions.ConnectionError("the broker connection is already closed")
        params: dict[str, Any] = super()._connparams(asynchronous=asynchronous)
        return params


class Transport(kombu_redis.Transport):
    """kombu's Redis transport with :class:`Channel`."""

    Channel = Channel


def install() -> None:
    """Make ``redis://`` and ``rediss://`` broker URLs use :class:`Transport` in this process."""
    for scheme in SCHEMES:
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
