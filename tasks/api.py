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

from config.settings import Settings, get_settings
from workers.errors import CorralError, InputError
from workers.functions import get_function, live_count
from workers.operations import FINISHED, create_operation, get_operation, operation_view
from workers.replicas import check_count, check_target
from workers.store.db import Database, get_database
from workers.store.migrate import check_schema
from workers.store.models import COUNTED_STATES

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


def _enqueue(db: Database, op_id: str, send: Callable[[], Any]) -> str:
    try:
        send()
    except CorralError:
        raise
    except Exception as exc:  # kombu/redis raise many types when the broker is down
        from workers.replicas import fail_op

        reason = f"could not queue the task: {type(exc).__name__}: {exc}"
        fail_op(db, op_id, reason)
        raise BrokerError(reason) from None
    return op_id


def spawn(function: str, count: int = 1, *, settings: Settings | None = None) -> str:
    """Ask for ``count`` more replicas of ``function``; returns the operation id."""
    from tasks.replicas import spawn as spawn_task

    db = database(settings)
    count = check_count(count)
    with db.transaction() as s:
        fn = get_function(s, function)
        have = live_count(s, fn, COUNTED_STATES)
        if have + count > fn.max_replicas:
            raise InputError(
                f"spawning {count} would give {function} {have + count} replicas, "
                f"above its max of {fn.max_replicas}"
            )
        op = create_operation(s, "spawn", {"function": function, "count": count},
                              function_id=fn.id)
    return _enqueue(db, op.id, lambda: spawn_task.delay(op.id))


def scale(function: str, target: int, *, settings: Settings | None = None) -> str:
    """Set ``function``'s replica target; returns the operation id."""
    from tasks.replicas import scale as scale_task

    db = database(settings)
    if isinstance(target, bool) or not isinstance(target, int):
        raise InputError(f"target must be an integer, got {target!r}")
    with db.transaction() as s:
        fn = get_function(s, function)
        check_target(fn, target)
        op = create_operation(s, "scale", {"function": function, "target": target},
                              function_id=fn.id)
    return _enqueue(db, op.id, lambda: scale_task.delay(op.id))


def delete(replica_id: str, *, settings: Settings | None = None) -> str:
    """Delete one replica; returns the operation id."""
    from tasks.replicas import delete_replica
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
    return _enqueue(db, op.id, lambda: delete_replica.delay(replica_id, op.id))


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
        if view["status"] in FINISHED:
            return view
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"operation {op_id} still {view['status']} after {timeout:g}s "
                f"({view['done']} done, {view['failed']} failed of {view['total']})"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 1.0)
