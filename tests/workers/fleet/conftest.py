"""Fixtures for the GPU tests: a real Redis broker with a PostgreSQL store."""

from __future__ import annotations

import pytest

from tests.fixtures import Env


@pytest.fixture
def pg_broker_env(broker_env: Env) -> Env:
    """Settings for real workers: the session's Redis as broker, on PostgreSQL.

    ``broker_env`` on the PostgreSQL store; tests using it are ``@postgres_only``.
    """
    assert not broker_env.db.is_sqlite, "mark the test @postgres_only"
    return broker_env
