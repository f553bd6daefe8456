"""Answers that landed while the store was down: kept in Redis, recorded by the next handler.

A handler that cannot record the VMs its creates made tries again until near its hard
limit; past that it gives up, and its answers wait in Redis (``workers.replicas.landed``)
for whoever takes the rows next. Against a real seed agent (no ``requestId``: a create
sent twice makes two VMs), the session's Redis and PostgreSQL, which the test stops.
"""

from __future__ import annotations

import threading

from sqlalchemy import update

from agents.faults import Fault
from testkit.eventually import eventually
from testkit.services import PostgresServer
from tests.fixtures import Env, StartAgents, postgres_only
from tests.helpers import operation, replicas
from tests.workers.replicas.helpers import created, no_drift, running, spawn_op
from workers.base import clock
from workers.replicas import landed
from workers.replicas.owners import Budget
from workers.replicas.spawn import run_batch
from workers.store.models import Node, ReplicaState


@postgres_only  # stops the PostgreSQL server (SQLite has no server to stop)
def test_answers_the_store_refused_until_the_hard_limit_are_recorded_by_the_next_handler(
    broker_env: Env, start_agents: StartAgents, postgres_server: PostgresServer
) -> None:
    # The held creates wait out the test's steps (stopping PostgreSQL takes seconds on a
    # loaded machine): with the tests' 2 s deadline they timed out first, their answers
    # lost rather than kept. A call may start only while it can end before the soft limit.
    broker_env.set(create_timeout_s="8")
    (agent,) = start_agents(1, env=broker_env, seed_only=True)
    with broker_env.db.transaction() as s:  # it made VMs before: its full bound at once
        s.execute(update(Node).values(last_create_ok_at=clock.now()))
    # One answer lands first; the other two while its recording is being refused: the
    # handler gives up holding them unrecorded (before, they were lost, not kept)
    first_held, held = threading.Event(), threading.Event()
    agent.agent.inject(
        "CreateReplica", Fault.delay(60, until=first_held), *[Fault.delay(60, until=held)] * 2
    )
    op_id, fn_id, jobs = spawn_op(broker_env, 3)
    settings = broker_env.settings
    budget = Budget.of(settings, soft_s=12, hard_s=13)  # gives up recording 2 s before 13 s
    failed: list[BaseException] = []

    def handler() -> None:
        try:
            run_batch(broker_env.db, settings, op_id, fn_id, jobs, budget)
        except Exception as exc:
            failed.append(exc)

    first = threading.Thread(target=handler)
    first.start()
    try:
        eventually(lambda: created([agent]) == 3, 20, "the three creates to go out")
        ids = [(r.id, str(r.node_id)) for r in replicas(broker_env)]
        postgres_server.stop()
        first_held.set()  # it lands with the store down, for longer than the handler has
        eventually(lambda: landed.find(settings, ids), 20, "the first answer kept in Redis")
        held.set()  # these land while its recording is refused
        eventually(lambda: len(agent.driver.list()) == 3, 20, "the other two VMs made")
        first.join(30)
    finally:
        first_held.set()
        held.set()
        postgres_server.start()
    assert not first.is_alive() and failed, "the handler gave up with the store down"
    rows = replicas(broker_env)
    assert {(r.status, r.vmid) for r in rows} == {(ReplicaState.CREATING, None)}
    kept = landed.find(settings, [(r.id, str(r.node_id)) for r in rows])
    assert {vm.vmid for vm in kept.values()} == running([agent]) and len(kept) == 3
    # The next handler (a redelivery once the first one's ownership lapsed) records them.
    clock.travel(settings.task_time_limit_s)
    nxt = run_batch(broker_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    assert set(nxt.states.values()) == {"idle"} and nxt.maybes == []
    assert created([agent]) == 3  # 6 before: three maybes, three replacements sent
    rows = replicas(broker_env)
    assert {r.status for r in rows} == {ReplicaState.IDLE}
    assert running([agent]) == {str(r.vmid) for r in rows}
    op = operation(broker_env, op_id)
    assert (op.status, op.done, op.failed) == ("succeeded", 3, 0)
    assert landed.find(settings, [(r.id, str(r.node_id)) for r in rows]) == {}  # dropped
    no_drift(broker_env)
