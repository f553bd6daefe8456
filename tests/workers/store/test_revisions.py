"""The schema check without Alembic: the head read from the revision files, the database's row."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from tests.fixtures import Env
from workers.base.errors import SchemaError
from workers.store import revisions
from workers.store.db import Database
from workers.store.migrate import alembic_config, upgrade


def test_the_head_read_from_the_files_is_alembics() -> None:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert revisions.head_revision() == head
    chain = revisions.revisions()
    assert chain["0001"] is None and len(chain) >= 6


def test_a_migrated_store_is_at_the_head(corral_env: Env) -> None:
    assert revisions.current_revision(corral_env.db) == revisions.head_revision()
    revisions.check_schema(corral_env.db)  # nothing raised


def test_an_unmigrated_database_is_refused_until_upgraded(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'fresh.sqlite'}")
    try:
        assert revisions.current_revision(db) is None
        with pytest.raises(SchemaError, match=r"is not migrated: run `corral db upgrade`"):
            revisions.check_schema(db)
        assert upgrade(db) == (None, revisions.head_revision())
        revisions.check_schema(db)
    finally:
        db.dispose()


def _versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **files: str) -> None:
    (tmp_path / "versions").mkdir()
    for name, text in files.items():
        (tmp_path / "versions" / f"{name}.py").write_text(text)
    monkeypatch.setattr(revisions, "MIGRATIONS", tmp_path)


def test_either_quote_style_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _versions(
        tmp_path,
        monkeypatch,
        a='"""one"""\nrevision, down_revision = \'0001\', None\n',
        b='"""two"""\n\nrevision, down_revision = "0002", "0001"\n',
    )
    assert revisions.revisions() == {"0001": None, "0002": "0001"}
    assert revisions.head_revision() == "0002"


def test_a_file_without_its_line_or_two_heads_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _versions(
        tmp_path,
        monkeypatch,
        a='revision, down_revision = "0001", None\n',
        b='revision, down_revision = "0002", "0001"\n',
        c='revision, down_revision = "0003", "0001"\n',
    )
    with pytest.raises(SchemaError, match=r"one head, found \['0002', '0003'\]"):
        revisions.head_revision()
    (tmp_path / "versions" / "d.py").write_text("revision = '0004'\n")
    with pytest.raises(SchemaError, match=r"d\.py: no `revision, down_revision"):
        revisions.revisions()
