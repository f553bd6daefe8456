"""Fixtures for the GPU tests: a real Redis broker with a PostgreSQL store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from config.settings import get_settings, reset_settings
from tests.fixtures import Env, _apply
from workers import clock
from workers.app import configure


@pytest.fixture
def pg_broker_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str, pg_url: str
) -> Iterator[Env]:
    """Settings for real workers: the session's Redis as broker, a fresh PostgreSQL store."""
    env = _apply(Env(monkeypatch, tmp_path), pg_url, broker_url=redis_url,
                 result_backend=redis_url)
    env.set(eager="0")
    yield env
    env.db.dispose()
    clock.reset()
    reset_settings()
    configure(get_settings())
