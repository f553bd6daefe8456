"""A node's call slots as leases in Redis, so its in-flight bound holds across the fleet.

The model
---------
``CORRAL_NODE_MAX_INFLIGHT`` is a promise to the agent: it never sees more
concurrent calls from corral than that, however many worker processes and worker
hosts send them. Each process already bounds its own calls (:mod:`workers.backends.inflight`);
this module makes the per-node bound fleet-wide. A node's slots are a sorted set on
the broker's Redis, ``corral:slots:<node id>``: one member per call in flight (a
lease token), scored by when the lease lapses, on the Redis server's clock so
every host agrees.

* **Acquire** - one Lua script, atomic: drop the lapsed leases, then grant up to
  ``k`` of the free slots at once. A process asks for as many as its calls to the
  node are waiting for, so a batch costs a round trip or two, not one per call.
  When none are free it asks again after 2 ms, backing off to 25 ms.
* **Hand on, release** - a call that ends hands its lease to the next call of the
  same process waiting for that node (no round trip); with none waiting the lease
  is removed (``ZREM``, those freed together in one command). A call that may still
  run on the agent (its deadline passed, its connection was lost mid-call, it was
  cancelled) neither hands on nor releases: its lease lapses, at most
  :data:`SLACK_S` after the call's deadline, so the agent is not sent a call more
  while it still works on that one.
* **Lapse** - a lease lives for the longest call timeout (create, RPC, Lambdo)
  plus :data:`SLACK_S`; a call's own deadline ends it before that. A worker that
  is SIGKILLed mid-call never releases: its slots come back by themselves when
  their leases lapse. A lease handed on with less than that call time left is
  renewed first (or, if it lapsed, the call waits for a new one).
* **Whose** - a lease's token names its holder: a worker process's stable name
  (:func:`become`: the Celery worker's name and its pool process, ``w1@host/2``;
  the same again when the worker or that pool process is started anew), the
  process (pid and start time) and a sequence number. A worker that starts
  frees the leases its dead predecessors of the same name left
  (:func:`free_dead`), so a killed worker's slots do not block its nodes,
  fleet-wide, until they lapse; a lease whose process still runs on this host is
  never freed (two workers given the same name by mistake keep their own).

Calls wait for slots on the process's event loop thread, never inside a database
transaction. Without a Redis broker (``memory://``) or in eager mode (everything
in one process) there is nothing to share: the bound is the process's own. If
Redis does not answer, the call fails as a transport error (retried alone, with
backoff), never sent unbounded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio

from config.settings import Settings
from workers.backends import inflight
from workers.base.errors import TransientBackendError
from workers.base.redis_client import redis_client

log = logging.getLogger(__name__)

SLACK_S = 2.0  # a lease outlives the longest call timeout by this much
PREFIX = "corral:slots:"

# KEYS[1] the node's lease set; ARGV[1] the bound, ARGV[2] lease ms, ARGV[3..] tokens.
# Returns how many of the tokens (the first ones) were granted.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local ms = tonumber(ARGV[2])
local n = math.min(tonumber(ARGV[1]) - redis.call('ZCARD', KEYS[1]), #ARGV - 2)
if n <= 0 then return 0 end
for i = 1, n do
  redis.call('ZADD', KEYS[1], now + ms, ARGV[i + 2])
end
redis.call('PEXPIRE', KEYS[1], ms)
return n
"""

# KEYS[1] the node's lease set; ARGV[1] lease ms, ARGV[2] the token. 1: renewed, 0: lapsed.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not score or tonumber(score) <= now then
  redis.call('ZREM', KEYS[1], ARGV[2])
  return 0
end
local ms = tonumber(ARGV[1])
redis.call('ZADD', KEYS[1], now + ms, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ms)
return 1
"""

_seq = itertools.count(1)
_holder: tuple[int, str] = (0, "")
_identity: tuple[int, str] | None = None  # (pid, stable name) of this worker process
WHOSE = "#"  # in a token: the stable name before it, the process after it
_STARTTIME = 19  # /proc/PID/stat's field 22, counted from field 3


def key(node: Hashable) -> str:
    """The Redis key of a node's lease set."""
    return f"{PREFIX}{node}"


def lease_s(settings: Settings) -> float:
    """How long a lease lives: the longest call timeout plus the slack."""
    return settings.call_timeout_s + SLACK_S


MAX_CONNECTIONS = 32  # to the slots' Redis, per worker process


@dataclass(frozen=True)
class RedisSlots:
    """Node slots leased from one Redis server (an :class:`workers.backends.inflight.Source`)."""

    url: str
    ttl_s: float

    @property
    def need_s(self) -> float:
        """Lease time a call may need: one with less left is renewed before the call."""
        return self.ttl_s - SLACK_S

    def _client(self) -> Any:
        # A blocking pool: calls beyond its connections wait their turn (up to the socket
        # timeout) instead of failing, however many batches share the process's loop.
        return inflight.resource(
            f"redis:{self.url}",
            lambda: redis.asyncio.Redis(
                connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
                    self.url,
                    max_connections=MAX_CONNECTIONS,
                    timeout=5,
                    socket_timeout=5,
                    socket_connect_timeout=5,
                )
            ),
        )

    async def acquire(self, node: Hashable, bound: int, want: int) -> list[inflight.Lease]:
        """Up to ``want`` of the node's ``bound`` slots, granted at once."""
        tokens = [_token() for _ in range(want)]
        started = _loop_time()
        try:
            n = int(
                await self._client().eval(
                    _ACQUIRE, 1, key(node), bound, int(self.ttl_s * 1000), *tokens
                )
            )
        except redis.RedisError as exc:
            raise _unavailable(node, exc) from None
        return [inflight.Lease(t, started + self.ttl_s) for t in tokens[:n]]

    async def renew(self, node: Hashable, lease: inflight.Lease) -> bool:
        """Push a held lease's expiry out by a full lease; False when it had lapsed."""
        started = _loop_time()
        try:
            ok = int(
                await self._client().eval(_RENEW, 1, key(node), int(self.ttl_s * 1000), lease.token)
            )
        except redis.RedisError as exc:
            raise _unavailable(node, exc) from None
        if ok:
            lease.expires_at = started + self.ttl_s
        return bool(ok)

    async def release(self, node: Hashable, leases: Sequence[inflight.Lease]) -> None:
        """Give leases back (one command for all)."""
        await self._client().zrem(key(node), *[lease.token for lease in leases])


def _token() -> str:
    """A lease token unique in the fleet: whose (name, process; new after a fork), sequence."""
    global _holder
    pid = os.getpid()
    if _holder[0] != pid:
        if _identity is not None and _identity[0] == pid:
            _holder = (pid, f"{_identity[1]}{WHOSE}{pid}.{_started(pid)}")
        else:
            _holder = (pid, f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}")
    return f"{_holder[1]}:{next(_seq)}"


def become(name: str) -> None:
    """Take ``name`` (a worker's name and pool process: ``w1@host/0``) for this process's leases."""
    global _identity, _holder
    _identity = (os.getpid(), name.replace(WHOSE, "?"))
    _holder = (0, "")


def _started(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), or None if it does not run here.

    A zombie (killed, not yet reaped) does not run.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # from field 3 (state) on
    if not fields or fields[0] in ("Z", "X"):
        return None
    return fields[_STARTTIME] if len(fields) > _STARTTIME else ""


def _dead(member: str, prefix: str) -> bool:
    """Whether a lease was taken under ``prefix`` by a process that no longer runs here."""
    if not member.startswith(prefix) or WHOSE not in member:
        return False
    process = member.rpartition(WHOSE)[2].rpartition(":")[0]
    pid_text, _, started = process.partition(".")
    if not pid_text.isdigit():
        return False
    return _started(int(pid_text)) != started


def free_dead(url: str, name: str) -> int:
    """Free the leases that dead processes named ``name`` (or ``name/...``) left; how many.

    Run when a worker (``w1@host``) or one of its pool processes (``w1@host/2``) starts:
    a lease of a process of that name that still runs here is kept. Best effort: leases
    not freed lapse by themselves.
    """
    client = redis_client(url)
    if client is None:
        return 0
    prefixes = (f"{name}{WHOSE}", f"{name}/")
    freed = 0
    try:
        for key_ in client.scan_iter(match=f"{PREFIX}*", count=100):
            members = [
                m.decode(errors="replace") if isinstance(m, bytes) else str(m)
                for m in client.zrange(key_, 0, -1)
            ]
            dead = [m for m in members if any(_dead(m, p) for p in prefixes)]
            if dead:
                freed += int(client.zrem(key_, *dead))
    except redis.RedisError as exc:
        log.warning("could not free the node slots %s's dead processes left: %s", name, exc)
        return freed
    if freed:
        log.info("freed %d node call slot(s) that a dead process of %s held", freed, name)
    return freed


def _loop_time() -> float:
    return asyncio.get_running_loop().time()


def _unavailable(node: Hashable, exc: Exception) -> TransientBackendError:
    """Slots are taken (or renewed) before a call goes out: nothing was sent to the node, so a
    create may be sent again, also to an agent that cannot deduplicate it."""
    return TransientBackendError(
        f"in-flight slots of node {node} unavailable (Redis: {type(exc).__name__}: {exc})",
        nothing_done=True,
    )


def source(settings: Settings) -> RedisSlots | None:
    """Where node slots are leased for these settings: the broker's Redis, or None (local)."""
    if settings.eager or not settings.broker_url.startswith(("redis://", "rediss://", "unix://")):
        return None
    return RedisSlots(settings.broker_url, lease_s(settings))


async def _close(resources: dict[str, Any]) -> None:
    for name in [n for n in resources if n.startswith("redis:")]:
        await resources.pop(name).aclose()


inflight.on_reset(_close)


def held(client: Any, node: Hashable) -> int:
    """Leases of a node not yet lapsed (from a synchronous Redis client)."""
    seconds, micros = client.time()
    now_ms = int(seconds) * 1000 + int(micros) // 1000
    return int(client.zcount(key(node), f"({now_ms}", "+inf"))
