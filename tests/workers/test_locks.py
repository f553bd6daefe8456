"""Locking every node at once waits one lock timeout in all, not one per node someone holds.

``lock_timeout`` bounds each wait for a row lock. A placement locks every node of its kind
in one statement: with the nodes held one after the other, each for less than the lock
timeout, its waits added up (a placement waited 11 s with a 2.5 s lock timeout). Here
three nodes are held by three other transactions, each freed 0.6 lock timeouts after the
placement's statement began to wait for it: the statement must fail (before the code
that bounds the total, it took every lock, 1.8 lock timeouts after it began).
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import Connection, select, text
from sqlalchemy.exc import DBAPIError

from testkit.eventually import eventually
from tests.fixtures import Env, postgres_only
from workers.base.kinds import NodeKind
from workers.fleet.nodes import upsert_node
from workers.locks import lock_nodes
from workers.store.db import is_transient
from workers.store.models import Node

LOCK_TIMEOUT_S = 1.0
HOLD = 0.6  # of the lock timeout: each wait alone is shorter than it


def _waiting_on(probe: Connection, pid: int) -> list[int]:
    """The backends ``pid`` waits for a lock of."""
    return list(
        probe.execute(text("SELECT unnest(pg_blocking_pids(:pid))"), {"pid": pid}).scalars()
    )


@postgres_only  # SQLite takes one write lock per transaction
def test_locking_every_node_waits_one_lock_timeout_in_all(store_env: Env) -> None:
    store_env.set(db_lock_timeout_s=str(LOCK_TIMEOUT_S))
    db = store_env.db
    with db.transaction() as s:
        for n in range(3):
            upsert_node(s, f"127.0.0.{n + 1}:50051", name=f"node{n + 1}", kind=NodeKind.FCDAEMON)
    with db.read() as s:
        ids = list(s.scalars(select(Node.id).order_by(Node.name)))
    holders = [db.engine.connect() for _ in ids]
    probe = db.engine.connect()
    probe.execute(text("SET lock_timeout = 0"))
    for holder, node_id in zip(holders, ids, strict=True):
        holder.execute(text("SELECT 1 FROM nodes WHERE id = :id FOR UPDATE"), {"id": node_id})
    outcome: list[BaseException | None] = []
    pids: list[int] = []

    def place() -> None:
        try:
            with db.transaction() as s:
                pids.append(int(s.scalar(text("SELECT pg_backend_pid()"))))
                lock_nodes(s, NodeKind.FCDAEMON)
            outcome.append(None)
        except DBAPIError as exc:
            outcome.append(exc)

    placing = threading.Thread(target=place, daemon=True)
    placing.start()
    try:
        eventually(lambda: bool(pids), 10, "the placement's transaction")
        for holder in holders:  # each freed 0.6 lock timeouts after the wait for it began
            held = int(holder.execute(text("SELECT pg_backend_pid()")).scalar_one())
            eventually(
                lambda held=held: outcome or held in _waiting_on(probe, pids[0]),  # type: ignore[misc]
                10,
                "the placement to wait for the node",
            )
            if outcome:
                break
            time.sleep(HOLD * LOCK_TIMEOUT_S)
            holder.rollback()
        placing.join(10)
        assert outcome, "the placement still waits"
        (exc,) = outcome
        # each wait was shorter than the lock timeout, and yet it failed: in all, they were not
        assert isinstance(exc, DBAPIError) and is_transient(exc), exc
    finally:
        for holder in holders:
            holder.rollback()
            holder.close()
        probe.close()
        placing.join(10)
