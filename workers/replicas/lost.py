"""Replicas lost with their node: marked Dead once it has been unhealthy past its grace.

A node that misses ``CORRAL_HEALTH_MISSES`` probes in a row is unhealthy
(:mod:`workers.fleet.health`, which knows nodes only); once it has stayed unhealthy for
``CORRAL_NODE_DEAD_GRACE_S``, the health task marks its live replicas Dead here, through
the replica state machine (:func:`workers.replicas.lifecycle.transition`: their
reservations are freed, their operations settled). Reconcile then brings their
functions back to their min elsewhere. A node that answers again keeps its Dead rows;
what it still runs is an orphan to reconcile.

Except where reconcile cannot see orphans: on a node that cannot list its VMs
(:func:`workers.replicas.delete.release_waits`: an agent of the seed protocol) a row
with a VM is marked Deleting instead - it no longer counts toward its function, its
operation fails, but it keeps the slot its VM may still hold - and the reaper releases
the VM once the node answers (:mod:`workers.replicas.delete`). Rows already Deleting
there wait likewise.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.locks import lock_functions
from workers.operations import settle
from workers.replicas.delete import WAITS, release_waits
from workers.replicas.lifecycle import transition
from workers.store.db import Database
from workers.store.models import LIVE_STATES, Node, Replica, ReplicaState


def mark_lost(db: Database, settings: Settings) -> int:
    """Mark Dead the replicas of nodes unhealthy for longer than the grace period."""
    cutoff = now() - timedelta(seconds=settings.node_dead_grace_s)
    lost = 0
    with db.transaction() as s:
        gone = list(
            s.scalars(select(Node).where(Node.healthy.is_(False), Node.unhealthy_since <= cutoff))
        )
        if gone:
            lock_functions(s)  # counters of any function may move (workers.locks)
        for node in gone:
            for replica in s.scalars(
                select(Replica)
                .where(Replica.node_id == node.id, Replica.status.in_(LIVE_STATES))
                # of=Replica: not the outer-joined node/GPU; one someone else is moving is
                # left for the next pass
                .with_for_update(of=Replica, skip_locked=True)
            ):
                error = f"node {node.name} unreachable since {node.unhealthy_since}"
                if replica.vmid is None or not release_waits(node):
                    transition(s, replica, ReplicaState.DEAD, settings, error=error)
                elif replica.status != ReplicaState.DELETING:
                    _wait_for_node(s, settings, replica, f"{error}; {WAITS}")
                else:
                    continue  # already waits for its release
                lost += 1
    return lost


def _wait_for_node(s: Session, settings: Settings, replica: Replica, error: str) -> None:
    """Mark a lost node's replica Deleting, its VM released once the node answers."""
    waiting, replica.operation_id = replica.operation_id, None
    transition(s, replica, ReplicaState.DELETING, settings, error=error)
    if waiting:
        settle(s, waiting, parts=[replica.id], ok=False, error=error)
