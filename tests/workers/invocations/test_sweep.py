"""The calls' sweep on the real broker (no worker: its messages stay queued to be counted)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
from sqlalchemy import select, update

from tasks.invocations import CALLS
from tests.fixtures import Env
from tests.helpers import deploy_fn
from workers.base import clock
from workers.invocations import attempts, records, sweep
from workers.invocations.attempts import Attempt
from workers.invocations.records import StoredRequest
from workers.store.models import Call, CallStatus

REQUEST = StoredRequest("POST", "", "", (), b"")


@pytest.fixture
def client(broker_env: Env) -> Iterator[redis.Redis]:
    """The broker's Redis."""
    broker_env.set(calls_resend_s=5)
    connection = redis.Redis.from_url(broker_env.settings.broker_url)
    yield connection
    connection.close()


def _sent(client: redis.Redis, queue: str = "corral.invocations") -> list[tuple[str, str]]:
    """(task, call id) of every message waiting in the calls' queue."""
    out = []
    for raw in client.lrange(queue, 0, -1):
        message = json.loads(raw)
        body = json.loads(__import__("base64").b64decode(message["body"]))
        out.append((message["headers"]["task"], body[0][0]))
    return out


def test_lost_messages_are_sent_again_once_per_interval_never_into_a_backlog(
    broker_env: Env, client: redis.Redis
) -> None:
    env = broker_env
    deploy_fn(env, "fn")
    db, settings = env.db, env.settings
    queued = records.accept(db, settings, "fn", REQUEST).call_id  # its message was lost
    lapsed = records.accept(db, settings, "fn", REQUEST).call_id
    began = attempts.begin(db, settings, lapsed, clock.now() + timedelta(seconds=30))
    assert isinstance(began, Attempt)  # its worker dies: nothing moves it after its lease
    done = records.accept(db, settings, "fn", REQUEST, callback="http://127.0.0.2/").call_id
    finished = attempts.begin(db, settings, done, clock.now() + timedelta(seconds=60))
    assert isinstance(finished, Attempt)
    attempts.finish(db, settings, finished, attempts.Answer(200))
    assert sweep.sweep(db, settings, CALLS).as_dict() == {
        "resent": 0,
        "callbacks_resent": 0,
        "purged": 0,
        "error": None,
    }  # nothing is late yet
    clock.travel(6)
    report = sweep.sweep(db, settings, CALLS)
    assert (report.resent, report.callbacks_resent) == (1, 1)  # the queued one; the callback
    assert sorted(_sent(client)) == sorted(
        [("corral.invoke", queued), ("corral.call_callback", done)]
    )
    clock.travel(60)  # now the lapsed attempt's lease and a resend interval have passed too
    report = sweep.sweep(db, settings, CALLS)
    # the lapsed one; not the queued one: the message sent for it still waits in the queue
    assert report.resent == 1
    invokes = sorted(cid for task, cid in _sent(client) if task == "corral.invoke")
    assert invokes == sorted([queued, lapsed])
    assert sweep.sweep(db, settings, CALLS).resent == 0  # moved on: not every pass
    client.delete("corral.invocations")  # the queue lost its messages (a broker crash)
    clock.travel(6)
    assert sweep.sweep(db, settings, CALLS).resent == 2  # the queued call's once more, now
    invokes = sorted(cid for task, cid in _sent(client) if task == "corral.invoke")
    assert invokes == sorted([queued, lapsed])  # (and the lapsed one's: nobody took it)
    with db.read() as s:
        statuses = dict(s.execute(select(Call.id, Call.status)).all())
    assert statuses[done] == CallStatus.SUCCEEDED.value


def test_old_finished_calls_are_purged(broker_env: Env, client: redis.Redis) -> None:
    env = broker_env
    env.set(calls_keep_s=60, calls_keep_max=100)
    deploy_fn(env, "fn")
    db, settings = env.db, env.settings
    old = records.accept(db, settings, "fn", REQUEST).call_id
    with db.transaction() as s:
        s.execute(
            update(Call)
            .where(Call.id == old)
            .values(status=CallStatus.DEAD.value, finished_at=clock.now(), resend_at=None)
        )
    assert sweep.sweep(db, settings, CALLS).purged == 0
    clock.travel(61)
    assert sweep.sweep(db, settings, CALLS).purged == 1
