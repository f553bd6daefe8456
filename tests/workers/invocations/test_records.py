"""Calls as rows, on SQLite and PostgreSQL: accepting (idempotency keys), redriving, purging."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from tests.fixtures import Env
from tests.helpers import deploy_fn
from workers.base import clock
from workers.base.errors import InputError, NotFound
from workers.invocations import records
from workers.invocations.records import StoredRequest
from workers.store.models import Call, CallStatus

REQUEST = StoredRequest("POST", "/p", "q=1", (("x-a", "b"),), b"body", "127.0.0.1")


def _calls(env: Env) -> list[Call]:
    with env.db.read() as s:
        return list(s.scalars(select(Call).order_by(Call.created_at)))


def test_a_call_is_stored_with_its_functions_limits(store_env: Env) -> None:
    deploy_fn(store_env, "fn", call_attempts=7, call_max_age=60)
    accepted = records.accept(store_env.db, store_env.settings, "fn", REQUEST)
    (call,) = _calls(store_env)
    assert (accepted.call_id, accepted.status, accepted.replayed) == (
        call.id,
        CallStatus.QUEUED,
        False,
    )
    assert (call.method, call.path, call.query, call.body) == ("POST", "/p", "q=1", b"body")
    assert call.headers == [["x-a", "b"]] and call.client == "127.0.0.1"
    assert (call.attempts, call.attempt_limit) == (0, 7)
    assert abs((call.expires_at - call.created_at).total_seconds() - 60) < 1
    deploy_fn(store_env, "plain")
    records.accept(store_env.db, store_env.settings, "plain", REQUEST)
    plain = _calls(store_env)[1]
    assert plain.attempt_limit == store_env.settings.calls_max_attempts


def test_an_unknown_function_or_a_bad_key_changes_nothing(store_env: Env) -> None:
    deploy_fn(store_env, "fn")
    with pytest.raises(NotFound):
        records.accept(store_env.db, store_env.settings, "nosuch", REQUEST)
    for bad in ("", "has space", "x" * 256, "caf\u00e9"):
        with pytest.raises(InputError):
            records.accept(store_env.db, store_env.settings, "fn", REQUEST, key=bad)
    assert _calls(store_env) == []


def test_a_key_names_one_call_per_function_within_its_window(store_env: Env) -> None:
    deploy_fn(store_env, "fn")
    deploy_fn(store_env, "other")
    db, settings = store_env.db, store_env.settings
    first = records.accept(db, settings, "fn", REQUEST, key="k1")
    again = records.accept(db, settings, "fn", REQUEST, key="k1")
    assert again.call_id == first.call_id and again.replayed
    elsewhere = records.accept(db, settings, "other", REQUEST, key="k1")
    assert elsewhere.call_id != first.call_id and not elsewhere.replayed
    clock.travel(settings.calls_idempotency_window_s + 1)  # past the window: a new call
    later = records.accept(db, settings, "fn", REQUEST, key="k1")
    assert later.call_id != first.call_id and not later.replayed
    assert records.accept(db, settings, "fn", REQUEST, key="k1").call_id == later.call_id
    with db.read() as s:
        old = s.get(Call, first.call_id)
        assert old is not None and old.idempotency_key is None  # the old call kept, no key
    assert len(_calls(store_env)) == 3


def test_the_same_key_at_once_from_many_threads_makes_one_call(store_env: Env) -> None:
    """The store's unique index decides, not a look first: one insert wins, the rest read it."""
    deploy_fn(store_env, "fn")
    db, settings = store_env.db, store_env.settings
    barrier = threading.Barrier(8)
    got: list[records.Accepted] = []
    errors: list[BaseException] = []

    def accept() -> None:
        barrier.wait()
        try:
            got.append(records.accept(db, settings, "fn", REQUEST, key="same"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=accept) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len({a.call_id for a in got}) == 1
    assert sum(not a.replayed for a in got) == 1  # exactly one made it
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(Call)) == 1


def test_withdraw_takes_back_only_a_call_never_started(store_env: Env) -> None:
    deploy_fn(store_env, "fn")
    db, settings = store_env.db, store_env.settings
    gone = records.accept(db, settings, "fn", REQUEST)
    kept = records.accept(db, settings, "fn", REQUEST)
    with db.transaction() as s:
        s.execute(update(Call).where(Call.id == kept.call_id).values(attempts=1))
    assert records.withdraw(db, gone.call_id)
    assert not records.withdraw(db, kept.call_id)
    assert [c.id for c in _calls(store_env)] == [kept.call_id]


def _dead(env: Env, call_id: str, attempts: int = 3) -> None:
    with env.db.transaction() as s:
        s.execute(
            update(Call)
            .where(Call.id == call_id)
            .values(
                status=CallStatus.DEAD.value,
                attempts=attempts,
                finished_at=clock.now(),
                resend_at=None,
                error="gave up",
            )
        )


def test_redrive_opens_dead_calls_again_with_a_fresh_budget(store_env: Env) -> None:
    deploy_fn(store_env, "fn", call_attempts=2)
    db, settings = store_env.db, store_env.settings
    dead = records.accept(db, settings, "fn", REQUEST).call_id
    alive = records.accept(db, settings, "fn", REQUEST).call_id
    _dead(store_env, dead)
    assert records.redrive(db, settings, [alive]) == []  # not dead: left alone
    assert records.redrive(db, settings, function="fn") == [dead]
    with db.read() as s:
        call = s.get(Call, dead)
        assert call is not None
        assert (call.status, call.attempts, call.attempt_limit, call.redrives) == (
            CallStatus.QUEUED,
            3,
            5,
            1,
        )
        assert call.finished_at is None and call.resend_at is not None
    assert records.redrive(db, settings, [dead]) == []  # queued now: a second redrive is a no-op
    with pytest.raises(NotFound):
        records.redrive(db, settings, ["not-an-id"])


def test_purge_removes_old_finished_calls_and_those_beyond_the_count(store_env: Env) -> None:
    deploy_fn(store_env, "fn")
    db, settings = store_env.db, store_env.settings
    ids = [records.accept(db, settings, "fn", REQUEST).call_id for _ in range(5)]
    for i, call_id in enumerate(ids[:4]):
        _dead(store_env, call_id)
        with db.transaction() as s:  # finished one after the other, an hour apart
            s.execute(
                update(Call)
                .where(Call.id == call_id)
                .values(finished_at=clock.now() - timedelta(hours=10 - i))
            )
    assert records.purge(db, settings, older_than_s=8.5 * 3600) == 2  # 10 h and 9 h ago
    assert records.purge(db, settings, older_than_s=10**6, keep_max=1) == 1  # the oldest left
    left = {c.id for c in _calls(store_env)}
    assert left == {ids[3], ids[4]}  # the newest finished one, and the open one
    with pytest.raises(InputError):
        records.purge(db, settings, older_than_s=-1)


def test_a_view_never_shows_a_callbacks_query_or_credentials(store_env: Env) -> None:
    deploy_fn(store_env, "fn")
    db, settings = store_env.db, store_env.settings
    url = "https://hooks.example.com:8443/cb?token=s3cret"
    call_id = records.accept(db, settings, "fn", REQUEST, callback=url).call_id
    with db.read() as s:
        view = records.call_view(records.get_call(s, call_id), answer=True)
    assert view["callback"] is not None
    assert view["callback"]["url"] == "https://hooks.example.com:8443/cb?***"
    assert "s3cret" not in repr(view)
    assert view["answer"] is None and view["path"] == "/p?q=1"
