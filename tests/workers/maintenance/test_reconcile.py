"""Reconcile (rows vs. what agents run), draining and the top-up to min, against real agents."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
from sqlalchemy import select

from agents.drivers import VM, MemoryDriver, VMSpec
from agents.faults import Fault
from agents.fcdaemon import serve_fcdaemon
from corral import api
from corral.cli import main
from tasks.maintenance import QUEUE
from tasks.maintenance import reconcile as reconcile_task
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, one_agent, replicas
from workers import leases
from workers.base import clock
from workers.fleet.nodes import upsert_node
from workers.maintenance.reconcile import reconcile
from workers.store.models import Function, Node, ReplicaState


def test_orphan_vm_is_destroyed_after_its_grace(corral_env: Env, start_agents: StartAgents) -> None:
    agent = one_agent(corral_env, start_agents)
    api.wait(api.spawn("hello", 1), timeout=10)
    orphan = agent.driver.start(VMSpec(image="examples.hello"))  # behind corral's back
    corral_env.set(orphan_grace_s="60")
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.orphans_destroyed == [] and report.orphans_waiting == 1  # just seen
    clock.travel(59)  # the grace runs on corral's clock from the first sighting
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.orphans_destroyed == [] and report.orphans_waiting == 1
    clock.travel(2)
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.orphans_destroyed == [f"node1/{orphan.vmid}"]
    assert [vm.vmid for vm in agent.driver.list()] == [replicas(corral_env)[0].vmid]
    assert {r.vmid for r in agent.agent.calls_of("ReleaseVMSetup")} == {orphan.vmid}


def test_vm_of_a_spawn_in_flight_is_not_an_orphan(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agent = one_agent(corral_env, start_agents)
    corral_env.set(orphan_grace_s="0")
    with corral_env.db.read() as s:
        fn_id = s.scalars(select(Function.id)).one()
    creating(corral_env, fn_id, "req-1")
    agent.driver.start(VMSpec(image="examples.hello", request_id="req-1"))
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.orphans_destroyed == []
    assert len(agent.driver.list()) == 1


def test_vanished_vm_marks_the_row_dead_and_min_is_restored(
    corral_env: Env, start_agents: StartAgents
) -> None:
    agent = one_agent(corral_env, start_agents, min=2)
    api.wait(api.spawn("hello", 2), timeout=10)
    gone = replicas(corral_env)[0]
    assert agent.driver.stop(gone.vmid or "")  # the VM dies on the node
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert report.vanished == [gone.id]
    assert report.top_up == {"hello": 1}
    dead = next(r for r in replicas(corral_env) if r.id == gone.id)
    assert dead.status == ReplicaState.DEAD and "vanished" in (dead.error or "")
    with corral_env.db.read() as s:
        assert s.scalars(select(Node)).one().live == 1


def test_reconcile_task_tops_up_to_min(corral_env: Env, start_agents: StartAgents) -> None:
    agent = one_agent(corral_env, start_agents, min=3)
    result = reconcile_task.delay().get()
    assert result["top_up"] == {"hello": 3}
    assert len(agent.driver.list()) == 3
    assert reconcile_task.delay().get()["top_up"] == {}  # already at min


def test_node_without_list_extension_is_skipped_once(
    corral_env: Env, start_agents: StartAgents
) -> None:

    (agent,) = start_agents(1)
    agent.agent.inject("ListReplicas", Fault.abort(grpc.StatusCode.UNIMPLEMENTED, "old agent"))
    first = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert first.nodes_unlistable == ["node1"]
    second = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert second.nodes_unlistable == [] and second.nodes_checked == []
    assert len(agent.agent.calls_of("ListReplicas")) == 1


def test_only_one_reconcile_pass_at_a_time(corral_env: Env, start_agents: StartAgents) -> None:
    start_agents(1)
    assert leases.acquire(corral_env.db, "reconcile", "other", 60)
    assert reconcile(corral_env.db, corral_env.settings, holder="me", queue=QUEUE).skipped
    leases.release(corral_env.db, "reconcile", "other")
    assert not reconcile(corral_env.db, corral_env.settings, holder="me", queue=QUEUE).skipped


def test_drain_moves_idle_replicas_off(corral_env: Env, start_agents: StartAgents) -> None:
    a, _b = start_agents(2)
    deploy_fn(corral_env, min=2)
    api.wait(api.spawn("hello", 2), timeout=10)
    assert main(["nodes", "drain", "node1"]) == 0
    report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
    assert len(report.drained) == 1
    assert a.driver.list() == []
    # min is 2: the next pass replaces it on the other node
    assert reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE).top_up == {
        "hello": 1
    }


def test_reconcile_command_reports_what_it_found(
    corral_env: Env, start_agents: StartAgents, capsys: pytest.CaptureFixture[str]
) -> None:

    agent = one_agent(corral_env, start_agents, min=1)
    corral_env.set(orphan_grace_s="0")
    orphan = agent.driver.start(VMSpec(image="examples.hello"))
    capsys.readouterr()
    assert main(["reconcile", "--wait"]) == 0
    out = capsys.readouterr().out
    assert f"destroyed orphan node1/{orphan.vmid}" in out
    assert "hello below its min: spawn" in out
    assert main(["reconcile", "--wait", "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["status"] == "succeeded" and view["result"]["orphans_destroyed"] == []
    assert len(agent.driver.list()) == 1  # the orphan is gone, min 1 was spawned


class _MeetingListing(MemoryDriver):
    """A memory driver whose listings wait for each other in groups, counting how many run at once.

    Each listing waits until ``meeting.parties`` listings are under way together (or
    breaks the meeting after 10 s: listed one by one), so the count shows whether nodes
    are listed at once without a guessed sleep.
    """

    def __init__(
        self, seen: list[int], lock: threading.Lock, now: list[int], meeting: threading.Barrier
    ) -> None:
        super().__init__()
        self.seen, self.lock, self.now, self.meeting = seen, lock, now, meeting

    def list(self) -> list[VM]:
        """List once the meeting is complete, counted."""
        with self.lock:
            self.now[0] += 1
            self.seen.append(self.now[0])
        try:
            self.meeting.wait()
        finally:
            with self.lock:
                self.now[0] -= 1
        return super().list()


@pytest.mark.parametrize("bound", [2, 16])
def test_reconcile_lists_nodes_at_once_within_its_bound(corral_env: Env, bound: int) -> None:
    corral_env.set(reconcile_concurrency=str(bound))
    seen: list[int] = []
    lock, now = threading.Lock(), [0]
    meeting = threading.Barrier(min(bound, 4), timeout=10)
    agents = [
        serve_fcdaemon("127.0.0.1:0", driver=_MeetingListing(seen, lock, now, meeting))
        for _ in range(4)
    ]
    try:
        with corral_env.db.transaction() as s:
            for i, agent in enumerate(agents):
                upsert_node(s, agent.address, name=f"slow{i}")
        report = reconcile(corral_env.db, corral_env.settings, holder="t", queue=QUEUE)
        assert sorted(report.nodes_checked) == [f"slow{i}" for i in range(4)]
        assert max(seen) == min(bound, 4)  # listed together, never beyond the bound
    finally:
        for agent in agents:
            agent.stop(grace=0)
