"""Notices that a function has a replica ready: claims waiting on a cold start are told.

The model
---------
A claim waiting for a cold start (:class:`workers.replicas.claims.ClaimAttempt`)
looks in the store again after a pause that grows from 20 ms to half a second; left at
that, a replica that becomes ready just after a look waits for the next one. So
whatever makes a replica claimable for a new reason tells the waiters: once its
transaction has committed, the spawn that records a VM Idle, and the registry that
applies a guest's READY, publish the function's name on the Redis channel
:data:`CHANNEL` (the broker's server). A gateway subscribes (:func:`listen`) and wakes
its claims waiting on that function at once (:meth:`workers.gateway.ledger.Ledger.wake`).

A gateway that carries out a spawn itself (:class:`workers.dispatch.TaskQueue`) is also told
directly, without the round trip through Redis (:func:`listen_here`).

A notice is a hint, never the truth: the woken claim still claims through the store,
and a notice that is lost (Redis away, a gateway that subscribed late) only means the
claim looks again on its own schedule, as it did before notices.

:class:`Readied` gathers what a transaction made ready - the functions to announce and
the ``ready`` stages to observe (:mod:`workers.observability.stages`) - for its caller to tell once
the transaction has committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
import redis.asyncio

from config.settings import Settings
from workers.base.redis_client import redis_client
from workers.observability import stages

log = logging.getLogger(__name__)

CHANNEL = "corral:replica-ready"
RETRY_MAX_S = 5.0  # a lost subscription is made again after at most this long
_here: list[Callable[[str], object]] = []  # listeners in this process, told at once


def listen_here(on_ready: Callable[[str], object]) -> Callable[[], None]:
    """Call ``on_ready(function)`` (from any thread) for notices made in this process.

    Returns the function that stops it.
    """
    _here.append(on_ready)
    return lambda: _here.remove(on_ready)


def announce(client: redis.Redis | None, functions: Iterable[str]) -> None:
    """Tell listeners (this process's, then every gateway's) that these functions have a
    replica ready (quietly)."""
    names = sorted(set(functions))
    for on_ready in list(_here):
        for name in names:
            try:
                on_ready(name)
            except Exception as exc:  # a listener that went away (its loop closed)
                log.debug("a listener here could not be told of %s: %s", name, exc)
    if client is None or not names:
        return
    try:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.publish(CHANNEL, name)
        pipe.execute()
    except redis.RedisError as exc:  # the waiters look again on their own schedule
        log.debug("could not announce ready replicas of %s: %s", names, exc)


@dataclass
class Readied:
    """What a transaction made ready, to tell once it has committed."""

    functions: set[str] = field(default_factory=set)
    stages: list[stages.Ready] = field(default_factory=list)

    def tell(self, settings: Settings) -> None:
        """Observe the timed READYs and announce the functions (after the commit)."""
        if not (self.functions or self.stages):
            return
        client = redis_client(settings.broker_url)
        for ready in self.stages:
            ready.observe(client)
        announce(client, self.functions)


async def listen(url: str, on_ready: Callable[[str], None]) -> None:
    """Forever: call ``on_ready(function)`` for each notice (reconnecting when Redis drops)."""
    pause = 0.1
    while True:
        client = redis.asyncio.Redis.from_url(url, socket_connect_timeout=5)
        try:
            async with client.pubsub(ignore_subscribe_messages=True) as pubsub:
                await pubsub.subscribe(CHANNEL)
                pause = 0.1
                async for message in pubsub.listen():
                    data = message.get("data")
                    if isinstance(data, bytes):
                        on_ready(data.decode("utf-8", "replace"))
        except (redis.RedisError, OSError) as exc:
            log.debug("ready notices: %s; subscribing again in %.1fs", exc, pause)
        finally:
            await client.aclose()
        await asyncio.sleep(pause)
        pause = min(pause * 2, RETRY_MAX_S)
