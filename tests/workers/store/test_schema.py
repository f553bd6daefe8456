"""The store refuses to be used before it is migrated, and says how to fix it."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from config.settings import reset_settings
from corral.cli import main
from workers.base.clock import now
from workers.celery import _check_schema
from workers.store.db import Database
from workers.store.migrate import alembic_config, head_revision, upgrade
from workers.store.models import Base, Operation
from workers.store.revisions import MIGRATIONS


@pytest.fixture
def fresh_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, empty_url: str) -> Iterator[Path]:
    """Settings pointing at an empty, never migrated database (each store in turn)."""
    for key in list(os.environ):
        if key.startswith("CORRAL_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CORRAL_DATABASE_URL", empty_url)
    monkeypatch.setenv("CORRAL_EAGER", "1")
    reset_settings()
    yield tmp_path
    reset_settings()


def test_unmigrated_database_is_refused_then_upgrade_fixes_it(
    fresh_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["nodes", "list"]) == 1
    err = capsys.readouterr().err
    assert "is not migrated: run `corral db upgrade`" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["db", "upgrade"]) == 0
    head = head_revision()
    assert f"migrated empty -> {head}" in capsys.readouterr().out
    assert main(["db", "upgrade"]) == 0
    assert f"already at revision {head}" in capsys.readouterr().out
    assert main(["nodes", "list", "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"


def test_a_worker_refuses_an_unmigrated_database(fresh_db: Path) -> None:
    with pytest.raises(SystemExit, match="not migrated"):
        _check_schema()


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.sqlite'}"
    return str(request.getfixturevalue("pg_url"))


def test_the_migrations_build_exactly_the_models(empty_url: str) -> None:
    db = Database(empty_url)
    try:
        upgrade(db)
        with db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        db.dispose()


def test_every_revision_goes_down_and_up_again(empty_url: str) -> None:
    cfg = alembic_config(empty_url)
    command.upgrade(cfg, "head")
    command.downgrade(cfg, "base")
    db = Database(empty_url)
    try:
        with db.engine.connect() as conn:
            assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
        command.upgrade(cfg, "head")
        with db.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        db.dispose()


def test_a_revision_is_plain_alembic_and_never_imports_corral() -> None:
    # A revision states the schema as it was at its time: the models (and any helper of
    # corral's) change later, so it may import only SQLAlchemy, Alembic and the stdlib.
    for path in sorted((MIGRATIONS / "versions").glob("*.py")):
        imports = re.findall(r"^(?:from|import) (\w+)", path.read_text(), re.MULTILINE)
        assert imports, path.name
        assert not {"workers", "config", "tasks"} & set(imports), path.name


def test_upgrading_from_0001_keeps_operations_and_starts_their_progress_clock(
    empty_url: str,
) -> None:

    url = empty_url
    command.upgrade(alembic_config(url), "0001")
    db = Database(url)
    try:
        if url.startswith("postgresql"):  # a server far from UTC: timestamps must stay UTC
            with db.engine.connect() as conn:
                name = conn.execute(text("SELECT current_database()")).scalar()
                conn.execute(text(f"ALTER DATABASE \"{name}\" SET timezone TO 'Asia/Tokyo'"))
                conn.commit()
            db.dispose()
        with db.engine.begin() as conn:
            for op_id, status in (("a", "running"), ("b", "succeeded")):
                conn.execute(
                    text(
                        "INSERT INTO operations (id, kind, params, status, total, done, failed,"
                        " created_at) VALUES (:id, 'spawn', '{}', :status, 1, 0, 0,"
                        " '2026-01-01 00:00:00')"
                    ),
                    {"id": op_id, "status": status},
                )
        command.upgrade(alembic_config(url), "head")
        with db.read() as s:
            stamped = {op.id: op.progress_at for op in s.scalars(select(Operation))}
        assert stamped["b"] is None  # finished operations are never re-sent
        assert stamped["a"] is not None  # open ones start their clock at the upgrade, in UTC
        assert abs((stamped["a"] - now()).total_seconds()) < 60
        with db.engine.connect() as conn:
            assert conn.execute(text("SELECT sum(redrives) FROM operations")).scalar() == 0
    finally:
        db.dispose()
