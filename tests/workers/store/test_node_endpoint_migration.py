"""Revision 0009: one node per address, on a store that has nodes already (each store)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import text

from workers.store.db import Database
from workers.store.migrate import alembic_config, current_revision


@pytest.fixture(params=["sqlite", "postgresql"])
def at_0008(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """An empty store migrated to 0008: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    else:
        url = str(request.getfixturevalue("pg_url"))
    command.upgrade(alembic_config(url), "0008")
    db = Database(url)
    yield db
    db.dispose()


def _add(db: Database, *nodes: tuple[str, str, str]) -> None:
    with db.engine.begin() as conn:
        for name, kind, address in nodes:
            conn.execute(
                text(
                    "INSERT INTO nodes (id, name, kind, address, capacity, live, healthy, "
                    "draining, misses, create_failures, created_at) VALUES (:name, :name, "
                    ":kind, :address, 1, 0, true, false, 0, 0, '2026-01-01 00:00:00')"
                ),
                {"name": name, "kind": kind, "address": address},
            )


def _rows(db: Database) -> dict[str, tuple[str | None, bool, str | None]]:
    with db.engine.connect() as conn:
        found = conn.execute(text("SELECT name, endpoint, healthy, last_error FROM nodes"))
        return {name: (endpoint, bool(healthy), error) for name, endpoint, healthy, error in found}


def test_addresses_get_their_endpoint_and_a_named_node_is_set_aside(at_0008: Database) -> None:
    _add(
        at_0008,
        ("agent", "fcdaemon", "127.0.0.1:50051"),
        ("v6", "fcdaemon", "[::1]:50051"),
        ("lambdo", "lambdo", "http://127.0.0.1"),
        ("compose", "fcdaemon", "agent:50051"),  # how compose's agent registered itself
    )
    command.upgrade(alembic_config(at_0008.url), "head")
    rows = _rows(at_0008)
    assert {name: row[0] for name, row in rows.items()} == {
        "agent": "127.0.0.1:50051",
        "v6": "[::1]:50051",
        "lambdo": "127.0.0.1:80",
        "compose": None,
    }
    assert rows["agent"][1] and not rows["compose"][1]
    assert "re-add it" in (rows["compose"][2] or "")


def test_two_nodes_at_one_address_stop_the_upgrade_and_change_nothing(at_0008: Database) -> None:
    _add(
        at_0008,
        ("victim", "fcdaemon", "127.0.0.1:50051"),
        ("dup", "fcdaemon", "[::ffff:127.0.0.1]:50051"),  # the same address, written otherwise
    )
    with pytest.raises(RuntimeError, match=re.escape("dup and victim are both at 127.0.0.1:50051")):
        command.upgrade(alembic_config(at_0008.url), "head")
    assert current_revision(at_0008) == "0008"
    with at_0008.engine.begin() as conn:
        conn.execute(text("DELETE FROM nodes WHERE name = 'dup'"))
    command.upgrade(alembic_config(at_0008.url), "head")
    assert _rows(at_0008)["victim"][0] == "127.0.0.1:50051"
