"""Liveness under exactly-once: an ambiguous answer from a seed agent never parks a request.

Each test runs ``celery -A workers worker`` processes (the thread pool and prefork) against
the session's Redis and reference agents on loopback that speak only the seed protocol
(``--seed-only``: no ``requestId``, no ``ListReplicas``), on SQLite and PostgreSQL, through
the producer API the CLI uses (``corral spawn NAME --wait`` is ``api.spawn`` + ``api.wait``),
and ends by comparing both sides: every VM an agent runs has exactly one live row, and
``corral db check`` finds no drift.
"""

from __future__ import annotations

import time

import grpc
import pytest
from sqlalchemy import select

from agents.faults import Fault
from agents.fcdaemon import RunningAgent
from corral import api
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.faults.conftest import POOL_PER_STORE
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, replicas
from tests.workers.replicas.helpers import created, no_drift, running
from workers.base import clock
from workers.maintenance.reaper import reap
from workers.registry.service import RunningRegistry
from workers.store.models import Node, ReplicaState

UNAVAILABLE = Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy")  # the agent did nothing


def _fleet_agrees(env: Env, agent: RunningAgent) -> None:
    """The VMs the agent runs are exactly the VMs of the live replicas; no counter drifts."""
    idle = {str(r.vmid) for r in replicas(env) if r.status == ReplicaState.IDLE}
    assert running([agent]) == idle
    no_drift(env)


def _live(env: Env) -> int:
    with env.db.read() as s:
        return s.scalars(select(Node)).one().live


@pytest.mark.timeout(120)
@POOL_PER_STORE
def test_a_seed_agent_answering_unavailable_twice_still_spawns_within_15_s(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess], pool: str
) -> None:
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    agent.agent.inject("CreateReplica", UNAVAILABLE, UNAVAILABLE)
    deploy_fn(broker_env, "flaky")
    worker = WorkerProcess(broker_env.tmp, concurrency=2, pool=pool)
    worker_processes.append(worker.start())
    started = time.monotonic()
    view = api.wait(api.spawn("flaky", 1), timeout=15)  # `corral spawn flaky --wait`
    assert time.monotonic() - started < 15
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 1, 0), (
        view,
        worker.tail(),
    )
    assert created([agent]) == 3 and len(agent.driver.list()) == 1
    # the two ambiguous creates are maybes, shown as such, holding their slots
    assert view["maybes"] == {"open": 2}
    listed = sorted(r["status"] for r in api.replicas("flaky"))
    assert listed == ["idle", "maybe", "maybe"] and _live(broker_env) == 3
    _fleet_agrees(broker_env, agent)
    # This node's guests never reported READY: the maybes wait for the creating deadline,
    # then end, giving their slots back once.
    clock.travel(broker_env.settings.creating_deadline_s + 1)
    reap(broker_env.db, broker_env.settings, holder="t")
    assert api.operation(view["id"])["maybes"] == {"ended": 2} and _live(broker_env) == 1
    _fleet_agrees(broker_env, agent)


@pytest.mark.timeout(120)
@POOL_PER_STORE
def test_a_create_whose_answer_is_lost_ends_with_n_replicas_and_no_vm_without_a_row(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    registry: RunningRegistry,
    pool: str,
) -> None:
    # the first create's deadline passes... (3 s: on a loaded machine an ordinary create
    # has taken over 1 s, which made it a second maybe)
    limits = {"CORRAL_CREATE_TIMEOUT_S": "3"}
    broker_env.set(create_timeout_s="3")
    (agent,) = start_agents(1, env=broker_env, seed_only=True, registry=registry.address)
    agent.agent.inject("CreateReplica", Fault.delay(5.0))  # ...and the agent makes its VM
    deploy_fn(broker_env)
    worker = WorkerProcess(broker_env.tmp, concurrency=2, pool=pool, extra_env=limits)
    worker_processes.append(worker.start())
    view = api.wait(api.spawn("hello", 3), timeout=30)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 3, 0), (
        view,
        worker.tail(),
    )
    assert created([agent]) == 4
    idle = {str(r.vmid) for r in replicas(broker_env) if r.status == ReplicaState.IDLE}
    assert len(idle) == 3

    def settled() -> bool:  # the late VM said READY: it was the maybe's, and it went
        return api.operation(view["id"])["maybes"] == {"released": 1} and (running([agent]) == idle)

    eventually(settled, 20, "the maybe's VM to be released", detail=worker.tail)
    (maybe,) = [r for r in replicas(broker_env) if r.maybe_of == view["id"]]
    assert maybe.status == ReplicaState.DELETED and maybe.vmid not in idle
    assert _live(broker_env) == 3
    _fleet_agrees(broker_env, agent)
