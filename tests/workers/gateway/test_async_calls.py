"""Asynchronous calls end to end: a real gateway, a real Celery worker, Redis, the store.

``POST /async-function/NAME`` stores and queues the call and answers 202 with its id;
the worker runs it through the gateway's own flow (a cold start included); ``GET
/calls/ID`` then answers the stored answer. Each test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import redis
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from sqlalchemy import func, select

from corral import api
from corral.cli import main
from netplumb.addresses import parse_url
from tasks.invocations import CALLS
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls
from testkit.eventually import eventually
from tests.celery_workers import worker_thread
from tests.fixtures import Env
from tests.helpers import deploy_fn
from tests.workers.gateway.conftest import CALLEE, Stack
from tests.workers.invocations.receiver import Receiver
from workers.gateway import serve_gateway
from workers.invocations import callbacks
from workers.observability import tracing
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


def _callback_over(stack: Stack, call_id: str) -> Call:
    def over() -> Call | None:
        call = _finished(stack, call_id)
        return call if call.callback_state in ("delivered", "failed") else None

    found = eventually(over, 60, f"call {call_id}'s callback over")
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
    accepted = httpcalls.post(
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
    shown = httpcalls.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert shown.status_code == 200
    assert shown.headers["x-call-status"] == "succeeded"
    assert shown.headers["x-call-attempts"] == "1"
    answer = shown.json()
    assert answer["call_id"] == call_id and answer["attempt"] == 1  # the replica saw both
    assert answer["body"] == "payload"
    assert _ledger(ledger) == [(call_id, 1)]
    stack.finish()  # the worker's gateway gives its claim back too


def test_a_pending_call_reads_202_and_an_unknown_one_404(stack: Stack, tmp_path: Path) -> None:
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(tmp_path / "ledger")})
    gw = stack.gateway()
    call_id = httpcalls.post(f"{gw.url}/async-function/callee?delay=2", timeout=30).headers[
        "x-call-id"
    ]
    pending = httpcalls.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert pending.status_code == 202
    assert pending.json()["status"] in ("queued", "running")
    assert httpcalls.get(f"{gw.url}/calls/{'0' * 32}", timeout=10).status_code == 404
    assert httpcalls.get(f"{gw.url}/calls/not-an-id", timeout=10).status_code == 404
    assert httpcalls.get(f"{gw.url}/calls/{call_id}/more", timeout=10).status_code == 404
    assert _finished(stack, call_id).status == CallStatus.SUCCEEDED
    stack.finish()


def test_an_unknown_function_is_404_at_once_and_nothing_is_queued(stack: Stack) -> None:
    gw = stack.gateway()
    answer = httpcalls.post(f"{gw.url}/async-function/nosuch", content=b"x" * 1000, timeout=10)
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
    answer = httpcalls.get(f"{gw.url}/async-function/callee", timeout=10)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert _count(stack) == 0


def test_the_same_idempotency_key_twice_runs_once(stack: Stack, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)})
    gw = stack.gateway()
    key = {"Idempotency-Key": "order-42"}
    first = httpcalls.post(f"{gw.url}/async-function/callee", headers=key, content=b"a", timeout=30)
    second = httpcalls.post(
        f"{gw.url}/async-function/callee", headers=key, content=b"b", timeout=30
    )
    assert first.status_code == second.status_code == 202
    assert first.headers["x-call-id"] == second.headers["x-call-id"]
    assert second.headers["idempotent-replayed"] == "true"
    call = _finished(stack, first.headers["x-call-id"])
    assert json.loads(call.answer_body or b"{}")["body"] == "a"  # the first request's
    other = httpcalls.post(
        f"{gw.url}/async-function/callee", headers={"Idempotency-Key": "order-43"}, timeout=30
    )
    _finished(stack, other.headers["x-call-id"])
    assert _count(stack) == 2
    assert sorted(_ledger(ledger)) == sorted(
        [(first.headers["x-call-id"], 1), (other.headers["x-call-id"], 1)]
    )
    stack.finish()


def test_a_failing_call_is_retried_then_answered(stack: Stack, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)}, call_attempts=3)
    gw = stack.gateway()
    call_id = httpcalls.post(f"{gw.url}/async-function/callee?fail=1", timeout=30).headers[
        "x-call-id"
    ]
    call = _finished(stack, call_id)
    assert (call.status, call.attempts, call.answer_status) == (CallStatus.SUCCEEDED, 2, 200)
    assert _ledger(ledger) == [(call_id, 1), (call_id, 2)]
    stack.finish()


def test_a_call_answered_500_is_retried_then_dead_then_redriven_and_answered(
    stack: Stack, tmp_path: Path
) -> None:
    stack.env.set(calls_backoff_s=0.05, calls_backoff_max_s=0.2)
    ledger = tmp_path / "ledger"
    env = {"CALLEE_LEDGER": str(ledger), "CALLEE_STATUS": "500"}
    stack.deploy("callee", image=CALLEE, env=env, call_attempts=2)
    gw = stack.gateway()
    call_id = httpcalls.post(f"{gw.url}/async-function/callee", timeout=30).headers["x-call-id"]
    dead = _finished(stack, call_id)
    assert (dead.status, dead.attempts, dead.answer_status) == (CallStatus.DEAD, 2, 500)
    assert dead.error is not None and dead.error.startswith(
        "gave up after 2 attempts: answered 500"
    )
    shown = httpcalls.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert (shown.status_code, shown.headers["x-call-status"]) == (500, "dead")  # its last answer

    stack.deploy("callee", image=CALLEE, env={**env, "CALLEE_STATUS": "200"}, call_attempts=2)
    stack.settled()  # the fixed build's replicas serve from now: no claim on the old one held
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["calls", "redrive", call_id, "--json"]) == 0
    assert json.loads(out.getvalue()) == {"redriven": [call_id]}
    call = _finished(stack, call_id)  # queued again by the redrive, until it is over
    assert call.status == CallStatus.SUCCEEDED, call.error
    assert (call.attempts, call.attempt_limit, call.redrives, call.answer_status) == (3, 4, 1, 200)
    assert _ledger(ledger) == [(call_id, 1), (call_id, 2), (call_id, 3)]
    assert httpcalls.get(f"{gw.url}/calls/{call_id}", timeout=10).status_code == 200
    stack.finish()


KEY = "callback-k3y"


def test_a_callback_is_delivered_signed(stack: Stack, tmp_path: Path) -> None:
    stack.env.set(callback_key=KEY, callback_hosts="127.0.0.2")
    stack.deploy("callee", image=CALLEE, env={"CALLEE_LEDGER": str(tmp_path / "ledger")})
    gw = stack.gateway()
    receiver = Receiver()
    try:
        url = f"http://127.0.0.2:{receiver.port}/hook?token=s3cret"
        call_id = httpcalls.post(
            f"{gw.url}/async-function/callee",
            content=b"hi",
            headers={"X-Callback-Url": url},
            timeout=30,
        ).headers["x-call-id"]
        eventually(lambda: receiver.got, 60, "the callback delivered")
        (headers, body, path) = receiver.got[0]
        assert path == "/hook?token=s3cret"
        assert headers["x-call-id"] == call_id
        assert (headers["x-call-status"], headers["x-function-status"]) == ("succeeded", "200")
        assert json.loads(body)["call_id"] == call_id  # the stored answer's body
        assert headers["content-type"] == "application/json"
        stamp, signature = headers["x-corral-timestamp"], headers["x-corral-signature"]
        assert callbacks.verify(KEY, stamp, signature, call_id, body)
        assert not callbacks.verify("another key", stamp, signature, call_id, body)
        assert not callbacks.verify(KEY, stamp, signature, call_id, body + b"!")
        assert not callbacks.verify(KEY, stamp, signature, "0" * 32, body)
        eventually(lambda: _finished(stack, call_id).callback_state == "delivered", 30, "recorded")
        shown = api.call(call_id)
        assert shown["callback"] is not None
        assert shown["callback"]["url"] == f"http://127.0.0.2:{receiver.port}/hook?***"
    finally:
        receiver.close()
    stack.finish()


def test_a_callback_host_off_the_allow_list_is_refused_at_once(stack: Stack) -> None:
    stack.env.set(callback_key=KEY, callback_hosts="127.0.0.2")
    stack.deploy("callee", image=CALLEE)
    gw = stack.gateway()
    for url in ("http://example.com/hook", "http://127.0.0.3/hook", "ftp://127.0.0.2/x"):
        answer = httpcalls.post(
            f"{gw.url}/async-function/callee", headers={"X-Callback-Url": url}, timeout=10
        )
        assert answer.status_code == 400, url
    assert _count(stack) == 0


def test_a_callback_to_corrals_own_listeners_or_nodes_is_refused(stack: Stack) -> None:
    stack.env.set(callback_key=KEY, callback_hosts="127.0.0.0/8")
    stack.deploy("callee", image=CALLEE)
    gw = stack.gateway()
    redis_port = parse_url(stack.env.settings.broker_url, {"redis": 6379}).port
    targets = {
        f"http://127.0.0.2:{redis_port}/": "one of corral's own listeners",  # the broker
        "http://127.0.0.1:9/": "node node1's address",  # the agent's host
    }
    for url, why in targets.items():
        call_id = httpcalls.post(
            f"{gw.url}/async-function/callee", headers={"X-Callback-Url": url}, timeout=10
        ).headers["x-call-id"]
        call = _callback_over(stack, call_id)
        assert call.callback_state == "failed"
        assert call.callback_error is not None and why in call.callback_error, call.callback_error
        assert call.callback_attempts == 1  # refused, not retried
    stack.finish()


def test_a_full_calls_queue_is_answered_429(broker_env: Env) -> None:
    """No worker consumes the queue here: its first message fills it."""
    broker_env.set(calls_queue_max=1)
    deploy_fn(broker_env, "fn")
    gateway = serve_gateway(broker_env.settings, "127.0.0.1:0", queue=HereFirst(QUEUE), calls=CALLS)
    try:
        assert httpcalls.post(f"{gateway.url}/async-function/fn", timeout=10).status_code == 202
        full = httpcalls.post(f"{gateway.url}/async-function/fn", content=b"x", timeout=10)
        assert full.status_code == 429 and full.headers["retry-after"]
        with broker_env.db.read() as s:
            assert s.scalar(select(func.count()).select_from(Call)) == 1  # nothing stored
        text = httpcalls.get(f"{gateway.url}/metrics", timeout=10).text
        assert 'corral_gateway_calls_total{code="429",function="fn"} 1.0' in text
        assert 'corral_gateway_calls_total{code="202",function="fn"} 1.0' in text
        assert "corral_gateway_call_accept_seconds_count 1.0" in text
    finally:
        gateway.stop()


def test_calls_are_listed_shown_and_purged_from_the_command_line(stack: Stack) -> None:
    stack.deploy("callee", image=CALLEE)
    gw = stack.gateway()
    accepted = httpcalls.post(f"{gw.url}/async-function/callee", content=b"hi", timeout=30)
    call_id = accepted.headers["x-call-id"]
    _finished(stack, call_id)

    def run(*argv: str) -> object:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(list(argv)) == 0
        return json.loads(out.getvalue())

    listed = run("calls", "--json", "--function", "callee")
    assert isinstance(listed, list) and [c["id"] for c in listed] == [call_id]
    assert listed[0]["status"] == "succeeded" and "answer" not in listed[0]
    shown = run("calls", "show", call_id, "--json")
    assert isinstance(shown, dict)
    assert shown["answer"]["status"] == 200 and shown["answer"]["encoding"] == "utf-8"
    assert json.loads(shown["answer"]["body"])["body"] == "hi"
    assert run("calls", "--json", "--status", "dead") == []
    assert run("calls", "purge", "--json") == {"purged": 0}  # finished just now: kept
    assert run("calls", "purge", "--older-than", "0", "--json") == {"purged": 1}
    assert _count(stack) == 0
    stack.finish()


CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_calls_attempts_are_spans_of_the_callers_trace(stack: Stack) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        stack.deploy("callee", image=CALLEE)
        gw = stack.gateway()
        parent = {"traceparent": f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"}
        call_id = httpcalls.post(
            f"{gw.url}/async-function/callee", headers=parent, timeout=30
        ).headers["x-call-id"]
        _finished(stack, call_id)

        def spans() -> dict[str, ReadableSpan] | None:
            got = {s.name: s for s in exporter.get_finished_spans()}
            wanted = {"POST /async-function/{name}", "call.attempt", "POST /function/{name}"}
            return got if wanted <= got.keys() else None

        got = eventually(spans, 30, "the call's spans")
        assert got is not None
        accept, attempt, served = (
            got["POST /async-function/{name}"],
            got["call.attempt"],
            got["POST /function/{name}"],
        )
        for span in (accept, attempt, served):
            assert span.context is not None
            assert format(span.context.trace_id, "032x") == CALLER_TRACE, span.name
        assert attempt.parent is not None and accept.context is not None
        assert attempt.parent.span_id == accept.context.span_id
        assert served.parent is not None and attempt.context is not None
        assert served.parent.span_id == attempt.context.span_id
        assert attempt.attributes is not None
        assert attempt.attributes["corral.call_id"] == call_id
        assert attempt.attributes["corral.call_verdict"] == "succeeded"
        assert (accept.kind, served.kind) == (SpanKind.SERVER, SpanKind.SERVER)
    finally:
        tracing.stop()
        provider.shutdown()
    stack.finish()


def test_an_answer_is_kept_up_to_its_bound_and_marked_cut(stack: Stack) -> None:
    stack.env.set(calls_answer_max=40)
    stack.deploy("callee", image=CALLEE)
    gw = stack.gateway()
    call_id = httpcalls.post(
        f"{gw.url}/async-function/callee", content=b"x" * 500, timeout=30
    ).headers["x-call-id"]
    call = _finished(stack, call_id)
    assert call.status == CallStatus.SUCCEEDED
    assert call.answer_truncated and len(call.answer_body or b"") == 40
    shown = httpcalls.get(f"{gw.url}/calls/{call_id}", timeout=10)
    assert shown.headers["x-call-answer-truncated"] == "true"
    assert len(shown.content) == 40 and shown.headers["content-length"] == "40"
    stack.finish()


def test_a_call_whose_function_was_removed_before_it_ran_is_dead_at_once(
    broker_env: Env,
) -> None:
    deploy_fn(broker_env, "fn")
    gateway = serve_gateway(broker_env.settings, "127.0.0.1:0", queue=HereFirst(QUEUE), calls=CALLS)
    try:
        call_id = httpcalls.post(f"{gateway.url}/async-function/fn", timeout=10).headers[
            "x-call-id"
        ]
    finally:
        gateway.stop()
    api.remove_function("fn")
    with worker_thread():  # the call's message runs only now
        with broker_env.db.read() as s:
            assert s.get(Call, call_id) is not None

        def over() -> Call | None:
            with broker_env.db.read() as s:
                call = s.get(Call, call_id)
                return call if call is not None and CallStatus(call.status).finished else None

        call = eventually(over, 60, "the call over")
    assert call is not None
    assert (call.status, call.attempts) == (CallStatus.DEAD, 1)  # not tried again
    assert call.error is not None and "the function is gone" in call.error
