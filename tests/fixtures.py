"""Fixtures for corral's own tests: settings, a migrated store, agents on loopback.

Store parity: every test that touches the store runs on SQLite *and* PostgreSQL.
``store_url`` is parametrized over :data:`STORES`, and the environment fixtures
build on it, so a test that asks for one of them runs twice, as
``test_x[sqlite]`` and ``test_x[postgres]``:

* ``corral_env`` - eager Celery on the store (``store_env`` is the same fixture);
* ``broker_env`` / ``thread_worker`` / ``worker_processes``
  (``tests/celery_workers.py``) - the session's Redis and real workers on it.

SQLite is a fresh file per test (a copy of one migrated at the start of the
session), always at the same path in a process (``sqlite_path``), so the process's
engine - and the statements it has compiled - serves every test. PostgreSQL is the
session's server (started once, ``tests/services.py``) with one migrated database per
test module (``pg_module_url``: a copy of one migrated at the start of the session),
emptied (``DELETE``) before each test: no per-test ``CREATE DATABASE`` or migration.
Nothing to do to adopt it: request ``corral_env`` (or ``broker_env``...) as before.
Select one store with ``-k sqlite`` / ``-k postgres``, or ``-m postgres``.

A test that is inherently single-store says so with a decorator and a comment
saying why::

    @sqlite_only  # corrupts the SQLite file by hand
    def test_x(corral_env: Env) -> None: ...

(:data:`sqlite_only` / :data:`postgres_only` override the parametrization.)
``pg_env`` keeps a fresh PostgreSQL database of its own per test, for tests that
need one (several processes racing, a server restart).

``start_agents`` starts reference fcdaemon agents (memory driver) on loopback and
registers them as nodes.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text

from agents.fcdaemon import RunningAgent, serve_fcdaemon
from config.settings import Settings, get_settings, reset_settings
from testkit.processes import FAST
from workers.backends import inflight
from workers.base import clock
from workers.celery import configure
from workers.fleet.nodes import upsert_node
from workers.store.db import Database, get_database
from workers.store.migrate import upgrade
from workers.store.models import Base, Node

# Eager tests need no broker, and must not write to a Redis someone runs on the default
# port (a developer's, or another suite's `corral up`): nothing listens on port 1.
NO_BROKER = "redis://127.0.0.1:1/0"


class Env:
    """Applies ``CORRAL_*`` variables for one test and rebuilds settings and the app."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp: Path) -> None:
        self._mp = monkeypatch
        self.tmp = tmp
        for key in list(os.environ):
            if key.startswith("CORRAL_"):
                monkeypatch.delenv(key)
        monkeypatch.setenv("CORRAL_STATE_DIR", str(tmp / "state"))

    def set(self, **values: Any) -> Settings:
        """Set variables (``database_url=...``) and return the new settings."""
        for key, value in values.items():
            self._mp.setenv("CORRAL_" + key.upper(), str(value))
        reset_settings()
        settings = get_settings()
        configure(settings)
        return settings

    @property
    def settings(self) -> Settings:
        """The settings in force."""
        return get_settings()

    @property
    def db(self) -> Database:
        """The store in force."""
        return get_database(get_settings().database_url)


# Eager tests' calls to an agent wait this long: FAST's 2 s was met by agents in the test's
# own process starved of the CPU (two suites side by side), and a create past its deadline
# is a transient failure, retried or a maybe. Tests of a deadline set their own (0.1-0.5
# s); worker processes, and the tests that drive them, keep FAST's.
EAGER_CALLS: dict[str, Any] = {"create_timeout_s": "5", "rpc_timeout_s": "5"}


def _apply(env: Env, url: str, *, migrate: bool = True, **extra: Any) -> Env:
    base = {k[len("CORRAL_") :].lower(): v for k, v in FAST.items()}
    env.set(**{**base, "broker_url": NO_BROKER, "database_url": url, "eager": "1", **extra})
    if migrate:
        upgrade(env.db)
    return env


STORES = ("sqlite", "postgres")
# Decorators for the few tests that are inherently single-store (say why next to each).
sqlite_only = pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
postgres_only = pytest.mark.parametrize("store_url", ["postgres"], indirect=True)


@pytest.fixture(scope="session")
def pg_template(postgres_server: Any) -> str:
    """The name of a migrated, empty PostgreSQL database, made once; module databases are
    copies of it (``CREATE DATABASE ... TEMPLATE``: a file copy, where migrating runs every
    revision's DDL)."""
    name = f"corral_t_{uuid.uuid4().hex[:16]}"
    db = get_database(postgres_server.create_database(name))
    upgrade(db)
    db.dispose()  # a template with a connection open cannot be copied
    return name


@pytest.fixture(scope="module")
def pg_module_url(postgres_server: Any, pg_template: str) -> Iterator[str]:
    """One migrated PostgreSQL database for the test module (a copy of the session's
    template), dropped after it."""
    name = f"corral_m_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name, template=pg_template)
    try:
        yield url
    finally:
        get_database(url).dispose()
        if postgres_server.is_running():
            postgres_server.drop_database(name)


def emptied(url: str) -> None:
    """Empty every corral table of a PostgreSQL database (the schema and its version stay).

    ``DELETE``, children first: a test leaves a few rows, and ``TRUNCATE`` makes every
    table's files anew (60 ms, against 2). Connections a previous test left open, whose
    locks would hold it up, are ended first.
    """
    db = get_database(url)
    db.dispose()
    with db.engine.connect() as conn:
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        )
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
        conn.commit()
    db.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty SQLite file, made once; each test gets a copy (migrating costs more)."""
    path = tmp_path_factory.mktemp("sqlite-template") / "corral.sqlite"
    db = Database(f"sqlite:///{path}")
    upgrade(db)
    db.dispose()  # the last connection to close checkpoints the WAL into the file
    return path


@pytest.fixture(params=STORES)
def store_url(request: pytest.FixtureRequest) -> str:
    """The URL of an empty, migrated store: a fresh SQLite file, or this module's PostgreSQL.

    Parametrized: a test that uses it (through ``corral_env``, ``broker_env``...) runs
    once per store.
    """
    return fresh_store(request, request.param)


@pytest.fixture(scope="session")
def sqlite_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where this process's tests keep their SQLite store: one path, so one engine (and the
    statements it has compiled) serves them all (:meth:`Database.engine`)."""
    return tmp_path_factory.mktemp("sqlite-store") / "corral.sqlite"


def refill_sqlite(path: Path, template: Path) -> str:
    """Make ``path`` a fresh copy of ``template``; its URL.

    The old files are unlinked, not written over: a connection still open on them (a
    process of the last test not yet gone) keeps its own files and never sees the new ones.
    """
    url = f"sqlite:///{path}"
    get_database(url).dispose()
    for old in (path, *(path.with_name(path.name + end) for end in ("-wal", "-shm", "-journal"))):
        old.unlink(missing_ok=True)
    fresh = path.with_name(path.name + ".new")
    shutil.copyfile(template, fresh)
    fresh.rename(path)
    return url


def fresh_store(request: pytest.FixtureRequest, store: str) -> str:
    """The URL of an empty, migrated ``store`` (``sqlite`` or ``postgres``) for one test."""
    if store == "sqlite":
        return refill_sqlite(
            request.getfixturevalue("sqlite_path"), request.getfixturevalue("sqlite_template")
        )
    postgres_server = request.getfixturevalue("postgres_server")
    if not postgres_server.is_running():  # a previous test may have stopped it
        postgres_server.start()
    url: str = request.getfixturevalue("pg_module_url")
    emptied(url)
    return url


@pytest.fixture
def corral_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, store_url: str) -> Iterator[Env]:
    """Eager Celery on an empty, migrated store: SQLite and PostgreSQL in turn."""
    env = _apply(Env(monkeypatch, tmp_path), store_url, migrate=False, **EAGER_CALLS)
    yield env
    env.db.dispose()
    clock.reset()
    reset_settings()
    configure(get_settings())


@pytest.fixture
def store_env(corral_env: Env) -> Env:
    """The same as ``corral_env`` (a name that says the test runs on both stores)."""
    return corral_env


@pytest.fixture
def pg_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pg_url: str) -> Iterator[Env]:
    """Eager Celery on a fresh, migrated PostgreSQL database."""
    env = _apply(Env(monkeypatch, tmp_path), pg_url, **EAGER_CALLS)
    yield env
    env.db.dispose()
    clock.reset()
    reset_settings()
    configure(get_settings())


StartAgents = Callable[..., list[RunningAgent]]


def _wait_for_nodes(db: Database, addresses: set[str], timeout: float = 15.0) -> None:
    """Wait until a node row exists for each of ``addresses`` (agents registering)."""
    deadline = time.monotonic() + timeout
    while True:
        with db.read() as s:
            if addresses <= set(s.scalars(select(Node.address))):
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"agents at {sorted(addresses)} did not register")
        time.sleep(0.05)


@pytest.fixture
def start_agents() -> Iterator[StartAgents]:
    """Start reference fcdaemon agents on loopback and register each as a node.

    Nodes are written to the store of the settings in force, so request an
    environment fixture (``corral_env``, ``broker_env``...) first.
    """
    started: list[RunningAgent] = []

    def start(
        n: int = 1,
        *,
        capacity: int = 64,
        env: Env | None = None,
        seed_only: bool = False,
        registry: str | None = None,
    ) -> list[RunningAgent]:
        """``seed_only``: agents without corral's extensions; ``registry``: report READY."""
        db = env.db if env is not None else get_database(get_settings().database_url)
        batch = [
            serve_fcdaemon(
                "127.0.0.1:0", seed_only=seed_only, registry=registry, advertise_ip="127.0.0.1"
            )
            for _ in range(n)
        ]
        started.extend(batch)
        if registry:  # each agent registers itself (RegisterNode): wait until all have
            _wait_for_nodes(db, {agent.address for agent in batch})
            return batch
        with db.transaction() as s:
            for i, agent in enumerate(batch, start=len(started) - n + 1):
                upsert_node(s, agent.address, name=f"node{i}", capacity=capacity)
        return batch

    yield start
    for agent in started:
        agent.stop(grace=0)
    # A later test's agent may get one of these ports again: a channel cached here
    # would still sit in reconnect backoff (up to 2 s) and refuse its first calls.
    inflight.reset()
