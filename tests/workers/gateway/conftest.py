"""A real data path for the gateway tests: Redis broker, a Celery worker, a process agent.

``stack`` gives a migrated store, a real Celery worker (threads) on the session's Redis,
one fcdaemon agent whose replicas are real processes serving HTTP on loopback
(``examples.*``, and :data:`HOSTILE`: a replica whose answers attack the gateway), and
:meth:`Stack.gateway` to start gateways (uvicorn, in threads) with settings of the
test's choosing. A gateway keeps the claims it used for ``gateway_keep_s`` (1.5 s by
default) before giving them back: :meth:`Stack.settled` waits for that.
:func:`gateway_process_on_port_0` and :func:`wait_healthy` serve the tests that run
``corral gateway`` as a process of its own.

Each test runs twice, on each store and each data plane (:mod:`tests.dataplanes`) once:
``[sqlite-haproxy]`` - SQLite, the default store, with HAProxy in front of the gateway,
the default data plane where HAProxy is installed - and ``[postgres-python]``. The
store's part is the same on both data planes (claims, cold starts, retiring), and the
data plane's the same on both stores, so the two runs cover what the four would; a test
whose gateway is a process of its own reads the data plane from :attr:`Stack.dataplane`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from agents import ProcessDriver, RunningAgent, serve_fcdaemon
from tasks.invocations import CALLS
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls
from testkit.eventually import eventually
from testkit.processes import ROOT, start_listening
from tests.dataplanes import PAIRS, need
from tests.fixtures import Env, fresh_store
from tests.helpers import deploy_fn, replicas
from workers.fleet.nodes import upsert_node
from workers.gateway import RunningGateway, serve_gateway, stored
from workers.gateway.haproxy.router import Router
from workers.gateway.ledger import Ledger
from workers.store.models import Claim, Replica

HOSTILE = "tests.workers.gateway.hostile"  # the image of a replica whose answers attack
CALLEE = "tests.workers.gateway.callee"  # the image of a function that records its calls
#: how long a test waits for HAProxy to be programmed (at once on a quiet machine; the
#: commands go from a thread of the gateway's, which a machine at load 27 has held past 10 s)
WARM_WAIT_S = 30.0


def gateway_process_on_port_0(
    log_path: Path, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """``corral gateway`` as a process of its own on a port it picks; it and its URL.

    ``prefix``: a command it runs under (``prlimit``); its output goes to ``log_path``.
    """
    argv = [*prefix, sys.executable, "-m", "corral.cli", "gateway", "--listen", "127.0.0.1:0"]
    env = dict(os.environ) if env is None else env
    return start_listening(argv, cwd=ROOT, env=env, log_path=log_path, timeout=120)


def wait_healthy(url: str) -> None:
    """Wait until the gateway at ``url`` answers ``/healthz`` (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpcalls.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.1)


class Stack:
    """The running parts of one test's data path."""

    def __init__(self, env: Env, agent: RunningAgent, dataplane: str = "python") -> None:
        self.env = env
        self.agent = agent
        self.dataplane = dataplane
        self.gateways: list[RunningGateway] = []

    @property
    def haproxy(self) -> bool:
        """True when this test's gateways run HAProxy in front of them."""
        return self.dataplane == "haproxy"

    def gateway(self, **overrides: Any) -> RunningGateway:
        """Start a gateway on a free loopback port (settings: the test's, plus ``overrides``);
        it sends asynchronous calls to ``corral.invocations``."""
        base = {
            "gateway_cold_start_timeout_s": 30.0,
            "gateway_report_interval_s": 0.2,
            "gateway_dataplane": self.dataplane,
        }
        settings = self.env.settings.model_copy(update={**base, **overrides})
        running = serve_gateway(settings, "127.0.0.1:0", queue=HereFirst(QUEUE), calls=CALLS)
        self.gateways.append(running)
        return running

    def warm(self, gw: RunningGateway, name: str, path: str = "") -> None:
        """Call function ``name`` once, so that the next calls are warm: with HAProxy, until
        HAProxy has the function's backend (the calls that follow go straight there)."""
        answer = httpcalls.get(f"{gw.url}/function/{name}{path}", timeout=60)
        assert answer.status_code == 200, answer.text
        self.routed(gw, name)

    def routed(self, gw: RunningGateway, name: str) -> None:
        """With HAProxy, wait until its map sends ``name``'s calls to a ready server.

        A call only the activator forwards (odd headers, a large body) takes its replica's
        environment back from HAProxy when no other is free; the function's backend comes
        back once that server is closed and the environment lent again (cis605: a warm
        call sent at once took the Python path).
        """
        if gw.warm is None:
            return
        router = gw.warm.router
        assert router is not None
        eventually(
            lambda: (r := router.routes.get(name)) is not None and r.live and bool(r.ready()),
            WARM_WAIT_S,
            f"{name}'s backend in HAProxy",
        )

    def carried(self, gw: RunningGateway, name: str, calls: int) -> None:
        """With HAProxy, wait until it has carried ``calls`` calls of ``name`` (else nothing)."""
        if gw.warm is None:
            return
        router = gw.warm.router
        assert router is not None
        eventually(
            lambda: router.counts.requests.get(name, 0) >= calls,
            WARM_WAIT_S,
            f"{calls} calls of {name} carried by HAProxy",
        )

    def deploy(self, name: str, image: str = "examples.hello", **fields: Any) -> None:
        """Deploy a function the process agent can run."""
        deploy_fn(self.env, name, image=image, **fields)

    def claims(self) -> int:
        """Claim rows held now."""
        with self.env.db.read() as s:
            return int(s.scalar(select(func.count()).select_from(Claim)) or 0)

    def claim_ids(self) -> set[str]:
        """The ids of the claim rows held now."""
        with self.env.db.read() as s:
            return set(s.scalars(select(Claim.id)))

    def settled(self, timeout: float = 20.0) -> float:
        """Wait until no claim is held (gateways give theirs back after their keep window).

        Returns the seconds waited; fails the test after ``timeout``.
        """
        started = time.monotonic()
        while self.claims():
            waited = time.monotonic() - started
            assert waited < timeout, f"{self.claims()} claims still held after {timeout:g}s"
            time.sleep(0.05)
        return time.monotonic() - started

    def finish(self, timeout: float = 20.0) -> None:
        """End the test: once no request of this test's gateways, nor an attempt of this
        process's calls' gateway (the in-process worker's), holds a claim, close them (they
        give back every claim they hold); then wait until the store holds none.

        What :meth:`settled` shows without waiting out the keep window: a claim a request
        kept, or one the store still has after its gateway gave back all it held, fails
        the test. A worker process's claims still go back after its keep window. A test of
        the keep window itself waits with :meth:`settled`.
        """
        ledgers: list[tuple[Ledger, Router | None, Callable[[], None]]] = [
            (gw.app.gateway.ledger, gw.warm.router if gw.warm else None, gw.stop)
            for gw in self.gateways
        ]
        replay = stored.current()
        if replay is not None:
            ledgers.append((replay.app.gateway.ledger, None, stored.close))
        for ledger, router, close in ledgers:
            eventually(
                functools.partial(_none_in_use, ledger, router),
                timeout,
                "every request of the gateway to give its claim back",
                detail=functools.partial(_in_use_said, ledger, router),
            )
            close()
        self.settled(timeout)

    def replicas(self, name: str) -> list[Replica]:
        """The function's replica rows, oldest first."""
        return replicas(self.env, name)

    def kill_vm(self, vmid: str) -> None:
        """Kill a replica's process behind corral's back; return once its port refuses.

        A SIGKILL is delivered, not done, when ``kill`` returns, and a process whose
        first thread has exited may still hold its socket in another: a call sent at once
        (cis86, cis96, two suites at once) was accepted by the socket of a process not yet
        gone, then cut off - a 502, where the test meant a refused connection, which a
        proxy may try elsewhere since it carried nothing.
        """
        (vm,) = [vm for vm in self.agent.driver.list() if vm.vmid == vmid]
        assert vm.pid is not None
        os.kill(vm.pid, signal.SIGKILL)
        where = (vm.ip, vm.port)
        eventually(lambda: _refused(where), 10, f"the killed replica's port {vm.port} to refuse")

    def creates(self) -> int:
        """CreateReplica calls the agent served."""
        return len(self.agent.agent.calls_of("CreateReplica"))

    def vms_asked(self) -> int:
        """VMs the agent was asked for: its creates' distinct request ids.

        A create past its deadline is sent again with its request id, and the agent
        (which dedups) answers it with the same VM: two calls, one VM.
        """
        return len({call.requestId for call in self.agent.agent.calls_of("CreateReplica")})


def in_use(ledger: Ledger, router: Router | None = None) -> int:
    """Claims a gateway's ledger holds with a request on them now: neither idle nor lent to
    HAProxy (``router``)."""
    idle = sum(len(pool.idle) for pool in list(ledger.pools.values()))
    lent = 0
    if router is not None:
        servers = [
            s for route in list(router.routes.values()) for s in list(route.servers.values())
        ]
        lent = sum(len(server.claims) for server in servers)
    return len(ledger.held) - idle - lent


def _none_in_use(ledger: Ledger, router: Router | None) -> bool:
    return in_use(ledger, router) == 0


def _in_use_said(ledger: Ledger, router: Router | None) -> str:
    return f"{in_use(ledger, router)} claims in use"


def _refused(where: tuple[str, int]) -> bool:
    """True if a connection to ``where`` is refused now (nothing listens there)."""
    try:
        socket.create_connection(where, timeout=1).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        pass  # a timeout: something still holds it
    return False


@contextlib.contextmanager
def data_path(env: Env, dataplane: str = "python") -> Iterator[Stack]:
    """A process agent (registered as node ``node1``) on the store and broker of ``env``."""
    agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver(allow_images=[HOSTILE, CALLEE]))
    with env.db.transaction() as s:
        upsert_node(s, agent.address, name="node1", capacity=64)
    running = Stack(env, agent, dataplane)
    try:
        yield running
    finally:
        for gateway in running.gateways:
            gateway.stop()
        agent.stop(grace=0)


@pytest.fixture(params=PAIRS, ids=[f"{store}-{plane}" for store, plane in PAIRS])
def pairing(request: pytest.FixtureRequest) -> tuple[str, str]:
    """This run's store and data plane."""
    store, plane = request.param
    return store, need(plane)


@pytest.fixture
def store_url(request: pytest.FixtureRequest, pairing: tuple[str, str]) -> str:
    """The store of this run (:data:`PAIRS`), empty and migrated."""
    return fresh_store(request, pairing[0])


@pytest.fixture
def dataplane(pairing: tuple[str, str]) -> str:
    """The data plane of this run (:data:`PAIRS`): ``python`` or ``haproxy``."""
    return pairing[1]


@pytest.fixture
def stack(thread_worker: Env, dataplane: str) -> Iterator[Stack]:
    """Broker, worker, store, a process agent (registered as node ``node1``)."""
    with data_path(thread_worker, dataplane) as running:
        yield running
