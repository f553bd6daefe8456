"""Orphan VMs kept in the store until released (:mod:`workers.replicas.orphans`), on an agent
that speaks only the seed protocol: there, nothing but the kept row remembers the VM."""

from __future__ import annotations

import grpc
from sqlalchemy import select

from agents.drivers import VMSpec
from agents.faults import Fault
from agents.fcdaemon import RunningAgent
from tasks.maintenance import QUEUE
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn
from workers.base import clock
from workers.maintenance.reconcile import reconcile
from workers.replicas import reports
from workers.replicas.delete import release_orphan
from workers.store.models import OrphanRelease


def _seed_agent_with_an_orphan(env: Env, start_agents: StartAgents) -> tuple[RunningAgent, str]:
    """A seed-only agent running a VM that said READY and that no replica took in time."""
    (agent,) = start_agents(1, env=env, seed_only=True)
    deploy_fn(env, "hello")
    vm = agent.driver.start(VMSpec(image="examples.hello"))  # its create's answer was lost
    assert reports.remember(env.db, env.settings, vm.vmid, "127.0.0.1")
    clock.travel(env.settings.create_timeout_s + env.settings.ready_grace_s + 1)
    (orphan,) = reports.orphans(env.db, env.settings)
    assert orphan.vmid == vm.vmid and len(orphan.node_ids) == 1
    return agent, vm.vmid


def _kept(env: Env) -> list[OrphanRelease]:
    with env.db.read() as s:
        return list(s.scalars(select(OrphanRelease)))


def test_an_orphan_whose_release_message_was_lost_is_released_by_reconcile(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agent, vmid = _seed_agent_with_an_orphan(corral_env, start_agents)
    # The registry queued its release_orphan; that message never ran (lost in transit).
    assert [k.vmid for k in _kept(corral_env)] == [vmid]
    early = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert early.orphans_destroyed == []  # not due yet: its message has its time first
    assert vmid in {vm.vmid for vm in agent.driver.list()}
    clock.travel(corral_env.settings.task_time_limit_s + 1)
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.nodes_unlistable == [] and report.nodes_checked == []  # it cannot list
    assert report.orphans_destroyed == [f"node1/{vmid}"]
    assert agent.driver.list() == []
    assert {r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")} == {vmid}
    assert _kept(corral_env) == []


def test_the_release_task_ends_the_kept_orphan(corral_env: Env, start_agents: StartAgents) -> None:
    agent, vmid = _seed_agent_with_an_orphan(corral_env, start_agents)
    (kept,) = _kept(corral_env)
    assert release_orphan(corral_env.db, corral_env.settings, kept.node_id, vmid) == "released"
    assert agent.driver.list() == [] and _kept(corral_env) == []
    clock.travel(corral_env.settings.task_time_limit_s + 1)
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.orphans_destroyed == []  # nothing released twice
    assert len(agent.agent.calls_of("ReleaseVMSetup")) == 1


def test_a_release_that_fails_is_put_off_then_done(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agent, vmid = _seed_agent_with_an_orphan(corral_env, start_agents)
    clock.travel(corral_env.settings.task_time_limit_s + 1)
    agent.agent.inject("ReleaseVMSetup", Fault.abort(grpc.StatusCode.INTERNAL, "disk busy"))
    failed = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert failed.orphans_destroyed == [] and len(failed.errors) == 1
    (kept,) = _kept(corral_env)
    assert kept.attempts == 1 and "disk busy" in (kept.error or "")
    again = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert again.orphans_destroyed == [] and again.errors == []  # put off: not due yet
    clock.travel(21)  # the first put-off is 20 s
    done = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert done.orphans_destroyed == [f"node1/{vmid}"]
    assert agent.driver.list() == [] and _kept(corral_env) == []
