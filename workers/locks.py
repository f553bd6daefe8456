"""The one order in which corral takes row locks: functions, nodes, GPUs, replicas, operations.

PostgreSQL breaks a deadlock by killing one of the transactions in it; corral
avoids making them. Every transaction takes the rows it locks in this order:

1. **functions** (by name) - the counter ``replica_count`` and the round-robin cursor;
2. **nodes** (by name) - the slot counter ``live``;
3. **GPUs** (by uuid) - ``mem_free_mb`` / ``slots_free``;
4. **replicas**;
5. **operations** - always last (settling a part, finishing an operation).

A transaction that may touch *several* counter rows takes them up front, in that
order, before any replica: placement of a batch locks its function and then every
node (and GPU) of its backend it may reserve on; the reaper, ``replicas.lost.mark_lost``
and reconcile's drain lock all functions first; ``corral db check`` locks all
functions, nodes and GPUs. While holding counter rows they lock replicas only with
``SKIP LOCKED`` (a replica someone else is moving is left for the next pass), so
they never wait for a replica.

The one exception is the single-replica transition (:func:`workers.replicas.lifecycle.
transition` after :func:`~workers.replicas.lifecycle.lock_replica`): it cannot know its
function and node before reading the replica, so it locks the replica and then the
one function, node and GPU it holds, in that order. It never waits for a second
replica and never holds two rows of one kind, and everything that holds several
counter rows waits for replicas only with ``SKIP LOCKED``: no cycle can form.

A statement that locks many counter rows waits for them all at most one lock timeout
(:func:`workers.store.db.one_lock_wait`), not one per row another transaction holds.

SQLite takes one database-wide write lock per transaction (``BEGIN IMMEDIATE``),
so none of this matters there; these statements run there as plain reads.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from workers.store.db import one_lock_wait
from workers.store.models import Function, Gpu, Node


def lock_functions(session: Session) -> None:
    """Lock every function row, by name (FOR NO KEY UPDATE: replica inserts still proceed)."""
    with one_lock_wait(session):
        session.execute(
            select(Function.id).order_by(Function.name).with_for_update(key_share=True)
        ).all()


def lock_nodes(session: Session, kind: str) -> None:
    """Lock every node row of one backend kind, by name."""
    statement = (
        select(Node.id).where(Node.kind == kind).order_by(Node.name).with_for_update(key_share=True)
    )
    with one_lock_wait(session):
        session.execute(statement).all()


def lock_gpus(session: Session) -> None:
    """Lock every GPU row, by uuid."""
    with one_lock_wait(session):
        session.execute(select(Gpu.id).order_by(Gpu.uuid).with_for_update(key_share=True)).all()
