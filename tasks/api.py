"""The producer's Python API: ask for spawns, deletes and scales, and follow them.

Each call validates its input against the store (unknown function, bad count,
target outside [min, max] raise :class:`~workers.errors.InputError` and change
nothing), writes an operation record, queues the task, and returns the
operation id. :func:`wait` follows an operation to its end::

    from tasks import api
    op = api.spawn("hello", 3)
    print(api.wait(op, timeout=60)["status"])
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery import Signature

from config.settings import Settings, get_settings
from workers.errors import CorralError, InputError
from workers.fleet.placement import spread_nodes
from workers.functions import get_function
from workers.maintenance.redrive import Redrive
from workers.operations import create_operation, get_operation, operation_view
from workers.replicas.actions import check_count, check_target
from workers.store.db import Database, get_database
from workers.store.migrate import check_schema
from workers.store.models import OP_FINISHED, Operation

_checked: set[str] = set()


class BrokerError(CorralError):
    """The broker did not take the task."""


def database(settings: Settings | None = None) -> Database:
    """The store, checked once per process to be migrated."""
    settings = settings or get_settings()
    db = get_database(settings.database_url)
    if db.url not in _checked:
        check_schema(db)
        _checked.add(db.url)
    return db


# Operations whose first task may run twice: everything it does is keyed by the
# operation and its request ids. Not CPU hogs: a second CreateCPUHogs starts more.
RESENDABLE = ("spawn", "scale", "delete", "reap", "reconcile")


def first_task(kind: str, op_id: str, params: dict[str, Any]) -> Signature:
    """The task that carries out an operation of ``kind``, built from its stored params."""
    from tasks.hogs import hogs as hogs_task
    from tasks.maintenance import reap as reap_task
    from tasks.maintenance import reconcile as reconcile_task
    from tasks.replicas import delete_replica
    from tasks.replicas import scale as scale_task
    from tasks.replicas import spawn as spawn_task

    if kind == "spawn":
        return spawn_task.si(op_id)
    if kind == "scale":
        return scale_task.si(op_id)
    if kind == "delete":
        return delete_replica.si(params["replica"], op_id)
    if kind == "hogs":
        return hogs_task.si(action=params["action"], n=params["n"], node=params["node"],
                            op_id=op_id)
    if kind == "reap":
        return reap_task.si(idle_timeout=params.get("idle_timeout"), op_id=op_id)
    if kind == "reconcile":
        return reconcile_task.si(op_id=op_id)
    raise ValueError(f"no task carries out operations of kind {kind!r}")


def resend(redrive: Redrive) -> None:
    """Send the first task of an operation that stopped moving again (see maintenance.redrive)."""
    first_task(redrive.kind, redrive.op_id, redrive.params).apply_async()


def _enqueue(db: Database, op: Operation) -> str:
    """Queue the first task of a freshly written operation; fail the operation if we cannot."""
    op_id = op.id
    try:
        first_task(op.kind, op_id, op.params).apply_async()
    except CorralError:
        raise
    except Exception as exc:  # kombu/redis raise many types when the broker is down
        from workers.operations import fail_op

        reason = f"could not queue the task: {type(exc).__name__}: {exc}"
        fail_op(db, op_id, reason)
        raise BrokerError(reason) from None
    return op_id


def spawn(function: str, count: int = 1, *, settings: Settings | None = None) -> str:
    """Ask for ``count`` more replicas of ``function``; returns the operation id."""
    db = database(settings)
    count = check_count(count)
    with db.transaction() as s:
        fn = get_function(s, function)
        adding = count
        if fn.placement == "spread":  # n on every healthy node
            adding = count * max(1, len(spread_nodes(s, fn)))
        have = fn.replica_count
        if have + adding > fn.max_replicas:
            raise InputError(
                f"spawning {adding} would give {function} {have + adding} replicas, "
                f"above its max of {fn.max_replicas}"
            )
        op = create_operation(s, "spawn", {"function": function, "count": count},
                              function_id=fn.id)
    return _enqueue(db, op)


def scale(function: str, target: int, *, settings: Settings | None = None) -> str:
    """Set ``function``'s replica target; returns the operation id."""
    db = database(settings)
    if isinstance(target, bool) or not isinstance(target, int):
        raise InputError(f"target must be an integer, got {target!r}")
    with db.transaction() as s:
        fn = get_function(s, function)
        check_target(fn, target)
        op = create_operation(s, "scale", {"function": function, "target": target},
                              function_id=fn.id)
    return _enqueue(db, op)


def delete(replica_id: str, *, settings: Settings | None = None) -> str:
    """Delete one replica; returns the operation id."""
    from workers.store.models import Replica

    db = database(settings)
    check_id(replica_id, "replica")
    with db.transaction() as s:
        replica = s.get(Replica, replica_id)
        if replica is None:
            from workers.errors import NotFound

            raise NotFound(f"unknown replica {replica_id!r}")
        op = create_operation(s, "delete", {"replica": replica_id},
                              function_id=replica.function_id, total=1)
    return _enqueue(db, op)


def check_id(value: str, what: str) -> str:
    """A row id (32 hex characters), or a clear :class:`InputError`."""
    if not isinstance(value, str) or len(value) != 32 or not value.isalnum():
        raise InputError(f"malformed {what} id {value!r}: expected 32 hex characters")
    return value


def operation(op_id: str, *, settings: Settings | None = None) -> dict[str, Any]:
    """The operation's current record."""
    db = database(settings)
    with db.read() as s:
        return operation_view(get_operation(s, op_id))


WAIT_POLL_MAX_S = 0.2  # wait() reads the operation at least this often


def wait(
    op_id: str,
    *,
    timeout: float = 120.0,
    poll: float = 0.05,
    settings: Settings | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Block until the operation finishes (or ``timeout``); returns its record."""
    deadline = time.monotonic() + timeout
    delay = poll
    while True:
        view = operation(op_id, settings=settings)
        if progress is not None:
            progress(view)
        if view["status"] in OP_FINISHED:
            return view
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"operation {op_id} still {view['status']} after {timeout:g}s "
                f"({view['done']} done, {view['failed']} failed of {view['total']})"
            )
        time.sleep(delay)
        # Backing off, but not past WAIT_POLL_MAX_S: a spawn of slow VMs ends within a
        # second or two, and a long last sleep would add most of that again.
        delay = min(delay * 1.5, WAIT_POLL_MAX_S)


def hogs(
    action: str, n: int, node: str | None = None, *, settings: Settings | None = None
) -> str:
    """Start or stop ``n`` CPU hogs on ``node`` (default: all healthy agents); returns the op id."""
    from workers.fleet.hogs import check_hogs, hog_targets

    db = database(settings)
    action, n = check_hogs(action, n)
    with db.transaction() as s:
        hog_targets(s, node)  # unknown node, Lambdo host or no healthy agents: refuse now
        op = create_operation(s, "hogs", {"action": action, "n": n, "node": node})
    return _enqueue(db, op)


# -- claims and the reaper ---------------------------------------------------------------------

MAX_COLD_START_S = 3600.0


def claim(
    function: str,
    *,
    cold_start_timeout: float = 0.0,
    ttl: float | None = None,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """Take one execution environment of an Idle replica of ``function``, as a lease.

    Returns the claim (``claim_id``, ``replica_id``, ``address``, ``expires_at``, ...): give it
    back with :func:`release`; unreleased, the reaper gives it back after ``ttl`` seconds
    (default ``CORRAL_CLAIM_TTL_S``). With nothing Idle and ``cold_start_timeout > 0``,
    wait up to that many seconds for a new replica: concurrent waiters of one function
    share spawns (a spawn is asked for only while waiters outnumber the environments
    already on their way).
    """
    from workers.replicas import claims

    settings = settings or get_settings()
    if isinstance(cold_start_timeout, bool) or not isinstance(cold_start_timeout, int | float):
        raise InputError(f"cold-start timeout must be a number, got {cold_start_timeout!r}")
    if not 0 <= cold_start_timeout <= MAX_COLD_START_S:
        raise InputError(
            f"cold-start timeout must be between 0 and {MAX_COLD_START_S:g}s, "
            f"got {cold_start_timeout!r}"
        )
    attempt = claims.ClaimAttempt(
        database(settings), settings, function, cold_start_timeout=cold_start_timeout,
        ttl_s=ttl, spawn=lambda name: spawn(name, 1, settings=settings),
    )
    try:
        while True:
            got = attempt.step()
            if isinstance(got, claims.Claimed):
                return {**got.as_dict(), "waited_s": round(attempt.waited_s, 3),
                        "spawned": attempt.spawned}
            time.sleep(got)
    finally:
        attempt.close()


def release(claim_id: str, *, settings: Settings | None = None) -> dict[str, Any]:
    """Give back exactly the environment a claim holds (``released`` False: it was not held)."""
    from workers.replicas import claims

    settings = settings or get_settings()
    return claims.release(database(settings), settings, check_id(claim_id, "claim"))


def suspect(claim_id: str, reason: str, *, settings: Settings | None = None) -> str | None:
    """Give back a claim whose replica failed to answer and delete that replica; the op id."""
    from workers.replicas import claims

    db = database(settings)
    op = claims.suspect(db, settings or get_settings(), check_id(claim_id, "claim"), reason)
    return _enqueue(db, op) if op is not None else None


def reap(idle_timeout: float | None = None, *, settings: Settings | None = None) -> str:
    """Ask for one reaper pass (optionally with an idle-timeout override); returns the op id."""
    from workers.maintenance.reaper import check_idle_timeout

    db = database(settings)
    idle_timeout = check_idle_timeout(idle_timeout)
    with db.transaction() as s:
        op = create_operation(s, "reap", {"idle_timeout": idle_timeout})
    return _enqueue(db, op)


def reconcile(*, settings: Settings | None = None) -> str:
    """Ask for one reconcile pass now; returns the operation id."""
    db = database(settings)
    with db.transaction() as s:
        op = create_operation(s, "reconcile", {})
    return _enqueue(db, op)
