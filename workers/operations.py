"""Operations: one record per producer request, and the one place that settles and ends them.

A producer writes the operation (kind, parameters, ``pending``) and then enqueues
a task carrying only the operation id, so a task message never holds a secret
and a redelivered message finds the same record. Parameters are stored with
secret-looking values redacted.

An operation has ``total`` parts (replicas to spawn or delete, nodes to call).
Its status (:class:`~workers.store.models.OpStatus`, mapped on the column) moves
``pending`` -> ``running`` -> one of :data:`FINISHED` (``succeeded``, ``partial``,
``failed``), and only through this module:

* :func:`mark_running` starts a pending operation (its plan is made, its first part
  settled);
* :func:`settle` counts parts done or failed (the replica state machine calls it
  when a replica reaches Idle, Allocated, Dead or Deleted) and finishes the
  operation when every part has settled (:func:`maybe_finish`, :func:`finish`).
  Each part is named (a replica id; a request id for a spawn that never got a row)
  and counted at most once ever (an ``op_parts`` row each, written by the count
  itself), so two deliveries of a task, or two paths reaching one replica, never
  count it twice: an operation's ``done + failed`` is what happened to its replicas;
* :func:`fail_operation` / :func:`fail_op` end an open operation as a whole (bad
  input, an unexpected error in its task, given up on); a finished one stays as it
  ended, so a late redelivery cannot rewrite an outcome;
* :func:`record_result` ends a one-step operation (reap, reconcile) with its report;
  :func:`record_pass` writes one already over, for a periodic pass that changed something.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict, cast

from sqlalchemy import ColumnElement, Table, and_, bindparam, case, delete, func, select, update
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session

from config.redact import redact, redact_params
from workers.base.clock import iso, now
from workers.base.errors import InputError, NotFound
from workers.base.kinds import OpKind
from workers.store.db import Database, insert_for
from workers.store.models import OP_FINISHED, OP_OPEN, Operation, OpPart, OpStatus

FINISHED = OP_FINISHED  # the one definition is on the status type (workers.store.models)
# Count parts done; the last of an operation with no failure also finishes it (succeeded).
_ALL_DONE = and_(
    Operation.done + bindparam("n") + Operation.failed >= Operation.total, Operation.failed == 0
)
_COUNT_DONE = (
    update(Operation)
    .where(Operation.id == bindparam("op_id"), Operation.status.in_(OP_OPEN))
    .values(
        done=Operation.done + bindparam("n"),
        progress_at=bindparam("at"),
        status=case((_ALL_DONE, OpStatus.SUCCEEDED), else_=Operation.status),
        finished_at=case((_ALL_DONE, bindparam("at")), else_=Operation.finished_at),
        started_at=case(
            (_ALL_DONE, func.coalesce(Operation.started_at, bindparam("at"))),
            else_=Operation.started_at,
        ),
    )
    .returning(Operation.done, Operation.failed, Operation.total, Operation.status)
    .execution_options(synchronize_session=False)
)
MAX_OP_ERRORS = 5
OP_PARTS = cast(Table, OpPart.__table__)


MAX_ERROR_CHARS = 500


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message`` for an operation's error, secrets masked.

    A database error shows its driver's message, never the statement or its parameters.
    """
    inner = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    lines = str(inner).strip().splitlines()
    first = redact(lines[0].strip())[:MAX_ERROR_CHARS] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def create_operation(
    session: Session,
    kind: OpKind,
    params: dict[str, Any],
    *,
    function_id: str | None = None,
    total: int = 0,
) -> Operation:
    """Write a pending operation record."""
    op = Operation(kind=kind, params=redact_params(params), function_id=function_id, total=total)
    session.add(op)
    session.flush()
    return op


def get_operation(session: Session, op_id: str) -> Operation:
    """The operation with this id, or :class:`NotFound`."""
    if not isinstance(op_id, str) or not op_id.isalnum() or len(op_id) > 64:
        raise InputError(f"malformed operation id {op_id!r}")
    op = session.get(Operation, op_id)
    if op is None:
        raise NotFound(f"unknown operation {op_id!r}")
    return op


def list_operations(session: Session, limit: int = 50) -> list[Operation]:
    """The newest operations first."""
    return list(
        session.scalars(select(Operation).order_by(Operation.created_at.desc()).limit(limit))
    )


class OperationView(TypedDict):
    """An operation as the CLI and API show it."""

    id: str
    kind: str
    status: str  # an OpStatus value: pending, running, succeeded, failed, ...
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    progress_at: str | None
    params: dict[str, Any]
    total: int
    done: int
    failed: int
    result: dict[str, Any] | None
    error: str | None
    redrives: int
    # Its maybes (creates with unknown outcomes, replaced at once), by what became of them:
    # open, adopted, released, ended (workers.replicas.maybes); shown for one operation.
    maybes: dict[str, int]


def operation_view(op: Operation, maybes: dict[str, int] | None = None) -> OperationView:
    """An operation as the CLI and API show it (with ``maybes``, its maybes' outcomes)."""
    return {
        "id": op.id,
        "kind": op.kind,
        "status": op.status,
        "created_at": iso(op.created_at),
        "started_at": iso(op.started_at),
        "finished_at": iso(op.finished_at),
        "progress_at": iso(op.progress_at),
        "params": op.params,
        "total": op.total,
        "done": op.done,
        "failed": op.failed,
        "result": op.result,
        "error": op.error,
        "redrives": op.redrives,  # times its first task was re-sent (workers.maintenance.redrive)
        "maybes": maybes or {},
    }


def record_pass(
    db: Database, kind: OpKind, result: dict[str, Any], *, total: int = 1, failed: int = 0
) -> str:
    """Record what a periodic housekeeping pass changed, as an operation already over; its id.

    Beat's passes run without an operation and send no task events, so Flower lists the
    operations' tasks, not a health check every 5 s. A pass that changed something
    (deleted a replica, destroyed an orphan, marked a node unhealthy...) leaves this
    record, so ``corral ops`` and the operations metrics show it.
    """
    with db.transaction() as s:
        op = create_operation(s, kind, {"by": "beat"}, total=total)
        op.result, op.done, op.failed = result, total - failed, failed
        finish(op, failed=failed, total=total)
        return op.id


def record_result(db: Database, op_id: str, result: dict[str, Any]) -> None:
    """Finish a one-step operation (reap, reconcile...) with its result."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None or op.status in OP_FINISHED:
            return
        op.total, op.done = 1, 1
        op.result = result
        finish(op, failed=0, total=1)


def settle(
    session: Session, op_id: str, *, parts: Sequence[str], ok: bool, error: str | None = None
) -> int:
    """Count ``parts`` of an operation done or failed, each once ever; how many were new.

    Finishes the operation when every part has settled.
    """
    n = _first_time(session, op_id, parts)
    if not n:
        return 0
    if ok:
        # The common case in one statement: count it; load the row only to finish it.
        counted = (
            session.connection().execute(_COUNT_DONE, {"op_id": op_id, "at": now(), "n": n}).first()
        )
        if counted is None:
            return n
        done, failed, total, status = counted
        if status == OpStatus.SUCCEEDED.value:  # its last part: finished by that statement
            forget_parts(session, op_id)
            return n
        if done + failed < total and status != OpStatus.PENDING.value:
            return n
        op = session.get(Operation, op_id, with_for_update=True, populate_existing=True)
        if op is not None:
            _maybe_finish_parts(session, op)
        return n
    op = session.scalars(select(Operation).where(Operation.id == op_id).with_for_update()).first()
    if op is None or op.status not in OP_OPEN:
        return n
    op.failed += n
    op.progress_at = now()
    errors = list((op.result or {}).get("errors", []))
    if error and len(errors) < MAX_OP_ERRORS:
        errors.append(error)
    op.result = {**(op.result or {}), "errors": errors}
    _maybe_finish_parts(session, op)
    return n


def _first_time(session: Session, op_id: str, parts: Sequence[str]) -> int:
    """Record ``parts`` as counted for the operation; how many were not counted before."""
    unique = list(dict.fromkeys(parts))
    if not unique:
        return 0
    conn = session.connection()
    insert = insert_for(session)
    stmt = (
        insert(OP_PARTS)
        .values([{"operation_id": op_id, "part": part} for part in unique])
        .on_conflict_do_nothing()
        .returning(OP_PARTS.c.part)
    )
    return len(conn.execute(stmt).all())


def _maybe_finish_parts(session: Session, op: Operation) -> None:
    """:func:`maybe_finish`, and forget the operation's counted parts once it is finished."""
    maybe_finish(op)
    if op.status in OP_FINISHED:
        forget_parts(session, op.id)


def forget_parts(session: Session, op_id: str) -> None:
    """Drop a finished operation's part markers (a finished operation counts nothing more)."""
    session.execute(
        delete(OpPart)
        .where(OpPart.operation_id == op_id)
        .execution_options(synchronize_session=False)
    )


def open_of(*kinds: OpKind) -> ColumnElement[bool]:
    """The SQL condition for an operation of one of ``kinds`` that is still open."""
    return and_(Operation.kind.in_(kinds), Operation.status.in_(OP_OPEN))


def mark_running(op: Operation) -> None:
    """Move a pending operation to running, its start time now."""
    if op.status == OpStatus.PENDING:
        op.status = OpStatus.RUNNING
        op.started_at = op.started_at or now()


def maybe_finish(op: Operation) -> None:
    """Close an operation whose parts have all settled."""
    if op.status in OP_FINISHED:
        return
    if op.done + op.failed < op.total:
        mark_running(op)
        return
    finish(op, failed=op.failed, total=op.total)


def finish(op: Operation, *, failed: int, total: int, error: str | None = None) -> None:
    """Mark an operation finished, with a one-line reason when anything failed."""
    op.finished_at = now()
    op.started_at = op.started_at or op.finished_at
    if failed == 0 and error is None:
        op.status = OpStatus.SUCCEEDED
        return
    op.status = OpStatus.FAILED if failed >= total else OpStatus.PARTIAL
    errors = (op.result or {}).get("errors", [])
    first = error or (errors[0] if errors else "unknown error")
    op.error = first if total <= 1 else f"{failed} of {total} failed; first: {first}"


def fail_operation(session: Session, op_id: str, error: str) -> None:
    """Mark an open operation failed as a whole, ``error`` its reason; a finished one stays.

    For bad input, an unexpected error in its task, or an operation given up on.
    Its part counts stay as they were. A finished operation (a late redelivery's
    failure) is left as it ended: succeeded, failed or partial.
    """
    op = session.get(Operation, op_id, with_for_update=True)
    if op is None or op.status in OP_FINISHED:
        return
    op.total = max(op.total, 1)
    op.finished_at = now()
    op.started_at = op.started_at or op.finished_at
    op.status = OpStatus.FAILED
    op.error = error
    forget_parts(session, op_id)


def fail_op(db: Database, op_id: str, error: str) -> None:
    """Mark a whole operation failed with a one-line reason."""
    with db.transaction() as s:
        fail_operation(s, op_id, error)
