"""One attempt of a call: started by one conditional UPDATE, ended by a verdict.

:func:`begin` takes the call for this attempt - it must be queued, due for a retry, or
held by an attempt whose lease lapsed, with attempts and age left - in one statement,
judged on the store's clock; a message delivered twice, or one whose call is held by a
live attempt, starts nothing. A call whose attempts or age are spent is settled dead
there and then. The attempt holds the call under its *owner* token until
``lease_until`` (the task's hard time limit: past it, its worker is gone).

:func:`finish` records what the attempt got (:class:`Answer`) as the table in
:mod:`workers.invocations` says: succeeded from any attempt while the call is open;
retrying or dead only by the attempt that holds it. :func:`run` is an attempt from start
to verdict, with its span in the call's trace and its count in the metrics.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import redis
from sqlalchemy import DateTime, and_, bindparam, case, func, or_, select, update

from config.settings import Settings
from workers.base.clock import now
from workers.invocations import stats
from workers.invocations.records import StoredRequest
from workers.observability import tracing
from workers.store.db import Database, store_now
from workers.store.models import CALL_OPEN, Call, CallStatus, new_id

log = logging.getLogger(__name__)

EARLY_PAUSE_S = 0.05  # a retry's message that came early is sent again at least this late
ERROR_MAX = 2000  # characters of an error kept


class Verdict(enum.StrEnum):
    """What became of a call's message."""

    SUCCEEDED = "succeeded"  # the call's terminal record: an answer not retried
    RETRY = "retry"  # another attempt after ``countdown`` seconds
    DEAD = "dead"  # the call's terminal record: attempts or age spent
    SKIPPED = "skipped"  # nothing to do (``note`` says why; ``countdown``: send it again then)


@dataclass(frozen=True)
class Outcome:
    """A message's verdict; ``callback``: the call's callback is due, queue its delivery."""

    verdict: Verdict
    note: str = ""
    countdown: float = 0.0
    callback: bool = False


@dataclass(frozen=True)
class Attempt:
    """One attempt of a call: which, who holds it, and the request to run."""

    call_id: str
    function: str
    number: int
    token: str
    request: StoredRequest
    trace: dict[str, Any] | None = None


@dataclass(frozen=True)
class Answer:
    """What an attempt got: an answer (its status, headers, body) or none (``status`` None)."""

    status: int | None
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    truncated: bool = False
    error: str | None = None  # what went wrong (no answer, or the gateway's own answer)
    final: bool = False  # no other attempt could do better (its function was removed)

    @property
    def retried(self) -> bool:
        """Whether this answer is tried again: none at all, 429, or a 5xx (unless final)."""
        return self.status is None or self.status == 429 or self.status >= 500

    @property
    def retry_after_s(self) -> float | None:
        """The answer's ``Retry-After`` in seconds (a number of them only), if any."""
        for name, value in self.headers:
            if name.lower() == "retry-after" and value.strip().isdigit():
                return float(value.strip())
        return None

    def describe(self) -> str:
        """The error to record for a retried answer."""
        if self.error:
            return self.error[:ERROR_MAX]
        return f"answered {self.status}"


def backoff_s(settings: Settings, attempt: int, retry_after_s: float | None = None) -> float:
    """Seconds before the attempt after ``attempt``: exponential, capped, equal jitter.

    The ceiling is ``CORRAL_CALLS_BACKOFF_S`` doubled per attempt made, at most
    ``CORRAL_CALLS_BACKOFF_MAX_S``; the wait is drawn between half of it and all of it
    (the rule :func:`workers.celery.backoff_s` follows for tasks). A ``Retry-After`` longer
    than that is honoured, up to the largest ceiling.
    """
    ceiling = min(settings.calls_backoff_max_s, settings.calls_backoff_s * 2 ** (attempt - 1))
    wait = random.uniform(ceiling / 2, ceiling)  # noqa: S311 - retry jitter, not a secret
    if retry_after_s is not None:
        wait = max(wait, min(retry_after_s, settings.calls_backoff_max_s))
    return wait


_OPEN = Call.status.in_(CALL_OPEN)
_AT = bindparam("at", type_=DateTime())
# Built once (a statement's construction costs more CPU than its round trip).
_BEGIN = (
    update(Call)
    .where(
        Call.id == bindparam("call_id"),
        Call.attempts < Call.attempt_limit,
        Call.expires_at > store_now(),
        or_(
            Call.status == CallStatus.QUEUED.value,
            and_(Call.status == CallStatus.RETRYING.value, Call.next_at <= store_now()),
            and_(Call.status == CallStatus.RUNNING.value, Call.lease_until < store_now()),
        ),
    )
    .values(
        status=CallStatus.RUNNING.value,
        attempts=Call.attempts + 1,
        owner=bindparam("token"),
        lease_until=bindparam("lease_until", type_=DateTime()),
        started_at=func.coalesce(Call.started_at, _AT),
        next_at=_AT,
        resend_at=bindparam("resend", type_=DateTime()),
        updated_at=_AT,
    )
    .returning(
        Call.function,
        Call.attempts,
        Call.method,
        Call.path,
        Call.query,
        Call.headers,
        Call.body,
        Call.client,
        Call.scheme,
        Call.trace,
    )
)
_SUCCEED = (
    update(Call)
    .where(Call.id == bindparam("call_id"), _OPEN)
    .values(
        status=CallStatus.SUCCEEDED.value,
        finished_at=_AT,
        updated_at=_AT,
        owner=None,
        lease_until=None,
        resend_at=None,
        error=None,
        callback_state=case((Call.callback_url.is_(None), None), else_="pending"),
        callback_at=case(
            (Call.callback_url.is_(None), None),
            else_=bindparam("callback_at", type_=DateTime()),
        ),
        answer_status=bindparam("answer_status"),
        answer_headers=bindparam("answer_headers", type_=Call.__table__.c.answer_headers.type),
        answer_body=bindparam("answer_body", type_=Call.__table__.c.answer_body.type),
        answer_truncated=bindparam("answer_truncated"),
    )
    .returning(Call.callback_url)
)


def begin(
    db: Database, settings: Settings, call_id: str, lease_until: datetime
) -> Attempt | Outcome:
    """Take the call for a new attempt held until ``lease_until``; else why not (an Outcome)."""
    token = new_id()
    at = now()
    params = {
        "call_id": call_id,
        "token": token,
        "lease_until": lease_until,
        "at": at,
        "resend": lease_until + timedelta(seconds=settings.calls_resend_s),
    }
    with db.statements() as conn:  # one statement: the attempt's start needs no transaction
        taken = conn.execute(_BEGIN, params).first()
        if taken is not None:
            request = StoredRequest(
                method=taken.method,
                path=taken.path,
                query=taken.query,
                headers=tuple((str(k), str(v)) for k, v in taken.headers or ()),
                body=taken.body or b"",
                client=taken.client,
                scheme=taken.scheme,
            )
            return Attempt(call_id, taken.function, taken.attempts, token, request, taken.trace)
    return _not_begun(db, settings, call_id)


def _not_begun(db: Database, settings: Settings, call_id: str) -> Outcome:
    """Why a call's message started no attempt; a call out of attempts or age is settled dead."""
    with db.transaction() as s:
        call = s.get(Call, call_id, with_for_update=True)
        if call is None:
            return Outcome(Verdict.SKIPPED, "unknown call (purged, or never stored)")
        at = now()
        status = CallStatus(call.status)
        if status.finished:
            return Outcome(Verdict.SKIPPED, f"{status.value} already")
        live = call.lease_until is not None and call.lease_until >= at
        if status == CallStatus.RUNNING and live:
            return Outcome(Verdict.SKIPPED, f"attempt {call.attempts} runs it")
        if call.attempts >= call.attempt_limit:
            last = (call.error or "no record of how it ended").rstrip(".")
            reason = f"gave up after {call.attempts} attempts: {last}"
            if status == CallStatus.RUNNING:
                reason = (
                    f"gave up after {call.attempts} attempts: the last stopped reporting "
                    "(its worker was lost)"
                )
        elif call.expires_at <= at:
            reason = f"expired: no attempt started within its max age ({call.expires_at}Z)"
        else:  # a retry's message that came early: send it again when it is due
            wait = max(EARLY_PAUSE_S, (call.next_at - at).total_seconds())
            return Outcome(Verdict.SKIPPED, "not due yet", countdown=wait)
        _settle(call, CallStatus.DEAD, at, settings, error=reason)
        return Outcome(Verdict.DEAD, reason, callback=call.callback_url is not None)


def _settle(
    call: Call, status: CallStatus, at: datetime, settings: Settings, *, error: str | None
) -> None:
    """Write a call's terminal record on its locked row."""
    call.status = status
    call.finished_at = at
    call.updated_at = at
    call.owner = call.lease_until = call.resend_at = None
    call.error = error
    if call.callback_url:
        call.callback_state = "pending"
        call.callback_at = at + timedelta(seconds=settings.calls_resend_s)


def _answer_values(answer: Answer) -> dict[str, Any]:
    return {
        "answer_status": answer.status,
        "answer_headers": [list(h) for h in answer.headers] if answer.status is not None else None,
        "answer_body": answer.body if answer.status is not None else None,
        "answer_truncated": answer.truncated,
    }


def finish(db: Database, settings: Settings, attempt: Attempt, answer: Answer) -> Outcome:
    """Record what ``attempt`` got: succeeded, a retry after a backoff, or dead."""
    at = now()
    if not answer.retried:
        params = {
            "call_id": attempt.call_id,
            "at": at,
            "callback_at": at + timedelta(seconds=settings.calls_resend_s),
            **_answer_values(answer),
        }
        with db.statements() as conn:
            done = conn.execute(_SUCCEED, params).first()
        if done is None:
            return Outcome(Verdict.SKIPPED, "finished already: this answer is not kept")
        return Outcome(Verdict.SUCCEEDED, callback=done.callback_url is not None)
    with db.transaction() as s:
        call = s.scalars(
            select(Call)
            .where(
                Call.id == attempt.call_id,
                Call.status == CallStatus.RUNNING.value,
                Call.owner == attempt.token,
            )
            .with_for_update()
        ).first()
        if call is None:
            return Outcome(Verdict.SKIPPED, "another attempt holds the call: this one is dropped")
        for column, value in _answer_values(answer).items():
            setattr(call, column, value)
        wait = backoff_s(settings, attempt.number, answer.retry_after_s)
        error = answer.describe()
        if answer.final:
            _settle(call, CallStatus.DEAD, at, settings, error=error)
            return Outcome(Verdict.DEAD, error, callback=call.callback_url is not None)
        if attempt.number < call.attempt_limit and at + timedelta(seconds=wait) < call.expires_at:
            call.status = CallStatus.RETRYING
            call.owner = call.lease_until = None
            call.next_at = at + timedelta(seconds=wait)
            call.resend_at = call.next_at + timedelta(seconds=settings.calls_resend_s)
            call.updated_at = at
            call.error = error
            return Outcome(Verdict.RETRY, error, countdown=wait)
        why = (
            f"gave up after {attempt.number} attempts"
            if attempt.number >= call.attempt_limit
            else "its max age ends before another attempt"
        )
        reason = f"{why}: {error}"
        _settle(call, CallStatus.DEAD, at, settings, error=reason)
        return Outcome(Verdict.DEAD, reason, callback=call.callback_url is not None)


Runner = Callable[[Attempt], Answer]


def run(  # noqa: PLR0913 - one message's parts, the rest by name
    db: Database,
    settings: Settings,
    call_id: str,
    lease_until: datetime,
    runner: Runner,
    *,
    counters: redis.Redis | None = None,
) -> Outcome:
    """One message of a call: begin an attempt, run it with ``runner``, record the verdict."""
    began = begin(db, settings, call_id, lease_until)
    if isinstance(began, Outcome):
        _count(counters, began)
        return began
    attributes = {
        "corral.call_id": call_id,
        "corral.call_attempt": began.number,
        "corral.function": began.function,
    }
    with tracing.span(
        "call.attempt", parent=tracing.context_of(began.trace), attributes=attributes
    ) as span:
        try:
            answer = runner(began)
        except Exception as exc:  # the runner's own failure: the attempt got no answer
            log.exception("call %s attempt %d failed to run", call_id, began.number)
            answer = Answer(None, error=f"the attempt failed to run: {type(exc).__name__}: {exc}")
        outcome = finish(db, settings, began, answer)
        if span is not None:
            span.set_attribute("corral.call_verdict", outcome.verdict.value)
            if answer.status is not None:
                span.set_attribute("http.response.status_code", answer.status)
    _count(counters, outcome)
    return outcome


def _count(counters: redis.Redis | None, outcome: Outcome) -> None:
    """Add a verdict to the shared counters (a metric is not worth failing the call over)."""
    if counters is None or outcome.verdict == Verdict.SKIPPED:
        return
    try:
        stats.count(counters, outcome.verdict.value)
    except redis.RedisError as exc:
        log.warning("could not count a call's %s: %s", outcome.verdict.value, exc)
