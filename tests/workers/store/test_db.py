"""A process's engine (:class:`workers.store.db.Database`): kept across the closing of its
connections, with the statements it compiled, and made again when its settings change."""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.engine.default import CACHE_HIT, CACHE_MISS

from tests.fixtures import Env, postgres_only
from workers.store.db import Database
from workers.store.models import Node

NODES = select(Node.id).where(Node.address == "nowhere")


def _cache_hit(db: Database) -> Any:
    with db.engine.connect() as conn:
        return conn.execute(NODES).context.cache_hit


def _closed(raw: Any) -> bool:
    """Whether a DBAPI connection (psycopg's, or sqlite3's) is closed."""
    if isinstance(raw, sqlite3.Connection):
        try:
            raw.execute("SELECT 1")
        except sqlite3.ProgrammingError:
            return True
        return False
    return bool(raw.closed)


def test_dispose_closes_the_connections_and_keeps_the_compiled_statements(
    store_env: Env,
) -> None:
    db = store_env.db
    engine = db.engine
    assert _cache_hit(db) in (CACHE_MISS, CACHE_HIT)
    assert _cache_hit(db) == CACHE_HIT
    with db.read() as s:
        raw = s.connection().connection.dbapi_connection
    db.dispose()
    assert _closed(raw)  # its connection closed...
    assert db.engine is engine  # ...its engine kept, with what it compiled
    assert _cache_hit(db) == CACHE_HIT
    with db.read() as s:  # a new connection
        assert s.connection().connection.dbapi_connection is not raw


@postgres_only  # SQLite's engine takes nothing from the settings
def test_an_engine_whose_settings_changed_is_made_again_at_its_next_use(store_env: Env) -> None:
    db = store_env.db
    engine = db.engine
    store_env.set(db_lock_timeout_s="7")
    assert db.engine is engine  # its connections are not closed: nothing changes yet
    db.dispose()
    assert db.engine is not engine
    with db.read() as s:
        assert s.scalar(text("SHOW lock_timeout")) == "7s"
