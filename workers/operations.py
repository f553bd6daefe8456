"""Operation records: one per producer request, created before its task is queued.

A producer writes the operation (kind, parameters, ``pending``) and then enqueues
a task carrying only the operation id, so a task message never holds a secret
and a redelivered message finds the same record. Parameters are stored with
secret-looking values redacted.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from workers.errors import InputError, NotFound
from workers.functions import iso
from workers.store.db import Database
from workers.store.models import OP_FINISHED, Operation

SECRET_HINTS = ("secret", "token", "password", "aws_access_key", "authorization")
FINISHED = OP_FINISHED  # the one definition is on the status type (workers.store.models)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with secret-looking values replaced."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if any(h in key.lower() for h in SECRET_HINTS):
            out[key] = "<redacted>" if value else value
        elif isinstance(value, dict):
            out[key] = redact(value)
        else:
            out[key] = value
    return out


_SECRET_TEXT = (
    (re.compile(r"(?i)\bbearer\s+\S+"), "Bearer <redacted>"),
    # user:password@ in URLs
    (re.compile(r"(//[^/\s:@]*):[^@\s/]*@"), r"\1:<redacted>@"),
    # password=..., token: ..., secret '...', aws_secret_access_key=...
    (re.compile(r"(?i)\b([\w-]*(?:" + "|".join(SECRET_HINTS) + r")[\w-]*)(['\"]?\s*[=:]\s*)"
                r"(['\"]?)[^\s,;'\")]+"), r"\1\2\3<redacted>"),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), "<redacted>"),
)
MAX_ERROR_CHARS = 500


def redact_text(text: str) -> str:
    """``text`` with secret-looking values (URL passwords, key=value secrets, tokens) masked."""
    for pattern, replacement in _SECRET_TEXT:
        text = pattern.sub(replacement, text)
    return text


def describe_error(exc: BaseException) -> str:
    """``Type: first line of the message`` for an operation's error, secrets masked.

    A database error shows its driver's message, never the statement or its parameters.
    """
    from sqlalchemy.exc import StatementError

    inner = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    lines = str(inner).strip().splitlines()
    first = redact_text(lines[0].strip())[:MAX_ERROR_CHARS] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def create_operation(
    session: Session, kind: str, params: dict[str, Any], *, function_id: str | None = None,
    total: int = 0,
) -> Operation:
    """Write a pending operation record."""
    op = Operation(kind=kind, params=redact(params), function_id=function_id, total=total)
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


def operation_view(op: Operation) -> dict[str, Any]:
    """An operation as the CLI and API show it."""
    return {
        "id": op.id,
        "kind": op.kind,
        "status": op.status,
        "params": op.params,
        "total": op.total,
        "done": op.done,
        "failed": op.failed,
        "result": op.result,
        "error": op.error,
        "created_at": iso(op.created_at),
        "started_at": iso(op.started_at),
        "finished_at": iso(op.finished_at),
        "progress_at": iso(op.progress_at),
        "redrives": op.redrives,  # times its first task was re-sent (workers.redrive)
    }


def record_result(db: Database, op_id: str, result: dict[str, Any]) -> None:
    """Finish a one-step operation (reap, reconcile...) with its result."""
    from workers.lifecycle import finish

    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None or op.status in OP_FINISHED:
            return
        op.total, op.done = 1, 1
        op.result = result
        finish(op, failed=0, total=1)
