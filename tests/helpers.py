"""Helpers shared by the tests: deploy a test function, spawn replicas, read the replica rows."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar

import redis
from sqlalchemy import select

from agents.fcdaemon import RunningAgent
from config.celery import QUEUES
from corral import api
from tests.fixtures import Env, StartAgents
from workers.backends import Vm
from workers.backends.fcdaemon import MAX_RECONNECT_BACKOFF_S
from workers.base import clock
from workers.celery import app
from workers.functions import deploy, spec_from
from workers.replicas.arrivals import record
from workers.replicas.outcomes import Next, Outcome
from workers.replicas.owners import Budget, Pending, owner_token, take
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import place
from workers.store.models import LIVE_STATES, Operation, Replica

R = TypeVar("R")


def passes_until_heard(run: Callable[[], R], missed: Callable[[R], object]) -> list[R]:
    """Health passes (``run``) until one no longer ``missed`` the node that is back, or 9 s.

    The process's connection to its address may sit in gRPC's reconnect backoff from the
    misses (2 s at most): a pass then counts one more miss, and a later one hears it.
    """
    passes = [run()]
    give_up = time.monotonic() + 2 * MAX_RECONNECT_BACKOFF_S + 5
    while missed(passes[-1]) and time.monotonic() < give_up:
        time.sleep(0.25)  # the backoff runs out on gRPC's timer: no event to wait on here
        passes.append(run())
    return passes


def broker_state(url: str) -> str:
    """What the broker's Redis holds, for a failure's message: each key, its type and size."""
    client = redis.Redis.from_url(url, decode_responses=True)
    size = {"list": client.llen, "hash": client.hlen, "zset": client.zcard, "set": client.scard}
    parts = []
    for key in sorted(client.keys("*"))[:40]:
        kind = str(client.type(key))
        parts.append(f"{key!r} ({kind} {size.get(kind, client.strlen)(key)})")
    eager = app.conf.task_always_eager  # a task carried out here never reaches the broker
    return f"broker: {', '.join(parts) or 'empty'}; this process's app eager: {eager}"


def broker_drained(env: Env) -> bool:
    """Whether every message sent to the broker has run: none queued, none unacknowledged.

    Tasks are acknowledged after they ran (``acks_late``), and a task sends the tasks it
    starts before it is acknowledged, so this holds only once a whole tree of tasks is over.
    """
    client = redis.Redis.from_url(env.settings.broker_url)
    try:
        with client.pipeline() as pipe:  # one reading (MULTI): queues, then unacked
            for queue in QUEUES:
                pipe.llen(queue)
            pipe.hlen("unacked")
            return not any(pipe.execute())
    finally:
        client.close()


def deploy_fn(env: Env, /, name: str = "hello", **fields: object) -> str:
    """Deploy (or redeploy, bumping the build) a fcdaemon function; returns its id.

    Test defaults: image ``examples.hello``, kernel ``/k``, at most 50 replicas;
    ``fields`` (any :class:`~workers.functions.FunctionSpec` field) override them.
    """
    spec: dict[str, object] = {"image": "examples.hello", "kernel": "/k", "max": 50, **fields}
    with env.db.transaction() as s:
        fn, _ = deploy(s, spec_from(name=name, **spec), env.settings)
        return fn.id


def one_agent(
    env: Env, start_agents: StartAgents, /, name: str = "hello", **fields: object
) -> RunningAgent:
    """One node agent registered in ``env``'s store, and ``name`` deployed with ``fields``."""
    (agent,) = start_agents(1, env=env)
    deploy_fn(env, name, **fields)
    return agent


def spawn_ok(function: str, count: int, timeout: float = 120.0) -> api.OperationView:
    """Spawn ``count`` replicas of ``function`` and wait; asserts the operation succeeded."""
    view = api.wait(api.spawn(function, count), timeout=timeout)
    assert view["status"] == "succeeded", view
    return view


def replicas(env: Env, name: str | None = None, *, live: bool = False) -> list[Replica]:
    """Every replica row (of one function; only live ones with ``live``), oldest first."""
    with env.db.read() as s:
        query = select(Replica).order_by(Replica.created_at)
        if live:
            query = query.where(Replica.status.in_(LIVE_STATES))
        rows = list(s.scalars(query))
    return [r for r in rows if name is None or r.function.name == name]


def operation(env: Env, op_id: str) -> Operation:
    """The operation row ``op_id`` (which must exist)."""
    with env.db.read() as s:
        op = s.get(Operation, op_id)
        assert op is not None
        return op


def result_of(op: Mapping[str, Any] | Operation) -> dict[str, Any]:
    """An operation's result (its view's or its row's), which must be there."""
    found = op.result if isinstance(op, Operation) else op["result"]
    assert found is not None, op
    return dict(found)


def creating(
    env: Env,
    function_id: str,
    request_id: str,
    node_id: str | None = None,
    op_id: str | None = None,
) -> Pending:
    """A Creating row for ``request_id``, placed and taken as a spawn handler does (no VM)."""
    place(env.db, env.settings, op_id, function_id, [SpawnJob(request_id, node_id)])
    taken = take(
        env.db, env.settings, [request_id], owner_token(), Budget.of(env.settings).own_until()
    )
    (pending,) = taken.pending
    return pending


def record_vm(env: Env, pending: Pending, vm: Vm) -> Outcome:
    """Record ``vm`` for an owned row the way a spawn handler does; what became of the row."""
    nxt = Next()
    record(env.db, env.settings, [(pending, vm)], nxt, Budget.of(env.settings))
    return nxt.states[pending.request_id]


def lapsed() -> datetime:
    """An ownership deadline the store's clock has passed (a handler that died a second ago).

    Not ``clock.now()``: the process's estimate of the store's time may run a few
    milliseconds ahead of the transaction time PostgreSQL compares it with.
    """
    return clock.now() - timedelta(seconds=1)


def queued(env: Env, queue: str) -> list[dict[str, Any]]:
    """The messages waiting in ``queue`` on the test broker, oldest first (kombu pushes on
    the left): each one's task, args, kwargs and headers."""
    client = redis.Redis.from_url(env.settings.broker_url)
    try:
        raw = client.lrange(queue, 0, -1)
    finally:
        client.close()
    out = []
    for item in reversed(raw):
        message = json.loads(item)
        body = json.loads(base64.b64decode(message["body"]))
        out.append(
            {
                "task": message["headers"]["task"],
                "args": body[0],
                "kwargs": body[1],
                "headers": message["headers"],
            }
        )
    return out


def calls(messages: list[dict[str, Any]]) -> list[tuple[str, list[Any], dict[str, Any]]]:
    """Each message's task, args and kwargs."""
    return [(m["task"], m["args"], m["kwargs"]) for m in messages]
