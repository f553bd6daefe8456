"""Small helpers shared by the GPU tests."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tests.fixtures import Env
from tests.helpers import replicas
from workers.maintenance.audit import audit
from workers.store.models import LIVE_STATES, Gpu, Node, Replica


def live(env: Env, function: str | None = None) -> list[Replica]:
    """Live replicas (of one function, if named), oldest first."""
    return replicas(env, function, live=True)


def per_node(env: Env) -> dict[str, int]:
    """Live replicas per node name (every node listed, zeros included)."""
    with env.db.read() as s:
        names = {n.id: n.name for n in s.scalars(select(Node))}
    counts = Counter(names[r.node_id] for r in live(env) if r.node_id)
    return {name: counts.get(name, 0) for name in sorted(names.values())}


def gpus_by_uuid(env: Env) -> dict[str, Gpu]:
    """Every GPU row by UUID."""
    with env.db.read() as s:
        return {g.uuid: g for g in s.scalars(select(Gpu))}


def audit_gpus(session: Session) -> list[str]:
    """Mismatches between each GPU's counters and the replicas holding it (empty: all good)."""
    problems = [d.message for d in audit(session, lock=False).drifts if d.kind == "gpu"]
    stray = session.scalar(
        select(func.count(Replica.id)).where(
            Replica.gpu_slot.is_not(None), Replica.status.not_in(LIVE_STATES)
        )
    )
    if stray:
        problems.append(f"{stray} retired replica(s) still hold a GPU slot")
    return problems
