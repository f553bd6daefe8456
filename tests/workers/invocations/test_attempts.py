"""An attempt from start to verdict, on SQLite and PostgreSQL: at least once, one terminal record.

A message delivered twice starts one attempt; an attempt whose lease lapsed (its worker
gone) is taken over; the attempt that lost the call cannot undo the one that took it
over, but an answer it got is kept; a trigger counts every terminal record written.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from sqlalchemy import update

from testkit import terminals
from tests.fixtures import Env
from tests.helpers import deploy_fn
from workers.base import clock
from workers.invocations import attempts, records
from workers.invocations.attempts import Answer, Attempt, Outcome, Verdict
from workers.invocations.records import StoredRequest
from workers.store.models import Call, CallStatus

REQUEST = StoredRequest("POST", "", "", (), b"x")
OK = Answer(200, (("content-type", "text/plain"),), b"done")
FAILED = Answer(503, body=b"busy\n", error="answered 503: busy")


@pytest.fixture
def env(store_env: Env) -> Iterator[Env]:
    """The store with every terminal record logged; fast backoffs."""
    store_env.set(calls_backoff_s=0.1, calls_backoff_max_s=0.2)
    terminals.install(store_env.db)
    yield store_env
    terminals.remove(store_env.db)


def _lease(seconds: float = 60.0) -> datetime:
    return clock.now() + timedelta(seconds=seconds)


def _call(env: Env, **fn: object) -> str:
    deploy_fn(env, "fn", **fn)
    return records.accept(env.db, env.settings, "fn", REQUEST).call_id


def _row(env: Env, call_id: str) -> Call:
    with env.db.read() as s:
        call = s.get(Call, call_id)
        assert call is not None
        return call


def _begin(env: Env, call_id: str, lease: datetime | None = None) -> Attempt:
    began = attempts.begin(env.db, env.settings, call_id, lease or _lease())
    assert isinstance(began, Attempt), began
    return began


def test_a_message_delivered_twice_starts_one_attempt(env: Env) -> None:
    call_id = _call(env)
    first = _begin(env, call_id)
    assert (first.number, first.function, first.request) == (1, "fn", REQUEST)
    again = attempts.begin(env.db, env.settings, call_id, _lease())
    assert isinstance(again, Outcome) and again.verdict == Verdict.SKIPPED
    assert "attempt 1 runs it" in again.note
    done = attempts.finish(env.db, env.settings, first, OK)
    assert done == Outcome(Verdict.SUCCEEDED)
    late = attempts.begin(env.db, env.settings, call_id, _lease())  # a late redelivery
    assert isinstance(late, Outcome) and late.verdict == Verdict.SKIPPED
    call = _row(env, call_id)
    assert (call.status, call.attempts, call.answer_status, call.answer_body) == (
        CallStatus.SUCCEEDED,
        1,
        200,
        b"done",
    )
    assert call.resend_at is None and call.owner is None
    assert terminals.seen(env.db) == {call_id: 1}


def test_a_lapsed_attempt_is_taken_over_and_cannot_undo_its_successor(env: Env) -> None:
    call_id = _call(env)
    lost = _begin(env, call_id, lease=clock.now() - timedelta(seconds=1))  # its worker died
    second = _begin(env, call_id)
    assert second.number == 2 and second.token != lost.token
    stale = attempts.finish(env.db, env.settings, lost, FAILED)  # its retry is not its to make
    assert stale.verdict == Verdict.SKIPPED
    assert _row(env, call_id).status == CallStatus.RUNNING
    assert attempts.finish(env.db, env.settings, second, OK).verdict == Verdict.SUCCEEDED
    assert terminals.seen(env.db) == {call_id: 1}


def test_an_answer_the_lapsed_attempt_got_is_kept_and_its_successor_adds_none(env: Env) -> None:
    call_id = _call(env)
    lost = _begin(env, call_id, lease=clock.now() - timedelta(seconds=1))
    second = _begin(env, call_id)
    assert attempts.finish(env.db, env.settings, lost, OK).verdict == Verdict.SUCCEEDED
    after = attempts.finish(env.db, env.settings, second, FAILED)
    assert after.verdict == Verdict.SKIPPED
    again = attempts.finish(env.db, env.settings, second, OK)
    assert again.verdict == Verdict.SKIPPED  # one terminal record, whoever comes second
    assert _row(env, call_id).status == CallStatus.SUCCEEDED
    assert terminals.seen(env.db) == {call_id: 1}


def test_a_failing_call_is_retried_then_dead_with_its_last_answer(env: Env) -> None:
    env.set(calls_backoff_s=5, calls_backoff_max_s=10)
    call_id = _call(env, call_attempts=2)
    first = _begin(env, call_id)
    retry = attempts.finish(env.db, env.settings, first, FAILED)
    assert retry.verdict == Verdict.RETRY and 2.5 <= retry.countdown <= 5
    call = _row(env, call_id)
    assert (call.status, call.error, call.answer_status) == (
        CallStatus.RETRYING,
        "answered 503: busy",
        503,
    )
    early = attempts.begin(env.db, env.settings, call_id, _lease())  # before its backoff
    assert isinstance(early, Outcome) and early.verdict == Verdict.SKIPPED and early.countdown > 0
    clock.travel(6)
    second = _begin(env, call_id)
    dead = attempts.finish(env.db, env.settings, second, Answer(None, error="no answer"))
    assert dead.verdict == Verdict.DEAD
    call = _row(env, call_id)
    assert call.status == CallStatus.DEAD
    assert call.error == "gave up after 2 attempts: no answer"
    assert call.answer_status is None  # the last attempt got no answer: none kept
    assert terminals.seen(env.db) == {call_id: 1}


def test_a_429s_retry_after_is_honoured_up_to_the_largest_backoff(env: Env) -> None:
    call_id = _call(env, call_attempts=3)
    slow = Answer(429, (("Retry-After", "30"),), b"")
    retry = attempts.finish(env.db, env.settings, _begin(env, call_id), slow)
    assert retry.verdict == Verdict.RETRY and retry.countdown == 0.2  # capped


def test_a_call_past_its_age_or_attempts_dies_when_its_message_comes(env: Env) -> None:
    old = _call(env, call_max_age=5)
    clock.travel(6)
    expired = attempts.begin(env.db, env.settings, old, _lease())
    assert isinstance(expired, Outcome) and expired.verdict == Verdict.DEAD
    assert "expired" in expired.note
    spent = _call(env, call_attempts=1)
    _begin(env, spent, lease=clock.now() - timedelta(seconds=1))  # its worker died
    gave_up = attempts.begin(env.db, env.settings, spent, _lease())
    assert isinstance(gave_up, Outcome) and gave_up.verdict == Verdict.DEAD
    assert "the last stopped reporting" in gave_up.note
    assert terminals.seen(env.db) == {old: 1, spent: 1}


def test_no_retry_is_scheduled_past_the_calls_age(env: Env) -> None:
    call_id = _call(env, call_attempts=5, call_max_age=1)
    first = _begin(env, call_id)
    with env.db.transaction() as s:  # its age ends before any backoff could
        s.execute(
            update(Call)
            .where(Call.id == call_id)
            .values(expires_at=clock.now() + timedelta(seconds=0.01))
        )
    dead = attempts.finish(env.db, env.settings, first, FAILED)
    assert dead.verdict == Verdict.DEAD
    assert "its max age ends before another attempt" in dead.note


def test_a_callback_is_due_once_the_call_is_over(env: Env) -> None:
    deploy_fn(env, "fn")
    call_id = records.accept(
        env.db, env.settings, "fn", REQUEST, callback="http://127.0.0.2/hook"
    ).call_id
    done = attempts.finish(env.db, env.settings, _begin(env, call_id), OK)
    assert done == Outcome(Verdict.SUCCEEDED, callback=True)
    call = _row(env, call_id)
    assert call.callback_state == "pending" and call.callback_at is not None


def test_run_counts_a_runner_that_raises_as_no_answer(env: Env) -> None:
    call_id = _call(env, call_attempts=1)

    def broken(_: Attempt) -> Answer:
        raise RuntimeError("boom")

    outcome = attempts.run(env.db, env.settings, call_id, _lease(), broken)
    assert outcome.verdict == Verdict.DEAD
    assert "the attempt failed to run: RuntimeError: boom" in (_row(env, call_id).error or "")
