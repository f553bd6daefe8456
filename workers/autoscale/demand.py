"""The demand signal: what gateways see of each function's load, shared through Redis.

The model
---------
Every gateway process counts, per function, the requests it is forwarding now
(*in flight*) and those waiting for a free execution environment (*queued*), and
keeps a time-weighted average of their sum over its report interval
(*concurrency*, Knative's "observed concurrency"). Once per interval it writes one
:class:`Sample` per function with :func:`report`:

* ``corral:demand:<function>`` - a hash, one field per gateway id, its value the
  sample as JSON; the whole hash expires ``ttl_s`` after the last report, and a
  reader ignores a field older than ``stale_after_s`` (a gateway that died stops
  counting within that time);
* ``corral:demand:last:<function>`` - when a request last arrived at any gateway
  (seconds since the epoch), for scale-to-zero.

:func:`read` adds up the fresh samples of all gateways into one :class:`Demand`
for each function it is asked about (the autoscaler asks about the functions in the
store); the autoscaler turns that into a replica target. Timestamps are seconds since
the epoch on the store's clock (:func:`workers.base.clock.epoch`): gateways and beat run on
different hosts, and a host whose own clock is off must not make a sample look stale or
fresh.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

import redis

from workers.base import clock

PREFIX = "corral:demand:"


@dataclass(frozen=True)
class Sample:
    """One gateway's view of one function over its last report interval."""

    inflight: int  # requests being forwarded at report time
    queued: int  # requests waiting for an environment at report time
    concurrency: float  # time-weighted mean of inflight + queued over the interval
    requests: int  # requests that arrived during the interval
    at: float  # when the sample was taken (epoch seconds)


@dataclass(frozen=True)
class Demand:
    """All fresh gateway samples of one function, added up."""

    inflight: int
    queued: int
    concurrency: float
    requests: int
    gateways: int  # how many gateways reported a fresh sample
    last_request_at: float | None  # newest request at any gateway, epoch seconds


def _key(function: str) -> str:
    return PREFIX + function


def _last_key(function: str) -> str:
    return PREFIX + "last:" + function


def report(
    client: redis.Redis, gateway_id: str, samples: Mapping[str, Sample], *, ttl_s: float = 30.0
) -> None:
    """Publish this gateway's samples, one per function, in one round trip."""
    if not samples:
        return
    pipe = client.pipeline(transaction=False)
    for function, sample in samples.items():
        pipe.hset(_key(function), gateway_id, json.dumps(asdict(sample)))
        pipe.pexpire(_key(function), int(ttl_s * 1000))
        if sample.requests > 0:
            pipe.set(_last_key(function), repr(sample.at), px=int(max(ttl_s, 86_400) * 1000))
    pipe.execute()


def read(
    client: redis.Redis,
    functions: Iterable[str],
    *,
    now: float | None = None,
    stale_after_s: float = 10.0,
) -> dict[str, Demand]:
    """The summed demand of each of ``functions`` (zeros for one no gateway reported)."""
    names = sorted(functions)
    if not names:
        return {}
    current = clock.epoch() if now is None else now
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(_key(name))
        pipe.get(_last_key(name))
    replies = pipe.execute()
    out: dict[str, Demand] = {}
    for i, name in enumerate(names):
        fields, last = replies[2 * i], replies[2 * i + 1]
        fresh = [
            s
            for s in (_parse(v) for v in fields.values())
            if s is not None and current - s.at <= stale_after_s
        ]
        out[name] = Demand(
            inflight=sum(s.inflight for s in fresh),
            queued=sum(s.queued for s in fresh),
            concurrency=sum(s.concurrency for s in fresh),
            requests=sum(s.requests for s in fresh),
            gateways=len(fresh),
            last_request_at=float(last) if last is not None else None,
        )
    return out


def _parse(raw: bytes | str) -> Sample | None:
    try:
        data = json.loads(raw)
        return Sample(
            inflight=int(data["inflight"]),
            queued=int(data["queued"]),
            concurrency=float(data["concurrency"]),
            requests=int(data["requests"]),
            at=float(data["at"]),
        )
    except (ValueError, KeyError, TypeError):
        return None  # a malformed field counts as no report
