"""What a producer asks of replicas: checked against the store, written as an operation.

Each function validates the request in the caller's transaction - an unknown function
or replica, a bad count, a target outside [min, max] or a spawn past the function's max
raise :class:`~workers.base.errors.InputError` and write nothing - and returns the operation
row; the caller queues its first task (:func:`workers.dispatch.submit` does both).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from workers.base.errors import InputError
from workers.base.kinds import OpKind
from workers.fleet.placement import spread_nodes
from workers.functions import get_function
from workers.operations import create_operation
from workers.replicas.checks import check_count, check_target
from workers.replicas.views import get_replica
from workers.store.models import Function, Operation


def request_spawn(session: Session, function: str, count: int) -> Operation:
    """An operation for ``count`` more replicas of ``function`` (``count`` per node: spread)."""
    count = check_count(count)
    return spawn_of(session, get_function(session, function), count)


def spawn_of(session: Session, fn: Function, count: int) -> Operation:
    """:func:`request_spawn` for a function row the caller has read (``count`` checked)."""
    function = fn.name
    adding = count
    if fn.placement == "spread":  # n on every healthy node
        adding = count * max(1, len(spread_nodes(session, fn)))
    have = fn.replica_count
    if have + adding > fn.max_replicas:
        raise InputError(
            f"spawning {adding} would give {function} {have + adding} replicas, "
            f"above its max of {fn.max_replicas}"
        )
    return create_operation(
        session, OpKind.SPAWN, {"function": function, "count": count}, function_id=fn.id
    )


def request_scale(session: Session, function: str, target: int) -> Operation:
    """An operation bringing ``function`` to ``target`` replicas (within its [min, max])."""
    fn = get_function(session, function)
    target = check_target(fn, target)
    return create_operation(
        session, OpKind.SCALE, {"function": function, "target": target}, function_id=fn.id
    )


def request_delete(session: Session, replica_id: str) -> Operation:
    """An operation deleting the replica ``replica_id``."""
    replica = get_replica(session, replica_id)
    return create_operation(
        session, OpKind.DELETE, {"replica": replica_id}, function_id=replica.function_id, total=1
    )
