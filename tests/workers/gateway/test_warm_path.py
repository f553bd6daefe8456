"""The HAProxy data plane's own behaviour: what it carries, what it gives back, how it mends.

Real HTTP, HAProxy, broker, worker and process agent, on both stores (the router's
claims go through the ledger and the store as the Python path's do). What both data
planes share is tested on both in the other modules; here is what only the warm path
has: calls carried by HAProxy and their environments given back, demand beyond it
moved to the activator and back, a replica it cannot reach retired, HAProxy restarted,
functions demoted, and routing changes while calls keep coming.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from corral import api
from testkit import httpcalls
from testkit.eventually import eventually
from tests.dataplanes import need
from tests.fixtures import STORES, Env
from tests.workers.gateway.conftest import HOSTILE, WARM_WAIT_S, Stack, data_path
from workers.autoscale import demand
from workers.gateway import RunningGateway
from workers.gateway.haproxy.router import Router
from workers.gateway.haproxy.runtime import Commands, parse_stat
from workers.store.models import ReplicaState


@pytest.fixture(params=STORES)
def pairing(request: pytest.FixtureRequest) -> tuple[str, str]:
    """Each store, with HAProxy (the directory's pairs give one store the Python path)."""
    return request.param, need("haproxy")


@pytest.fixture
def warm_stack(thread_worker: Env, caplog: pytest.LogCaptureFixture) -> Iterator[Stack]:
    """Broker, worker, store and a process agent, the gateways with HAProxy in front.

    The router's INFO lines (each server closed, and why) go with a failure's report."""
    caplog.set_level(logging.INFO, logger="workers.gateway.haproxy.router")
    with data_path(thread_worker, need("haproxy")) as running:
        yield running


def _router(gw: RunningGateway) -> Router:
    assert gw.warm is not None and gw.warm.router is not None
    return gw.warm.router


def _lent(gw: RunningGateway, name: str) -> int:
    """Connections HAProxy may open to ``name``'s ready servers (0 while it routes none:
    no route, or its map entry not yet in HAProxy - calls go to the activator then)."""
    route = _router(gw).routes.get(name)  # a route comes and goes with its servers
    return 0 if route is None or not route.live else sum(s.maxconn for s in route.ready())


def _haproxy_view(gw: RunningGateway, name: str) -> str:
    """HAProxy's counters of ``name``'s backend (``show stat``: a failure's detail)."""
    route = _router(gw).routes.get(name)
    if route is None:
        return f"no route for {name}"
    assert gw.warm is not None
    commands = Commands(gw.warm.layout.admin)
    try:
        (stat,) = commands.ask("show stat")
    finally:
        commands.close()
    return "\n".join(str(row) for row in parse_stat(stat) if row.backend == route.backend)


def _peak(gw: RunningGateway, name: str) -> int:
    """The most calls of ``name`` a ready server of it had at once this keep window."""
    route = _router(gw).routes.get(name)
    return 0 if route is None else max((s.peak for s in route.ready()), default=0)


def _lending(gw: RunningGateway, stack: Stack, name: str) -> str:
    """What HAProxy has of ``name`` and what the store holds: a failed wait's detail."""
    router = _router(gw)
    route = router.routes.get(name)
    servers = [] if route is None else list(route.servers.values())
    told = [(s.name, s.state, len(s.claims), s.owed, s.surplus, s.suspect) for s in servers]
    return (
        f"servers {told}; demoted {router.counts.demoted.get(name)!r};"
        f" replicas {[(r.id[:8], r.status.name, r.envs_in_use) for r in stack.replicas(name)]};"
        f" claims {stack.claims()}"
    )


def _python_calls(gw: RunningGateway, name: str) -> float:
    """Calls of ``name`` the gateway behind HAProxy answered itself."""
    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("corral_function_invocations_total{") and f'"{name}"' in line
    )


def _warm_calls(gw: RunningGateway, name: str) -> float:
    """Calls of ``name`` HAProxy carried to its replicas (``corral_warm_requests_total``)."""
    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    line = f'corral_warm_requests_total{{function="{name}"}} '
    return sum(float(x[len(line) :]) for x in text.splitlines() if x.startswith(line))


def _get_at_once(url: str, n: int) -> list[int]:
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            return [
                a.status_code for a in await asyncio.gather(*(client.get(url) for _ in range(n)))
            ]

    return asyncio.run(run())


KEEP_S = 3.0  # the keep window: the environment goes back once unused this long


def test_warm_calls_go_through_haproxy_and_their_environment_back_after_the_keep_window(
    warm_stack: Stack,
) -> None:
    warm_stack.deploy("hello", max=2, exec_envs=2)
    gw = warm_stack.gateway(gateway_keep_s=KEEP_S)
    assert "haproxy" in gw.dataplane
    warm_stack.warm(gw, "hello")  # a cold start, answered by the activator
    with httpcalls.client(timeout=30) as client:
        for _ in range(20):
            assert client.get(f"{gw.url}/function/hello").status_code == 200
    # lent to HAProxy: read at once, within the keep window of the last call (cis232, two
    # suites at once: read after waiting for the router's counters, a 1 s window had passed)
    assert warm_stack.claims() == 1
    warm_stack.carried(gw, "hello", 20)
    assert _python_calls(gw, "hello") == 1  # only the cold start went through the gateway
    # unused for the keep window: HAProxy's server goes, the environment back to the store
    warm_stack.settled(10)
    assert _router(gw).routes == {}
    (replica,) = warm_stack.replicas("hello")
    assert (replica.status, replica.envs_in_use) == (ReplicaState.IDLE, 0)


def test_demand_beyond_haproxy_goes_to_the_activator_and_comes_back_warm(
    warm_stack: Stack,
) -> None:
    warm_stack.deploy("echo", image="examples.echo", max=3, exec_envs=1)
    gw = warm_stack.gateway(gateway_keep_s=30.0)
    warm_stack.warm(gw, "echo")  # one replica, its one environment lent to HAProxy
    # ...and used there, as the router has seen: an environment HAProxy used this keep
    # window is not asked back. (A CI run failed here, most likely so: asked back on
    # counters older than the call just started on it, it went to the activator, and a
    # cold start's claim made meanwhile stayed in the activator's pool, as fresh ones do.)
    assert httpcalls.get(f"{gw.url}/function/echo?delay=0.5", timeout=30).status_code == 200
    eventually(lambda: _peak(gw, "echo") >= 1, WARM_WAIT_S, "the router to see the call")
    before = _python_calls(gw, "echo")
    # three at once: HAProxy has room for one, the activator takes two (and starts replicas)
    assert _get_at_once(f"{gw.url}/function/echo?delay=0.5", 3) == [200] * 3
    assert _python_calls(gw, "echo") - before == 2
    assert len(warm_stack.replicas("echo")) == 3
    eventually(
        lambda: _lent(gw, "echo") == 3,
        WARM_WAIT_S,
        "the activator's environments lent to HAProxy once its calls were done",
        detail=lambda: _lending(gw, warm_stack, "echo"),
    )
    # the same demand again: HAProxy carries all of it now
    assert _get_at_once(f"{gw.url}/function/echo?delay=0.5", 3) == [200] * 3
    assert _python_calls(gw, "echo") - before == 2
    warm_stack.carried(gw, "echo", 1 + 1 + 3)


def test_calls_handed_to_the_activator_are_counted_once(warm_stack: Stack) -> None:
    """HAProxy's counters and the activator's together: each call once, in the demand the
    autoscaler reads and in the metrics, whichever path it took."""
    warm_stack.deploy("echo", image="examples.echo", max=3, exec_envs=1)
    gw = warm_stack.gateway(gateway_keep_s=30.0)
    warm_stack.warm(gw, "echo")  # one environment lent to HAProxy
    client = redis.Redis.from_url(warm_stack.env.settings.broker_url)
    before = _python_calls(gw, "echo") + _warm_calls(gw, "echo")
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:  # every report while the calls run (the gateway's: every 0.2 s)
        while not done.wait(0.05):
            now = demand.read(client, ["echo"])["echo"]
            if now is not None:
                seen.append(now.inflight + now.queued)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        # one on HAProxy's replica, two handed to the activator by the function's backend
        assert _get_at_once(f"{gw.url}/function/echo?delay=3", 3) == [200] * 3
    finally:
        done.set()
        watcher.join()
        client.close()
    assert max(seen) == 3, seen  # neither twice (HAProxy's and the activator's) nor lost
    assert _python_calls(gw, "echo") - before >= 1  # (the activator did take some)
    eventually(
        lambda: _python_calls(gw, "echo") + _warm_calls(gw, "echo") - before == 3,
        WARM_WAIT_S,
        "each call counted once in the metrics",
    )


def _read_all(url: str) -> None:
    """GET ``url`` and read its answer to the end."""
    with httpcalls.stream("GET", url, timeout=30) as answer:
        assert answer.status_code == 200
        for _ in answer.iter_bytes():
            pass


def test_a_replica_haproxy_cannot_reach_is_retired_and_calls_go_elsewhere(
    warm_stack: Stack,
) -> None:
    warm_stack.deploy("echo", image="examples.echo", max=4, exec_envs=1)
    gw = warm_stack.gateway(gateway_keep_s=30.0)
    assert api.wait(api.spawn("echo", 2), timeout=60)["status"] == "succeeded"
    # two calls at once, long enough to overlap on a loaded machine: one environment each
    # (at 0.3 s one environment once served both, one after the other: one replica lent)
    assert _get_at_once(f"{gw.url}/function/echo?delay=2", 2) == [200, 200]
    router = _router(gw)
    eventually(lambda: _lent(gw, "echo") == 2, 10, "both replicas lent")  # one each
    bad = next(iter(router.routes["echo"].servers))  # the first: balance first tries it first
    (row,) = [r for r in warm_stack.replicas("echo") if r.id == bad]
    assert row.vmid is not None
    warm_stack.kill_vm(row.vmid)
    # refused connections carried nothing: a POST goes to the other replica too
    answer = httpcalls.post(f"{gw.url}/function/echo", content=b"once", timeout=60)
    # (cis86, two suites at once: HAProxy's own 502 once - the counters say which server)
    assert (answer.status_code, answer.content) == (200, b"once"), _haproxy_view(gw, "echo")
    rows = eventually(
        lambda: [r for r in warm_stack.replicas("echo") if r.id == bad and r.error],
        WARM_WAIT_S,
        "the unreachable replica retired",
    )
    assert rows[0].status in (ReplicaState.DELETING, ReplicaState.DELETED)
    assert (rows[0].error or "").startswith("suspect: haproxy could not reach it")
    eventually(lambda: bad not in router.routes["echo"].servers, 10, "its server gone")
    assert httpcalls.get(f"{gw.url}/function/echo", timeout=60).status_code == 200


def test_a_warm_call_whose_only_replica_fails_is_served_by_the_activator(
    warm_stack: Stack,
) -> None:
    warm_stack.deploy("echo", image="examples.echo", max=3, exec_envs=1)
    gw = warm_stack.gateway(gateway_keep_s=30.0)
    warm_stack.warm(gw, "echo")
    (replica,) = warm_stack.replicas("echo")
    assert replica.vmid is not None
    warm_stack.kill_vm(replica.vmid)
    # rewritten for the replica already: the backup activator puts it back as the caller
    # sent it and serves it as the Python path does (a cold start of another replica)
    before = _python_calls(gw, "echo") + _warm_calls(gw, "echo")
    answer = httpcalls.post(f"{gw.url}/function/echo?x=1", content=b"payload", timeout=60)
    assert (answer.status_code, answer.content) == (200, b"payload")
    assert len(warm_stack.replicas("echo")) == 2
    route = _router(gw).routes.get("echo")
    eventually(  # HAProxy's counters of the dead replica's server read, and it closed
        lambda: route is None or all(s.replica_id != replica.id for s in route.ready()),
        10,
        "the dead replica's server closed",
    )
    # the call was counted once: by the activator, which served it
    assert _python_calls(gw, "echo") + _warm_calls(gw, "echo") - before == 1


def test_haproxy_started_again_gets_every_route_back(warm_stack: Stack) -> None:
    warm_stack.deploy("hello", max=2, exec_envs=2)
    gw = warm_stack.gateway(gateway_keep_s=60.0)
    warm_stack.warm(gw, "hello")
    router = _router(gw)
    assert gw.warm is not None and gw.warm.process.proc is not None
    first = gw.warm.process.proc.pid
    os.kill(first, signal.SIGKILL)
    process = gw.warm.process

    def started_again() -> bool:
        # one read of the pid: None while the killed one dies and before its successor
        # starts (cis659: `alive()`, then `pid` read a moment later, saw the killed process
        # alive and then gone - None, not the first - while its route was still marked live)
        pid = process.pid
        return pid is not None and pid != first and router.routes["hello"].live

    eventually(started_again, 20, "HAProxy started again, the route given to it again")
    assert router.counts.restarts == 1
    with httpcalls.client(timeout=30) as client:  # the same port: the gateway's socket
        for _ in range(5):
            assert client.get(f"{gw.url}/function/hello").status_code == 200
    warm_stack.carried(gw, "hello", 5)


def test_a_function_whose_answer_haproxy_refused_takes_the_python_path(
    warm_stack: Stack,
) -> None:
    warm_stack.deploy("evil", image=HOSTILE, max=1, exec_envs=4)
    gw = warm_stack.gateway(gateway_keep_s=30.0)
    warm_stack.warm(gw, "evil", "/")
    assert httpcalls.get(f"{gw.url}/function/evil/bomb?mib=1", timeout=30).status_code == 502
    router = _router(gw)
    eventually(lambda: "evil" in router.counts.demoted, 10, "evil demoted")
    eventually(lambda: "evil" not in router.routes, 10, "its backend given up")
    before = _python_calls(gw, "evil")
    assert httpcalls.get(f"{gw.url}/function/evil/bomb?mib=1", timeout=30).status_code == 502
    assert _python_calls(gw, "evil") == before + 1  # refused by the gateway's own bounds
    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    assert 'corral_warm_demoted{function="evil"} 1.0' in text
    assert 'corral_gateway_answers_refused_total{function="evil",reason="head_lines"}' in text


def test_an_answer_past_the_call_timeout_is_cut_off_and_its_function_demoted(
    warm_stack: Stack,
) -> None:
    # its head came at once and a byte of body keeps coming: HAProxy's inactivity timeout
    # never fires, the watchdog (show sess, every second) cuts it at the call timeout
    warm_stack.deploy("evil", image=HOSTILE, max=1, exec_envs=4)
    gw = warm_stack.gateway(gateway_keep_s=30.0, gateway_timeout_s=2.0)
    warm_stack.warm(gw, "evil", "/")
    started = time.monotonic()
    with pytest.raises(httpx.RemoteProtocolError):  # broken off, as the Python path does
        _read_all(f"{gw.url}/function/evil/trickle")
    assert time.monotonic() - started < 20  # (without the watchdog: never)
    router = _router(gw)
    eventually(lambda: "evil" in router.counts.demoted, 10, "evil demoted")
    assert "call timeout" in router.counts.demoted["evil"]


def test_no_call_fails_while_replicas_come_and_go(warm_stack: Stack) -> None:
    """The full figure (1,000 calls a second) is ``python -m bench.warmroutes``'s."""
    # calls of 50 ms at 100 a second: some 5 at once, so HAProxy needs the replicas scaled
    # up (hello's answer at once needs one, whatever the machine: no route changes to see)
    warm_stack.deploy("hello", image="examples.echo", max=6, exec_envs=2)
    gw = warm_stack.gateway(gateway_keep_s=0.3)
    warm_stack.warm(gw, "hello")
    stop = threading.Event()
    scaled: list[str] = []

    def churn() -> None:  # replicas come (scale up) and go (scale down of idle ones)
        targets = [4, 1]
        while not stop.is_set():
            target = targets[len(scaled) % 2]
            api.wait(api.scale("hello", target), timeout=60)
            scaled.append(str(target))
            stop.wait(0.5)

    def enough(elapsed: float) -> bool:  # 8 s of load, and on until the churn scaled 4 times
        return elapsed >= 60 or (elapsed >= 8 and len(scaled) >= 4)

    async def load(rate: float) -> list[int | str]:
        out: list[int | str] = []
        async with httpx.AsyncClient(timeout=30) as client:

            async def one() -> None:
                try:
                    answer = await client.get(f"{gw.url}/function/hello?delay=0.05")
                    out.append(answer.status_code)
                except httpx.HTTPError as exc:
                    out.append(type(exc).__name__)

            began, calls = time.monotonic(), []
            while not enough((now := time.monotonic()) - began):
                calls.append(asyncio.ensure_future(one()))
                await asyncio.sleep(max(0.0, began + len(calls) / rate - now))
            await asyncio.gather(*calls)
        return out

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        answers = asyncio.run(load(rate=100))
    finally:
        stop.set()
        churner.join(120)
    failed = [a for a in answers if a != 200]
    assert answers and not failed, f"{len(failed)} of {len(answers)} failed: {set(failed)}"
    assert len(scaled) >= 4, scaled  # it did scale up and down meanwhile (a loaded CI box
    # once managed 3 in a fixed 8 s: the load now lasts until the churn has done 4)
    assert len(warm_stack.replicas("hello")) > 2

    # A scale-down removes only replicas no call holds: on a loaded machine every one it
    # looked at was serving or kept, and no replica had gone by the end. So the last one
    # waits for the gateway to give its holds back, which it does a report at a time: beside
    # a second suite (cis699) it came while all four were still held and removed none.
    def held() -> list[tuple[str, int, str | None]]:
        return [(r.status.name, r.envs_in_use, r.error) for r in warm_stack.replicas("hello")]

    eventually(
        lambda: not any(envs for _, envs, _ in held()),
        WARM_WAIT_S,
        "the gateway's holds given back",
        detail=lambda: repr(held()),
    )
    view = api.wait(api.scale("hello", 1), timeout=60)
    assert view["status"] == "succeeded", view
    eventually(  # the scale-downs' deletes end (a loaded machine had them still Deleting)
        lambda: any(r.status == ReplicaState.DELETED for r in warm_stack.replicas("hello")),
        WARM_WAIT_S,
        "a replica of the churn deleted",
        detail=lambda: f"{held()!r}\nthe last scale-down: {view['result']}",
    )
    text = httpcalls.get(f"{gw.url}/metrics", timeout=10).text
    for change in ("add", "remove"):
        line = f'corral_warm_route_change_seconds_count{{change="{change}"}}'
        assert line in text and float(text.split(line, 1)[1].split()[0]) >= 2, change
