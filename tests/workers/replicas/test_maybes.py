"""The "sent" mark and maybes: a create goes out again only if it never went, and an ambiguous
answer never parks its request.

Each test drives the production path (``spawn.run_batch`` / ``creates.create``, the reaper,
the registry's ``UpdateStatus`` logic) against real gRPC agents on loopback that speak only
the seed protocol (no ``requestId``, no ``ListReplicas``: a create sent twice makes two VMs),
on SQLite and PostgreSQL, and checks what the agents run against the rows and counters.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import grpc
import pytest
from sqlalchemy import select, update

from agents.faults import Fault
from agents.fcdaemon import RunningAgent, spec_from_request
from corral import api
from tasks.maintenance import QUEUE
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, lapsed, operation, replicas, result_of
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
from workers.backends import fcdaemon, inflight, networks
from workers.base import clock
from workers.maintenance.reaper import reap
from workers.registry.service import OK, READY, Registry
from workers.replicas import creates, sends
from workers.replicas.lifecycle import ready_window
from workers.replicas.maybes import (
    MAX_REQUEST_ID,
    Replaced,
    Settled,
    maybe_request_id,
    note_ready_node,
    replace,
    reports_ready,
    settle_vm,
)
from workers.replicas.moves import lock_for_moves
from workers.replicas.outcomes import Next
from workers.replicas.owners import Budget, Owner, disown, mark_sent, owner_token, take
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import place, run_batch
from workers.store.models import Function, Gpu, Node, OrphanRelease, Replica, ReplicaState

UNAVAILABLE = Fault.abort(grpc.StatusCode.UNAVAILABLE, "busy")  # the agent did nothing


def _maybes(env: Env) -> list[Replica]:
    return [r for r in replicas(env) if r.status == ReplicaState.MAYBE]


def _idle(env: Env) -> list[Replica]:
    return [r for r in replicas(env) if r.status == ReplicaState.IDLE]


def test_a_row_owned_but_never_marked_sent_is_sent_by_the_next_handler(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, jobs = spawn_op(corral_env, 3)
    settings = corral_env.settings
    place(corral_env.db, settings, op_id, fn_id, jobs)
    # a handler took the rows and died before marking them sent (its ownership lapsed)
    dead = take(corral_env.db, settings, [j.request_id for j in jobs], owner_token(), lapsed())
    assert len(dead.pending) == 3 and created([agent]) == 0

    nxt = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    assert set(nxt.states.values()) == {"idle"} and nxt.maybes == []
    assert created([agent]) == 3 and running([agent]) == {r.vmid for r in _idle(corral_env)}
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("succeeded", 3, 0)
    no_drift(corral_env)


def test_an_ambiguous_answer_from_a_seed_agent_makes_a_maybe_replaced_at_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("CreateReplica", UNAVAILABLE, UNAVAILABLE)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings

    nxt = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    assert nxt.states == {jobs[0].request_id: "idle"} and len(nxt.maybes) == 2
    assert created([agent]) == 3 and len(running([agent])) == 1
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed, op.total) == ("succeeded", 1, 0, 1)
    (replica,) = _idle(corral_env)
    assert replica.request_id == jobs[0].request_id and replica.placements == 3
    maybes = _maybes(corral_env)
    assert {r.id for r in maybes} == set(nxt.maybes)
    assert all(r.vmid is None and r.maybe_of == op_id for r in maybes)
    assert all(r.request_id.startswith(f"{jobs[0].request_id}~") for r in maybes)
    # each maybe keeps its slot on the node; only the replica counts toward the function
    assert nodes(corral_env)["node1"].live == 3
    with corral_env.db.read() as s:
        assert s.scalar(select(Function.replica_count).where(Function.id == fn_id)) == 1
    no_drift(corral_env)
    # `corral ops OP` and `corral replicas` show them as such
    assert api.operation(op_id, settings=settings)["maybes"] == {"open": 2}
    assert sorted(r["status"] for r in api.replicas("hello", settings=settings)) == [
        "idle",
        "maybe",
        "maybe",
    ]
    # This node's guests were never seen to report READY: its maybes wait for the creating
    # deadline, then end Dead, each giving its slot back once.
    clock.travel(settings.create_timeout_s + settings.ready_grace_s + 1)
    reap(corral_env.db, settings, holder="t")
    assert len(_maybes(corral_env)) == 2
    clock.travel(settings.creating_deadline_s)
    reap(corral_env.db, settings, holder="t")
    assert _maybes(corral_env) == []
    assert {r.status for r in replicas(corral_env) if r.maybe_of} == {ReplicaState.DEAD}
    assert nodes(corral_env)["node1"].live == 1
    assert api.operation(op_id, settings=settings)["maybes"] == {"ended": 2}
    no_drift(corral_env)


def test_a_maybe_on_a_node_whose_guests_report_ready_waits_only_as_long_as_a_ready_would(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("CreateReplica", UNAVAILABLE)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    (maybe,) = _maybes(corral_env)
    (replica,) = _idle(corral_env)
    assert nodes(corral_env)["node1"].ready_seen_at is None
    # the replacement's guest says READY: the node is one whose guests report, and the
    # maybe made before anyone knew waits no longer than a READY would
    registry = Registry(corral_env.db, settings, QUEUE)
    assert registry.update_status(str(replica.vmid), READY, peer="127.0.0.1") == OK
    assert nodes(corral_env)["node1"].ready_seen_at is not None
    clock.travel(settings.create_timeout_s + settings.ready_grace_s + 1)
    reap(corral_env.db, settings, holder="t")
    (ended,) = [r for r in replicas(corral_env) if r.id == maybe.id]
    assert ended.status == ReplicaState.DEAD and "maybe ended" in str(ended.error)
    assert nodes(corral_env)["node1"].live == 1
    assert operation(corral_env, op_id).status == "succeeded"
    no_drift(corral_env)


def test_a_maybe_made_on_a_node_known_to_report_ready_waits_only_for_a_ready_and_says_why(
    corral_env: Env, start_agents: StartAgents, caplog: pytest.LogCaptureFixture
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("CreateReplica", UNAVAILABLE)
    with corral_env.db.transaction() as s:  # a guest of the node was seen to say READY
        s.execute(update(Node).values(ready_seen_at=clock.now()))
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    with caplog.at_level("WARNING", logger="workers.replicas.maybes"):
        run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    (maybe,) = _maybes(corral_env)
    assert maybe.deadline_at is not None
    assert maybe.deadline_at <= clock.now() + ready_window(settings)  # not the creating one
    head = "maybe: its create on node1 went out, outcome unknown ("
    assert maybe.error is not None and maybe.error.startswith(head)
    why = maybe.error[len(head) :].split("); replaced by ")[0]
    assert why and f"replica {maybe.id} on node1 is a maybe: {why}" in caplog.messages
    clock.travel(settings.create_timeout_s + settings.ready_grace_s + 1)
    reap(corral_env.db, settings, holder="t")
    assert _maybes(corral_env) == []
    no_drift(corral_env)


def _lost_answer(env: Env, agent: RunningAgent, count: int) -> tuple[str, str, str]:
    """A spawn of ``count`` whose first create's answer is lost (the agent makes the VM after
    corral's deadline): (operation, function, the VM no row has) once the agent made it."""
    op_id, fn_id, nxt = _answer_lost(env, agent, count)
    assert set(nxt.states.values()) == {"idle"} and len(nxt.maybes) == 1, [
        (r.status, r.error) for r in replicas(env)
    ]
    (extra,) = running([agent]) - {r.vmid for r in _idle(env)}
    return op_id, fn_id, extra


def _answer_lost(env: Env, agent: RunningAgent, count: int) -> tuple[str, str, Next]:
    """Run a spawn of ``count`` whose first create's answer is lost: corral's deadline passes
    (``DEADLINE_EXCEEDED``) and the agent makes that VM anyway, after corral gave up on it.

    No deadline is waited out: a create held past a short deadline, beside others held to
    the same deadline, failed those too on a loaded machine.
    """
    agent.agent.inject("CreateReplica", Fault.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "late"))
    op_id, fn_id, jobs = spawn_op(env, count)
    nxt = run_batch(env.db, env.settings, op_id, fn_id, jobs, Budget.of(env.settings))
    first = agent.agent.calls_of("CreateReplica")[0]
    agent.driver.start(spec_from_request(first))  # the VM of the answer corral never had
    return op_id, fn_id, nxt


def test_a_ready_that_can_only_be_the_maybes_ends_it_and_releases_its_vm(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, vmid = _lost_answer(corral_env, agent, 2)
    settings = corral_env.settings
    assert operation(corral_env, op_id).status == "succeeded"
    # another create on the node is in flight: its answer might yet name this vmid
    token = owner_token()
    place(corral_env.db, settings, None, fn_id, [SpawnJob("other")])
    (other,) = take(
        corral_env.db, settings, ["other"], token, Budget.of(settings).own_until()
    ).pending
    assert mark_sent(corral_env.db, token, [other]) == {other.replica_id}
    queue = ReleasingQueue()
    released = queue.released
    registry = Registry(corral_env.db, settings, queue)
    assert registry.update_status(vmid, READY, peer="127.0.0.1") == OK  # remembered
    assert len(_maybes(corral_env)) == 1 and released == []
    with corral_env.db.transaction() as s:  # that create proved to make nothing
        disown(s, token, [other.replica_id])
    registry.sweep()
    assert released == [vmid] and vmid not in running([agent])
    assert running([agent]) == {r.vmid for r in _idle(corral_env)}
    (settled,) = [r for r in replicas(corral_env) if r.maybe_of == op_id]
    assert (settled.status, settled.vmid) == (ReplicaState.DELETED, vmid)
    assert api.operation(op_id, settings=settings)["maybes"] == {"released": 1}
    no_drift(corral_env)


def test_a_ready_from_the_maybes_own_guest_is_adopted_when_the_function_wants_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    with corral_env.db.transaction() as s:  # its guests report from their own network
        s.execute(update(Node).values(replica_networks=["127.0.0.1/32", "10.77.0.0/24"]))
    networks.forget()
    op_id, _, vmid = _lost_answer(corral_env, agent, 1)
    settings = corral_env.settings
    with corral_env.db.transaction() as s:  # a scale wants two of them now
        s.execute(update(Function).values(target=2))
    queue = ReleasingQueue()
    released = queue.released
    registry = Registry(corral_env.db, settings, queue)
    assert registry.update_status(vmid, READY, peer="10.77.0.9") == OK
    (adopted,) = [r for r in replicas(corral_env) if r.maybe_of == op_id]
    assert (adopted.status, adopted.vmid) == (ReplicaState.IDLE, vmid)
    assert adopted.address == "http://10.77.0.9:8080" and released == []
    assert running([agent]) == {r.vmid for r in _idle(corral_env)}
    with corral_env.db.read() as s:
        assert s.scalar(select(Function.replica_count)) == 2
    assert api.operation(op_id, settings=settings)["maybes"] == {"adopted": 1}
    no_drift(corral_env)


def test_a_retry_of_the_same_message_takes_back_what_its_earlier_run_left(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, jobs = spawn_op(corral_env, 2)
    settings = corral_env.settings
    ids = [j.request_id for j in jobs]
    until = Budget.of(settings).own_until()  # the earlier run ended without giving them up
    earlier = owner_token("message-1", 0)
    written = place(corral_env.db, settings, op_id, fn_id, jobs, owner=Owner(earlier, until))
    sent = next(p for p in written if p.request_id == ids[0])
    assert mark_sent(corral_env.db, earlier, [sent]) == {sent.replica_id}
    (sent_at,) = [r.sent_at for r in replicas(corral_env) if r.id == sent.replica_id]
    assert sent_at is not None
    inflight.run(  # its one create went out and made a VM; its answer was lost
        fcdaemon.client(backends.target(sent.node), settings).create_replica(
            fcdaemon.create_request(sent.function, sent.request_id, settings)
        )
    )
    # a handler of another message leaves both alone: their owner lives
    other = take(corral_env.db, settings, ids, owner_token("message-2", 0), until)
    assert sorted(other.busy) == sorted(ids) and other.pending == other.ambiguous == []
    # a second delivery of the same message takes back only the row never sent
    again = take(corral_env.db, settings, ids, owner_token("message-1", 0), until)
    assert [p.request_id for p in again.pending] == [ids[1]] and again.busy == [ids[0]]
    # its retry takes back everything: the sent row, ambiguous here, becomes a maybe
    retry = Owner(owner_token("message-1", 1), until)
    nxt = creates.create(corral_env.db, settings, ids, Budget.of(settings), owner=retry)
    assert nxt.states == dict.fromkeys(ids, "idle") and len(nxt.maybes) == 1
    assert created([agent]) == 3 and len(running([agent])) == 3
    (maybe,) = _maybes(corral_env)  # it keeps when its create went out
    assert (maybe.id, maybe.sent_at) == (sent.replica_id, sent_at)
    assert operation(corral_env, op_id).status == "succeeded"
    no_drift(corral_env)


def test_two_runs_of_one_message_at_once_send_each_create_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents = start_agents(2, env=corral_env, seed_only=True)
    for agent in agents:  # slow enough that both runs overlap
        agent.agent.inject("CreateReplica", *[Fault.delay(0.3)] * 6)
    op_id, fn_id, jobs = spawn_op(corral_env, 6)
    settings = corral_env.settings

    def deliver(_: int) -> Next:
        owner = Owner(owner_token("message-1", 0), Budget.of(settings).own_until())
        written = place(corral_env.db, settings, op_id, fn_id, jobs, owner=owner)
        ids = [j.request_id for j in jobs]
        return creates.create(
            corral_env.db, settings, ids, Budget.of(settings), owner=owner, owned=written
        )

    at_once(2, deliver)
    assert created(agents) == 6
    assert {r.status for r in replicas(corral_env)} == {ReplicaState.IDLE}
    assert running(agents) == {r.vmid for r in replicas(corral_env)}
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("succeeded", 6, 0)
    no_drift(corral_env)


def test_an_exception_in_a_batch_lets_go_of_the_rows_it_never_sent(
    corral_env: Env, start_agents: StartAgents, monkeypatch: pytest.MonkeyPatch
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, jobs = spawn_op(corral_env, 3)
    settings = corral_env.settings

    def store_gone(*_: object) -> bool:
        raise RuntimeError("the store went away")

    monkeypatch.setattr(sends, "mark_sent_soon", store_gone)
    with pytest.raises(RuntimeError, match="store went away"):
        run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    rows = replicas(corral_env)
    assert {(r.status, r.owner, r.sent_at) for r in rows} == {(ReplicaState.CREATING, None, None)}
    monkeypatch.undo()
    # nothing was sent: the next handler sends them at once, on a seed agent too
    nxt = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    assert set(nxt.states.values()) == {"idle"} and created([agent]) == 3
    no_drift(corral_env)


# A maybe's VM is adopted only while its function wants one more: below its target and max.
# (A one-line mutation, ``<`` -> ``<=`` in ``maybes._wants_one_more``, went uncaught before
# this: a maybe's VM showing up when the function already had its target, or its max, would
# be adopted, one replica more than asked for, past max.)


def _late_vm(env: Env, agent: RunningAgent) -> tuple[str, str]:
    """A spawn of one whose create's answer is lost, the agent making the VM after corral's
    deadline: (the maybe's row id, the VM no row has) once the agent made it."""
    _, _, nxt = _answer_lost(env, agent, 1)
    assert set(nxt.states.values()) == {"idle"} and len(nxt.maybes) == 1
    (maybe,) = [r for r in replicas(env) if r.status == ReplicaState.MAYBE]
    (late,) = running([agent]) - {r.vmid for r in replicas(env) if r.vmid}
    return maybe.id, late


@pytest.mark.parametrize(
    ("limits", "settled"),
    [
        ((1, 20), Settled.RELEASED),  # at its target (one replica: the maybe's replacement)
        ((3, 1), Settled.RELEASED),  # below its target, but at its max
        ((2, 20), Settled.ADOPTED),  # below both: wanted
    ],
    ids=["at-target", "at-max", "wanted"],
)
def test_a_maybes_vm_is_adopted_only_below_the_target_and_the_max(
    corral_env: Env,
    start_agents: StartAgents,
    caplog: pytest.LogCaptureFixture,
    limits: tuple[int, int],
    settled: Settled,
) -> None:
    target, most = limits
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    maybe_id, vmid = _late_vm(corral_env, agent)
    db, settings, address = corral_env.db, corral_env.settings, "http://127.0.0.1:9"
    with corral_env.db.transaction() as s:
        s.execute(update(Function).values(target=target, max_replicas=most))
    (replacement,) = _idle(corral_env)
    assert replacement.vmid is not None  # another row's VM is never the maybe's
    assert settle_vm(db, settings, maybe_id, replacement.vmid, address) == Settled.NOT_OURS
    (maybe,) = _maybes(corral_env)
    assert (maybe.id, maybe.vmid) == (maybe_id, None)
    before = maybe.error
    assert before is not None and before.startswith("maybe: its create on ")

    with caplog.at_level("INFO", logger="workers.replicas.maybes"):
        got = settle_vm(db, settings, maybe_id, vmid, address)
    assert got == settled
    with corral_env.db.read() as s:
        count = s.scalar(select(Function.replica_count))
    assert count == (2 if settled == Settled.ADOPTED else 1)
    (row,) = [r for r in replicas(corral_env) if r.id == maybe_id]
    if settled == Settled.ADOPTED:
        assert (row.status, row.vmid, row.address, row.error) == (
            ReplicaState.IDLE,
            vmid,
            address,
            None,
        )
        said = f"maybe {maybe_id}: its VM {vmid} showed up and is adopted"
    else:
        why = "after its replacement, or with the function at its max"
        assert (row.status, row.vmid, row.address) == (ReplicaState.DELETED, vmid, None)
        # what made it a maybe is kept (a deadline's cost is told from a kill's)
        assert row.error == f"maybe: its VM {vmid} showed up {why}; released (it was a {before})"
        said = f"maybe {maybe_id}: its VM {vmid} showed up {why}; releasing it"
    assert said in caplog.messages
    no_drift(corral_env)
    # settled once: the same VM again is what became of it; another VM is never its
    again = Settled.ADOPTED if settled == Settled.ADOPTED else Settled.NOT_OURS
    assert settle_vm(db, settings, maybe_id, vmid, address) == again
    assert settle_vm(db, settings, maybe_id, "vm-other", address) == Settled.NOT_OURS
    assert settle_vm(db, settings, "no-such-row", vmid, address) == Settled.NOT_OURS
    assert [(r.status, r.vmid) for r in replicas(corral_env) if r.id == maybe_id] == [
        (row.status, vmid)
    ]
    no_drift(corral_env)


def test_a_maybe_with_no_node_for_a_replacement_keeps_its_part_of_the_operation_open(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True, capacity=1)
    agent.agent.inject("CreateReplica", UNAVAILABLE)  # the maybe holds the node's one slot
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    (maybe,) = _maybes(corral_env)
    assert (maybe.operation_id, maybe.maybe_of) == (op_id, op_id)  # the operation waits on it
    assert maybe.error is not None and maybe.error.startswith("maybe: its create on node1 ")
    assert maybe.error.endswith(
        "; not replaced (no node for a replacement: no capacity for hello on any healthy "
        "fcdaemon node)"
    )
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("running", 0, 0)
    no_drift(corral_env)
    # its VM shows up, wanted though the function wants none (its operation waits on it),
    # but where it answers is unknown: released, and the part it was waited on for fails
    with corral_env.db.transaction() as s:
        s.execute(update(Function).values(target=0))
    assert settle_vm(corral_env.db, settings, maybe.id, "vm-late", None) == Settled.RELEASED
    error = "maybe: its VM vm-late showed up where it answers is unknown (its agent reported it)"
    (ended,) = [r for r in replicas(corral_env) if r.id == maybe.id]
    assert (ended.status, ended.vmid, ended.operation_id) == (ReplicaState.DELETED, "vm-late", None)
    assert ended.error == f"{error}; released (it was a {maybe.error})"
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("failed", 0, 1)
    assert result_of(op)["errors"] == [ended.error]
    with corral_env.db.read() as s:  # its VM is kept as an orphan until released
        noted = [(o.node_id, o.vmid) for o in s.scalars(select(OrphanRelease))]
    assert noted == [(maybe.node_id, "vm-late")]
    no_drift(corral_env)


@pytest.mark.parametrize("gpu_left", [True, False], ids=["gpu-left", "gpu-full"])
def test_a_replacement_is_a_fresh_creating_row_with_the_functions_envs_and_its_own_gpu(
    corral_env: Env, start_agents: StartAgents, gpu_left: bool
) -> None:
    start_agents(1, env=corral_env, seed_only=True)
    corral_env.set(gpu_fit="first")  # the GPU recorded first, not the fullest that fits
    gpus = [("first", 5000), ("exact", 1000)] if gpu_left else [("first", 1000)]
    with corral_env.db.transaction() as s:  # room for the first row's grant, and one more?
        for i, (uuid, mem) in enumerate(gpus):
            s.add(Gpu(uuid=uuid, server="gs:1", mngr_addr="gm:1", mem_total_mb=mem,
                      mem_free_mb=mem, slots_total=4, slots_free=4, first_port=4000 + 4 * i,
                      created_at=datetime(2030, 1, 1, 0, 0, i)))  # fmt: skip
    op_id, fn_id, jobs = spawn_op(corral_env, 1, exec_envs=2, gpu_mem=1000)
    db, settings, token = corral_env.db, corral_env.settings, owner_token()
    place(db, settings, op_id, fn_id, jobs)
    (sent,) = take(
        db, settings, [jobs[0].request_id], token, Budget.of(settings).own_until()
    ).pending
    assert mark_sent(db, token, [sent]) == {sent.replica_id}
    with db.transaction() as s:  # its answer was cut
        lock_for_moves(s, [sent])
        got = replace(s, settings, sent, token, "cut", max_placements=3)
    rows = {r.id: r for r in replicas(corral_env)}
    maybe = rows.pop(sent.replica_id)
    assert maybe.status == ReplicaState.MAYBE
    if gpu_left:
        assert got == Replaced.REPLACED
        (fresh,) = rows.values()
        assert (fresh.status, fresh.request_id, fresh.operation_id, fresh.placements) == (
            ReplicaState.CREATING,
            jobs[0].request_id,
            op_id,
            2,
        )
        assert (fresh.envs_total, fresh.gpu_mem_mb, fresh.owner, fresh.sent_at) == (
            2,
            1000,
            None,
            None,
        )
        assert fresh.gpu_id == maybe.gpu_id and fresh.gpu_slot != maybe.gpu_slot  # "first"
        assert fresh.deadline_at is not None and fresh.deadline_at > clock.now()
    else:
        assert got == Replaced.UNREPLACED and rows == {}
        assert maybe.error is not None and maybe.error.endswith(
            "; not replaced (no GPU for a replacement: no GPU capacity for hello (1000 MB))"
        )
        assert nodes(corral_env)["node1"].live == 1  # the replacement's slot given back
        assert maybe.operation_id == op_id  # the operation waits on the maybe itself
    no_drift(corral_env)


def test_a_row_another_handler_owns_is_not_made_a_maybe(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env, seed_only=True)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    pending = creating(corral_env, fn_id, jobs[0].request_id, op_id=op_id)  # another's row
    settings = corral_env.settings
    with corral_env.db.transaction() as s:
        lock_for_moves(s, [pending])
        got = replace(s, settings, pending, owner_token(), "cut", max_placements=3)
    assert got == Replaced.LOST
    (row,) = replicas(corral_env)
    assert (row.status, row.request_id, row.error) == (
        ReplicaState.CREATING,
        jobs[0].request_id,
        None,
    )
    no_drift(corral_env)


def test_a_request_made_a_maybe_on_its_last_placement_is_not_replaced_and_waits_on_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("CreateReplica", UNAVAILABLE, UNAVAILABLE, UNAVAILABLE)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    nxt = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    assert len(nxt.maybes) == 3 and created([agent]) == 3
    maybes = sorted(_maybes(corral_env), key=lambda r: r.placements)
    assert [r.placements for r in maybes] == [1, 2, 3] and _idle(corral_env) == []
    last = maybes[-1]
    assert last.request_id.startswith(f"{jobs[0].request_id}~")
    assert last.error is not None and last.error.endswith("; not replaced (tried 3 times)")
    assert (last.operation_id, last.maybe_of) == (op_id, op_id)  # the operation waits on it
    op = operation(corral_env, op_id)
    assert (op.status, op.done, op.failed) == ("running", 0, 0)
    no_drift(corral_env)


def test_a_replacement_is_placed_by_the_placement_policy_in_force(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(placement="pack")  # the function names none: the setting's
    first, _ = start_agents(2, env=corral_env, seed_only=True)
    first.agent.inject("CreateReplica", UNAVAILABLE)
    op_id, fn_id, jobs = spawn_op(corral_env, 1)
    settings = corral_env.settings
    run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    (maybe,) = _maybes(corral_env)
    (replica,) = _idle(corral_env)
    by_id = {n.id: name for name, n in nodes(corral_env).items()}
    # packed next to the maybe (fewest live would take the empty node)
    assert by_id[str(maybe.node_id)] == by_id[str(replica.node_id)] == "node1"
    no_drift(corral_env)


def test_a_node_first_seen_to_report_ready_shortens_its_maybes_deadlines_once(
    corral_env: Env,
) -> None:
    settings = corral_env.settings
    fn_id = deploy_fn(corral_env, "hello")
    far = clock.now() + timedelta(hours=1)
    near = clock.now() + timedelta(seconds=1)  # sooner than a READY could come: kept
    with corral_env.db.transaction() as s:
        kind = s.scalars(select(Function.backend).where(Function.id == fn_id)).one()
        for name in ("a", "b"):
            s.add(Node(name=name, kind=kind, address="127.0.0.1:9", capacity=8))
    ids = {n.name: n.id for n in nodes(corral_env).values()}
    rows = {  # request id: (state, node, deadline)
        "far": (ReplicaState.MAYBE, "a", far),
        "near": (ReplicaState.MAYBE, "a", near),
        "creating": (ReplicaState.CREATING, "a", far),
        "elsewhere": (ReplicaState.MAYBE, "b", far),
    }
    with corral_env.db.transaction() as s:
        for rid, (state, node, deadline) in rows.items():
            s.add(Replica(request_id=rid, function_id=fn_id, build_version="b",
                          status=int(state), node_id=ids[node], deadline_at=deadline))  # fmt: skip

    def note() -> tuple[dict[str, datetime | None], dict[str, datetime | None]]:
        with corral_env.db.transaction() as s:
            note_ready_node(s, settings, ids["a"])
        seen = {n.name: n.ready_seen_at for n in nodes(corral_env).values()}
        return seen, {r.request_id: r.deadline_at for r in replicas(corral_env)}

    seen, deadlines = note()
    at = seen["a"]
    assert at is not None and seen["b"] is None
    assert deadlines == {
        "far": at + ready_window(settings),
        "near": near,
        "creating": far,
        "elsewhere": far,
    }
    clock.travel(60)
    assert note() == (seen, deadlines)  # only the first READY of a node shortens them


def test_a_maybes_request_id_keeps_as_much_of_the_original_as_fits_its_column() -> None:
    row = "r" * 32
    assert maybe_request_id("spawn-1", row) == f"spawn-1~{row}"
    long = "x" * MAX_REQUEST_ID  # the column's length: cut to fit with the mark and row id
    said = maybe_request_id(long, row)
    assert len(said) == MAX_REQUEST_ID and said == f"{long[: MAX_REQUEST_ID - 33]}~{row}"


@pytest.mark.parametrize(
    ("readiness", "seen", "reports"),
    [
        ("guest", None, True),  # the function's guests say READY
        ("agent", clock.now(), True),  # a guest on the node was seen to say it
        ("agent", None, False),  # neither: the agent's answer is all there is
    ],
)
def test_a_node_reports_ready_for_a_guest_function_or_once_seen_to(
    readiness: str, seen: datetime | None, reports: bool
) -> None:
    node = Node(name="n", kind="fcdaemon", address="127.0.0.1:9", ready_seen_at=seen)
    assert reports_ready(node, Function(name="f", readiness=readiness)) is reports
