"""Idle times as corral sees them: recorded where invocations pass, kept in Redis.

The model
---------
A function's idle time is the time from the end of one invocation to the start of the
next (:mod:`workers.autoscale.keepalive` turns them into keep-alive windows). corral
sees invocations in two places, and both record:

* **the gateway** - every request to ``/function/NAME`` is an invocation from its
  admission to its answer. The gateway's :class:`Recorder` (on its event loop, no
  locks, no I/O) notes starts and ends; once per report interval the gateway hands
  what it noted (:meth:`Recorder.take`, one :class:`Activity` per function) to
  :func:`record` in its store thread. A start within one bin of the gateway's own
  last activity is counted locally as an idle time of bin 0 (it is one whatever
  other gateways saw); only the rare start after a longer local silence is sent
  with its time, to be measured against what *every* gateway saw;
* **the claim API** - :func:`corral.api.claim` is a start and :func:`corral.api.release`
  an end, each recorded as it happens (the gateway's own claims are held across
  requests, so its invocations are its requests, not its claims).

Where it lives, and why
-----------------------
One Redis hash per function, ``corral:idle:<function name>``, on the broker's
server: the bin width and count it was made with (``bin``, ``n``), the counts
(``c<i>`` for bin ``i``, ``oob`` beyond the range, ``total``), the last few
out-of-bounds idle times (``recent``) and the newest activity any recorder reported
(``last``, epoch seconds). :func:`record` updates it with one Lua script, so
recorders on many hosts never lose each other's counts: each start is measured
against ``last`` as all of them left it. It is bounded (at most ``n`` + 6 fields;
counts halve past ``CORRAL_KEEPALIVE_HISTORY``) and survives restarts of every
corral process; a hash made with another bin width or range is started again, and
one that is lost or malformed reads as no history - its function falls back to its
fixed keep-alive. It expires after :data:`TTL_S` without a write.

:func:`plans` reads them back as each function's keep-alive windows
(:class:`workers.autoscale.keepalive.Plan`) for the reaper, the autoscaler, ``corral
functions show`` and the metrics.

Timestamps are seconds since the epoch on the store's clock (:func:`workers.base.clock.epoch`),
as for the demand signal: recorders and readers run on different hosts.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import redis

from config.settings import Settings
from workers.autoscale.keepalive import (
    RECENT_OOB,
    IdleHistogram,
    KeepAlivePolicy,
    Plan,
    bins_for,
    windows,
)
from workers.base import clock as store_clock

log = logging.getLogger(__name__)

PREFIX = "corral:idle:"
TTL_S = 30 * 86_400.0  # a histogram nobody wrote to for 30 days is dropped
MAX_PENDING = 64  # long-idle starts one recorder keeps between two reports, per function

_RECORD = """
local key = KEYS[1]
local bin, nbins = tonumber(ARGV[1]), tonumber(ARGV[2])
local history, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
local short, last, keep = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if redis.call('HGET', key, 'bin') ~= ARGV[1] or tonumber(redis.call('HGET', key, 'n')) ~= nbins then
  local seen = redis.call('HGET', key, 'last')
  redis.call('DEL', key)
  redis.call('HSET', key, 'bin', ARGV[1], 'n', nbins, 'total', 0)
  if seen then redis.call('HSET', key, 'last', seen) end
end
local function halve()
  local all = redis.call('HGETALL', key)
  local total = 0
  for i = 1, #all, 2 do
    local f = all[i]
    if f == 'oob' or string.match(f, '^c%d+$') then
      local v = math.floor(tonumber(all[i + 1]) / 2)
      if v > 0 then redis.call('HSET', key, f, v) else redis.call('HDEL', key, f) end
      total = total + v
    end
  end
  redis.call('HSET', key, 'total', total)
end
local function count(f, k)
  redis.call('HINCRBY', key, f, k)
  if redis.call('HINCRBY', key, 'total', k) > history then halve() end
end
if short > 0 then count('c0', short) end
local prev = tonumber(redis.call('HGET', key, 'last'))
for i = 8, #ARGV do
  local at = tonumber(ARGV[i])
  if prev then
    local idle = at - prev
    if idle < 0 then idle = 0 end
    local b = math.floor(idle / bin)
    if b < nbins then
      count('c' .. b, 1)
    else
      count('oob', 1)
      local recent = {}
      for v in string.gmatch(redis.call('HGET', key, 'recent') or '', '%S+') do
        table.insert(recent, v)
      end
      table.insert(recent, string.format('%.17g', idle))
      while #recent > keep do table.remove(recent, 1) end
      redis.call('HSET', key, 'recent', table.concat(recent, ' '))
    end
  end
  if not prev or at > prev then prev = at end
end
if last and (not prev or last > prev) then prev = last end
if prev then redis.call('HSET', key, 'last', string.format('%.17g', prev)) end
redis.call('PEXPIRE', key, ttl)
return 1
"""


@dataclass(frozen=True)
class Shape:
    """The histogram every recorder and reader agrees on (``CORRAL_KEEPALIVE_*``)."""

    bin_s: float = 60.0
    range_s: float = 14_400.0
    history: int = 10_000

    @classmethod
    def from_settings(cls, settings: Settings) -> Shape:
        """The shape of a :class:`config.settings.Settings`."""
        return cls(settings.keepalive_bin_s, settings.keepalive_range_s, settings.keepalive_history)

    @property
    def bins(self) -> int:
        """How many bins the range holds."""
        return bins_for(self.bin_s, self.range_s)


@dataclass
class Activity:
    """What one recorder saw of one function since its last report."""

    short: int = 0  # starts within one bin of the recorder's own previous activity
    arrivals: list[float] = field(default_factory=list)  # other starts, epoch seconds
    last: float | None = None  # its newest activity: the last end, or now while one runs


@dataclass
class _Seen:
    active: int = 0
    last: float | None = None
    reported: float | None = None
    pending: Activity = field(default_factory=Activity)


class Recorder:
    """One gateway's view of its invocations, reported with :meth:`take` (no I/O here)."""

    def __init__(self, bin_s: float, clock: Callable[[], float] = store_clock.epoch) -> None:
        self.bin_s = bin_s
        self.clock = clock
        self._seen: dict[str, _Seen] = {}

    @contextlib.contextmanager
    def invocation(self, function: str) -> Iterator[None]:
        """Note one invocation of ``function`` for as long as the block runs."""
        self.started(function)
        try:
            yield
        finally:
            self.ended(function)

    def started(self, function: str) -> None:
        """An invocation of ``function`` starts now."""
        seen = self._seen.get(function)
        if seen is None:
            seen = self._seen[function] = _Seen()
        at = self.clock()
        if seen.active or (seen.last is not None and at - seen.last < self.bin_s):
            seen.pending.short += 1  # bin 0, whatever other recorders saw
        elif len(seen.pending.arrivals) < MAX_PENDING:
            seen.pending.arrivals.append(at)
        seen.active += 1
        seen.last = at

    def ended(self, function: str) -> None:
        """An invocation of ``function`` ends now."""
        seen = self._seen.get(function)
        if seen is not None:
            seen.active = max(0, seen.active - 1)
            seen.last = self.clock()

    def take(self) -> dict[str, Activity]:
        """What was seen since the last call, per function with anything new."""
        now = self.clock()
        out: dict[str, Activity] = {}
        for function, seen in self._seen.items():
            last = now if seen.active else seen.last
            pending = seen.pending
            if pending.short or pending.arrivals or last != seen.reported:
                out[function] = Activity(pending.short, pending.arrivals, last)
                seen.pending, seen.reported = Activity(), last
        return out


def key(function: str) -> str:
    """The Redis key of a function's idle times."""
    return PREFIX + function


def record(client: redis.Redis, shape: Shape, activity: Mapping[str, Activity]) -> None:
    """Add what recorders saw to the shared histograms, one script per function."""
    if not activity:
        return
    pipe = client.pipeline(transaction=False)
    for function, seen in sorted(activity.items()):
        pipe.eval(
            _RECORD,
            1,
            key(function),
            repr(float(shape.bin_s)),
            shape.bins,
            shape.history,
            int(TTL_S * 1000),
            seen.short,
            "" if seen.last is None else repr(seen.last),
            RECENT_OOB,
            *(repr(a) for a in sorted(seen.arrivals)),
        )
    pipe.execute()


def record_quietly(
    client: redis.Redis | None, shape: Shape, activity: Mapping[str, Activity]
) -> None:
    """:func:`record`, where a statistic is not worth failing the caller over."""
    if client is None:
        return
    try:
        record(client, shape, activity)
    except redis.RedisError as exc:  # Redis away: these idle times are lost, nothing else
        log.debug("could not record idle times: %s", exc)


@dataclass(frozen=True)
class IdleRecord:
    """A function's idle times as read back: its histogram, and its newest activity."""

    histogram: IdleHistogram | None  # None: no usable history (missing, other shape, malformed)
    last: float | None  # epoch seconds of the newest activity any recorder reported


def load(client: redis.Redis, shape: Shape, functions: Iterable[str]) -> dict[str, IdleRecord]:
    """The idle times of each of ``functions``, in one round trip."""
    names = sorted(set(functions))
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(key(name))
    return {name: parse(raw, shape) for name, raw in zip(names, pipe.execute(), strict=True)}


def parse(raw: Mapping[bytes | str, bytes | str], shape: Shape) -> IdleRecord:
    """One hash as read from Redis; anything malformed is no history."""
    data = {_text(k): _text(v) for k, v in raw.items()}
    last = _number(data.get("last"))
    try:
        if float(data["bin"]) != shape.bin_s or int(data["n"]) != shape.bins:
            return IdleRecord(None, last)
        hist = IdleHistogram.empty(shape.bin_s, shape.range_s)
        for name, value in data.items():
            if name.startswith("c"):
                i, count = int(name[1:]), int(value)
                if not 0 <= i < shape.bins or count < 0:
                    raise ValueError(f"field {name}={value}")
                hist.counts[i] = count
        hist.oob = int(data.get("oob", "0"))
        hist.recent_oob = [float(v) for v in data.get("recent", "").split()][-RECENT_OOB:]
        if hist.oob < 0 or not all(math.isfinite(v) and v >= 0 for v in hist.recent_oob):
            raise ValueError("negative or non-finite out-of-bounds idle times")
    except (KeyError, ValueError):
        return IdleRecord(None, last)
    return IdleRecord(hist, last)


def plans(client: redis.Redis, settings: Settings, functions: Iterable[str]) -> dict[str, Plan]:
    """Each function's keep-alive windows now, from its recorded idle times."""
    policy = KeepAlivePolicy.from_settings(settings)
    return {
        name: Plan(windows(policy, seen.histogram), seen.last)
        for name, seen in load(client, Shape.from_settings(settings), functions).items()
    }


def forget(client: redis.Redis, function: str) -> None:
    """Drop a function's idle times (it was removed)."""
    client.delete(key(function))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None
