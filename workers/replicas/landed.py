"""Creates that answered while the store could not record them: kept in Redis until it can.

The model
---------
A create that answered made a VM: that is known, and a store that blinks must not turn
it into an unknown. Its handler records the VM (:func:`workers.replicas.arrivals.record`)
and, when the store refuses, tries again inside its task until near the task's hard
time limit. At the first refusal it also writes the answers here, on the broker's
Redis (not the store): one key per replica, ``corral:landed:<replica id>``, holding the
node the create went to and the VM it made, kept for ``CORRAL_CREATING_DEADLINE_S``
plus the task's hard limit (as long as the row may still be Creating). Once the VMs
are recorded the keys go.

If the handler never gets to record them (the store stayed down past its time, its
worker was killed), the row is left Creating, owned by a handler that lapses, marked
sent. Whoever takes such a row next - the task's retry, a redelivery, redrive, a
give-up - looks here first (:func:`workers.replicas.owners.take`): a kept answer is
recorded like any other (:func:`workers.replicas.lifecycle.arrive`, conditional on the
node), so the create is never sent again and the row never becomes a maybe. A key for
a row that moved to another node or ended names a VM no row takes: it is released.

Redis is not the store: if it is down too, or lost the keys, the create is ambiguous as
it was before (a maybe on an agent that cannot deduplicate creates) and nothing is
created twice. Without a Redis broker (eager mode, ``memory://``) nothing is kept.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import redis

from config.settings import Settings
from workers.backends import Vm
from workers.base.redis_client import redis_client

log = logging.getLogger(__name__)

PREFIX = "corral:landed:"


@dataclass(frozen=True)
class Landed:
    """A create's answer: the replica it was for, the node that made the VM, and the VM."""

    replica_id: str
    node_id: str
    vm: Vm


def key(replica_id: str) -> str:
    """The Redis key that keeps a replica's landed answer."""
    return f"{PREFIX}{replica_id}"


def keep_s(settings: Settings) -> int:
    """How long an answer is kept: as long as its row may still be Creating."""
    return int(settings.creating_deadline_s + settings.task_time_limit_s) + 1


def keep(settings: Settings, answers: Sequence[Landed]) -> bool:
    """Write these answers to Redis (one round trip); whether they are kept."""
    client = redis_client(settings.broker_url)
    if client is None or not answers:
        return False
    try:
        with client.pipeline(transaction=False) as pipe:
            for a in answers:
                value = {"node": a.node_id, "vmid": a.vm.vmid, "address": a.vm.address}
                pipe.set(key(a.replica_id), json.dumps(value), ex=keep_s(settings))
            pipe.execute()
    except redis.RedisError as exc:
        log.error("could not keep %d landed answer(s) in Redis: %s", len(answers), exc)
        return False
    log.warning("kept %d landed answer(s) in Redis until the store records them", len(answers))
    return True


def find(settings: Settings, rows: Iterable[tuple[str, str]]) -> dict[str, Vm]:
    """The kept answers of these ``(replica id, node id)`` rows made on that node, by replica.

    Redis down or the key gone: none (the create is then ambiguous, as without this).
    """
    client = redis_client(settings.broker_url)
    wanted = list(rows)
    if client is None or not wanted:
        return {}
    try:
        values = client.mget([key(rid) for rid, _ in wanted])
    except redis.RedisError as exc:
        log.warning("could not read landed answers from Redis: %s", exc)
        return {}
    out: dict[str, Vm] = {}
    for (rid, node_id), raw in zip(wanted, values, strict=True):
        found = _parse(raw)
        if found is not None and found[0] == node_id:
            out[rid] = found[1]
    return out


def _parse(raw: object) -> tuple[str, Vm] | None:
    """A kept value as (node id, VM); None if it is not one."""
    if not isinstance(raw, bytes | str):
        return None
    try:
        value = json.loads(raw)
        return str(value["node"]), Vm(str(value["vmid"]), str(value["address"]))
    except (ValueError, KeyError, TypeError):
        return None


def forget(settings: Settings, replica_ids: Iterable[str]) -> None:
    """Drop the kept answers of these replicas (recorded now); best effort, they expire."""
    client = redis_client(settings.broker_url)
    ids = list(replica_ids)
    if client is None or not ids:
        return
    try:
        client.delete(*[key(rid) for rid in ids])
    except redis.RedisError as exc:
        log.warning("could not drop %d kept answer(s) from Redis: %s", len(ids), exc)
