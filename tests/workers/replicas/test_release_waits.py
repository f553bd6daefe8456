"""A release a seed-protocol agent never got waits for it: the row stays Deleting, not Dead.

Found by the partition run (``bench/partition.py``): a delete whose release could not
reach a seed agent (its retries ran out), or a seed node lost past its dead grace, ended
its row Dead while the VM ran on - and nothing would ever release it, since reconcile
cannot list such a node and its guest said READY long ago. Each test drives the production
path (``delete_one`` as the ``delete_replica`` task calls it, the health task's
``mark_lost``, the reaper) against real gRPC agents on loopback that speak only the seed
protocol, taken down and brought back on the same port with the VMs they run, on SQLite
and PostgreSQL.
"""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from agents.faults import Fault
from agents.fcdaemon import RunningAgent, serve_fcdaemon
from corral import api
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation, replicas
from tests.workers.replicas.helpers import no_drift, nodes, running, spawn_idle
from workers.backends import inflight
from workers.base import clock
from workers.base.errors import TransientBackendError
from workers.base.kinds import OpKind
from workers.fleet.health import check_health
from workers.maintenance.reaper import reap
from workers.operations import create_operation
from workers.replicas.delete import WAITS, delete_one
from workers.replicas.lost import mark_lost
from workers.store.models import Function, Node, ReplicaState


def _cannot_list(env: Env, *names: str) -> None:
    """What reconcile's first pass learns of a seed agent: it cannot list its VMs."""
    with env.db.transaction() as s:
        s.execute(update(Node).where(Node.name.in_(names)).values(can_list=False))


def _cut_off(*agents: RunningAgent) -> None:
    """Nothing answers at the agents' addresses any more; their VMs run on (a partition)."""
    for agent in agents:
        agent.server.stop(0).wait()


def _back(agent: RunningAgent) -> RunningAgent:
    """The agent answering again on its port, with the VMs it ran (they outlived the outage)."""
    inflight.reset()  # no channel left in reconnect backoff from the outage
    return serve_fcdaemon(
        agent.address, driver=agent.driver, seed_only=True, advertise_ip="127.0.0.1"
    )


def _answers(env: Env) -> None:
    """Wait until corral's health probe hears the agent again (a client's reconnect back-off
    to the address it could not reach lasts up to 2 s)."""
    eventually(
        lambda: (
            "node1" not in check_health(env.db, env.settings).missed and nodes(env)["node1"].healthy
        ),
        timeout=10,
        what="node1 answering corral's probe",
    )


def _released_once_back(env: Env, agent: RunningAgent, replica_id: str) -> None:
    """The agent answers again: the next reaper pass releases the waiting row's VM."""
    back = _back(agent)
    try:
        _answers(env)
        report = reap(env.db, env.settings, holder="t")
        assert [(d.replica_id, d.outcome) for d in report.deleted] == [(replica_id, "deleted")]
        assert running([back]) == set()
        assert _status(env, replica_id) == ReplicaState.DELETED
        assert nodes(env)["node1"].live == 0
        no_drift(env)
    finally:
        back.stop(grace=0)


def _status(env: Env, replica_id: str) -> ReplicaState:
    return next(ReplicaState(r.status) for r in replicas(env) if r.id == replica_id)


@pytest.mark.timeout(60)
def test_a_release_a_seed_agent_never_got_waits_deleting_until_the_reaper_reaches_it(
    store_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=store_env, seed_only=True)
    deploy_fn(store_env)
    (replica,) = spawn_idle(store_env, "hello", 1)
    _cannot_list(store_env, "node1")
    settings = store_env.settings
    with store_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.DELETE, {"replica": replica.id}).id
    _cut_off(agent)

    with pytest.raises(TransientBackendError) as caught:
        delete_one(store_env.db, settings, replica.id, op_id)
    # the delete_replica task's retries ran out on that error
    state, error = delete_one(store_env.db, settings, replica.id, op_id, error=caught.value)

    assert state == "deleting" and WAITS in str(error)
    assert _status(store_env, replica.id) == ReplicaState.DELETING  # Dead on the code before
    assert nodes(store_env)["node1"].live == 1  # the slot its VM holds
    op = operation(store_env, op_id)
    assert (op.status, op.failed) == ("failed", 1) and WAITS in str(op.error)
    assert running([agent]) == {replica.vmid}

    clock.travel(settings.creating_deadline_s + 1)  # past its deadline, node still away
    report = reap(store_env.db, settings, holder="t")
    assert [(d.replica_id, d.outcome) for d in report.deleted] == [(replica.id, "waiting")]
    assert _status(store_env, replica.id) == ReplicaState.DELETING

    clock.travel(settings.creating_deadline_s + 1)
    _released_once_back(store_env, agent, replica.id)


@pytest.mark.timeout(60)
def test_a_lost_seed_nodes_replicas_wait_deleting_and_go_when_it_answers_listers_end_dead(
    store_env: Env, start_agents: StartAgents
) -> None:
    store_env.set(health_misses="1", node_dead_grace_s="0")
    (seed,) = start_agents(1, env=store_env, seed_only=True)
    (lister,) = start_agents(1, env=store_env)
    deploy_fn(store_env, placement="roundrobin")
    on = {str(r.node and r.node.name): r for r in spawn_idle(store_env, "hello", 2)}
    _cannot_list(store_env, "node1")
    with store_env.db.transaction() as s:  # node2 lists (as a corral agent would)
        s.execute(update(Node).where(Node.name == "node2").values(can_list=True))
    _cut_off(seed, lister)
    settings = store_env.settings
    assert sorted(check_health(store_env.db, settings).became_unhealthy) == ["node1", "node2"]

    assert mark_lost(store_env.db, settings) == 2
    assert mark_lost(store_env.db, settings) == 0  # once
    assert _status(store_env, on["node1"].id) == ReplicaState.DELETING  # Dead before
    assert _status(store_env, on["node2"].id) == ReplicaState.DEAD  # reconcile finds its VM
    found = nodes(store_env)
    assert (found["node1"].live, found["node2"].live) == (1, 0)
    with store_env.db.read() as s:  # neither counts: replaced elsewhere, as a Dead row is
        assert s.scalar(select(Function.replica_count)) == 0

    clock.travel(settings.creating_deadline_s + 1)
    assert reap(store_env.db, settings, holder="t").deleted == []  # its node is unhealthy
    _released_once_back(store_env, seed, on["node1"].id)


@pytest.mark.timeout(60)
def test_a_seed_node_gone_for_good_can_be_removed_and_its_waiting_rows_retire(
    store_env: Env, start_agents: StartAgents
) -> None:
    store_env.set(health_misses="1", node_dead_grace_s="0")
    (agent,) = start_agents(1, env=store_env, seed_only=True)
    deploy_fn(store_env)
    (replica,) = spawn_idle(store_env, "hello", 1)
    _cannot_list(store_env, "node1")
    with pytest.raises(Exception, match="still runs 1 replica"):
        api.remove_node("node1")  # healthy, running a replica: refused, as before
    _cut_off(agent)
    settings = store_env.settings
    check_health(store_env.db, settings)
    assert mark_lost(store_env.db, settings) == 1
    assert _status(store_env, replica.id) == ReplicaState.DELETING

    api.remove_node("node1")  # the operator says it will not answer again
    assert "node1" not in nodes(store_env)
    clock.travel(settings.creating_deadline_s + 1)
    report = reap(store_env.db, settings, holder="t")
    assert [(d.replica_id, d.outcome) for d in report.deleted] == [(replica.id, "gone")]
    assert _status(store_env, replica.id) == ReplicaState.DELETED
    no_drift(store_env)


@pytest.mark.timeout(60)
def test_idle_replicas_reaped_while_their_seed_node_is_away_each_wait_saying_why(
    store_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=store_env, seed_only=True)
    deploy_fn(store_env)
    idle = spawn_idle(store_env, "hello", 2)
    _cannot_list(store_env, "node1")
    _cut_off(agent)
    settings = store_env.settings
    clock.travel(settings.idle_timeout_s + 1)
    report = reap(store_env.db, settings, holder="t")
    assert sorted((d.replica_id, d.outcome) for d in report.deleted) == sorted(
        (r.id, "waiting") for r in idle
    )
    for d in report.deleted:
        assert d.error is not None and d.error.endswith(f"; {WAITS}")
        assert "ReleaseVMSetup" in d.error
    assert {_status(store_env, r.id) for r in idle} == {ReplicaState.DELETING}
    node = nodes(store_env)["node1"]
    assert node.misses == 1  # one miss a pass, however many releases failed
    assert node.last_error is not None and "ReleaseVMSetup" in node.last_error


@pytest.mark.timeout(60)
def test_a_release_the_pass_has_no_time_left_to_send_stays_deleting_for_the_next_pass(
    store_env: Env, start_agents: StartAgents
) -> None:
    # A pass sends no release later than 7 - 4.5 - 1 = 1.5 s after it began to release; the
    # first release takes 3 s, well inside its 4.5 s deadline, so the second is never sent.
    store_env.set(
        task_soft_time_limit_s=7,
        task_time_limit_s=9,
        create_timeout_s=4.5,
        rpc_timeout_s=4.5,
        lambdo_timeout_s=4.5,
        node_max_inflight=1,  # one release at a time
    )
    (agent,) = start_agents(1, env=store_env)
    deploy_fn(store_env)
    idle = {r.id for r in spawn_idle(store_env, "hello", 2)}
    agent.agent.inject("ReleaseVMSetup", Fault.delay(3.0))
    settings = store_env.settings
    clock.travel(settings.idle_timeout_s + 1)
    report = reap(store_env.db, settings, holder="t")
    outcomes = {d.replica_id: d.outcome for d in report.deleted}
    assert set(outcomes) == idle and sorted(outcomes.values()) == ["deleted", "left"]
    (left,) = [rid for rid, outcome in outcomes.items() if outcome == "left"]
    assert _status(store_env, left) == ReplicaState.DELETING
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 1 and len(running([agent])) == 1

    clock.travel(settings.creating_deadline_s + 1)
    report = reap(store_env.db, settings, holder="t")
    assert [(d.replica_id, d.outcome) for d in report.deleted] == [(left, "deleted")]
    assert _status(store_env, left) == ReplicaState.DELETED and running([agent]) == set()
    no_drift(store_env)
