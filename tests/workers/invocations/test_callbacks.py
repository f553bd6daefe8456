"""Callbacks: the allow-list, the signature, where they may never go, and delivery's verdicts."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from pydantic import SecretStr

from config.settings import ConfigError, Settings, load_settings
from tests.fixtures import Env
from tests.helpers import deploy_fn
from tests.workers.invocations.receiver import Receiver
from workers.base import clock
from workers.fleet.nodes import upsert_node
from workers.invocations import attempts, callbacks, records
from workers.invocations.attempts import Answer, Attempt
from workers.invocations.callbacks import CallbackRefused, check_url
from workers.invocations.records import StoredRequest
from workers.store.models import Call

KEY = "k3y"


def _settings(hosts: str, key: str | None = KEY) -> Settings:
    return load_settings(
        callback_hosts=hosts, callback_key=SecretStr(key) if key else None, eager=True
    )


def test_a_url_must_be_allowed_signed_and_plain() -> None:
    allowed = _settings("hooks.example.com, *.example.org, 10.0.0.0/8, [::1]")
    assert check_url("https://hooks.example.com/cb?x=1", allowed).target == "/cb?x=1"
    assert check_url("http://a.b.example.org:8080", allowed).port == 8080
    assert check_url("http://10.1.2.3/", allowed).by_name is False
    assert check_url("http://[::1]:9000/", allowed).host == "::1"
    for refused in (
        "https://evil.example.com/",  # not listed
        "https://example.org/",  # *.example.org is below it only
        "https://hooks.example.com.evil.net/",
        "http://11.0.0.1/",  # outside the network
        "ftp://hooks.example.com/",
        "https://user:pw@hooks.example.com/",
        "https://hooks.example.com/a b",
        "not a url",
        "https://hooks.example.com:99999/",
    ):
        with pytest.raises(CallbackRefused):
            check_url(refused, allowed)
    with pytest.raises(CallbackRefused, match="CORRAL_CALLBACK_KEY"):
        check_url("https://hooks.example.com/", _settings("hooks.example.com", key=None))
    with pytest.raises(ConfigError):
        load_settings(callback_hosts="not a host!")


def test_a_signature_covers_the_timestamp_the_call_and_the_body() -> None:
    stamp = int(clock.epoch())
    signature = callbacks.sign(KEY, stamp, "c" * 32, b"body")
    assert signature.startswith("v1=") and len(signature) == 67
    assert callbacks.verify(KEY, str(stamp), signature, "c" * 32, b"body")
    assert not callbacks.verify(KEY, str(stamp + 1), signature, "c" * 32, b"body")
    assert not callbacks.verify(KEY, str(stamp), signature, "d" * 32, b"body")
    assert not callbacks.verify(KEY, str(stamp), signature, "c" * 32, b"bodY")
    assert not callbacks.verify("other", str(stamp), signature, "c" * 32, b"body")
    assert not callbacks.verify(KEY, "soon", signature, "c" * 32, b"body")
    old = callbacks.sign(KEY, stamp - 600, "c" * 32, b"body")
    assert not callbacks.verify(KEY, str(stamp - 600), old, "c" * 32, b"body")  # replayed late


def test_corrals_own_listeners_nodes_and_replica_networks_are_never_reached(
    store_env: Env,
) -> None:
    settings = store_env.set(
        callback_key=KEY,
        callback_hosts="127.0.0.0/8, 10.0.0.0/8, localhost",
        replica_networks="10.9.0.0/16",
        registry_listen="127.0.0.1:50052",
    )
    with store_env.db.transaction() as s:
        upsert_node(s, "127.0.0.5:50051", name="n1")

    def why(url: str) -> str:
        with pytest.raises(CallbackRefused) as refused:
            callbacks.destination(store_env.db, settings, check_url(url, settings))
        return str(refused.value)

    assert "corral's own listeners" in why("http://127.0.0.9:50052/")  # the registry
    assert "node n1" in why("http://127.0.0.5:8000/")
    assert "replicas' networks" in why("http://10.9.1.1/")
    ip = callbacks.destination(
        store_env.db, settings, check_url("http://127.0.0.2:8000/", settings)
    )
    assert str(ip) == "127.0.0.2"  # a loopback address the allow-list names itself
    settings = store_env.set(callback_hosts="localhost")  # a name only: it may not lead inward
    assert "a name may not lead to a loopback" in why("http://localhost:8000/")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    """A callback receiver that answers 503, then 200."""
    running = Receiver(503, 200)
    yield running
    running.close()


def _finished_with_callback(env: Env, url: str) -> str:
    deploy_fn(env, "fn")
    request = StoredRequest("POST", "", "", (), b"")
    call_id = records.accept(env.db, env.settings, "fn", request, callback=url).call_id
    began = attempts.begin(env.db, env.settings, call_id, clock.now() + timedelta(seconds=60))
    assert isinstance(began, Attempt)
    answer = Answer(201, (("content-type", "text/plain"),), b"made")
    assert attempts.finish(env.db, env.settings, began, answer).callback
    return call_id


def test_a_delivery_is_retried_on_5xx_then_delivered(store_env: Env, receiver: Receiver) -> None:
    store_env.set(callback_key=KEY, callback_hosts="127.0.0.2")
    call_id = _finished_with_callback(store_env, f"{receiver.url}/cb")
    first = callbacks.deliver(store_env.db, store_env.settings, call_id)
    assert first.state == "retry" and first.countdown > 0
    second = callbacks.deliver(store_env.db, store_env.settings, call_id)
    assert second.state == "delivered"
    assert callbacks.deliver(store_env.db, store_env.settings, call_id).state == "skipped"
    assert len(receiver.got) == 2
    headers, body, _ = receiver.got[1]
    assert (body, headers["content-type"], headers["x-function-status"]) == (
        b"made",
        "text/plain",
        "201",
    )
    with store_env.db.read() as s:
        call = s.get(Call, call_id)
        assert call is not None
        assert (call.callback_state, call.callback_attempts, call.callback_status) == (
            "delivered",
            2,
            200,
        )


def test_a_delivery_refused_by_its_receiver_or_unreachable_ends_failed(store_env: Env) -> None:
    store_env.set(callback_key=KEY, callback_hosts="127.0.0.2", callback_attempts=2)
    refusing = Receiver(400)
    try:
        call_id = _finished_with_callback(store_env, f"{refusing.url}/cb")
        failed = callbacks.deliver(store_env.db, store_env.settings, call_id)
        assert (failed.state, failed.note) == ("failed", "the receiver answered 400")
    finally:
        refusing.close()
    gone = _finished_with_callback(store_env, f"{refusing.url}/cb")  # nobody listens now
    assert callbacks.deliver(store_env.db, store_env.settings, gone).state == "retry"
    last = callbacks.deliver(store_env.db, store_env.settings, gone)
    assert last.state == "failed" and last.note.startswith("gave up after 2 deliveries")
