"""Races a code review traced, each pinned by a test that failed before its fix.

Interleavings that depend on timing are forced with a hook at the exact point
(a listing that returns just before a spawn records its VM, a health probe that
waits for a second pass), against real agents and the real store; concurrent
planning runs on PostgreSQL with threads released together.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import select, text

from agents.faults import Fault
from corral import api
from tasks.maintenance import QUEUE
from tasks.replicas import scale, spawn
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, one_agent, operation, replicas, spawn_ok
from tests.workers.replicas.helpers import at_once
from workers import backends, leases
from workers.base import clock
from workers.base.kinds import OpKind
from workers.fleet import health, placement
from workers.maintenance.reaper import reap
from workers.maintenance.reconcile import below_min, reconcile
from workers.operations import create_operation, fail_operation
from workers.replicas import spawn as replica_logic
from workers.replicas.claims import claim, release
from workers.replicas.creates import create
from workers.replicas.owners import Budget
from workers.replicas.plan import SpawnJob
from workers.replicas.scale import plan_scale
from workers.replicas.spawn import place, plan_spawn, run_batch
from workers.store.models import Claim, Function, Node, ReplicaState


@pytest.fixture
def store(corral_env: Env) -> Env:
    """The same test on SQLite and on PostgreSQL (``corral_env`` runs on both)."""
    return corral_env


def _fn_id(env: Env, name: str = "hello") -> str:
    with env.db.read() as s:
        return s.scalars(select(Function.id).where(Function.name == name)).one()


def _new_op(env: Env, kind: OpKind, **params: Any) -> str:
    """An operation written as the API writes it, without queueing its task."""
    with env.db.transaction() as s:
        op = create_operation(s, kind, {"function": "hello", **params}, function_id=_fn_id(env))
        return op.id


# -- 1. reconcile vs. a spawn that lands while the node is listed ------------------------------


def test_a_vm_recorded_while_its_node_is_listed_is_neither_vanished_nor_orphan(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = one_agent(corral_env, start_agents)
    settings = corral_env.set(orphan_grace_s="0")
    place(corral_env.db, settings, None, _fn_id(corral_env), [SpawnJob("req-1")])
    listing = backends.list_vms

    landed: list[Mapping[str, str]] = []

    def list_then_spawn_lands(node: Node, s: Any) -> Any:
        vms = listing(node, s)  # the node is listed before the VM exists...
        landed.append(create(corral_env.db, settings, ["req-1"], Budget.of(settings)).states)
        return vms  # ...and the spawn records its VM before reconcile reads the rows

    monkeypatch.setattr(backends, "list_vms", list_then_spawn_lands)
    first = reconcile(corral_env.db, settings, holder="t", queue=QUEUE)
    monkeypatch.setattr(backends, "list_vms", listing)
    # the race took place: the node was listed (once, no error) and the VM landed meanwhile
    assert landed == [{"req-1": "idle"}], first
    assert first.nodes_checked == ["node1"], first
    second = reconcile(corral_env.db, settings, holder="t", queue=QUEUE)

    assert first.vanished == [] and second.vanished == []
    assert second.orphans_destroyed == []
    (row,) = replicas(corral_env)
    assert row.status == ReplicaState.IDLE
    assert [vm.vmid for vm in agent.driver.list()] == [row.vmid]


# -- 2. deleting a replica its spawn still waits for -------------------------------------------


@pytest.mark.parametrize("readiness", ["agent", "guest"])
def test_deleting_a_creating_or_starting_replica_settles_its_spawn(
    corral_env: Env, start_agents: StartAgents, readiness: str
) -> None:
    corral_env.set(create_timeout_s="30")  # no deadline while the create is held
    agent = one_agent(corral_env, start_agents, readiness=readiness)
    settings = corral_env.settings
    spawn_op = _new_op(corral_env, OpKind.SPAWN, count=1)
    fn_id, jobs = plan_spawn(corral_env.db, spawn_op)
    made = threading.Event()  # the node is still making the VM until the delete is done
    if readiness == "agent":
        agent.agent.inject("CreateReplica", Fault.delay(60, until=made))
    spawning = threading.Thread(
        target=run_batch, args=(corral_env.db, settings, spawn_op, fn_id, jobs, Budget.of(settings))
    )
    spawning.start()
    if readiness == "guest":  # the VM exists; the replica waits in Starting for its guest
        spawning.join(10)
    else:
        _wait_for_call(agent)
    (row,) = replicas(corral_env)
    assert row.status == (ReplicaState.STARTING if readiness == "guest" else ReplicaState.CREATING)

    try:
        deleted = api.wait(api.delete(row.id), timeout=10)
    finally:
        made.set()
    assert deleted["status"] == "succeeded"
    spawned = api.wait(spawn_op, timeout=5)  # timed out here before the fix
    assert spawned["status"] == "failed"
    assert "deleted before it was ready" in (spawned["error"] or "")
    spawning.join(10)  # a VM the node was still making arrives late and is released
    assert agent.driver.list() == []
    assert replicas(corral_env)[0].status == ReplicaState.DELETED
    assert len(agent.agent.calls_of("CreateReplica")) == 1


def _wait_for_call(agent: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not agent.agent.calls_of("CreateReplica"):
        assert time.monotonic() < deadline, "no CreateReplica call"
        time.sleep(0.02)


# -- 3. concurrent scales, scale + top-up, redelivered spread spawns ----------------------------


def test_two_concurrent_scales_to_five_plan_five_replicas(
    store: Env, start_agents: StartAgents
) -> None:
    start_agents(2)
    deploy_fn(store)
    ops = [_new_op(store, OpKind.SCALE, target=5) for _ in range(2)]
    plans = at_once(2, lambda i: plan_scale(store.db, store.settings, ops[i]))
    assert len(plans) == 2
    assert sorted(len(p.spawns) for p in plans) == [0, 5]  # 5 and 5 before the fix
    for op_id in ops:  # carry the plans out (eager): five replicas, not ten
        api.wait(_resend(op_id), timeout=30)
    assert [r.status for r in replicas(store)] == [ReplicaState.IDLE] * 5


def _resend(op_id: str) -> str:
    """Run an operation's first task again (eager): a redelivery."""
    scale.delay(op_id)
    return op_id


def test_a_scale_planned_but_not_placed_counts_for_top_up(
    store: Env, start_agents: StartAgents
) -> None:
    start_agents(1)
    deploy_fn(store, min=2)
    plan = plan_scale(store.db, store.settings, _new_op(store, OpKind.SCALE, target=5))
    assert len(plan.spawns) == 5
    assert below_min(store.db, store.settings) == {}  # {"hello": 2} before the fix
    # and a second scale sees the first's five on their way
    again = plan_scale(store.db, store.settings, _new_op(store, OpKind.SCALE, target=6))
    assert len(again.spawns) == 1


def test_a_redelivered_spread_spawn_keeps_its_node_list(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(2)
    deploy_fn(corral_env, placement="spread")
    op_id = _new_op(corral_env, OpKind.SPAWN, count=1)
    _, first = plan_spawn(corral_env.db, op_id)
    start_agents(1)  # a third node comes up before the message is redelivered
    _, again = plan_spawn(corral_env.db, op_id)
    assert again == first and len(first) == 2
    assert operation(corral_env, op_id).total == 2


# -- 5. a task whose operation already ended -----------------------------------------------------


@pytest.mark.parametrize("kind", [OpKind.SPAWN, OpKind.SCALE])
def test_a_task_for_a_failed_operation_does_nothing(
    corral_env: Env, start_agents: StartAgents, kind: OpKind
) -> None:
    agent = one_agent(corral_env, start_agents)
    op_id = _new_op(corral_env, kind, **({"count": 2} if kind == OpKind.SPAWN else {"target": 2}))
    with corral_env.db.transaction() as s:  # what a publish that timed out records
        fail_operation(s, op_id, "could not queue the task: TimeoutError")
    (spawn if kind == OpKind.SPAWN else scale).delay(op_id)  # ...yet Redis had taken it
    assert replicas(corral_env) == [] and agent.driver.list() == []
    assert operation(corral_env, op_id).status == "failed"


# -- 6. health passes --------------------------------------------------------------------------


def test_overlapping_health_passes_count_one_miss(
    store: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    (agent,) = start_agents(1)
    agent.stop(grace=0)  # every probe fails
    second_done = threading.Event()
    probe = backends.probe
    calls: list[int] = []

    def slow_first(node: Node, s: Any) -> bool:
        calls.append(1)
        try:
            return probe(node, s)
        finally:
            if len(calls) == 1:  # the first pass is still probing when the next starts
                second_done.wait(20)

    monkeypatch.setattr(backends, "probe", slow_first)
    results: list[health.HealthReport] = []
    first = threading.Thread(
        target=lambda: results.append(health.check_health(store.db, store.settings))
    )
    first.start()
    while not calls:
        threading.Event().wait(0.01)
    results.append(health.check_health(store.db, store.settings))
    second_done.set()
    first.join(30)
    with store.db.read() as s:
        assert s.scalars(select(Node.misses)).one() == 1  # 2 before the fix
    assert sorted(r.skipped for r in results) == [False, True]
    assert leases.current(store.db, health.LEASE) is None  # given back


# -- 4. one lock order; timeouts on PostgreSQL ---------------------------------------------------


def test_two_batches_pinned_in_opposite_node_orders_do_not_deadlock(
    pg_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_agents(2)
    deploy_fn(pg_env, name="f1")
    deploy_fn(pg_env, name="f2")
    with pg_env.db.read() as s:
        a, b = s.scalars(select(Node.id).order_by(Node.name)).all()
    both_hold_one = threading.Barrier(2, timeout=3)
    reserve = placement.reserve_node
    taken: dict[int, int] = {}

    def reserve_then_wait(
        session: Any, fn: Function, policy: str, pinned: str | None = None
    ) -> Node:
        node = reserve(session, fn, policy, pinned=pinned)
        me = threading.get_ident()
        taken[me] = taken.get(me, 0) + 1
        if taken[me] == 1:  # each batch holds its first node while the other takes its own
            # broken: the other batch waits for our nodes, which is the order holding
            with contextlib.suppress(threading.BrokenBarrierError):
                both_hold_one.wait()
        return node

    monkeypatch.setattr(replica_logic, "reserve_node", reserve_then_wait)
    orders = {"f1": [a, b], "f2": [b, a]}

    def batch(i: int) -> str | None:
        name = f"f{i + 1}"
        jobs = [SpawnJob(f"{name}.{n}", node) for n, node in enumerate(orders[name])]
        try:
            place(pg_env.db, pg_env.settings, None, _fn_id(pg_env, name), jobs)
        except Exception as exc:  # a deadlock before the fix
            return f"{type(exc).__name__}: {exc}"
        return None

    assert at_once(2, batch) == [None, None]
    rows = replicas(pg_env)
    assert len(rows) == 4 and {r.status for r in rows} == {ReplicaState.CREATING}
    with pg_env.db.read() as s:
        assert [n.live for n in s.scalars(select(Node).order_by(Node.name))] == [2, 2]


def test_postgres_connections_carry_lock_and_statement_timeouts(pg_env: Env) -> None:
    settings = pg_env.set(db_lock_timeout_s="2.5", db_statement_timeout_s="25")
    pg_env.db.dispose()
    with pg_env.db.read() as s:
        assert s.scalar(text("SHOW lock_timeout")) == "2500ms"
        assert s.scalar(text("SHOW statement_timeout")) == "25s"
    assert settings.db_lock_timeout_s == 2.5


# -- found by the soak: a claim on a replica that was deleted under it ---------------------------


@pytest.mark.parametrize("ends", ["released", "expired"])
def test_a_claim_on_a_replica_deleted_under_it_ends_with_it(
    store: Env, start_agents: StartAgents, ends: str
) -> None:
    start_agents(1)
    deploy_fn(store)
    spawn_ok("hello", 1, timeout=30)
    held = claim(store.db, store.settings, "hello", ttl_s=5)
    assert api.wait(api.delete(held.replica_id), timeout=30)["status"] == "succeeded"
    if ends == "released":  # an IntegrityError (envs_in_use -1) before the fix
        assert release(store.db, store.settings, held.claim_id)["released"] is False
    else:  # the reaper's expiry failed the same way, and with it every reap pass
        clock.travel(10)
        try:
            assert not reap(store.db, store.settings, holder="t").skipped
        finally:
            clock.reset()
    with store.db.read() as s:
        assert s.scalars(select(Claim)).all() == []
    (row,) = replicas(store)
    assert row.status == ReplicaState.DELETED and row.envs_in_use == 0
