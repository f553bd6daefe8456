"""How a replica is shown to operators and scripts."""

from __future__ import annotations

from typing import Any

from workers.clock import iso
from workers.store.models import Replica, ReplicaState


def replica_view(replica: Replica) -> dict[str, Any]:
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
        "created_at": iso(replica.created_at),
        "ready_at": iso(replica.ready_at),
        "last_used_at": iso(replica.last_used_at),
        "idle_since": iso(replica.idle_since),
    }
