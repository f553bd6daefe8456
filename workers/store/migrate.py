"""Schema migrations (Alembic) and the check that refuses an un-migrated database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from workers.store.db import Database

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class SchemaError(Exception):
    """The database is not at the schema this code expects."""


def alembic_config(url: str) -> Config:
    """An Alembic configuration for ``url`` using corral's migration scripts."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest migration this code ships."""
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def current_revision(db: Database) -> str | None:
    """The revision the database is at, or None when it was never migrated."""
    with db.engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(db: Database) -> tuple[str | None, str]:
    """Migrate the database to the newest revision; returns (before, after)."""
    before = current_revision(db)
    command.upgrade(alembic_config(db.url), "head")
    return before, head_revision()


def check_schema(db: Database) -> None:
    """Raise :class:`SchemaError` unless the database is migrated to head."""
    current = current_revision(db)
    head = head_revision()
    if current != head:
        state = "not migrated" if current is None else f"at revision {current}, need {head}"
        raise SchemaError(f"database {safe_url(db.url)} is {state}: run `corral db upgrade`")


def safe_url(url: str) -> str:
    """The URL with any password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def regenerate_initial() -> Path:
    """Rewrite the initial migration from the models (development only, before a release)."""
    import tempfile

    versions = MIGRATIONS / "versions"
    for old in versions.glob("0001_*.py"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = alembic_config(f"sqlite:///{tmp}/empty.sqlite")
        command.revision(cfg, message="initial schema", autogenerate=True, rev_id="0001")
    (path,) = versions.glob("0001_*.py")
    import shutil
    import subprocess

    ruff = shutil.which("ruff")
    if ruff:  # keep generated code as tidy as the rest of the tree
        subprocess.run([ruff, "format", "-q", str(path)], check=False)
        subprocess.run([ruff, "check", "--fix", "--unsafe-fixes", "-q", str(path)], check=False)
    return path


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["regenerate"]:
        raise SystemExit("usage: python -m workers.store.migrate regenerate")
    print(regenerate_initial())
