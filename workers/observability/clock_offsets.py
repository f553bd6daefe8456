"""How far each host's wall clock is from the store's, as its workers measured it, for operators.

corral reads no host's wall clock (:mod:`workers.base.clock`): every process measures the
store's clock and counts on its monotonic clock in between, so a host whose clock is
off changes nothing. It is still worth seeing - an NTP daemon that stopped, a clock a
container inherited wrong - so each worker process, after a task, publishes its latest
measurement (host clock minus store clock, in seconds) under its host's name in one
Redis hash (:data:`KEY`), at most once per measurement (every ``clock.SYNC_EVERY_S``).
The exporter serves them as ``corral_clock_offset_seconds{host}``; a host that has not
published for :data:`STALE_S` (no worker runs there now) is left out.
"""

from __future__ import annotations

import json
import socket

import redis

from workers.base import clock

KEY = "corral:metrics:clock_offset"
STALE_S = 600.0

_published = 0  # the number of this process's last measurement published


def publish(client: redis.Redis, host: str | None = None) -> bool:
    """Publish this process's latest measurement, if it has a new one; whether it did."""
    global _published
    measured = clock.host_offset()
    if measured is None or measured[0] == _published:
        return False
    number, offset_s = measured
    value = json.dumps({"offset_s": round(offset_s, 6), "at": clock.epoch()})
    client.hset(KEY, host or socket.gethostname(), value)
    _published = number
    return True


def offsets(client: redis.Redis) -> dict[str, float]:
    """Each host's latest published offset (s ahead of the store), fresh ones only."""
    fresh: dict[str, float] = {}
    at = clock.epoch()
    for host, raw in client.hgetall(KEY).items():
        try:
            value = json.loads(raw)
            if at - float(value["at"]) <= STALE_S:
                name = host.decode(errors="replace") if isinstance(host, bytes) else str(host)
                fresh[name] = float(value["offset_s"])
        except (ValueError, KeyError, TypeError):
            continue
    return fresh
