"""A real data path for the gateway tests: Redis broker, a Celery worker, a process agent.

``stack`` gives a migrated store (SQLite, then PostgreSQL), a real Celery worker
(threads) on the session's Redis, one fcdaemon agent whose replicas are real processes
serving HTTP on loopback (``examples.*``, and :data:`HOSTILE`: a replica whose answers
attack the gateway), and :meth:`Stack.gateway` to start gateways (uvicorn, in
threads) with settings of the test's choosing. A gateway keeps the claims it used for
``gateway_keep_s`` (1.5 s by default) before giving them back: :meth:`Stack.settled`
waits for that. :func:`free_port` and :func:`wait_healthy` serve the tests that run
``corral gateway`` as a process of its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from agents import ProcessDriver, RunningAgent, serve_fcdaemon
from tasks.invocations import CALLS
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from tests.fixtures import Env
from tests.helpers import deploy_fn, replicas
from workers.fleet.nodes import upsert_node
from workers.gateway import RunningGateway, serve_gateway
from workers.store.models import Claim, Replica

HOSTILE = "tests.workers.gateway.hostile"  # the image of a replica whose answers attack
CALLEE = "tests.workers.gateway.callee"  # the image of a function that records its calls


def wait_healthy(url: str) -> None:
    """Wait until the gateway at ``url`` answers ``/healthz`` (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the gateway did not start"
        time.sleep(0.1)


class Stack:
    """The running parts of one test's data path."""

    def __init__(self, env: Env, agent: RunningAgent) -> None:
        self.env = env
        self.agent = agent
        self.gateways: list[RunningGateway] = []

    def gateway(self, **overrides: Any) -> RunningGateway:
        """Start a gateway on a free loopback port (settings: the test's, plus ``overrides``);
        it sends asynchronous calls to ``corral.invocations``."""
        base = {"gateway_cold_start_timeout_s": 30.0, "gateway_report_interval_s": 0.2}
        settings = self.env.settings.model_copy(update={**base, **overrides})
        running = serve_gateway(settings, "127.0.0.1:0", queue=HereFirst(QUEUE), calls=CALLS)
        self.gateways.append(running)
        return running

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

    def replicas(self, name: str) -> list[Replica]:
        """The function's replica rows, oldest first."""
        return replicas(self.env, name)

    def creates(self) -> int:
        """CreateReplica calls the agent served."""
        return len(self.agent.agent.calls_of("CreateReplica"))


@contextlib.contextmanager
def data_path(env: Env) -> Iterator[Stack]:
    """A process agent (registered as node ``node1``) on the store and broker of ``env``."""
    agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver(allow_images=[HOSTILE, CALLEE]))
    with env.db.transaction() as s:
        upsert_node(s, agent.address, name="node1", capacity=64)
    running = Stack(env, agent)
    try:
        yield running
    finally:
        for gateway in running.gateways:
            gateway.stop()
        agent.stop(grace=0)


@pytest.fixture
def stack(thread_worker: Env) -> Iterator[Stack]:
    """Broker, worker, store, a process agent (registered as node ``node1``)."""
    with data_path(thread_worker) as running:
        yield running
