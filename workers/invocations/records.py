"""Calls as rows: accepting one (its idempotency key), reading them, redriving, purging.

:func:`accept` writes a call with its function's limits (attempts, the age no attempt
may start after) in one statement - an INSERT from a SELECT of the function, so a
function removed meanwhile inserts nothing - committed alone (the 202's hot path: no
transaction round trips). With an ``Idempotency-Key`` the row is inserted ``ON CONFLICT DO NOTHING``
on the unique (function, key) index: of two requests with one key, at once or apart,
exactly one inserts, and the other reads the row the first wrote (PostgreSQL makes the
second wait for the first's commit). A key older than
``CORRAL_CALLS_IDEMPOTENCY_WINDOW_S`` is taken off its old call, and the new call takes it.

:func:`redrive` opens dead calls again; :func:`purge` removes finished calls by age and
beyond a count; :func:`call_view` is a call as the CLI and ``GET /calls/ID`` show it.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NotRequired, TypedDict
from urllib.parse import urlsplit

from sqlalchemy import Connection, bindparam, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import iso, now
from workers.base.errors import InputError, NotFound
from workers.base.names import check_name
from workers.store.db import Database, seconds_after
from workers.store.models import CALL_FINISHED, Call, CallStatus, Function, new_id

MAX_KEY = 255  # characters of an Idempotency-Key
PURGE_BATCH = 1000
LIST_MAX = 10_000


@dataclass(frozen=True)
class StoredRequest:
    """A request as the gateway would forward it (text is latin-1: every byte kept)."""

    method: str
    path: str  # the raw path after /async-function/NAME ("" or "/...")
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    client: str | None = None  # the caller's address (X-Forwarded-For)
    scheme: str = "http"


@dataclass(frozen=True)
class Accepted:
    """What :func:`accept` did: the call's id and status; ``replayed``: the key's earlier call."""

    call_id: str
    status: CallStatus
    replayed: bool = False


@dataclass(frozen=True)
class StoredAnswer:
    """A call's last answer as kept: its status (None: it got none), headers, body."""

    status: int | None
    headers: tuple[tuple[str, str], ...]
    body: bytes
    truncated: bool  # the body was cut at CORRAL_CALLS_ANSWER_MAX bytes

    @classmethod
    def of(cls, call: Call) -> StoredAnswer:
        """The answer a call row keeps."""
        return cls(
            status=call.answer_status,
            headers=tuple((str(k), str(v)) for k, v in call.answer_headers or ()),
            body=call.answer_body or b"",
            truncated=call.answer_truncated,
        )


def check_key(key: str | None) -> str | None:
    """An ``Idempotency-Key`` (printable ASCII, at most 255 characters), else InputError."""
    if key is None:
        return None
    if not key or len(key) > MAX_KEY or not all(0x20 < ord(c) < 0x7F for c in key):
        raise InputError(
            f"Idempotency-Key must be 1 to {MAX_KEY} visible ASCII characters, no spaces"
        )
    return key


def limits(fn: Function | None, settings: Settings) -> tuple[int, float]:
    """A function's attempts per call and max age in seconds (its own, else the defaults)."""
    attempts = fn.call_attempts if fn is not None else None
    age = fn.call_max_age_s if fn is not None else None
    return attempts or settings.calls_max_attempts, age or settings.calls_max_age_s


#: The columns :func:`accept` writes from its parameters (the rest come from the function).
_WRITTEN = (
    "id",
    "function",
    "status",
    "idempotency_key",
    "method",
    "path",
    "query",
    "headers",
    "body",
    "client",
    "scheme",
    "trace",
    "attempts",
    "next_at",
    "resend_at",
    "redrives",
    "created_at",
    "updated_at",
    "answer_truncated",
    "callback_url",
    "callback_attempts",
)


@functools.cache
def _statements(sqlite_store: bool) -> tuple[Any, Any]:
    """The INSERT of a call from a SELECT of its function, built once per dialect: plain,
    and ``ON CONFLICT DO NOTHING`` on the idempotency key (both ``RETURNING`` its id)."""
    columns = Call.__table__.c
    values = [bindparam(name, type_=columns[name].type) for name in _WRITTEN]
    made = (sqlite.insert if sqlite_store else postgresql.insert)(Call).from_select(
        [*_WRITTEN, "attempt_limit", "expires_at"],
        select(
            *values,
            func.coalesce(Function.call_attempts, bindparam("default_attempts")),
            seconds_after(
                bindparam("at", type_=columns.created_at.type),
                func.coalesce(Function.call_max_age_s, bindparam("default_age")),
            ),
        ).where(Function.name == bindparam("function_name")),
    )
    keyed = made.on_conflict_do_nothing(index_elements=["function", "idempotency_key"])
    return made.returning(Call.id), keyed.returning(Call.id)


def accept(  # noqa: PLR0913 - the request, the rest by name
    db: Database,
    settings: Settings,
    function: str,
    request: StoredRequest,
    *,
    key: str | None = None,
    callback: str | None = None,
    trace: dict[str, str] | None = None,
) -> Accepted:
    """Store a call of ``function`` (queued), or find the one its ``key`` names already.

    Raises :class:`~workers.base.errors.NotFound` for an unknown function.
    """
    key = check_key(key)
    check_name(function)
    at = now()
    params: dict[str, Any] = {
        "id": new_id(),
        "function": function,
        "function_name": function,
        "status": CallStatus.QUEUED.value,
        "idempotency_key": key,
        "method": request.method,
        "path": request.path,
        "query": request.query,
        "headers": [list(pair) for pair in request.headers],
        "body": request.body,
        "client": request.client,
        "scheme": request.scheme,
        "trace": trace,
        "attempts": 0,
        "next_at": at,
        "resend_at": at + timedelta(seconds=settings.calls_resend_s),
        "redrives": 0,
        "created_at": at,
        "updated_at": at,
        "answer_truncated": False,
        "callback_url": callback,
        "callback_attempts": 0,
        "at": at,
        "default_attempts": settings.calls_max_attempts,
        "default_age": settings.calls_max_age_s,
    }
    plain, keyed = _statements(db.is_sqlite)
    with db.statements() as conn:
        if key is None:
            if conn.execute(plain, params).first() is None:
                raise NotFound(f"unknown function {function!r}")
            return Accepted(str(params["id"]), CallStatus.QUEUED)
        window = at - timedelta(seconds=settings.calls_idempotency_window_s)
        return _keyed(conn, keyed, params, window)


def _keyed(
    conn: Connection, insert: Any, params: dict[str, Any], window_start: datetime
) -> Accepted:
    """Insert a call with a key, unless the key names a call of the window already."""
    key, function = params["idempotency_key"], params["function"]
    for _ in range(3):
        made = conn.execute(insert, params).scalar()
        if made is not None:
            return Accepted(made, CallStatus.QUEUED)
        held = conn.execute(
            select(Call.id, Call.status, Call.created_at).where(
                Call.function == function, Call.idempotency_key == key
            )
        ).first()
        if held is None:
            if not conn.execute(select(Function.id).where(Function.name == function)).first():
                raise NotFound(f"unknown function {function!r}")
            continue  # purged meanwhile: insert again
        if held.created_at >= window_start:
            return Accepted(held.id, CallStatus(held.status), replayed=True)
        # past the window: the key is free again; the old call keeps no key
        conn.execute(
            update(Call)
            .where(Call.id == held.id, Call.idempotency_key == key)
            .values(idempotency_key=None)
        )
    raise InputError(f"Idempotency-Key {key!r} is contended: try again")


def withdraw(db: Database, call_id: str) -> bool:
    """Remove a call whose message could not be sent (never started); whether it was."""
    with db.transaction() as s:
        gone = s.execute(
            delete(Call)
            .where(Call.id == call_id, Call.status == CallStatus.QUEUED.value, Call.attempts == 0)
            .returning(Call.id)
        ).first()
        return gone is not None


def check_call_id(value: str) -> str:
    """A call id (32 hex characters), else :class:`NotFound` (an id is not guessable)."""
    if not isinstance(value, str) or len(value) != 32 or not all(c in _HEX for c in value):
        raise NotFound(f"unknown call {value[:40]!r}")
    return value


_HEX = frozenset("0123456789abcdef")


def get_call(session: Session, call_id: str) -> Call:
    """The call ``call_id``, or :class:`NotFound`."""
    call = session.get(Call, check_call_id(call_id))
    if call is None:
        raise NotFound(f"unknown call {call_id!r}")
    return call


class AnswerView(TypedDict):
    """A call's stored answer: its status, headers and body (UTF-8 text, else base64)."""

    status: int
    headers: list[list[str]]
    body: str
    encoding: str  # "utf-8" or "base64"
    truncated: bool  # the body was cut at CORRAL_CALLS_ANSWER_MAX bytes


class CallbackView(TypedDict):
    """A call's callback: where (its query masked), and how its delivery went."""

    url: str
    state: str | None  # pending, delivered, failed (None: the call is not over)
    attempts: int
    status: int | None  # the receiver's last answer
    error: str | None


class CallView(TypedDict):
    """A call as ``corral calls`` and ``GET /calls/ID`` show it."""

    id: str
    function: str
    status: str
    method: str
    path: str
    attempts: int
    attempt_limit: int
    redrives: int
    created_at: str | None
    started_at: str | None
    finished_at: str | None
    expires_at: str | None
    next_at: str | None
    error: str | None
    answer_status: int | None
    idempotency_key: str | None
    callback: CallbackView | None
    answer: NotRequired[AnswerView | None]  # (a call shown alone)


def masked_url(url: str) -> str:
    """A URL without its credentials and query (they may carry a token)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}" + ("?***" if parts.query else "")


def call_view(call: Call, *, answer: bool = False) -> CallView:
    """The call as shown; with ``answer``, its stored answer too."""
    path = call.path or "/"
    view: CallView = {
        "id": call.id,
        "function": call.function,
        "status": CallStatus(call.status).value,
        "method": call.method,
        "path": path + (f"?{call.query}" if call.query else ""),
        "attempts": call.attempts,
        "attempt_limit": call.attempt_limit,
        "redrives": call.redrives,
        "created_at": iso(call.created_at),
        "started_at": iso(call.started_at),
        "finished_at": iso(call.finished_at),
        "expires_at": iso(call.expires_at),
        "next_at": iso(call.next_at) if call.status == CallStatus.RETRYING else None,
        "error": call.error,
        "answer_status": call.answer_status,
        "idempotency_key": call.idempotency_key,
        "callback": None,
    }
    if call.callback_url:
        view["callback"] = {
            "url": masked_url(call.callback_url),
            "state": call.callback_state,
            "attempts": call.callback_attempts,
            "status": call.callback_status,
            "error": call.callback_error,
        }
    if answer:
        view["answer"] = answer_view(call)
    return view


def answer_view(call: Call) -> AnswerView | None:
    """The call's stored answer (None: it has none)."""
    if call.answer_status is None:
        return None
    body = call.answer_body or b""
    try:
        text, encoding = body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(body).decode("ascii"), "base64"
    return {
        "status": call.answer_status,
        "headers": [list(h) for h in call.answer_headers or []],
        "body": text,
        "encoding": encoding,
        "truncated": call.answer_truncated,
    }


def list_calls(
    session: Session,
    *,
    function: str | None = None,
    status: str | None = None,
    limit: int = 50,
) -> list[Call]:
    """Calls, newest first (of one function, in one status)."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIST_MAX:
        raise InputError(f"limit must be 1 to {LIST_MAX}, got {limit!r}")
    query = select(Call).order_by(Call.created_at.desc(), Call.id).limit(limit)
    if function is not None:
        query = query.where(Call.function == check_name(function))
    if status is not None:
        query = query.where(Call.status == _status(status).value)
    return list(session.scalars(query))


def _status(text: str) -> CallStatus:
    try:
        return CallStatus(text)
    except ValueError:
        names = ", ".join(s.value for s in CallStatus)
        raise InputError(f"unknown call status {text!r}; use one of {names}") from None


def redrive(
    db: Database,
    settings: Settings,
    ids: Sequence[str] = (),
    *,
    function: str | None = None,
    limit: int = 1000,
) -> list[str]:
    """Open dead calls again - these, or those of ``function``, or all - with a fresh budget.

    Each keeps its id and attempt count, gets its function's attempts and age anew from
    now, and counts one more redrive; the ids returned are to be sent (the sweep sends a
    call again if that fails). A call that is not dead is left alone.
    """
    for call_id in ids:
        check_call_id(call_id)
    with db.transaction() as s:
        query = select(Call).where(Call.status == CallStatus.DEAD.value)
        if ids:
            query = query.where(Call.id.in_(list(ids)))
        if function is not None:
            query = query.where(Call.function == check_name(function))
        calls = list(s.scalars(query.order_by(Call.finished_at).limit(limit).with_for_update()))
        names = {c.function for c in calls}
        fns = {fn.name: fn for fn in s.scalars(select(Function).where(Function.name.in_(names)))}
        at = now()
        for call in calls:
            attempts, age = limits(fns.get(call.function), settings)
            call.status = CallStatus.QUEUED
            call.attempt_limit = call.attempts + attempts
            call.expires_at = at + timedelta(seconds=age)
            call.next_at = at
            call.resend_at = at + timedelta(seconds=settings.calls_resend_s)
            call.finished_at = None
            call.owner = call.lease_until = None
            call.redrives += 1
            call.updated_at = at
            call.callback_state = call.callback_at = call.callback_error = None
            call.callback_status = None
            call.callback_attempts = 0
        return [c.id for c in calls]


def purge(
    db: Database,
    settings: Settings,
    *,
    older_than_s: float | None = None,
    keep_max: int | None = None,
    batches: int | None = None,
) -> int:
    """Delete finished calls finished ``older_than_s`` ago (default ``CORRAL_CALLS_KEEP_S``),
    and the oldest beyond ``keep_max``; how many. ``batches`` bounds the work (the sweep)."""
    age = settings.calls_keep_s if older_than_s is None else older_than_s
    if isinstance(age, bool) or not isinstance(age, int | float) or age < 0:
        raise InputError(f"older-than must be a number of seconds >= 0, got {age!r}")
    cutoff = now() - timedelta(seconds=age)
    removed, rounds = 0, 0
    while batches is None or rounds < batches:
        rounds += 1
        with db.transaction() as s:
            ids = list(
                s.scalars(
                    select(Call.id)
                    .where(Call.finished_at < cutoff, Call.status.in_(CALL_FINISHED))
                    .limit(PURGE_BATCH)
                )
            )
            if not ids and keep_max is not None:
                ids = list(
                    s.scalars(
                        select(Call.id)
                        .where(Call.status.in_(CALL_FINISHED), Call.finished_at.is_not(None))
                        .order_by(Call.finished_at.desc())
                        .offset(keep_max)
                        .limit(PURGE_BATCH)
                    )
                )
            if not ids:
                break
            s.execute(delete(Call).where(Call.id.in_(ids)))
        removed += len(ids)
    return removed
