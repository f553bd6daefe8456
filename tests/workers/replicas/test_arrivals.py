"""Recording VMs that came back (:mod:`workers.replicas.arrivals`): a VM too late for its row
is released, and kept as an orphan until it is, on an agent that speaks only the seed
protocol (no ``ListReplicas``: reconcile cannot find it there by listing)."""

from __future__ import annotations

import time

import grpc
from sqlalchemy import select

from agents.drivers import VMSpec
from agents.faults import Fault
from agents.fcdaemon import RunningAgent
from tasks.maintenance import QUEUE
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, record_vm, replicas
from workers.backends import Vm
from workers.base import clock, timelimits
from workers.base.timelimits import Deadline
from workers.maintenance.reconcile import reconcile
from workers.replicas.delete import delete_one
from workers.replicas.outcomes import Outcome
from workers.replicas.owners import Pending
from workers.store.models import OrphanRelease, ReplicaState


def _kept(env: Env) -> list[tuple[str, str]]:
    with env.db.read() as s:
        return [(k.node_id, k.vmid) for k in s.scalars(select(OrphanRelease))]


def _deleted_while_creating(env: Env, agent: RunningAgent) -> tuple[Pending, str]:
    """A replica's row deleted while its create was out, and the VM that create made."""
    fn_id = deploy_fn(env, "hello")
    pending = creating(env, fn_id, "req-late")
    vm = agent.driver.start(VMSpec(image="examples.hello"))  # the create, on the agent
    assert delete_one(env.db, env.settings, pending.replica_id, None) == ("deleted", None)
    return pending, vm.vmid


def _recorded(env: Env, pending: Pending, vmid: str) -> Outcome:
    """Record the late VM: no row takes it."""
    state = record_vm(env, pending, Vm(vmid, "http://127.0.0.1:20001"))
    (row,) = replicas(env)
    assert (row.status, row.vmid) == (ReplicaState.DELETED, None)  # no row took the VM
    return state


def _late_vm(env: Env, agent: RunningAgent) -> tuple[str, Outcome]:
    """A VM of ``agent`` whose row was deleted while its create was out, then recorded."""
    pending, vmid = _deleted_while_creating(env, agent)
    return vmid, _recorded(env, pending, vmid)


def test_a_late_vm_is_released_and_nothing_is_kept(
    corral_env: Env, start_agents: StartAgents
) -> None:
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    vmid, state = _late_vm(corral_env, agent)
    assert state == Outcome.of(ReplicaState.DELETED)
    assert agent.driver.list() == []
    assert [r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")] == [vmid]
    assert _kept(corral_env) == []  # released: its kept orphan ended


def test_a_late_vm_whose_release_fails_is_kept_until_reconcile_releases_it(
    corral_env: Env, start_agents: StartAgents
) -> None:
    # The release fails (in the partition run: the in-flight slots' Redis cut off); the
    # seed agent cannot list its VMs, so the kept row is all that remembers this one.
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("ReleaseVMSetup", Fault.abort(grpc.StatusCode.UNAVAILABLE, "cut"))
    vmid, _ = _late_vm(corral_env, agent)
    assert [vm.vmid for vm in agent.driver.list()] == [vmid]  # still running
    (kept,) = _kept(corral_env)
    assert kept[1] == vmid
    early = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert early.orphans_destroyed == []  # not due while a task could still be releasing it
    clock.travel(corral_env.settings.task_time_limit_s + 1)
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.nodes_checked == []  # it cannot list: the kept row found the VM
    assert report.orphans_destroyed == [f"node1/{vmid}"]
    assert agent.driver.list() == [] and _kept(corral_env) == []


def test_a_late_vm_whose_release_outlasts_the_tasks_time_is_kept_and_the_task_goes_on(
    corral_env: Env, start_agents: StartAgents
) -> None:
    # The release waits past the task's soft limit (an agent that does not answer): the
    # wait is cut there, and the VM is left to its kept row as for a release that failed.
    (agent,) = start_agents(1, env=corral_env, seed_only=True)
    agent.agent.inject("ReleaseVMSetup", Fault.delay(5))
    pending, vmid = _deleted_while_creating(corral_env, agent)  # before the task's time
    now = time.monotonic()
    deadline = Deadline(now + 1.0, hard_at=now + 30)
    with timelimits.running(deadline):
        state = _recorded(corral_env, pending, vmid)  # returns: nothing raised out of it
    assert state == Outcome.of(ReplicaState.DELETED)
    assert time.monotonic() - now < 5  # cut at the soft limit, not the agent's 5 s
    assert deadline.wrapping_up
    assert [k[1] for k in _kept(corral_env)] == [vmid]  # reconcile releases it when due
