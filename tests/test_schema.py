"""The store refuses to be used before it is migrated, and says how to fix it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from config.settings import reset_settings
from tasks.cli import main


@pytest.fixture
def fresh_db(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for key in list(os.environ):
        if key.startswith("CORRAL_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CORRAL_DATABASE_URL", f"sqlite:///{tmp_path / 'new.sqlite'}")
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
    assert "migrated empty -> 0001" in capsys.readouterr().out
    assert main(["db", "upgrade"]) == 0
    assert "already at revision 0001" in capsys.readouterr().out
    assert main(["nodes", "list", "--json"]) == 0
    assert capsys.readouterr().out.strip() == "[]"


def test_a_worker_refuses_an_unmigrated_database(fresh_db: Path) -> None:
    from workers.app import _check_schema

    with pytest.raises(SystemExit, match="not migrated"):
        _check_schema()
