"""One owner per create: duplicate handlers, lapsed owners, stale moves, counts settled once.

Each test drives the production path (``spawn.run_batch``, ``creates.create``,
``spawn.give_up``, ``delete.delete_batch``) against real gRPC agents on loopback -
agents that speak only the seed protocol (no ``requestId``, no ``ListReplicas``) and
agents with corral's extensions - on SQLite and PostgreSQL, and checks both sides: what
the agents run, and the rows and counters corral keeps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest
from celery import Celery, Task
from sqlalchemy import event, select, update
from sqlalchemy.exc import OperationalError

from agents.faults import Fault
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, lapsed, operation, replicas
from tests.workers.replicas.helpers import (
    ReleasingQueue,
    at_once,
    created,
    no_drift,
    nodes,
    running,
    spawn_op,
)
from workers import backends
from workers.backends import fcdaemon, inflight
from workers.base import clock
from workers.base.kinds import OpKind
from workers.maintenance import reaper
from workers.maintenance.reaper import reap
from workers.operations import create_operation
from workers.registry.service import DESTROY, READY, Registry
from workers.replicas import arrivals, moves, owners
from workers.replicas.delete import delete_batch
from workers.replicas.outcomes import Next, Outcome
from workers.replicas.owners import Budget, Owner, Pending, let_go, mark_sent, owner_token, take
from workers.replicas.plan import SpawnJob
from workers.replicas.scale import plan_scale
from workers.replicas.spawn import give_up, place, run_batch
from workers.store.db import Database
from workers.store.models import Node, Replica, ReplicaState


def test_two_deliveries_of_one_batch_at_once_send_each_create_once_to_a_seed_agent(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents = start_agents(2, env=corral_env, seed_only=True)
    for agent in agents:  # slow enough that both deliveries are in flight together
        agent.agent.inject("CreateReplica", *[Fault.delay(0.3)] * 6)
    op_id, fn_id, jobs = spawn_op(corral_env, 6)
    settings = corral_env.settings

    def deliver(_: int) -> Next:
        return run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))

    first, second = at_once(2, deliver)
    assert created(agents) == 6  # the seed protocol made two VMs per replica before
    rows = replicas(corral_env)
    assert len(rows) == 6 and {r.status for r in rows} == {ReplicaState.IDLE}
    assert {r.vmid for r in rows} == running(agents)
    # one delivery sent each create; the other found the row owned and left it alone
    states = [first.states.get(j.request_id) for j in jobs] + [
        second.states.get(j.request_id) for j in jobs
    ]
    assert states.count(Outcome.IDLE) == 6 and states.count(Outcome.OWNED_ELSEWHERE) == 6
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed, op.total) == ("succeeded", 6, 0, 6)
    no_drift(corral_env)


@pytest.mark.parametrize("seed_only", [True, False], ids=["seed", "extensions"])
def test_a_create_left_by_a_dead_owner_is_sent_again_only_where_the_node_deduplicates(
    corral_env: Env, start_agents: StartAgents, seed_only: bool
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=seed_only)
    op_id, fn_id, jobs = spawn_op(corral_env, 3)
    settings = corral_env.settings
    place(corral_env.db, settings, op_id, fn_id, jobs)
    # A handler took the rows, marked them sent and its creates reached the agent; then
    # it died (its ownership has lapsed) before recording anything.
    token = owner_token()
    dead = take(corral_env.db, settings, [j.request_id for j in jobs], token, lapsed())
    assert mark_sent(corral_env.db, token, dead.pending) == {p.replica_id for p in dead.pending}
    for p in dead.pending:
        inflight.run(
            fcdaemon.client(backends.target(p.node), settings).create_replica(
                fcdaemon.create_request(p.function, p.request_id, settings)
            )
        )
    assert len(agent.driver.list()) == 3

    redelivered = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    rows = replicas(corral_env)
    assert set(redelivered.states.values()) == {"idle"}
    assert operation(corral_env, op_id).status == "succeeded"
    if not seed_only:  # the same requestId again: the agent answers with the VM it made
        assert created([agent]) == 6 and len(agent.driver.list()) == 3
        assert {r.vmid for r in rows} == running([agent])
        no_drift(corral_env)
        return
    # The seed protocol cannot tell: each row is a maybe, keeping its slot (not its
    # count), and a replacement was created at once - never the same create again blindly.
    assert len(redelivered.maybes) == 3 and created([agent]) == 6
    maybes = [r for r in rows if r.status == ReplicaState.MAYBE]
    assert {r.id for r in maybes} == set(redelivered.maybes)
    assert all(r.vmid is None and r.maybe_of == op_id for r in maybes)
    assert {r.request_id for r in rows if r.status == ReplicaState.IDLE} == {
        j.request_id for j in jobs
    }
    assert nodes(corral_env)["node1"].live == 6 and len(agent.driver.list()) == 6
    no_drift(corral_env)
    # The first VMs now say READY: no create is in flight on their node, so each can
    # only be a maybe's; the maybe ends and its VM is released.
    queue = ReleasingQueue()
    released = queue.released
    registry = Registry(corral_env.db, settings, queue)
    orphans = running([agent]) - {r.vmid for r in rows}
    for vmid in orphans:
        assert registry.update_status(vmid, READY, peer="127.0.0.1") == DESTROY
    assert set(released) == orphans
    idle = {r.vmid for r in replicas(corral_env) if r.status == ReplicaState.IDLE}
    assert running([agent]) == idle
    assert {r.status for r in replicas(corral_env) if r.maybe_of} == {ReplicaState.DELETED}
    assert nodes(corral_env)["node1"].live == 3
    no_drift(corral_env)


def test_whether_an_owner_is_live_is_judged_by_the_database_not_the_handlers_clock(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    start_agents(1, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    request_id = jobs[0].request_id
    owner = Owner(owner_token(), Budget.of(settings).own_until())
    place(corral_env.db, settings, op_id, fn_id, jobs, owner=owner)  # owned, live
    # A handler and a reaper whose clocks read an hour ahead (say, before their next
    # measurement of the store's clock): to the database the owner is still live.
    ahead = clock.now() + timedelta(hours=1)
    monkeypatch.setattr(owners, "now", lambda: ahead)
    monkeypatch.setattr(reaper, "now", lambda: ahead)
    taken = take(corral_env.db, settings, [request_id], owner_token(), ahead)
    assert (taken.pending, taken.busy) == ([], [request_id])
    assert reap(corral_env.db, settings, holder="ahead").deleted == []
    (row,) = replicas(corral_env)
    assert (row.status, row.owner) == (ReplicaState.CREATING, owner.token)


def test_a_stale_owner_can_neither_move_the_row_nor_free_its_node_twice(
    corral_env: Env, start_agents: StartAgents
) -> None:
    a, b = start_agents(2, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    place(corral_env.db, settings, op_id, fn_id, jobs)
    request_id = jobs[0].request_id
    # the first handler's ownership lapses (a retry chain stuck on a hanging agent)...
    stale_token = owner_token()
    (stale,) = take(corral_env.db, settings, [request_id], stale_token, lapsed()).pending
    # ...and a redelivered batch takes the row over (the agent deduplicates creates)
    fresh_token = owner_token()
    with corral_env.db.transaction() as s:
        s.get(Node, stale.node.id).can_list = True  # type: ignore[union-attr]
    (fresh,) = take(
        corral_env.db, settings, [request_id], fresh_token, Budget.of(settings).own_until()
    ).pending
    first = stale.node.name
    assert nodes(corral_env)[first].live == 1

    def move(p: Pending, token: str) -> moves.Moved:
        with corral_env.db.transaction() as s:
            moves.lock_for_moves(s, [p])
            return moves.move(s, settings, p, token, "INTERNAL: boom", counted=True)

    assert move(stale, stale_token) == moves.Moved.LOST  # not its row any more: nothing changes
    assert nodes(corral_env)[first].live == 1
    assert move(fresh, fresh_token) == moves.Moved.MOVED
    assert move(fresh, fresh_token) == moves.Moved.LOST  # its create on the first node is over
    assert move(stale, stale_token) == moves.Moved.LOST
    live = {name: n.live for name, n in nodes(corral_env).items()}
    assert live == {first: 0, ("node2" if first == "node1" else "node1"): 1}
    # a VM the first node makes now, for the stale create, finds the row elsewhere
    vm = inflight.run(
        fcdaemon.client(backends.target(stale.node), settings).create_replica(
            fcdaemon.create_request(stale.function, request_id, settings)
        )
    )
    nxt = Next()
    late = [(stale, backends.Vm(vm.vmid, "http://x"))]
    arrivals.record(corral_env.db, settings, late, nxt, Budget.of(settings))
    (row,) = replicas(corral_env)
    assert row.status == ReplicaState.CREATING and row.vmid is None
    assert row.node_id != stale.node.id and row.placements == 2
    assert a.driver.list() == [] or b.driver.list() == []  # the late VM was released
    assert running([a, b]) == set()
    no_drift(corral_env)


def test_concurrent_give_ups_move_the_replica_once_and_leaveno_drift(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(3, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    place(corral_env.db, settings, op_id, fn_id, jobs)
    request_id = jobs[0].request_id
    (placed,) = replicas(corral_env)
    assert placed.node_id is not None

    outcomes = at_once(  # four deliveries of the give-up of one create that failed there
        4,
        lambda _: give_up(
            corral_env.db,
            settings,
            request_id,
            "UNAVAILABLE: gone",
            Budget.of(settings),
            failed_on=placed.node_id,
        ),
    )
    states = sorted(nxt.states[request_id] for nxt in outcomes)
    assert states.count(Outcome.MOVED) == 1, states
    assert sum(len(nxt.again) for nxt in outcomes) == 1
    (row,) = replicas(corral_env)
    assert row.placements == 2 and row.status == ReplicaState.CREATING
    assert sum(n.live for n in nodes(corral_env).values()) == 1
    no_drift(corral_env)


def test_a_delete_batch_delivered_twice_counts_each_replica_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env)
    op_id, fn_id, jobs = spawn_op(corral_env, 3)
    settings = corral_env.settings
    run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    with corral_env.db.transaction() as s:
        scale_id = create_operation(
            s, OpKind.SCALE, {"function": "hello", "target": 0}, function_id=fn_id
        ).id
    plan = plan_scale(corral_env.db, settings, scale_id)
    assert len(plan.deletes) == 3
    first, *rest = plan.deletes
    # the first delivery retired one replica, then its worker died
    assert delete_batch(corral_env.db, settings, scale_id, [first], Budget.of(settings)).done == 1
    assert operation(corral_env, scale_id).done == 1
    # a second delivery of the whole batch, its last release slow
    slow_vmid = next(r.vmid for r in replicas(corral_env) if r.id == rest[-1])
    agent.agent.inject("ReleaseVMSetup", Fault.delay(0), Fault.delay(1.0))
    thread = threading.Thread(
        target=delete_batch,
        args=(corral_env.db, settings, scale_id, plan.deletes, Budget.of(settings)),
    )
    thread.start()
    deadline = time.monotonic() + 5
    while len(agent.agent.calls_of("ReleaseVMSetup")) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    op = operation(corral_env, scale_id)
    # the retired replica is not counted again: two replicas are still being deleted
    assert (op.status, op.done) == ("running", 1), (op.status, op.done)
    thread.join(10)
    op = operation(corral_env, scale_id)
    assert (op.status, op.done, op.failed, op.total) == ("succeeded", 3, 0, 3)
    assert {r.status for r in replicas(corral_env)} == {ReplicaState.DELETED}
    assert agent.driver.list() == [] and slow_vmid
    no_drift(corral_env)


def test_two_runs_asking_to_mark_one_row_in_one_group_only_its_owner_sends_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    """The process marks its calls in groups: a row two runs of one message ask to mark in
    the same group is sent by the run that owns it, not by both (12 creates for 6 before)."""
    start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, jobs = spawn_op(corral_env, 2)
    settings, db = corral_env.settings, corral_env.db
    until = Budget.of(settings).own_until()
    first, second = owner_token("message-1", 0), owner_token("message-1", 0)
    held, row = place(db, settings, op_id, fn_id, jobs, owner=Owner(first, until))
    # a second delivery of the same message takes back the row the first has not marked
    assert [p.replica_id for p in take(db, settings, [row.request_id], second, until).pending] == [
        row.replica_id
    ]
    with db.transaction() as s:  # the store is busy: the process's marks wait in one group
        s.execute(update(Replica).where(Replica.id == held.replica_id).values(error="busy"))
        blocker = owners.mark_sent_soon(db, first, held.replica_id)
        eventually(blocker.running, 10, "the marks to wait for the store")
        theirs = owners.mark_sent_soon(db, first, row.replica_id)
        ours = owners.mark_sent_soon(db, second, row.replica_id)
    assert blocker.result(10) is True
    assert (ours.result(10), theirs.result(10)) == (True, False)
    (marked,) = [r for r in replicas(corral_env) if r.id == row.replica_id]
    assert marked.owner == second and marked.sent_at is not None


# ``owners.let_go`` gives up only rows never sent: a row whose create went out stays owned.
# (A one-line mutation, ``_LET_GO`` without ``sent_at IS NULL``, went uncaught before these:
# a handler that failed after sending some creates would give up rows whose create is out,
# and the next handler would take them as never sent and send them again - to a seed agent,
# a second VM.)


def test_let_go_gives_up_the_unsent_rows_and_keeps_the_sent_ones(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env, seed_only=True)
    fn_id = deploy_fn(corral_env, "hello", max=5)
    settings = corral_env.settings
    place(corral_env.db, settings, None, fn_id, [SpawnJob("sent"), SpawnJob("unsent")])
    token = owner_token()
    taken = take(
        corral_env.db, settings, ["sent", "unsent"], token, Budget.of(settings).own_until()
    )
    pending = {p.request_id: p for p in taken.pending}
    assert mark_sent(corral_env.db, token, [pending["sent"]]) == {pending["sent"].replica_id}
    let_go(corral_env.db, token, [p.replica_id for p in pending.values()])  # after an error
    with corral_env.db.read() as s:
        rows = {r.request_id: r for r in s.scalars(select(Replica))}
    assert (rows["unsent"].owner, rows["unsent"].owner_until, rows["unsent"].sent_at) == (
        None,
        None,
        None,
    )
    assert rows["sent"].owner == token and rows["sent"].sent_at is not None
    assert rows["sent"].owner_until is not None  # it lapses with its owner, as it must


def test_let_go_gives_up_only_its_own_rows(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env, "hello", max=5)
    settings = corral_env.settings
    place(corral_env.db, settings, None, fn_id, [SpawnJob("theirs")])
    theirs = owner_token()
    take(corral_env.db, settings, ["theirs"], theirs, Budget.of(settings).own_until())
    let_go(corral_env.db, owner_token(), [r.id for r in _rows(corral_env)])  # another handler
    assert [r.owner for r in _rows(corral_env)] == [theirs]


def test_a_twin_that_marked_its_row_sent_meanwhile_keeps_it_and_its_placements_come_along(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env, "hello", max=5)
    settings = corral_env.settings
    place(corral_env.db, settings, None, fn_id, [SpawnJob("raced"), SpawnJob("moved")])
    with corral_env.db.transaction() as s:  # a row already tried on two other nodes
        s.execute(update(Replica).where(Replica.request_id == "moved").values(placements=3))
    twin, mine = owner_token("message-1", 0), owner_token("message-1", 0)
    until = Budget.of(settings).own_until()
    take(corral_env.db, settings, ["raced"], twin, until)
    raced = next(r.id for r in _rows(corral_env) if r.request_id == "raced")
    marked: list[bool] = []

    def twin_marks(conn: Any, clause: Any, *_: Any) -> None:
        """The twin marks its row sent between this run's read and its UPDATE."""
        if getattr(clause, "is_update", False) and not marked:
            marked.append(True)
            conn.execute(update(Replica).where(Replica.id == raced).values(sent_at=clock.now()))

    event.listen(corral_env.db.engine, "before_execute", twin_marks)
    try:
        taken = take(corral_env.db, settings, ["raced", "moved"], mine, until)
    finally:
        event.remove(corral_env.db.engine, "before_execute", twin_marks)
    assert marked and taken.busy == ["raced"]  # unsent when read, sent when taken: the twin's
    assert [(p.request_id, p.placements) for p in taken.pending] == [("moved", 3)]
    owner = {r.request_id: r.owner for r in _rows(corral_env)}
    assert owner == {"raced": twin, "moved": mine}


def test_a_probe_asks_each_node_once_and_keeps_its_answer_on_that_nodes_row(
    corral_env: Env, start_agents: StartAgents, caplog: pytest.LogCaptureFixture
) -> None:
    (extended,) = start_agents(1, env=corral_env)  # node1
    start_agents(1, env=corral_env, seed_only=True)  # node2
    (busy,) = start_agents(1, env=corral_env)  # node3: cannot answer the first time
    busy.agent.inject("ListReplicas", Fault.abort(grpc.StatusCode.INTERNAL, "not now"))
    settings = corral_env.settings

    def probe(name: str) -> bool:
        return owners.probe_dedup(corral_env.db, settings, nodes(corral_env)[name])

    def kept() -> dict[str, bool | None]:
        return {name: node.can_list for name, node in nodes(corral_env).items()}

    with caplog.at_level(logging.INFO, logger="workers.replicas.owners"):
        assert probe("node3") is False
        assert kept() == {"node1": None, "node2": None, "node3": None}  # asked again later
        assert probe("node1") is True
        assert kept() == {"node1": True, "node2": None, "node3": None}
        assert probe("node2") is False
        assert kept() == {"node1": True, "node2": False, "node3": None}
        assert probe("node3") is True
        assert kept() == {"node1": True, "node2": False, "node3": True}
    lines = [r.getMessage() for r in caplog.records if r.name == "workers.replicas.owners"]
    assert lines[0].startswith("node node3 did not say whether it deduplicates creates: ")
    assert "not now" in lines[0]
    assert lines[1:] == [
        "node node1 deduplicates creates (requestId)",
        "node node2 speaks only the seed protocol",
        "node node3 deduplicates creates (requestId)",
    ]
    node = nodes(corral_env)["node2"]
    node.can_list = None  # a copy read before the answer was kept: it is asked, and told
    assert owners.probe_dedup(corral_env.db, settings, node) is False and node.can_list is False
    asked = [len(a.agent.calls_of("ListReplicas")) for a in (extended, busy)]
    assert [probe(name) for name in ("node1", "node2", "node3")] == [True, False, True]
    assert [len(a.agent.calls_of("ListReplicas")) for a in (extended, busy)] == asked  # kept


def _rows(env: Env) -> list[Replica]:
    with env.db.read() as s:
        return list(s.scalars(select(Replica)))


# -- tokens, and whose rows a token may take back (plain functions) -------------------------


def test_a_token_carries_its_retry_number_in_hex() -> None:
    for retries in (0, 9, 10, 26, 255, 4096):
        assert owners._retry_of(owner_token("message-1", retries)) == retries
    assert owners._retry_of(owner_token("message-1", 10**6)) == 16**owners.RETRY_CHARS - 1
    assert owners._retry_of("k" * 32) == -1  # a token that does not say
    assert {len(owner_token("message-1", n)) for n in (0, 10**6)} == {32}  # the owner column's


def test_a_budget_is_the_settings_limits_unless_given_its_own(corral_env: Env) -> None:
    settings = corral_env.settings
    own = Budget.of(settings, started=5.0, soft_s=3.0, hard_s=4.0)
    assert own == Budget(started=5.0, soft_s=3.0, hard_s=4.0, call_s=settings.call_timeout_s)
    before = time.monotonic()
    default = Budget.of(settings)
    assert before <= default.started <= time.monotonic()
    assert (default.soft_s, default.hard_s) == (
        settings.task_soft_time_limit_s,
        settings.task_time_limit_s,
    )


def test_a_run_takes_back_from_its_earlier_runs_and_a_twins_unsent_rows_only() -> None:
    first, second, later = (owner_token("message-1", n) for n in (0, 0, 1))
    other = owner_token("message-2", 0)
    unsaid = first[: owners.KEY_CHARS] + "zzzz" + first[owners.KEY_CHARS + 4 :]
    reclaim = owners._reclaim
    assert reclaim(first, first, True) == owners.Reclaim.EARLIER  # its own
    assert reclaim(first, later, True) == owners.Reclaim.EARLIER  # the retry takes it back
    assert reclaim(unsaid, first, True) == owners.Reclaim.EARLIER  # a run that does not say
    assert reclaim(first, second, False) == owners.Reclaim.UNSENT  # a twin: only unsent
    for sent in (True, False):
        assert reclaim(first, second, sent) is (None if sent else owners.Reclaim.UNSENT)
        assert reclaim(later, first, sent) is None  # never from a later run
        assert reclaim(other, first, sent) is None  # nor another message's


def test_a_token_made_in_a_task_carries_its_message_and_its_retry_number() -> None:
    app = Celery("tokens", set_as_current=False)

    @app.task(bind=True)  # type: ignore[untyped-decorator]
    def make(self: Task, retries: int | None = None) -> str:
        return owner_token(retries=retries)

    assert owners._current_message() == (None, 0)  # outside a task
    token = make.apply(task_id="message-7", retries=3).get()
    run = owners.KEY_CHARS + owners.RETRY_CHARS
    assert token[:run] == owner_token("message-7", 3)[:run]  # its message's, then retry 3
    assert owners._retry_of(token) == 3
    again = make.apply(task_id="message-7", retries=3).get()
    assert again[:run] == token[:run] and again != token  # a redelivery: same key, new nonce
    said = make.apply((5,), task_id="message-7", retries=3).get()  # a retry number it is given
    assert said[: owners.KEY_CHARS] == token[: owners.KEY_CHARS] and owners._retry_of(said) == 5


def test_a_mark_the_store_refuses_raises_the_stores_error_to_its_caller(tmp_path: Path) -> None:
    broken = Database(f"sqlite:///{tmp_path / 'no-schema.sqlite'}")  # no replicas table
    with pytest.raises(OperationalError, match="no such table: replicas"):
        owners.mark_sent_soon(broken, owner_token(), "r1").result(10)
    broken.dispose()


def test_the_process_marks_with_one_daemon_thread(corral_env: Env) -> None:
    owners.mark_sent_soon(corral_env.db, owner_token(), "no-such-row").result(10)
    marker = owners._marker
    assert marker is not None
    assert owners.mark_sent_soon(corral_env.db, owner_token(), "no-such-row").result(10) is False
    assert owners._marker is marker  # the same thread, as long as the process lives
    # it never keeps the process from exiting, and shows by its name in a thread dump
    assert (marker.thread.name, marker.thread.daemon) == ("corral-marks", True)


class _Halt(BaseException):
    """What no ``except Exception`` catches (as KeyboardInterrupt or SystemExit)."""


def test_a_group_that_raises_past_every_handler_tells_its_callers_and_the_thread_goes_on(
    corral_env: Env, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = owners._Marker()  # a thread of its own: a fresh process's first mark
    assert (marker.thread.name, marker.thread.daemon) == ("corral-marks", True)
    db, token = corral_env.db, owner_token()

    def mark(replica_id: str) -> concurrent.futures.Future[bool]:
        done: concurrent.futures.Future[bool] = concurrent.futures.Future()
        marker.waiting.put(owners._Mark(db, token, replica_id, done))
        return done

    def halt(_: Database, marks: list[owners._Mark]) -> None:
        raise _Halt("the store call was cut")

    monkeypatch.setattr(owners, "_mark_group", halt)
    with (
        caplog.at_level(logging.ERROR, logger="workers.replicas.owners"),
        pytest.raises(_Halt, match="was cut"),
    ):
        mark("r1").result(10)  # never left waiting
    (said,) = [r for r in caplog.records if r.name == "workers.replicas.owners"]
    assert said.getMessage() == "marking 1 create(s) sent failed"
    assert said.exc_info is not None and said.exc_info[0] is _Halt

    def told_then_halt(_: Database, marks: list[owners._Mark]) -> None:
        marks[0].done.set_result(True)
        raise _Halt("after the answer")

    monkeypatch.setattr(owners, "_mark_group", told_then_halt)
    assert mark("r2").result(10) is True  # an answer given stands
    monkeypatch.undo()
    assert mark("no-such-row").result(10) is False  # the thread marks on


# SQLite only: the store is kept busy by its database write lock (rows that do not exist
# take no row lock on PostgreSQL); how the marks are grouped does not depend on the store.
@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_the_marks_asked_for_while_the_store_is_busy_are_made_in_one_transaction(
    corral_env: Env,
) -> None:
    marker = owners._Marker()
    db = corral_env.db
    commits: list[object] = []
    listener = commits.append
    event.listen(db.engine, "commit", listener)
    try:
        with db.transaction() as s:  # the store is busy: the marks asked for meanwhile wait
            s.execute(update(Replica).values(error="busy"))
            done: list[concurrent.futures.Future[bool]] = []
            for n in range(4):
                done.append(concurrent.futures.Future())
                marker.waiting.put(owners._Mark(db, owner_token(), f"no-such-row-{n}", done[-1]))
                if n == 0:
                    eventually(done[0].running, 10, "the first mark to wait for the store")
        assert [d.result(10) for d in done] == [False] * 4
        assert len(commits) == 3  # the busy one, the first mark, then the three others at once
    finally:
        event.remove(db.engine, "commit", listener)


def test_let_go_on_a_store_that_fails_says_so_and_raises_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = Database(f"sqlite:///{tmp_path / 'no-schema.sqlite'}")  # no replicas table
    with caplog.at_level(logging.WARNING, logger="workers.replicas.owners"):
        let_go(broken, owner_token(), ["r1", "r2"])
    (warning,) = [r for r in caplog.records if r.name == "workers.replicas.owners"]
    assert warning.getMessage().startswith("could not give up 2 unsent row(s): (sqlite3.")
    assert "no such table: replicas" in warning.getMessage()
    broken.dispose()
