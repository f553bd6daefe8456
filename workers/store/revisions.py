"""Which schema revision a database is at, which this code ships, and the check between them.

Every process that opens the store first checks that the database is at the newest
revision (:func:`check_schema`), so the check must be cheap and must not load Alembic:
``corral nodes list`` pays for it on every run. The newest revision is read from the
revision files themselves - each says ``revision, down_revision = "0006", "0005"`` on
one line (the format :mod:`workers.store.migrate` writes) - and the database's from
Alembic's ``alembic_version`` table with one query. Migrating is
:mod:`workers.store.migrate`'s job, with Alembic.
"""

from __future__ import annotations

import re
from pathlib import Path

from sqlalchemy import inspect, text
from sqlalchemy.engine import make_url

from workers.base.errors import SchemaError
from workers.store.db import Database

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_LINE = re.compile(
    r"""^revision, down_revision = (['"])(\w+)\1, (?:(['"])(\w+)\3|None)\s*$""", re.MULTILINE
)


def revisions() -> dict[str, str | None]:
    """Every revision the code ships -> the revision it follows (None for the first)."""
    found: dict[str, str | None] = {}
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        line = _LINE.search(path.read_text())
        if line is None:
            raise SchemaError(f"{path.name}: no `revision, down_revision = ...` line")
        found[line[2]] = line[4]
    return found


def head_revision() -> str:
    """The newest revision this code ships (the one no other revision follows)."""
    chain = revisions()
    heads = sorted(set(chain) - set(chain.values()))
    if len(heads) != 1:
        raise SchemaError(f"the migrations must have one head, found {heads or 'none'}")
    return heads[0]


def current_revision(db: Database) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    with db.engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        found = conn.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    if len(found) > 1:
        raise SchemaError(f"database {safe_url(db.url)} is at several revisions: {found}")
    return found[0] if found else None


def check_schema(db: Database) -> None:
    """Raise :class:`SchemaError` unless the database is migrated to head."""
    current = current_revision(db)
    head = head_revision()
    if current != head:
        state = "not migrated" if current is None else f"at revision {current}, need {head}"
        raise SchemaError(f"database {safe_url(db.url)} is {state}: run `corral db upgrade`")


def safe_url(url: str) -> str:
    """The URL with any password hidden."""
    return make_url(url).render_as_string(hide_password=True)
