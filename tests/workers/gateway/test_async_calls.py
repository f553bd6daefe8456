"""Asynchronous calls end to end: a real gateway, a real Celery worker, Redis, the store.

``POST /async-function/NAME`` stores and queues the call and answers 202 with its id;
the worker runs it through the gateway's own flow (a cold start included); ``GET
/calls/ID`` then answers the stored answer. Each test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import redis
from sqlalchemy import func, select

from tests.eventually import eventually
from tests.workers.gateway.conftest import CALLEE, Stack
from workers.store.models import Call, CallStatus


def _calls(stack: Stack) -> list[Call]:
    with stack.env.db.read() as s:
        return list(s.scalars(select(Call).order_by(Call.created_at)))


def _count(stack: Stack) -> int:
    with stack.env.db.read() as s:
        return int(s.scalar(select(func.count()).select_from(Call)) or 0)


def _finished(stack: Stack, call_id: str) -> Call:
    def over() -> Call | None:
        with stack.env.db.read() as s:
            call = s.get(Call, call_id)
            return call if call is not None and CallStatus(call.status).finished else None

    found = eventually(over, 60, f"call {call_id} finished")
    assert found is not None
    return found


def _ledger(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    return [(line.split()[0], int(line.split()[1])) for line in path.read_text().splitlines()]


def test_a_call_is_accepted_then_its_answer_is_stored(stack: Stack, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)})
    gw = stack.gateway()
    accepted = httpx.post(
        f"{gw.url}/async-function/callee/some/path?x=1",
        content=b"payload",
        headers={"X-Custom": "yes", "X-Call-Id": "forged"},
        timeout=30,
    )
    assert accepted.status_code == 202, accepted.text
    call_id = accepted.headers["x-call-id"]
    assert len(call_id) == 32 and call_id != "forged"
    assert accepted.json() == {"id": call_id, "status": "queued"}
    assert accepted.headers["location"] == f"/calls/{call_id}"

    call = _finished(stack, call_id)
    assert (call.status, call.attempts, call.answer_status) == (CallStatus.SUCCEEDED, 1, 200)
    shown = httpx.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert shown.status_code == 200
    assert shown.headers["x-call-status"] == "succeeded"
    assert shown.headers["x-call-attempts"] == "1"
    answer = shown.json()
    assert answer["call_id"] == call_id and answer["attempt"] == 1  # the replica saw both
    assert answer["body"] == "payload"
    assert _ledger(ledger) == [(call_id, 1)]
    stack.settled()  # the worker's gateway gives its claim back too


def test_a_pending_call_reads_202_and_an_unknown_one_404(stack: Stack, tmp_path: Path) -> None:
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(tmp_path / "ledger")})
    gw = stack.gateway()
    call_id = httpx.post(
        f"{gw.url}/async-function/callee?delay=2", timeout=30
    ).headers["x-call-id"]
    pending = httpx.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert pending.status_code == 202
    assert pending.json()["status"] in ("queued", "running")
    assert httpx.get(f"{gw.url}/calls/{'0' * 32}", timeout=10).status_code == 404
    assert httpx.get(f"{gw.url}/calls/not-an-id", timeout=10).status_code == 404
    assert httpx.get(f"{gw.url}/calls/{call_id}/more", timeout=10).status_code == 404
    assert _finished(stack, call_id).status == CallStatus.SUCCEEDED
    stack.settled()


def test_an_unknown_function_is_404_at_once_and_nothing_is_queued(stack: Stack) -> None:
    gw = stack.gateway()
    answer = httpx.post(f"{gw.url}/async-function/nosuch", content=b"x" * 1000, timeout=10)
    assert answer.status_code == 404
    assert "unknown function" in answer.text
    assert _count(stack) == 0
    client = redis.Redis.from_url(stack.env.settings.broker_url)
    try:
        assert client.llen("corral.invocations") == 0
    finally:
        client.close()


def test_only_post_is_accepted(stack: Stack, tmp_path: Path) -> None:
    stack.deploy("callee", image=CALLEE)
    gw = stack.gateway()
    answer = httpx.get(f"{gw.url}/async-function/callee", timeout=10)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert _count(stack) == 0


def test_the_same_idempotency_key_twice_runs_once(stack: Stack, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)})
    gw = stack.gateway()
    key = {"Idempotency-Key": "order-42"}
    first = httpx.post(f"{gw.url}/async-function/callee", headers=key, content=b"a", timeout=30)
    second = httpx.post(f"{gw.url}/async-function/callee", headers=key, content=b"b", timeout=30)
    assert first.status_code == second.status_code == 202
    assert first.headers["x-call-id"] == second.headers["x-call-id"]
    assert second.headers["idempotent-replayed"] == "true"
    call = _finished(stack, first.headers["x-call-id"])
    assert json.loads(call.answer_body or b"{}")["body"] == "a"  # the first request's
    other = httpx.post(
        f"{gw.url}/async-function/callee", headers={"Idempotency-Key": "order-43"}, timeout=30
    )
    _finished(stack, other.headers["x-call-id"])
    assert _count(stack) == 2
    assert sorted(_ledger(ledger)) == sorted(
        [(first.headers["x-call-id"], 1), (other.headers["x-call-id"], 1)]
    )
    stack.settled()


def test_a_failing_call_is_retried_then_answered(stack: Stack, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)}, call_attempts=3)
    gw = stack.gateway()
    call_id = httpx.post(f"{gw.url}/async-function/callee?fail=1", timeout=30).headers[
        "x-call-id"
    ]
    call = _finished(stack, call_id)
    assert (call.status, call.attempts, call.answer_status) == (CallStatus.SUCCEEDED, 2, 200)
    assert _ledger(ledger) == [(call_id, 1), (call_id, 2)]
    stack.settled()
