"""The Redis broker transport: kombu's, where a closed channel is a lost connection.

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

A publish can meet a closed channel too. Celery declares a task's queue as part of
its publish (``declare=[queue]``, a Redis ``SADD`` on a connection's first publish),
and kombu runs that declare under a retry loop of its own: when the broker is lost
there, the loop reconnects, which closes the channel the publish took a moment
before, and the publish then goes on with that closed channel. kombu's channel
fails with ``AttributeError`` again (``'NoneType' object has no attribute
'client'``), which the publish's own retry loop does not retry, so the task failed.
Here a closed channel, like a detached transport, fails as a lost connection when
it needs a Redis pool (every command it sends after its close does): the publish's
retry loop reconnects once more and publishes on a fresh channel, nothing sent
twice (the message had not reached Redis).

:func:`install` (called when the Celery app is created) maps the ``redis`` and
``rediss`` URL schemes to this transport in kombu's alias table, so broker URLs
stay ``redis://...`` everywhere (logs, ``celery inspect``, Flower's broker
page, which picks its Redis client by URL scheme).

:func:`restore` puts the messages a dead worker held back on their queues at once, by
their delivery tags, instead of after the visibility timeout (:mod:`stack.worker`).

A publish made by a running task (a retry, a hand-off, a child task) must end before
that task's hard limit, or the supervisor kills the worker and every task on it with
it. kombu retries a publish to a broker it cannot reach as its retry policy says
(``task_publish_retry_policy``: a dozen attempts), each attempt bounded by the
transport's socket timeouts, and nothing bounds the whole. :func:`within` turns a retry
policy into one that gives up - :class:`PublishOutOfTime` - when another attempt could
end past the task's hard limit: a publish then takes at most the time left, plus one
attempt when it started with less than that left. The task gives its own message back
instead (:class:`workers.celery.CorralTask`): it runs again once the broker is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis
from kombu.connection import Connection
from kombu.exceptions import OperationalError
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

__all__ = ["Channel", "PublishOutOfTime", "Transport", "attempt_s", "install", "restore", "within"]

SCHEMES = ("redis", "rediss")


class PublishOutOfTime(OperationalError):
    """The broker did not take a message, and another attempt could outlast the task."""


class Channel(kombu_redis.Channel):
    """kombu's Redis channel, which never opens a pool once it or its transport is closed."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        if self.connection is None:  # this channel was closed
            raise redis.exceptions.ConnectionError(
                "the broker channel is closed (its connection was lost and made again)"
            )
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


def restore(url: str, tags: Iterable[str], options: dict[str, Any]) -> int:
    """Put the unacknowledged messages with these delivery tags back on their queues; how many.

    kombu's own restore (``QoS.restore_by_tag``, what a worker's warm shutdown does for the
    messages it holds): in one Redis transaction each message leaves the unacked hash and
    goes back to the head of its queue, marked redelivered. A tag no longer held
    (acknowledged, or restored already by kombu's sweep) is skipped. Only for the tags of a
    worker that is gone: a live worker's message would run twice at once.
    """
    install()
    with Connection(url, transport_options=options) as conn:
        channel: Any = conn.default_channel
        client = channel.client
        held = [tag for tag in dict.fromkeys(tags) if client.hexists(channel.unacked_key, tag)]
        for tag in held:
            channel.qos.restore_by_tag(tag, client=client)
    return len(held)


def attempt_s(options: Mapping[str, Any]) -> float:
    """The longest one publish attempt may take under these transport options."""
    return float(options.get("socket_timeout") or 0) + float(
        options.get("socket_connect_timeout") or 0
    )


def within(policy: Mapping[str, Any] | None, hard_at: float, attempt: float) -> dict[str, Any]:
    """``policy`` (kombu's retry policy) made to give up before ``hard_at`` (``time.monotonic()``).

    kombu calls the policy's ``errback(exc, interval)`` after each failed attempt, before it
    waits ``interval`` and tries again; this one raises :class:`PublishOutOfTime` when
    that wait and one more ``attempt`` would reach ``hard_at``.
    """

    def give_up_in_time(exc: Exception, interval: float) -> None:
        left = hard_at - time.monotonic()
        if interval + attempt >= left:
            raise PublishOutOfTime(
                f"the broker did not take the message ({exc}); {max(left, 0):.1f}s left "
                "before the task's hard time limit"
            ) from exc

    return {**(policy or {}), "errback": give_up_in_time}
