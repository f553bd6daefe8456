"""What a fault costs: a kill, a store outage, a full node, a restart - seconds, not capacity.

Each test runs ``corral worker`` processes (the thread pool and prefork) against the
session's Redis and reference agents on loopback that speak only the seed protocol
(``--seed-only``: a create sent twice makes two VMs, and none can be listed), through the
producer API the CLI uses, and counts what the agent ran against the rows:

* a worker SIGKILLed with a node's in-flight bound of creates out leaves at most that
  many maybes (a create is marked sent when its call takes the node's slot, not a whole
  round before the first call), and the node still takes new replicas at once;
* a store that stops while creates land loses none of their answers: no second VM;
* a maybe that could not be replaced (its node is full) keeps its part of the operation
  open, and its VM is adopted when its guest says READY;
* a worker started again under its name frees the call slots its killed predecessor
  held, instead of leaving its nodes blocked fleet-wide until the leases lapse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from sqlalchemy import select, update

from agents.drivers import MemoryDriver
from agents.faults import Fault
from agents.fcdaemon import RegistryReporter, RunningAgent, serve_fcdaemon
from corral import api
from corral.cli import main
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from testkit.services import PostgresServer
from tests.faults.conftest import POOL_PER_STORE, POOLS, SHORT, apply_limits
from tests.fixtures import Env, StartAgents, postgres_only
from tests.helpers import deploy_fn, replicas
from tests.workers.replicas.helpers import created, no_drift, running
from workers.backends import networks, node_slots
from workers.base import clock
from workers.base.redis_client import redis_client
from workers.fleet.nodes import upsert_node
from workers.registry.service import RunningRegistry
from workers.store.models import LIVE_STATES, Function, Node, ReplicaState


def _node(env: Env) -> Node:
    with env.db.read() as s:
        return s.scalars(select(Node)).one()


#: what a maybe's error says when a call's own time made it, not the kill
CALL_COSTS = ("CreateReplica failed", "cut off by the task's time limit mid-call")


def _maybes(env: Env) -> tuple[int, list[str]]:
    """The maybes the kill left (their owner lapsed after sending), and the others' errors."""
    errors = [r.error or "" for r in replicas(env) if r.maybe_of is not None]
    others = [e for e in errors if "its owner lapsed after sending it" not in e]
    return len(errors) - len(others), others


def _made_vms_before(env: Env) -> None:
    """The node has created VMs before: off probation, it is sent its full in-flight bound."""
    with env.db.transaction() as s:
        s.execute(update(Node).values(last_create_ok_at=clock.now(), create_failures=0))


def _fleet_agrees(env: Env, agent: RunningAgent) -> bool:
    """The agent runs exactly the VMs of the live replicas (a maybe has no VM known)."""
    live = {str(r.vmid) for r in replicas(env) if r.status in LIVE_STATES and r.vmid}
    return running([agent]) == live


@pytest.mark.timeout(300)
@POOLS
def test_a_spawn_of_40_killed_with_4_creates_in_flight_leaves_at_most_4_maybes(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    registry: RunningRegistry,
    pool: str,
) -> None:
    """One seed node of capacity 50, 4 calls in flight at most: 40 + 4 maybes + 5 fit.

    Before, the killed worker had marked all 40 creates sent before its first call: the
    redelivered spawn made 40 maybes, could replace only 10 of them on the node, and ended
    partial; the next spawn found no capacity while the node ran 14 VMs.
    """
    limits = {**SHORT, "CORRAL_NODE_MAX_INFLIGHT": "4"}
    apply_limits(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True, registry=registry.address)
    with broker_env.db.transaction() as s:
        s.execute(update(Node).values(capacity=50))
    _made_vms_before(broker_env)
    held = threading.Event()  # the first four creates stay in flight until the worker is dead
    agent.agent.inject("CreateReplica", *[Fault.delay(60, until=held)] * 4)
    deploy_fn(broker_env)
    first = WorkerProcess(broker_env.tmp, concurrency=1, name="first", extra_env=limits, pool=pool)
    worker_processes.append(first.start())
    op = api.spawn("hello", 40)
    eventually(lambda: created([agent]) == 4, 20, "four creates to reach the agent")
    first.kill()
    held.set()  # the agent makes those four VMs; their answers are lost with the worker
    second = WorkerProcess(
        broker_env.tmp, concurrency=2, name="second", extra_env=limits, pool=pool
    )
    worker_processes.append(second.start())
    view = api.wait(op, timeout=120)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 40, 0), (
        view,
        second.tail(),
    )
    of_the_kill, others = _maybes(broker_env)
    assert of_the_kill <= 4, api.operation(op)["maybes"]
    # On a loaded machine a create of the second worker can pass its deadline (2 s), or
    # its batch its task's 4 s soft limit (cis626, beside another suite): a maybe too, but
    # the cost of that call, not of the kill (cis26); one whose VM showed up later keeps
    # that reason in its error (cis350: it was lost).
    assert all(any(cost in e for cost in CALL_COSTS) for e in others), others
    maybes = of_the_kill + len(others)
    assert created([agent]) == 40 + maybes  # each replacement sent once
    # the node takes five more at once (or what is left of its 50 after such late
    # creates): the maybes hold their slots, the kill lost none
    rest = min(5, 50 - 40 - maybes)
    more = api.wait(api.spawn("hello", rest), timeout=60)
    assert (more["status"], more["done"]) == ("succeeded", rest), (more, second.tail())
    # the VMs the killed worker's creates made said READY: released, none without a row
    eventually(lambda: _fleet_agrees(broker_env, agent), 30, "no VM without a row")
    assert len(running([agent])) == 40 + rest
    no_drift(broker_env)


OUTAGE_S = 4.0  # how long the store is down: the fault itself, not a guess at a window


@pytest.mark.timeout(240)
@postgres_only  # stops the PostgreSQL server (SQLite has no server to stop)
@POOLS
def test_a_store_outage_while_3_creates_land_leaves_3_vms_and_3_rows(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    postgres_server: PostgresServer,
    pool: str,
) -> None:
    """The worker asks the store again until it answers: 3 creates, 3 VMs, 3 rows.

    Before, the answers lived only in the task that could not record them: it failed, its
    retries ran out while the store was down and the spawn stayed open; whoever took the
    rows next made them maybes and replaced them (6 creates, 6 VMs, 3 without a row).
    """
    limits = {
        "CORRAL_TASK_SOFT_TIME_LIMIT_S": "20",
        "CORRAL_TASK_TIME_LIMIT_S": "25",
        "CORRAL_VISIBILITY_TIMEOUT_S": "30",
    }
    apply_limits(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    _made_vms_before(broker_env)
    held = threading.Event()
    agent.agent.inject("CreateReplica", *[Fault.delay(60, until=held)] * 3)
    deploy_fn(broker_env)
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=limits, pool=pool)
    worker_processes.append(worker.start())
    op = api.spawn("hello", 3)
    eventually(lambda: created([agent]) == 3, 20, "three creates to reach the agent")
    postgres_server.stop()
    try:
        held.set()  # the three creates land while the store is down
        eventually(lambda: len(running([agent])) == 3, 10, "the agent to make the VMs")
        time.sleep(OUTAGE_S)
    finally:
        postgres_server.start()
    try:
        view = api.wait(op, timeout=60)
    except TimeoutError as exc:  # cis481, beside another suite: still running, 0 of 3 done
        raise AssertionError(f"{exc}\n{worker.tail(120)}") from None
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 3, 0), (
        view,
        worker.tail(),
    )
    rows = replicas(broker_env)
    assert created([agent]) == 3 and len(rows) == 3, worker.tail()
    assert {r.status for r in rows} == {ReplicaState.IDLE}
    assert running([agent]) == {str(r.vmid) for r in rows}
    no_drift(broker_env)


@pytest.fixture
def off_node_guests(broker_env: Env, registry: RunningRegistry) -> Iterator[RunningAgent]:
    """A seed agent at 127.0.0.5 whose guests live on 127.0.0.1 and report READY from there.

    As an operator adds a node whose VMs answer on a network of their own
    (``corral nodes add 127.0.0.5:PORT --replica-network 127.0.0.1/32``): a READY from a
    guest's own IP tells corral where that VM answers, which adopting a maybe's VM needs.
    """
    agent = serve_fcdaemon("127.0.0.5:0", driver=MemoryDriver(ip="127.0.0.1"), seed_only=True)
    reporter = RegistryReporter(
        registry.address,
        node_ip="127.0.0.5",
        node_port=agent.port,
        node_id="node1",
        on_destroy=agent.agent.release,
        is_live=agent.agent.is_live,
    )
    agent.agent.on_created = lambda vm: reporter.report_ready(vm, probe=False)
    with broker_env.db.transaction() as s:
        upsert_node(s, f"127.0.0.5:{agent.port}", name="node1", capacity=2)
        s.execute(update(Node).values(replica_networks=["127.0.0.1/32"]))
    networks.forget()
    yield agent
    reporter.close()
    agent.stop(grace=0)


@pytest.mark.timeout(180)
@POOL_PER_STORE
def test_a_maybe_on_a_full_node_keeps_its_part_and_its_vm_is_adopted_when_ready(
    broker_env: Env,
    off_node_guests: RunningAgent,
    worker_processes: list[WorkerProcess],
    pool: str,
) -> None:
    """Capacity 2, spawn 2, the first create's answer lost: no room for a replacement.

    Before, the part failed at once (partial 1/2) and the maybe's VM, when its guest said
    READY, was released: a plain spawn sets no target, so nothing "wanted" it.
    """
    agent = off_node_guests
    limits = {
        "CORRAL_CREATE_TIMEOUT_S": "1",  # the first create's deadline passes...
        "CORRAL_TASK_SOFT_TIME_LIMIT_S": "8",
        "CORRAL_TASK_TIME_LIMIT_S": "10",
        "CORRAL_VISIBILITY_TIMEOUT_S": "12",
    }
    apply_limits(broker_env, limits)
    agent.agent.inject("CreateReplica", Fault.delay(2.0))  # ...and then the agent makes its VM
    deploy_fn(broker_env, ports=[8123])
    worker = WorkerProcess(broker_env.tmp, concurrency=2, extra_env=limits, pool=pool)
    worker_processes.append(worker.start())
    view = api.wait(api.spawn("hello", 2), timeout=60)
    assert (view["status"], view["done"], view["failed"]) == ("succeeded", 2, 0), (
        view,
        worker.tail(),
    )
    assert view["maybes"] == {"adopted": 1} and created([agent]) == 2
    rows = replicas(broker_env)
    assert sorted(r.status for r in rows) == [ReplicaState.IDLE, ReplicaState.IDLE]
    adopted = next(r for r in rows if r.maybe_of is not None)
    assert adopted.address == "http://127.0.0.1:8123"
    assert running([agent]) == {str(r.vmid) for r in rows}
    assert _node(broker_env).live == 2
    with broker_env.db.read() as s:
        assert s.scalar(select(Function.replica_count)) == 2
    no_drift(broker_env)


@pytest.mark.timeout(180)
@POOL_PER_STORE
def test_a_worker_killed_and_started_again_frees_its_call_slots_at_start(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    redis_url: str,
    pool: str,
) -> None:
    """Leases that would live 62 s: the node serves its full bound again at once.

    Before, the killed worker's four leases held the node's four slots, fleet-wide,
    until they lapsed.
    """
    limits = {
        "CORRAL_NODE_MAX_INFLIGHT": "4",
        "CORRAL_CREATE_TIMEOUT_S": "60",  # a slot's lease lives 62 s
        "CORRAL_TASK_SOFT_TIME_LIMIT_S": "70",
        "CORRAL_TASK_TIME_LIMIT_S": "75",
        "CORRAL_VISIBILITY_TIMEOUT_S": "300",  # the killed worker's spawn is not redelivered
    }
    apply_limits(broker_env, limits)
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    _made_vms_before(broker_env)
    node_id = _node(broker_env).id
    client = redis_client(redis_url)
    assert client is not None
    held = threading.Event()
    agent.agent.inject("CreateReplica", *[Fault.delay(60, until=held)] * 8)
    deploy_fn(broker_env)
    first = WorkerProcess(broker_env.tmp, concurrency=1, name="w1", extra_env=limits, pool=pool)
    worker_processes.append(first.start())
    api.spawn("hello", 4)
    eventually(
        lambda: created([agent]) == 4, 30, "four creates to reach the agent", detail=first.tail
    )
    assert node_slots.held(client, node_id) == 4
    first.kill()
    again = WorkerProcess(broker_env.tmp, concurrency=1, name="w1", extra_env=limits, pool=pool)
    worker_processes.append(again.start())
    try:
        eventually(  # well before the leases could lapse (62 s)
            lambda: node_slots.held(client, node_id) == 0,
            30,
            "the killed worker's slots to be freed",
            detail=again.tail,
        )
        # and the node takes its full bound at once: four new creates in flight together
        api.spawn("hello", 4)
        eventually(
            lambda: created([agent]) == 8, 30, "four more creates at once", detail=again.tail
        )
    finally:
        held.set()


def test_nodes_remove_names_the_maybes_a_node_holds_and_when_they_end(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "still runs 2 replica(s)" of a node that ran none."""
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    busy = Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy")  # the agent may have acted on it
    agent.agent.inject("CreateReplica", busy, busy)
    deploy_fn(corral_env)
    view = api.wait(api.spawn("hello", 1), timeout=30)
    assert view["maybes"] == {"open": 2}
    (idle,) = [r for r in replicas(corral_env) if r.status == ReplicaState.IDLE]
    assert api.wait(api.delete(idle.id), timeout=30)["status"] == "succeeded"
    ends = [r.deadline_at for r in replicas(corral_env) if r.status == ReplicaState.MAYBE]
    until = max(at for at in ends if at is not None)
    assert main(["nodes", "remove", "node1"]) == 1
    err = capsys.readouterr().err
    assert "runs no replica but holds 2 maybe(s)" in err, err
    assert until.isoformat(timespec="milliseconds") + "Z" in err, err
    assert "still runs" not in err
    assert _node(corral_env).live == 2  # nothing changed
