"""A log of every terminal record the store sees written for a call: a trigger on ``calls``.

Every UPDATE that writes ``succeeded`` or ``dead`` into a call's status (whatever it was
before) adds a row to ``calls_terminal_seen``: a call with one row reached one terminal
record; two rows would be two (a success overwritten by a death, a death written twice).
:func:`install` creates the table and trigger (SQLite or PostgreSQL), :func:`seen` reads
the log, :func:`remove` drops both.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import text

from workers.store.db import Database

_SQLITE = (
    "CREATE TABLE IF NOT EXISTS calls_terminal_seen (call_id TEXT, source TEXT, target TEXT)",
    "CREATE TRIGGER IF NOT EXISTS calls_terminal_u AFTER UPDATE OF status ON calls "
    "WHEN new.status IN ('succeeded', 'dead') BEGIN "
    "INSERT INTO calls_terminal_seen VALUES (new.id, old.status, new.status); END",
)
_PG = (
    "CREATE TABLE IF NOT EXISTS calls_terminal_seen (call_id text, source text, target text)",
    "CREATE OR REPLACE FUNCTION calls_terminal_note() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "BEGIN IF NEW.status IN ('succeeded', 'dead') THEN "
    "INSERT INTO calls_terminal_seen VALUES (NEW.id, OLD.status, NEW.status); END IF; "
    "RETURN NULL; END $$",
    "DROP TRIGGER IF EXISTS calls_terminal_u ON calls",
    "CREATE TRIGGER calls_terminal_u AFTER UPDATE OF status ON calls "
    "FOR EACH ROW EXECUTE FUNCTION calls_terminal_note()",
)
_PG_DROP = (
    "DROP TRIGGER IF EXISTS calls_terminal_u ON calls",
    "DROP FUNCTION IF EXISTS calls_terminal_note()",
    "DROP TABLE IF EXISTS calls_terminal_seen",
)
_SQLITE_DROP = (
    "DROP TRIGGER IF EXISTS calls_terminal_u",
    "DROP TABLE IF EXISTS calls_terminal_seen",
)


def install(db: Database) -> None:
    """Start logging terminal records."""
    with db.transaction() as s:
        for statement in _SQLITE if db.is_sqlite else _PG:
            s.execute(text(statement))


def seen(db: Database) -> Counter[str]:
    """How many terminal records each call got (calls that got none are absent)."""
    with db.read() as s:
        return Counter(
            str(cid) for (cid,) in s.execute(text("SELECT call_id FROM calls_terminal_seen"))
        )


def remove(db: Database) -> None:
    """Stop logging and drop the log."""
    with db.transaction() as s:
        for statement in _SQLITE_DROP if db.is_sqlite else _PG_DROP:
            s.execute(text(statement))
