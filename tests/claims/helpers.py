"""Shared helpers for the claims and reaper tests: deploy, spawn Idle replicas, count RPCs."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from sqlalchemy import select

from agents.fcdaemon import RunningAgent
from tasks import api
from tests.fixtures import Env
from workers import leases
from workers.claims import Claimed, NoIdleReplica, claim
from workers.functions import deploy, spec_from
from workers.store.db import Database
from workers.store.models import Replica, ReplicaState

T = TypeVar("T")


def deploy_fn(corral: Env, name: str = "hello", **fields: Any) -> None:
    """Create (or redeploy, bumping the build) a fcdaemon function."""
    base: dict[str, Any] = {"image": "examples.hello:latest", "kernel": "/boot/vmlinux",
                            "max": 50}
    base.update(fields)
    with corral.db.transaction() as s:
        deploy(s, spec_from(name=name, **base), corral.settings)


def spawn_idle(env: Env, name: str, n: int) -> list[Replica]:
    """Spawn ``n`` replicas (eager mode); returns the function's Idle replicas."""
    view = api.wait(api.spawn(name, n), timeout=30)
    assert view["status"] == "succeeded", view
    return [r for r in replicas(env, name) if r.status == ReplicaState.IDLE]


def replicas(env: Env, name: str | None = None) -> list[Replica]:
    """Every replica row (of one function), oldest first."""
    with env.db.read() as s:
        rows = list(s.scalars(select(Replica).order_by(Replica.created_at)))
    return [r for r in rows if name is None or r.function.name == name]


def by_id(env: Env) -> dict[str, Replica]:
    """Every replica row by id."""
    return {r.id: r for r in replicas(env)}


def released(agents: Iterable[RunningAgent]) -> Counter[str]:
    """How many ReleaseVMSetup calls each vmid got, over all agents."""
    return Counter(
        req.vmid for agent in agents for req in agent.agent.calls_of("ReleaseVMSetup")
    )


def created(agents: Iterable[RunningAgent]) -> int:
    """How many CreateReplica calls the agents got."""
    return sum(len(agent.agent.calls_of("CreateReplica")) for agent in agents)


def at_once(n: int, work: Callable[[int], T], timeout: float = 30.0) -> list[T]:
    """Run ``work(0) .. work(n - 1)`` in ``n`` threads released together; their results."""
    barrier = threading.Barrier(n)
    results: list[T] = []

    def one(i: int) -> None:
        barrier.wait()
        results.append(work(i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
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
    return ([r for r in results if not isinstance(r, str)],
            [r for r in results if isinstance(r, str)])


def race_for_lease(db: Database, racers: int = 8) -> list[str]:
    """Let ``racers`` threads try to take the lease ``race`` at once; returns the winners."""
    won = at_once(racers, lambda i: f"h{i}" if leases.acquire(db, "race", f"h{i}", 60) else "")
    return [w for w in won if w]
