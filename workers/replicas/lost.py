"""Replicas lost with their node: marked Dead once it has been unhealthy past its grace.

A node that misses ``CORRAL_HEALTH_MISSES`` probes in a row is unhealthy
(:mod:`workers.fleet.health`, which knows nodes only); once it has stayed unhealthy for
``CORRAL_NODE_DEAD_GRACE_S``, the health task marks its live replicas Dead here, through
the replica state machine (:func:`workers.replicas.lifecycle.transition`: their
reservations are freed, their operations settled). Reconcile then brings their
functions back to their min elsewhere. A node that answers again keeps its Dead rows;
what it still runs is an orphan to reconcile.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select

from config.settings import Settings
from workers.clock import now
from workers.locks import lock_functions
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
                transition(
                    s,
                    replica,
                    ReplicaState.DEAD,
                    settings,
                    error=f"node {node.name} unreachable since {node.unhealthy_since}",
                )
                lost += 1
    return lost
