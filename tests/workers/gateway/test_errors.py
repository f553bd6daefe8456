"""Each error answer of the gateway, with real HTTP, broker, worker and process agent."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr
from sqlalchemy import text

from corral import api
from corral.cli import main
from testkit import httpcalls
from testkit.eventually import eventually
from tests.workers.gateway.conftest import HOSTILE, WARM_WAIT_S, Stack
from workers.gateway import ListenRefused, check_listen
from workers.store.models import ReplicaState


def test_unknown_function_is_404_and_starts_nothing(stack: Stack) -> None:
    gw = stack.gateway()
    for path in ("/function/ghost", "/function/ghost/x?y=1", "/function/Not_A_Name"):
        answer = httpcalls.get(gw.url + path, timeout=30)
        assert answer.status_code == 404, path
        assert "unknown function" in answer.text or "function name" in answer.text
    assert stack.creates() == 0


def test_a_body_over_the_limit_is_413_before_anything_is_claimed(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo")
    gw = stack.gateway(gateway_max_body=1000)
    ok = httpcalls.post(f"{gw.url}/function/echo", content=b"x" * 1000, timeout=60)
    assert ok.status_code == 200 and ok.content == b"x" * 1000
    announced = httpcalls.post(f"{gw.url}/function/echo", content=b"x" * 1001, timeout=30)
    assert announced.status_code == 413

    def chunked() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(20):
            yield b"y" * 100

    streamed = httpcalls.post(f"{gw.url}/function/echo", content=chunked(), timeout=30)
    assert streamed.status_code == 413
    assert stack.creates() == 1
    stack.finish()


def test_no_replica_within_the_cold_start_timeout_is_503_with_retry_after(stack: Stack) -> None:
    stack.deploy("never", readiness="guest")  # no guest ever says READY here
    gw = stack.gateway(gateway_cold_start_timeout_s=1.0)
    started = time.monotonic()
    answer = httpcalls.get(f"{gw.url}/function/never", timeout=30)
    assert answer.status_code == 503
    assert int(answer.headers["retry-after"]) > 0
    assert "no ready replica of never after 1s" in answer.text
    assert 1.0 <= time.monotonic() - started < 10
    # the gateway asked for one replica; its create goes through the broker and a worker,
    # which a loaded machine had not yet sent when the 503 came back
    eventually(lambda: stack.creates() >= 1, 30, "the one create the cold start asked for")
    assert stack.creates() == 1 and stack.claims() == 0


@pytest.mark.parametrize("pairing", [("postgres", "python")], ids=["postgres-python"])
def test_a_lock_held_past_the_lock_timeout_delays_a_cold_start_instead_of_failing_it(
    stack: Stack,
) -> None:
    """PostgreSQL only: SQLite has no row locks (its busy timeout is a whole-store wait)."""
    stack.deploy("hello")
    gw = stack.gateway()
    hold_s = stack.env.settings.db_lock_timeout_s + 1.5
    held, done = threading.Event(), threading.Event()

    def holder() -> None:  # another transaction holding the function's row
        with stack.env.db.transaction() as s:
            s.execute(text("SELECT id FROM functions WHERE name = 'hello' FOR UPDATE"))
            held.set()
            done.wait(hold_s)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        started = time.monotonic()
        answer = httpcalls.get(f"{gw.url}/function/hello", timeout=60)
        # before: 503 "the store is unavailable" at the lock timeout, with 20 s still left
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - started >= stack.env.settings.db_lock_timeout_s
    finally:
        done.set()
        thread.join(30)


def test_a_replica_that_fails_is_retired_and_an_idempotent_request_retried(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect", max=5)
    gw = stack.gateway()
    view = api.wait(api.spawn("reflect", 2), timeout=60)
    assert view["status"] == "succeeded", view
    good, bad = stack.replicas("reflect")
    held = api.claim("reflect")  # one environment held elsewhere: the gateway gets the other
    if held["replica_id"] == bad.id:
        good, bad = bad, good
    assert bad.vmid is not None
    stack.kill_vm(bad.vmid)

    answer = httpcalls.get(f"{gw.url}/function/reflect", timeout=60)
    assert answer.status_code == 200  # served by a replica other than the dead one
    assert answer.headers["x-reflect-vmid"] not in (bad.vmid, "")
    rows = {r.id: r for r in stack.replicas("reflect")}
    assert rows[bad.id].status in (ReplicaState.DELETING, ReplicaState.DELETED)
    assert (rows[bad.id].error or "").startswith("suspect: ")
    assert api.release(held["claim_id"])["released"]
    stack.finish()


def test_a_warm_idempotent_call_whose_replica_closes_unanswered_is_answered_by_another(
    stack: Stack, tmp_path: Path
) -> None:
    """The Python path sends it to another claim and retires the replica that closed it.

    HAProxy does not (no L7 retry: what it costs, docs/security.md): the call is a 502
    and its function takes the Python path from then on (the answer counts as refused)."""
    stack.deploy("hostile", image=HOSTILE, max=2, exec_envs=1)
    gw = stack.gateway(gateway_keep_s=60.0)
    assert api.wait(api.spawn("hostile", 2), timeout=60)["status"] == "succeeded"
    slow = f"{gw.url}/function/hostile/slow"

    async def both() -> list[int]:  # the gateway takes both environments
        async with httpx.AsyncClient(timeout=60) as client:
            return [a.status_code for a in await asyncio.gather(client.get(slow), client.get(slow))]

    assert asyncio.run(both()) == [200, 200]
    if gw.warm is not None:  # both lent to HAProxy, its map entry in: the next call is warm
        router = gw.warm.router
        assert router is not None
        eventually(  # (cis612: ready servers, the map entry not yet in: the Python path)
            lambda: (
                (r := router.routes.get("hostile")) is not None and r.live and len(r.ready()) == 2
            ),
            WARM_WAIT_S,
            "both replicas lent to HAProxy",
        )
    flag = tmp_path / "hung-up"
    answer = httpcalls.get(f"{gw.url}/function/hostile/hangup?flag={flag}", timeout=60)
    assert flag.exists()  # a replica did close it unanswered
    if gw.warm is not None:
        assert gw.warm.router is not None
        assert answer.status_code == 502
        demoted = gw.warm.router.counts.demoted
        eventually(lambda: "hostile" in demoted, WARM_WAIT_S, "hostile demoted")
        assert httpcalls.get(f"{gw.url}/function/hostile", timeout=60).status_code == 200
        return
    assert (answer.status_code, answer.text) == (200, "ok")  # another replica answered
    (retired,) = eventually(
        lambda: [r for r in stack.replicas("hostile") if r.error],
        WARM_WAIT_S,
        "the replica that closed the call retired",
    )
    assert (retired.error or "").startswith("suspect: ")
    assert retired.status in (ReplicaState.DELETING, ReplicaState.DELETED)
    assert httpcalls.get(f"{gw.url}/function/hostile", timeout=60).status_code == 200


def test_a_non_idempotent_request_to_a_failed_replica_is_502_without_retry(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect", max=5)
    gw = stack.gateway()
    assert api.wait(api.spawn("reflect", 1), timeout=60)["status"] == "succeeded"
    (bad,) = stack.replicas("reflect")
    assert bad.vmid is not None
    stack.kill_vm(bad.vmid)
    answer = httpcalls.post(f"{gw.url}/function/reflect", content=b"once", timeout=60)
    assert answer.status_code == 502
    assert "failed to answer" in answer.text
    assert stack.creates() == 1  # not tried again: no cold start for a second replica
    (row,) = stack.replicas("reflect")
    assert row.status in (ReplicaState.DELETING, ReplicaState.DELETED)
    assert stack.claims() == 0


def test_requests_beyond_the_queue_are_429(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo", max=1, exec_envs=1)
    gw = stack.gateway(gateway_queue=2)
    assert httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code == 200  # warm

    async def gauge(name: str, value: int) -> None:
        """Until the gateway's metric ``name`` for echo reads ``value``."""
        line = f'{name}{{function="echo"}} {value:.1f}'
        metrics = f"{gw.url}/metrics"

        def shown() -> bool:
            return line in httpcalls.get(metrics, timeout=30).text

        await asyncio.to_thread(eventually, shown, 10, line)

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            busy = asyncio.ensure_future(client.get(f"{gw.url}/function/echo?delay=3"))
            await gauge("corral_inflight", 1)  # it holds the only environment
            queued = [
                asyncio.ensure_future(client.get(f"{gw.url}/function/echo?delay=0.1"))
                for _ in range(2)
            ]
            await gauge("corral_queue_depth", 2)
            refused = await client.get(f"{gw.url}/function/echo")
            assert refused.headers["retry-after"] == "1"
            metrics = (await client.get(f"{gw.url}/metrics")).text
            assert 'corral_queue_depth{function="echo"} 2.0' in metrics
            assert 'corral_inflight{function="echo"} 1.0' in metrics
            rest = await asyncio.gather(busy, *queued)
            return [refused.status_code] + [r.status_code for r in rest]

    assert asyncio.run(run()) == [429, 200, 200, 200]
    assert stack.creates() == 1
    stack.finish()


def test_a_call_past_the_timeout_is_504_and_releases(stack: Stack) -> None:
    stack.deploy("echo", image="examples.echo")
    gw = stack.gateway(gateway_timeout_s=1.0)
    answer = httpcalls.get(f"{gw.url}/function/echo?delay=5", timeout=30)
    assert answer.status_code == 504
    stack.settled()
    (row,) = stack.replicas("echo")
    assert (row.status, row.envs_in_use) == (ReplicaState.IDLE, 0)  # slow is not broken


def test_a_token_is_required_and_not_forwarded(stack: Stack) -> None:
    stack.deploy("reflect", image="examples.reflect")
    gw = stack.gateway(gateway_token=SecretStr("s3cret"))
    assert httpcalls.get(f"{gw.url}/function/reflect", timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpcalls.get(f"{gw.url}/function/reflect", headers=wrong, timeout=30).status_code == 401
    assert httpcalls.get(f"{gw.url}/metrics", timeout=30).status_code == 401
    assert httpcalls.get(f"{gw.url}/healthz", timeout=30).status_code == 200
    assert stack.creates() == 0
    right = {"Authorization": "Bearer s3cret"}
    answer = httpcalls.get(f"{gw.url}/function/reflect", headers=right, timeout=60)
    assert answer.status_code == 200
    assert "authorization" not in answer.json()["headers"]
    assert httpcalls.get(f"{gw.url}/metrics", headers=right, timeout=30).status_code == 200


def test_no_listening_off_loopback_without_a_token(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = stack.env.settings
    with pytest.raises(ListenRefused, match="CORRAL_GATEWAY_TOKEN"):
        check_listen(settings, "0.0.0.0:8080")
    assert check_listen(settings, "0.0.0.0:8080", insecure=True) == ("0.0.0.0", 8080)
    with_token = settings.model_copy(update={"gateway_token": SecretStr("t")})
    assert check_listen(with_token, "0.0.0.0:8080") == ("0.0.0.0", 8080)
    assert check_listen(settings, "127.0.0.1:0") == ("127.0.0.1", 0)
    assert check_listen(settings, "[::1]:9000") == ("::1", 9000)
    assert main(["gateway", "--listen", "0.0.0.0:0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        "corral: error: corral gateway refuses to listen on 0.0.0.0 "
        "without a token: set CORRAL_GATEWAY_TOKEN"
    )
    assert err.count("\n") == 1
