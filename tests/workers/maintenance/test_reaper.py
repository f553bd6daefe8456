"""The reaper against real agents on loopback, with a controllable clock."""

from __future__ import annotations

import logging
import re
import threading
import time
from datetime import datetime, timedelta

import grpc
import pytest
from sqlalchemy import select, update

from agents.faults import Fault, FaultPlan
from corral import api
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, replicas, result_of
from tests.workers.replicas.helpers import (
    at_once,
    by_id,
    idle_on,
    one_node_idle,
    released,
    spawn_idle,
)
from workers import leases
from workers.base import clock
from workers.base.errors import InputError
from workers.maintenance.reap_report import Reaped, ReapReport
from workers.maintenance.reaper import LEASE, reap
from workers.replicas.claims import claim, release
from workers.replicas.delete import begin_delete
from workers.store.models import Function, Node, Replica, ReplicaState


def _reap(env: Env, **kwargs: object) -> ReapReport:
    return reap(env.db, env.settings, holder="test", **kwargs)  # type: ignore[arg-type]


def _live_on_nodes(env: Env) -> int:
    with env.db.read() as s:
        return sum(n.live for n in s.scalars(select(Node)))


def test_idle_past_timeout_deleted_counting_from_last_use_or_readiness(
    corral_env: Env, start_agents: StartAgents
) -> None:
    # Ten minutes, so that the test's own seconds on a loaded machine (added to the
    # clock's travels) cannot move a replica across the timeout: 10 s to spare.
    agents, (a, b, c) = idle_on(corral_env, start_agents, 2, 3, idle_timeout=600)
    clock.travel(300)
    lent = claim(corral_env.db, corral_env.settings, "hello")
    used = lent.replica_id
    release(corral_env.db, corral_env.settings, lent.claim_id)  # its idle clock restarts now
    never = {r.id: r.vmid for r in (a, b, c) if r.id != used}
    assert len(never) == 2

    clock.travel(290)  # never-used: idle 590 s, used: idle 290 s
    assert _reap(corral_env).deleted == []
    clock.travel(20)  # never-used: 610 s, used: 310 s
    report = _reap(corral_env)
    assert {d.replica_id for d in report.deleted} == set(never)
    assert {d.reason for d in report.deleted} == {"idle"}
    assert {d.outcome for d in report.deleted} == {"deleted"}
    for d in report.deleted:  # idle since it became ready: 610 s, and the test's own time
        assert re.fullmatch(r"idle 6[12]\ds", d.detail), d.detail
    assert released(agents) == {vmid: 1 for vmid in never.values()}
    rows = by_id(corral_env)
    assert all(rows[rid].status == ReplicaState.DELETED for rid in never)
    assert rows[used].status == ReplicaState.IDLE
    assert _live_on_nodes(corral_env) == 1

    clock.travel(300)  # the used one reaches 610 s idle
    report = _reap(corral_env)
    assert [d.replica_id for d in report.deleted] == [used]
    assert sum(released(agents).values()) == 3


def test_min_replicas_are_kept(corral_env: Env, start_agents: StartAgents) -> None:
    agents, _ = idle_on(corral_env, start_agents, 1, 5, idle_timeout=10, min=2)
    clock.travel(11)
    report = _reap(corral_env)
    assert len(report.deleted) == 3
    assert report.kept_for_min == {"hello": 2}
    assert report.replace == {}  # current build: nothing to replace
    assert _reap(corral_env).deleted == []
    live = [r for r in replicas(corral_env) if r.status == ReplicaState.IDLE]
    assert len(live) == 2
    assert len(released(agents)) == 3


def test_autoscaled_function_keeps_its_target_and_a_manual_one_does_not(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env, idle_timeout=10, autoscale=True)
    deploy_fn(corral_env, "manual", idle_timeout=10)
    spawn_idle(corral_env, "hello", 4)
    spawn_idle(corral_env, "manual", 3)
    with corral_env.db.transaction() as s:  # as the autoscaler's last scale left them
        for fn in s.scalars(select(Function)):
            fn.target = 3
    clock.travel(11)
    report = _reap(corral_env)
    deleted = {d.function: 0 for d in report.deleted}
    for d in report.deleted:
        deleted[d.function] += 1
    assert deleted == {"hello": 1, "manual": 3}  # the autoscaler's 3 stay; scale's do not
    assert report.kept_for_min == {"hello": 3}
    assert len(released(agents)) == 4
    with corral_env.db.transaction() as s:  # the autoscaler scaled it to zero: all may go
        fn = s.scalars(select(Function).where(Function.name == "hello")).one()
        fn.target = 0
    assert {d.function for d in _reap(corral_env).deleted} == {"hello"}
    assert [r for r in replicas(corral_env) if r.status == ReplicaState.IDLE] == []


def test_allocated_and_busy_replicas_are_never_reaped(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env, idle_timeout=10)
    deploy_fn(corral_env, "duo", idle_timeout=10, exec_envs=2)
    spawn_idle(corral_env, "hello", 2)
    spawn_idle(corral_env, "duo", 1)
    day = 86_400  # claims that outlive the test: none expires
    lent = claim(corral_env.db, corral_env.settings, "hello", ttl_s=day)
    first = lent.replica_id
    second = claim(corral_env.db, corral_env.settings, "hello", ttl_s=day).replica_id
    busy = claim(corral_env.db, corral_env.settings, "duo", ttl_s=day).replica_id  # 1 of 2 busy
    clock.travel(1000)
    assert _reap(corral_env).deleted == []
    assert _reap(corral_env, idle_timeout=0).deleted == []
    assert released(agents) == {}

    release(corral_env.db, corral_env.settings, lent.claim_id)
    clock.travel(11)
    report = _reap(corral_env)
    assert [d.replica_id for d in report.deleted] == [first]
    rows = by_id(corral_env)
    assert rows[second].status == ReplicaState.ALLOCATED
    assert (rows[busy].status, rows[busy].envs_in_use) == (ReplicaState.IDLE, 1)


def test_idle_timeout_override_uses_idle_since(corral_env: Env, start_agents: StartAgents) -> None:
    one_node_idle(corral_env, start_agents, 2, idle_timeout=3600)
    clock.travel(10)
    assert _reap(corral_env).deleted == []
    assert _reap(corral_env, idle_timeout=20).deleted == []
    report = _reap(corral_env, idle_timeout=5)
    assert len(report.deleted) == 2 and report.idle_timeout == 5.0
    with pytest.raises(InputError, match="idle timeout"):
        _reap(corral_env, idle_timeout=-1)


def test_stale_builds_removed_and_replaced_when_at_min(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env)
    deploy_fn(corral_env, "pinned", min=1)
    old = spawn_idle(corral_env, "hello", 2)
    (pinned_old,) = spawn_idle(corral_env, "pinned", 1)
    deploy_fn(corral_env, env={"BUILD": "2"})
    deploy_fn(corral_env, "pinned", env={"BUILD": "2"})

    report = _reap(corral_env)  # no time passes: staleness alone is enough
    assert {d.replica_id for d in report.deleted} == {r.id for r in old}
    assert {d.reason for d in report.deleted} == {"stale"}
    with corral_env.db.read() as s:
        build = s.scalars(select(Function.build_version).where(Function.name == "hello")).one()
    assert {d.detail for d in report.deleted} == {
        f"build {r.build_version}, current {build}" for r in old
    }
    assert old[0].build_version != build
    assert report.kept_for_min == {"pinned": 1}
    assert report.replace == {"pinned": 1}
    assert released(agents) == {r.vmid: 1 for r in old}

    # Through the task: the kept stale replica gets a fresh replacement, then goes.
    view = api.wait(api.reap(), timeout=30)
    assert view["status"] == "succeeded", view
    assert set(result_of(view)["replacements"]) == {"pinned"}
    fresh = [r for r in replicas(corral_env, "pinned") if r.id != pinned_old.id]
    assert len(fresh) == 1 and fresh[0].status == ReplicaState.IDLE
    view = api.wait(api.reap(), timeout=30)
    assert [d["replica_id"] for d in result_of(view)["deleted"]] == [pinned_old.id]
    assert result_of(view)["replacements"] == {}
    assert by_id(corral_env)[fresh[0].id].status == ReplicaState.IDLE


def test_stuck_replicas_are_retired(
    corral_env: Env, start_agents: StartAgents, caplog: pytest.LogCaptureFixture
) -> None:
    agents = start_agents(1)
    deploy_fn(corral_env)
    deploy_fn(corral_env, "booting", readiness="guest")
    with corral_env.db.read() as s:
        fn_id = s.scalars(select(Function.id).where(Function.name == "hello")).one()
    # A spawn whose worker died after writing the row: Creating, no VM.
    pending = creating(corral_env, fn_id, "req-stuck")
    # A guest that never reports READY: Starting, with a VM.
    api.spawn("booting", 1)  # eager: ran already; its operation waits for READY
    (booting,) = replicas(corral_env, "booting")
    assert booting.status == ReplicaState.STARTING
    # A delete whose worker died after marking it: Deleting, with a VM.
    (doomed,) = spawn_idle(corral_env, "hello", 1)
    begin_delete(corral_env.db, corral_env.settings, doomed.id)
    assert _live_on_nodes(corral_env) == 3

    since = by_id(corral_env)[booting.id].updated_at  # when it became Starting
    assert since is not None and since != booting.created_at
    clock.travel(corral_env.settings.boot_deadline_s + 1)
    with caplog.at_level(logging.INFO, logger="workers.maintenance.reaper"):
        report = _reap(corral_env)
    boot_error = "stuck in starting: the guest did not report ready within 60s"
    assert f"replica {booting.id} {boot_error} (since {since})" in caplog.messages
    assert report.deleted == [
        Reaped(booting.id, "booting", "stuck", "stuck in starting", booting.vmid, "node1",
               "retired", boot_error)
    ]  # fmt: skip
    assert report.counts == {"stuck": 1, "stale": 0, "idle": 0}
    assert f"reap pass test: {report.counts}" in caplog.messages
    clock.travel(corral_env.settings.creating_deadline_s)
    report = _reap(corral_env)
    create_error = "stuck in creating: no answer from the node within 300s"
    assert sorted(report.deleted, key=lambda d: d.detail) == [
        Reaped(pending.replica_id, "hello", "stuck", "stuck in creating", None, "node1",
               "retired", create_error),
        Reaped(doomed.id, "hello", "stuck", "stuck in deleting", doomed.vmid, "node1",
               "deleted", None),
    ]  # fmt: skip
    rows = by_id(corral_env)
    assert (rows[pending.replica_id].status, rows[pending.replica_id].error) == (
        ReplicaState.DEAD,
        create_error,
    )
    assert (rows[booting.id].status, rows[booting.id].error) == (ReplicaState.DEAD, boot_error)
    assert rows[doomed.id].status == ReplicaState.DELETED
    assert released(agents) == {booting.vmid: 1, doomed.vmid: 1}
    assert _live_on_nodes(corral_env) == 0


def test_concurrent_passes_delete_each_replica_once(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents, idle = idle_on(corral_env, start_agents, 2, 12, idle_timeout=10)
    agents[0].agent.inject("ReleaseVMSetup", Fault.delay(0.3))  # the winner holds the lease
    clock.travel(11)
    reports = at_once(4, lambda i: reap(corral_env.db, corral_env.settings, holder=f"pass-{i}"))
    assert len(reports) == 4
    assert sum(len(r.deleted) for r in reports) == 12
    assert released(agents) == {r.vmid: 1 for r in idle}
    skipped = [r for r in reports if r.skipped]
    assert skipped, "the lease let no pass skip"
    assert all(r.deleted == [] for r in skipped)
    assert leases.current(corral_env.db, LEASE) is None  # released after the pass


def test_a_held_lease_skips_the_pass_until_it_expires(
    corral_env: Env, start_agents: StartAgents, caplog: pytest.LogCaptureFixture
) -> None:
    agents, idle = idle_on(corral_env, start_agents, 1, 3, idle_timeout=10)
    assert leases.acquire(corral_env.db, LEASE, "crashed-worker", 120)
    clock.travel(11)
    with caplog.at_level(logging.INFO, logger="workers.maintenance.reaper"):
        report = _reap(corral_env)
    assert "reap pass test skipped: lease held by crashed-worker" in caplog.messages
    assert report.skipped and report.held_by == "crashed-worker"
    assert report.deleted == [] and released(agents) == {}
    clock.travel(120)  # the crashed holder's lease lapses
    report = _reap(corral_env)
    assert not report.skipped
    assert released(agents) == {r.vmid: 1 for r in idle}


def test_batch_limit(corral_env: Env, start_agents: StartAgents) -> None:
    agents, idle = idle_on(corral_env, start_agents, 1, 7, idle_timeout=10)
    clock.travel(11)
    sizes = []
    for _ in range(3):
        report = _reap(corral_env, batch=3)
        sizes.append((len(report.deleted), report.more))
    assert sizes == [(3, True), (3, True), (1, False)]
    assert released(agents) == {r.vmid: 1 for r in idle}
    spawn_idle(corral_env, "hello", 1)
    clock.travel(11)
    assert [len(_reap(corral_env, batch=1).deleted) for _ in range(2)] == [1, 0]

    corral_env.set(reap_batch=2)
    spawn_idle(corral_env, "hello", 5)
    clock.travel(11)
    assert len(_reap(corral_env).deleted) == 2


def test_release_failures(corral_env: Env, start_agents: StartAgents) -> None:
    # One call at a time to the node, so the order of outcomes is the order of calls.
    corral_env.set(node_max_inflight="1", node_failures="2")
    (agent,), _ = idle_on(corral_env, start_agents, 1, 5, idle_timeout=10)
    with corral_env.db.transaction() as s:  # it lists its VMs (reconcile learns it): a VM
        s.execute(update(Node).values(can_list=True))  # its release missed is an orphan
    clock.travel(11)
    agent.agent.inject(
        "ReleaseVMSetup", *[Fault.abort(grpc.StatusCode.UNAVAILABLE, "node rebooting")] * 10
    )
    report = _reap(corral_env)
    failed = [d for d in report.deleted if d.outcome == "failed"]
    # After CORRAL_NODE_FAILURES transport failures in a row the node is not asked again
    # in this pass: the other VMs fail with the same error, without a call.
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 2
    assert len(failed) == 5 and report.failed == 5
    with corral_env.db.read() as s:  # one miss for the node, however many releases failed
        assert s.scalars(select(Node.misses)).one() == 1
    rows = by_id(corral_env)
    for d in failed:
        assert rows[d.replica_id].status == ReplicaState.DEAD
        assert "reconcile" in (rows[d.replica_id].error or "")
        assert (rows[d.replica_id].error or "").startswith(d.error or "-")
        assert "node rebooting" in (d.error or "").split("; ")[0]  # the release's own error
    assert _live_on_nodes(corral_env) == 0

    # A VM the node no longer has counts as released; other answers as they come.
    corral_env.set(node_max_inflight="16", node_failures="3")
    agent.agent.faults = FaultPlan(agent.agent.METHODS)  # the node answers again
    gone, ok = spawn_idle(corral_env, "hello", 2)
    assert gone.vmid is not None
    agent.driver.stop(gone.vmid)
    clock.travel(11)
    report = _reap(corral_env)
    outcomes = {d.replica_id: d.outcome for d in report.deleted}
    assert outcomes == {gone.id: "gone", ok.id: "deleted"}
    rows = by_id(corral_env)
    assert rows[gone.id].status == rows[ok.id].status == ReplicaState.DELETED


def test_reap_through_the_api_records_the_report(
    corral_env: Env, start_agents: StartAgents
) -> None:
    one_node_idle(corral_env, start_agents, 2, idle_timeout=10)
    clock.travel(11)
    view = api.wait(api.reap(), timeout=30)
    assert view["status"] == "succeeded"
    assert view["kind"] == "reap"
    assert result_of(view)["counts"] == {"idle": 2, "stale": 0, "stuck": 0}
    assert (view["total"], view["done"], view["failed"]) == (2, 2, 0)

    # an asked-for pass waits 0.5 s for the lease (calls must fit in the soft limit)
    corral_env.set(
        task_soft_time_limit_s="2",
        create_timeout_s="0.5",
        rpc_timeout_s="0.5",
        lambdo_timeout_s="0.5",
    )
    assert leases.acquire(corral_env.db, LEASE, "someone", 60)
    started = time.monotonic()
    view = api.wait(api.reap(idle_timeout=0), timeout=30)
    assert time.monotonic() - started >= 0.5
    assert view["status"] == "failed"
    assert "another reap pass holds the lease (someone)" in (view["error"] or "")
    # A periodic pass that ends while we wait lets the asked-for pass run.
    threading.Timer(0.2, leases.release, (corral_env.db, LEASE, "someone")).start()
    assert leases.acquire(corral_env.db, LEASE, "someone", 60)
    view = api.wait(api.reap(idle_timeout=0), timeout=30)
    assert view["status"] == "succeeded", view
    with pytest.raises(InputError, match="idle timeout"):
        api.reap(idle_timeout="soon")  # type: ignore[arg-type]


# -- the edges mutation testing found untested (python -m testkit.mutation) -----------------


def test_a_stale_replica_kept_for_min_asks_for_the_fresh_ones_missing(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "pinned", min=2)
    deploy_fn(corral_env, "other")
    stale = spawn_idle(corral_env, "pinned", 2)
    deploy_fn(corral_env, "pinned", min=2, env={"BUILD": "2"})  # both stale now
    fresh = [r for r in spawn_idle(corral_env, "pinned", 2) if r.id not in {s.id for s in stale}]
    begin_delete(corral_env.db, corral_env.settings, fresh[1].id)  # fresh, on its way out
    spawn_idle(corral_env, "other", 3)  # fresh replicas of another function, of the same
    with corral_env.db.transaction() as s:  # build (build versions are deploy times)
        build = s.scalar(select(Function.build_version).where(Function.name == "pinned"))
        s.execute(update(Function).values(build_version=build))
        s.execute(update(Replica).where(Replica.function_id != fresh[0].function_id).values(
            build_version=build
        ))  # fmt: skip
    report = _reap(corral_env)
    # three counted (two stale, one fresh): one stale may go, the other is kept for min,
    # and the one fresh replica of the two min asks for is missing
    assert report.counts == {"stuck": 0, "stale": 1, "idle": 0}
    assert report.kept_for_min == {"pinned": 1}
    assert report.replace == {"pinned": 1}


def test_a_stuck_create_still_owned_by_a_live_handler_is_left_to_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(creating_deadline_s="5")  # past its deadline long before its owner's
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env)
    pending = creating(corral_env, fn_id, "req-owned")
    clock.travel(6)
    assert _reap(corral_env).deleted == []  # its handler may yet record its VM
    assert by_id(corral_env)[pending.replica_id].status == ReplicaState.CREATING
    clock.travel(corral_env.settings.task_time_limit_s)  # the handler's ownership lapsed
    assert [d.replica_id for d in _reap(corral_env).deleted] == [pending.replica_id]


def test_the_stuck_sweep_stops_at_the_batch(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(1, env=corral_env)
    fn_id = deploy_fn(corral_env)
    later = creating(corral_env, fn_id, "req-1")  # recorded first
    clock.travel(1)
    first = creating(corral_env, fn_id, "req-2")
    with corral_env.db.transaction() as s:  # its deadline moved before the other's
        due = s.scalar(select(Replica.deadline_at).where(Replica.id == later.replica_id))
        assert due is not None
        s.execute(
            update(Replica)
            .where(Replica.id == first.replica_id)
            .values(deadline_at=due - timedelta(seconds=1))
        )
    clock.travel(corral_env.settings.creating_deadline_s + corral_env.settings.task_time_limit_s)
    report = _reap(corral_env, batch=1)
    assert [d.replica_id for d in report.deleted] == [first.replica_id]  # the oldest deadline
    assert report.more


def test_a_stuck_replica_whose_release_fails_ends_dead_with_both_errors(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1)
    deploy_fn(corral_env, "booting", readiness="guest")
    with corral_env.db.transaction() as s:  # it lists its VMs: reconcile finds the orphan
        s.execute(update(Node).values(can_list=True))
    api.spawn("booting", 1)
    (booting,) = replicas(corral_env, "booting")
    agent.agent.inject("ReleaseVMSetup", Fault.abort(grpc.StatusCode.UNAVAILABLE, "rebooting"))
    clock.travel(corral_env.settings.boot_deadline_s + 1)
    (reaped,) = _reap(corral_env).deleted
    stuck = "stuck in starting: the guest did not report ready within 60s; "
    assert (reaped.reason, reaped.outcome) == ("stuck", "failed")
    assert reaped.error is not None and reaped.error.startswith(stuck), reaped.error
    assert "rebooting" in reaped.error
    assert reaped.error.endswith("; reconcile will destroy the VM once the node answers")
    row = by_id(corral_env)[booting.id]
    assert (row.status, row.error) == (ReplicaState.DEAD, reaped.error)


def test_rows_kept_for_min_use_none_of_the_batch_the_pass_reads_on_past_them(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "pinned", idle_timeout=10, min=2)
    deploy_fn(corral_env, "other", idle_timeout=10)
    spawn_idle(corral_env, "pinned", 2)
    clock.travel(1)  # idle past their timeout a second after pinned's: read after them
    others = spawn_idle(corral_env, "other", 2)
    clock.travel(11)
    report = _reap(corral_env, batch=2)  # the first page is the two kept: a second one
    assert sorted(d.replica_id for d in report.deleted) == sorted(r.id for r in others)
    assert report.kept_for_min == {"pinned": 2}
    assert report.more


def test_a_pass_reads_at_most_ten_rows_per_unit_of_batch(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "pinned", idle_timeout=10, min=10)
    deploy_fn(corral_env, "other", idle_timeout=10)
    spawn_idle(corral_env, "pinned", 10)
    clock.travel(1)
    (other,) = spawn_idle(corral_env, "other", 1)
    clock.travel(11)
    report = _reap(corral_env, batch=1)  # ten rows kept for min: the pass stops there
    assert (report.deleted, report.kept_for_min) == ([], {"pinned": 10})
    report = _reap(corral_env, batch=2)  # twenty: it reaches the other
    assert [d.replica_id for d in report.deleted] == [other.id]


def test_a_delete_whose_node_is_gone_is_finished_by_the_stuck_sweep(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents, (doomed,) = idle_on(corral_env, start_agents, 1, 1)
    begin_delete(corral_env.db, corral_env.settings, doomed.id)  # its worker died here
    with corral_env.db.transaction() as s:  # and its node was removed since
        s.execute(update(Replica).where(Replica.id == doomed.id).values(node_id=None))
        s.add(Node(name="sick", address="127.0.0.1:9", capacity=1, healthy=False))
    clock.travel(corral_env.settings.creating_deadline_s + 1)  # a Deleting row's deadline
    report = _reap(corral_env)
    assert [(d.replica_id, d.detail) for d in report.deleted] == [(doomed.id, "stuck in deleting")]
    assert by_id(corral_env)[doomed.id].status == ReplicaState.DELETED
    assert released(agents) == {}  # no node to ask


def test_stale_means_an_older_build_of_its_own_function_and_no_environment_in_use(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "zeta", exec_envs=2)  # built first: an older build than alpha's
    clock.travel(1)
    deploy_fn(corral_env, "alpha")
    spawn_idle(corral_env, "zeta", 2)
    spawn_idle(corral_env, "alpha", 2)
    assert _reap(corral_env).deleted == []  # each of its own function's current build
    busy = claim(corral_env.db, corral_env.settings, "zeta", ttl_s=86_400).replica_id
    deploy_fn(corral_env, "alpha", env={"BUILD": "2"})
    deploy_fn(corral_env, "zeta", exec_envs=2, env={"BUILD": "2"})  # written last
    assert [d.function for d in _reap(corral_env, batch=1).deleted] == ["alpha"]  # by name
    report = _reap(corral_env)
    assert sorted(d.function for d in report.deleted) == ["alpha", "zeta"]
    assert busy not in {d.replica_id for d in report.deleted}  # one of its two envs in use
    row = by_id(corral_env)[busy]
    assert (row.status, row.envs_in_use) == (ReplicaState.IDLE, 1)


def test_bad_options_are_refused_before_anything_is_done(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agents, idle = idle_on(corral_env, start_agents, 1, 1, idle_timeout=10)
    clock.travel(11)
    year = 365 * 86_400
    with pytest.raises(InputError) as refused:
        _reap(corral_env, idle_timeout=year + 1)
    assert str(refused.value) == f"idle timeout must be between 0 and one year, got {year + 1}"
    for batch in (0, True, 1.5, "2"):
        with pytest.raises(InputError) as refused:
            _reap(corral_env, batch=batch)
        assert str(refused.value) == f"reap batch must be a positive integer, got {batch!r}"
    assert released(agents) == {} and leases.current(corral_env.db, LEASE) is None
    before = clock.now()
    report = _reap(corral_env, idle_timeout=year, batch=3)  # a year is allowed
    assert (report.holder, report.batch, report.idle_timeout) == ("test", 3, year)
    assert report.deleted == [] and report.started_at is not None
    started = datetime.fromisoformat(report.started_at).replace(tzinfo=None)
    assert before - timedelta(seconds=1) <= started <= clock.now()
    report = _reap(corral_env, batch=2)
    assert [d.replica_id for d in report.deleted] == [idle[0].id]
    assert not report.more  # one of the two left: the pass found all there was
    steps = ("select_s", "release_s", "finish_s")
    assert set(report.timings) == {*steps, "total_s"}
    assert all(isinstance(t, float) and 0 <= t == round(t, 6) for t in report.timings.values())
    assert sum(report.timings[s] for s in steps) <= report.timings["total_s"] + 1e-5
    assert report.timings["total_s"] < 3600  # a duration, not a clock's reading


def test_a_stale_replica_at_the_functions_max_asks_for_no_replacement(
    corral_env: Env, start_agents: StartAgents
) -> None:
    start_agents(1, env=corral_env)
    deploy_fn(corral_env, "pinned", min=1, max=1)
    spawn_idle(corral_env, "pinned", 1)
    deploy_fn(corral_env, "pinned", min=1, max=1, env={"BUILD": "2"})
    report = _reap(corral_env)
    assert (report.deleted, report.kept_for_min) == ([], {"pinned": 1})
    assert report.replace == {}  # a fresh one would go past the max


def test_a_pass_first_gives_back_the_environments_of_expired_claims(
    corral_env: Env, start_agents: StartAgents
) -> None:
    _, (replica,) = idle_on(corral_env, start_agents, 1, 1)  # the default idle timeout
    claim(corral_env.db, corral_env.settings, "hello", ttl_s=5)  # its caller died with it
    assert by_id(corral_env)[replica.id].status == ReplicaState.ALLOCATED
    clock.travel(6)
    report = _reap(corral_env)
    assert (report.claims_expired, report.deleted) == (1, [])
    back = by_id(corral_env)[replica.id]
    assert back.status == ReplicaState.IDLE and back.idle_since is not None
    # its idle clock starts again, to the settings' idle timeout (the function has none)
    assert back.reap_at == back.idle_since + timedelta(seconds=corral_env.settings.idle_timeout_s)


def test_a_release_the_node_refuses_ends_the_replica_dead_with_the_nodes_error(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(node_max_inflight="1")  # one call at a time: the refusals in order
    (agent,), (a, b) = idle_on(corral_env, start_agents, 1, 2, idle_timeout=10)
    clock.travel(11)
    agent.agent.inject(
        "ReleaseVMSetup", *[Fault.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such disk")] * 2
    )
    report = _reap(corral_env)
    assert {d.replica_id: d.outcome for d in report.deleted} == {a.id: "failed", b.id: "failed"}
    rows = by_id(corral_env)
    for d in report.deleted:
        assert d.error is not None and "no such disk" in d.error
        assert "reconcile" not in d.error  # not a transport failure: nothing to retry
        assert (rows[d.replica_id].status, rows[d.replica_id].error) == (
            ReplicaState.DEAD,
            d.error,
        )
    with corral_env.db.read() as s:  # a refusal is an answer: the node is not counted a miss
        assert s.scalars(select(Node.misses)).one() == 0
