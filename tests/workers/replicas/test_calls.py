"""A batch cut by the soft time limit: calls cancelled, landed VMs recorded, the rest handed on.

The soft limit is a deadline the batch checks between its wait slices
(:mod:`workers.base.timelimits`). These tests run a real batch against real agents under a
deadline and pull the deadline in once the batch is where the test wants it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from sqlalchemy import select

from agents.faults import Fault
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, operation, replicas
from workers.base import timelimits
from workers.base.kinds import OpKind
from workers.operations import create_operation
from workers.replicas.owners import Budget
from workers.replicas.spawn import plan_spawn, run_batch
from workers.store.models import Node, ReplicaState

SoftLimitWhen = Callable[[Callable[[], bool]], None]


@pytest.fixture
def soft_limit_when() -> Iterator[SoftLimitWhen]:
    """``fire(ready)``: this thread's task meets its soft limit once ``ready()`` is true.

    Waiting for the state the test needs, not for a time: on a busy machine two quick
    creates may take longer than any fixed delay (within 10 s, or it fires anyway).
    """
    deadline = timelimits.Deadline(time.monotonic() + 3600)
    stop = threading.Event()
    watchers: list[threading.Thread] = []

    def fire(ready: Callable[[], bool]) -> None:
        def watch() -> None:
            give_up = time.monotonic() + 10
            while not stop.is_set() and not ready() and time.monotonic() < give_up:
                time.sleep(0.005)
            deadline.at = time.monotonic()  # the soft limit falls now

        watchers.append(threading.Thread(target=watch, daemon=True))
        watchers[-1].start()

    with timelimits.running(deadline):
        yield fire
    stop.set()
    for watcher in watchers:
        watcher.join(15)


@pytest.mark.parametrize("seed_only", [True, False], ids=["seed", "extensions"])
def test_a_batch_cut_by_the_soft_limit_records_what_landed_and_never_sends_twice_blindly(
    corral_env: Env, start_agents: StartAgents, soft_limit_when: SoftLimitWhen, seed_only: bool
) -> None:
    # no create deadline while the two are held (2 s, the tests' own, passed on a loaded
    # machine before the cut: the creates were retried, and the cut found nothing in flight)
    corral_env.set(node_max_inflight="2", create_timeout_s="30")
    (agent,) = start_agents(1, env=corral_env, seed_only=seed_only)
    held = threading.Event()  # the last two sent stay in flight until the batch was cut
    agent.agent.inject(
        "CreateReplica",
        Fault.delay(0),
        Fault.delay(0),
        Fault.delay(60, until=held),
        Fault.delay(60, until=held),
    )
    with corral_env.db.transaction() as s:
        op_id = create_operation(
            s, OpKind.SPAWN, {"function": "hello", "count": 6}, function_id=deploy_fn(corral_env)
        ).id
    fn_id, jobs = plan_spawn(corral_env.db, op_id)
    settings = corral_env.settings

    def two_created_two_in_flight() -> bool:  # and two waiting
        if len(agent.agent.calls_of("CreateReplica")) < 4:
            return False
        return sum(r.status == ReplicaState.IDLE for r in replicas(corral_env)) >= 2

    soft_limit_when(two_created_two_in_flight)
    try:
        nxt = run_batch(corral_env.db, settings, op_id, fn_id, jobs, Budget.of(settings))
    finally:
        held.set()  # the node goes on making those two VMs

    states = sorted(nxt.states[j.request_id] for j in jobs)
    cut = "maybe, replaced" if seed_only else "cut off, sent again later"
    assert states == sorted(["idle"] * 2 + [cut] * 2 + ["not sent yet"] * 2), states
    assert len(agent.agent.calls_of("CreateReplica")) == 4  # the cut calls were sent once
    rows = {r.request_id: r for r in replicas(corral_env)}
    assert sum(r.status == ReplicaState.IDLE for r in rows.values()) == 2
    assert operation(corral_env, op_id).status == "running"  # never failed while calls run
    # the rest is handed on; a seed agent's cut creates are maybes now, their
    # replacements handed on to be sent (no round starts after a cut)
    assert len(nxt.rest) == (2 if seed_only else 4)
    assert len(nxt.again) == (2 if seed_only else 0) and len(nxt.maybes) == len(nxt.again)

    again = run_batch(
        corral_env.db,
        settings,
        op_id,
        fn_id,
        [j for j in jobs if j.request_id in {r.request_id for r in nxt.rest + nxt.again}],
        Budget.of(settings),
    )
    assert set(again.states.values()) == {"idle"}
    rows = {r.request_id: r for r in replicas(corral_env)}
    idle = [r for r in rows.values() if r.status == ReplicaState.IDLE]
    if seed_only:  # the two cut creates are maybes; their replacements are replicas
        assert len(idle) == 6 and len(agent.agent.calls_of("CreateReplica")) == 8
        maybes = [r for r in replicas(corral_env) if r.status == ReplicaState.MAYBE]
        assert {r.id for r in maybes} == set(nxt.maybes)
        # a VM the agent made for a cut create has no row (its READY would settle a
        # maybe); the maybes hold their slots meanwhile, so the node never over-commits
        extra = {vm.vmid for vm in agent.driver.list()} - {r.vmid for r in idle}
        assert len(extra) <= len(maybes) == 2
        with corral_env.db.read() as s:
            assert s.scalars(select(Node)).one().live == 8
        assert operation(corral_env, op_id).status == "succeeded"
    else:  # the same requestId again: the agent answers with the VMs it made meanwhile
        assert len(idle) == 6 and len(agent.driver.list()) == 6
        assert {r.vmid for r in idle} == {vm.vmid for vm in agent.driver.list()}
        assert operation(corral_env, op_id).status == "succeeded"
