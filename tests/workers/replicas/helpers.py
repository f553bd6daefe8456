"""Shared helpers for the replica tests: spawn Idle replicas, races, count RPCs, check counters."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import select

from agents.fcdaemon import RunningAgent
from tasks.maintenance import QUEUE
from tasks.queues import InProcessQueue
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn as deploy_fn  # re-exported: tests/gateway imports it here
from tests.helpers import replicas, spawn_ok
from workers import leases
from workers.base.kinds import OpKind
from workers.maintenance.audit import audit
from workers.operations import create_operation
from workers.replicas.claims import Claimed, NoIdleReplica, claim
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import plan_spawn
from workers.store.db import Database
from workers.store.models import Node, Replica, ReplicaState

T = TypeVar("T")


def idle_on(
    env: Env, start_agents: StartAgents, nodes: int, n: int, /, **fields: object
) -> tuple[list[RunningAgent], list[Replica]]:
    """``nodes`` node agents, ``hello`` deployed with ``fields`` and ``n`` Idle replicas of it."""
    agents = start_agents(nodes)
    deploy_fn(env, "hello", **fields)
    return agents, spawn_idle(env, "hello", n)


def one_node_idle(
    env: Env, start_agents: StartAgents, n: int = 1, /, **fields: object
) -> list[Replica]:
    """One node agent, ``hello`` deployed with ``fields``, and ``n`` Idle replicas of it."""
    return idle_on(env, start_agents, 1, n, **fields)[1]


def spawn_idle(env: Env, name: str, n: int) -> list[Replica]:
    """Spawn ``n`` replicas (eager mode); returns the function's Idle replicas."""
    spawn_ok(name, n, timeout=30)
    return [r for r in replicas(env, name) if r.status == ReplicaState.IDLE]


def by_id(env: Env) -> dict[str, Replica]:
    """Every replica row by id."""
    return {r.id: r for r in replicas(env)}


def released(agents: Iterable[RunningAgent]) -> Counter[str]:
    """How many ReleaseVMSetup calls each vmid got, over all agents."""
    return Counter(req.vmid for agent in agents for req in agent.agent.calls_of("ReleaseVMSetup"))


def created(agents: Iterable[RunningAgent]) -> int:
    """How many CreateReplica calls the agents got."""
    return sum(len(agent.agent.calls_of("CreateReplica")) for agent in agents)


def at_once(n: int, work: Callable[[int], T], timeout: float = 60.0) -> list[T]:
    """Run ``work(0) .. work(n - 1)`` in ``n`` threads released together; their results.

    Every thread must be done within ``timeout``: a test never judges a race on part of
    its racers, nor leaves one running into the next test (cis26: two racers of
    ``test_race_has_one_winner`` reached the store after its teardown had closed it).
    """
    barrier = threading.Barrier(n)
    results: list[T] = []

    def one(i: int) -> None:
        barrier.wait()
        results.append(work(i))

    threads = [threading.Thread(target=one, args=(i,), name=f"racer-{i}") for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()
    stuck = {
        t.name: "".join(traceback.format_stack(frames[t.ident]))
        for t in threads
        if t.is_alive() and t.ident in frames
    }
    assert not stuck, f"racers still running after {timeout:g} s: {stuck}"
    return results


def claim_race(
    env: Env, name: str, claimers: int, timeout: float = 30.0
) -> tuple[list[Claimed], list[str]]:
    """``claimers`` threads claim ``name`` at once; returns (claims, error messages)."""

    def one(_: int) -> Claimed | str:
        try:
            return claim(env.db, env.settings, name)
        except NoIdleReplica as exc:
            return str(exc)

    results = at_once(claimers, one, timeout)
    return (
        [r for r in results if not isinstance(r, str)],
        [r for r in results if isinstance(r, str)],
    )


def race_for_lease(db: Database, racers: int = 8) -> list[str]:
    """Let ``racers`` threads try to take the lease ``race`` at once; returns the winners."""
    won = at_once(racers, lambda i: f"h{i}" if leases.acquire(db, "race", f"h{i}", 60) else "")
    return [w for w in won if w]


def spawn_op(env: Env, count: int, /, **fields: Any) -> tuple[str, str, list[SpawnJob]]:
    """A spawn of ``hello`` written and planned as its first task does: (op, function, jobs)."""
    with env.db.transaction() as s:
        op_id = create_operation(
            s,
            OpKind.SPAWN,
            {"function": "hello", "count": count},
            function_id=deploy_fn(env, **{"max": 20, **fields}),
        ).id
    function_id, jobs = plan_spawn(env.db, op_id)
    return op_id, function_id, jobs


def running(agents: Iterable[RunningAgent]) -> set[str]:
    """The vmids the agents run."""
    return {vm.vmid for agent in agents for vm in agent.driver.list()}


def no_drift(env: Env) -> None:
    """Assert that ``corral db check`` finds every counter equal to what the rows say."""
    with env.db.read() as s:
        found = audit(s, lock=False)
    assert found.drifts == [], [d.message for d in found.drifts]


def nodes(env: Env) -> dict[str, Node]:
    """Every node row by name."""
    with env.db.read() as s:
        return {n.name: n for n in s.scalars(select(Node))}


class ReleasingQueue(InProcessQueue):
    """The in-process queue (a release runs here, on its node), noting each VM it released."""

    def __init__(self) -> None:
        super().__init__(QUEUE.tasks)
        self.released: list[str] = []

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Release the VM here, and note it."""
        super().release_orphan(node_id, vmid)
        self.released.append(vmid)
