"""How a replica is shown to operators and scripts, and the reads behind the listings."""

from __future__ import annotations

from typing import TypedDict

from sqlalchemy import select
from sqlalchemy.orm import Session

from workers.base.clock import iso
from workers.base.errors import NotFound
from workers.store.models import LIVE_STATES, Replica, ReplicaState


class ReplicaView(TypedDict):
    """A replica as the CLI and API show it."""

    id: str
    function: str
    node: str | None
    status: str  # the state's label: idle, allocated, creating, maybe, ...
    status_code: int
    vmid: str | None
    address: str | None
    build_version: str
    stale: bool
    envs_in_use: int
    envs_total: int
    gpu: str | None
    gpu_slot: int | None
    error: str | None
    request_id: str
    maybe_of: str | None  # a maybe's operation (workers.replicas.maybes)
    sent_at: str | None  # when its create was marked sent
    created_at: str | None
    ready_at: str | None
    last_used_at: str | None
    idle_since: str | None


def replica_view(replica: Replica) -> ReplicaView:
    """A replica as the CLI and API show it."""
    return {
        "id": replica.id,
        "function": replica.function.name,
        "node": replica.node.name if replica.node else None,
        "status": ReplicaState(replica.status).label,
        "status_code": replica.status,
        "vmid": replica.vmid,
        "address": replica.address,
        "build_version": replica.build_version,
        "stale": replica.build_version != replica.function.build_version,
        "envs_in_use": replica.envs_in_use,
        "envs_total": replica.envs_total,
        "gpu": replica.gpu.uuid if replica.gpu else None,
        "gpu_slot": replica.gpu_slot,
        "error": replica.error,
        "request_id": replica.request_id,
        "maybe_of": replica.maybe_of,
        "sent_at": iso(replica.sent_at),
        "created_at": iso(replica.created_at),
        "ready_at": iso(replica.ready_at),
        "last_used_at": iso(replica.last_used_at),
        "idle_since": iso(replica.idle_since),
    }


def get_replica(session: Session, replica_id: str) -> Replica:
    """The replica with this id, or :class:`NotFound`."""
    replica = session.get(Replica, replica_id)
    if replica is None:
        raise NotFound(f"unknown replica {replica_id!r}")
    return replica


def list_replicas(
    session: Session, function_id: str | None = None, *, include_retired: bool = False
) -> list[Replica]:
    """Replicas, oldest first: live only unless ``include_retired``; of one function if given."""
    query = select(Replica).order_by(Replica.created_at)
    if function_id is not None:
        query = query.where(Replica.function_id == function_id)
    if not include_retired:
        query = query.where(Replica.status.in_(LIVE_STATES))
    return list(session.scalars(query))


def maybes_of(s: Session, op_id: str) -> dict[str, int]:
    """The maybes made for an operation, by what became of them: open, adopted, released, ended."""
    out: dict[str, int] = {}
    rows = s.execute(
        select(Replica.status, Replica.vmid, Replica.address).where(Replica.maybe_of == op_id)
    )
    for status, vmid, address in rows:
        if status == ReplicaState.MAYBE:
            key = "open"
        elif address is not None:
            key = "adopted"  # its VM became an ordinary replica
        else:
            key = "released" if vmid is not None else "ended"  # its VM went / never came
        out[key] = out.get(key, 0) + 1
    return out
