"""Transactions and the task's deadline: none opened past it, no connection outliving its own.

A transaction is refused before it takes a connection once the running task is past its
soft limit; one that ends by any exception - ``BaseException`` included - gives its
connection back (invalidated when the exception may have cut the connection's state
short); PostgreSQL ends a session left idle inside a transaction
(``CORRAL_DB_IDLE_IN_TRANSACTION_TIMEOUT_S``). Counted with the pool's checked-out
connections and PostgreSQL's ``pg_stat_activity``.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager as ContextManager

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session

from testkit.eventually import eventually
from tests.fixtures import Env, postgres_only, sqlite_only
from workers import leases
from workers.base import timelimits
from workers.store.db import (
    PG_NETWORK,
    WAY_OUT_S,
    Database,
    TaskBoundPool,
    get_database,
    is_transient,
    network_bounds,
)

IDLE_IN_TRANSACTION = text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND state LIKE 'idle in transaction%'"
)


class Interrupted(BaseException):
    """Not an ``Exception``: what an interrupt or ``SystemExit`` looks like to the store."""


def _checked_out(db: Database) -> int:
    return int(db.engine.pool.checkedout())  # type: ignore[attr-defined]


def _idle_in_transaction(db: Database) -> int:
    if db.is_sqlite:
        return 0
    with db.read() as s:
        return int(s.scalar(IDLE_IN_TRANSACTION) or 0)


def test_many_deadline_expiries_leave_no_connection_checked_out_or_idle_in_a_transaction(
    store_env: Env,
) -> None:
    db = store_env.db

    def busy(n: int) -> None:
        """Take and read a lease until the deadline refuses the next transaction."""
        with timelimits.running(timelimits.Deadline(time.monotonic() + 0.05)):
            while True:
                try:
                    with db.transaction() as s:
                        leases.take(s, f"t{n}", "me", 60)
                    with db.read() as s:
                        leases.first_seen(s, f"t{n}", "me", 60)
                except timelimits.OutOfTime:
                    return

    threads = [threading.Thread(target=busy, args=(n,)) for n in range(8)]
    for _ in range(25):  # 200 deadlines, 8 threads at a time
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        threads = [threading.Thread(target=busy, args=(n,)) for n in range(8)]
    assert _checked_out(db) == 0
    assert _idle_in_transaction(db) == 0


def _raise_inside(opened: Callable[[], ContextManager[Session]], exc: type[BaseException]) -> None:
    with opened() as s:
        s.execute(text("SELECT 1"))
        raise exc("mid-transaction")


@pytest.mark.parametrize("exc", [Interrupted, KeyboardInterrupt, RuntimeError])
def test_a_transaction_ended_by_any_exception_gives_its_connection_back(
    store_env: Env, exc: type[BaseException]
) -> None:
    db = store_env.db
    for opened in (db.transaction, db.read):
        with pytest.raises(exc):
            _raise_inside(opened, exc)
        assert _checked_out(db) == 0
        assert _idle_in_transaction(db) == 0
    with db.transaction() as s:  # and the pool still serves
        assert s.scalar(text("SELECT 1")) == 1


def _abandoned(db: Database) -> Generator[None, None, None]:
    with db.transaction() as s:
        s.execute(text("SELECT 1"))
        yield


def test_a_transaction_in_a_generator_closed_half_way_gives_its_connection_back(
    store_env: Env,
) -> None:
    gen = _abandoned(store_env.db)
    next(gen)
    assert _checked_out(store_env.db) == 1
    gen.close()  # GeneratorExit inside the transaction
    assert _checked_out(store_env.db) == 0
    assert _idle_in_transaction(store_env.db) == 0


@postgres_only  # the server's own guard; SQLite has no sessions to end
def test_postgresql_ends_a_session_left_idle_in_a_transaction(store_env: Env) -> None:
    store_env.set(db_idle_in_transaction_timeout_s="0.5")
    db = get_database(store_env.settings.database_url)
    db.dispose()  # new connections carry the new setting
    session = db.session()
    pid = session.scalar(text("SELECT pg_backend_pid()"))  # opens a transaction; then stalls

    def gone() -> bool:
        with db.read() as s:
            found = s.scalar(
                text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
            )
        return bool(found == 0)

    try:
        eventually(gone, 10, "the server to end the session idle in its transaction")
        with pytest.raises(DBAPIError):  # its session is gone
            session.execute(text("SELECT 1"))
    finally:
        session.close()
    db.dispose()


# -- no wait outlasts the task: timeouts cut to the time left before its hard limit -----------

HARD_S = 2.0  # the task's hard limit, from now
LONG_S = 30.0  # the store's own lock timeout (and SQLite's busy timeout): past the hard limit


def _in_a_task_of(hard_s: float, body: Callable[[], object]) -> BaseException | None:
    """Run ``body`` in a thread as a task whose hard limit is ``hard_s`` away; what it raised.

    A body still waiting long after the hard limit (the thread not done in 15 s) fails.
    """
    raised: list[BaseException] = []

    def run() -> None:
        start = time.monotonic()
        deadline = timelimits.Deadline(start + hard_s / 2, hard_at=start + hard_s)
        with timelimits.running(deadline):
            try:
                body()
            except BaseException as exc:  # handed to the test
                raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(15)
    assert not thread.is_alive(), "a wait in the store outlasted the task's hard limit"
    return raised[0] if raised else None


@postgres_only  # a row lock (SQLite's write lock: below)
def test_a_lock_wait_in_a_task_ends_before_its_hard_limit(store_env: Env) -> None:
    store_env.set(db_lock_timeout_s=str(LONG_S))
    db = store_env.db
    with db.transaction() as s:
        leases.take(s, "held", "holder", 60)
    holder = db.engine.connect()
    try:
        holder.execute(text("SELECT 1 FROM leases WHERE name = 'held' FOR UPDATE"))

        def wait_for_the_row() -> None:
            with db.transaction() as s:
                s.execute(text("SELECT 1 FROM leases WHERE name = 'held' FOR UPDATE"))

        exc = _in_a_task_of(HARD_S, wait_for_the_row)
    finally:
        holder.rollback()
        holder.close()
    assert isinstance(exc, DBAPIError) and is_transient(exc), exc  # retried by the task base
    with db.transaction() as s:  # outside a task: the store's own timeouts again
        assert s.scalar(text("SHOW lock_timeout")) == "30s"


@postgres_only
def test_a_transaction_in_a_task_runs_under_the_time_left(store_env: Env) -> None:
    store_env.set(db_lock_timeout_s=str(LONG_S))
    shown: list[tuple[str, str]] = []

    def show() -> None:
        with store_env.db.read() as s:
            timeouts = s.execute(
                text("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
            ).one()
            shown.append((str(timeouts[0]), str(timeouts[1])))

    assert _in_a_task_of(HARD_S, show) is None
    ((statement, lock),) = shown
    assert statement == lock and statement.endswith("ms"), shown  # both cut to the time left
    assert 0 < int(statement.removesuffix("ms")) <= (HARD_S - WAY_OUT_S) * 1000


@postgres_only
def test_a_connection_a_task_takes_waits_on_the_network_only_its_time_left(
    store_env: Env,
) -> None:
    # A store cut off mid-transaction (unanswered sends) fails a connection after libpq's
    # TCP_USER_TIMEOUT, 10 s: a task with less left was killed at its hard limit first (a
    # worker recording landed VMs, in the partition run). Inside a task the socket's
    # timeout is cut to the time left; outside one it is PG_NETWORK's again.
    db = store_env.db

    def user_timeout_ms() -> int:
        with db.read() as s:
            fd = s.connection().connection.dbapi_connection.fileno()  # type: ignore[union-attr]
            with socket.socket(fileno=os.dup(fd)) as sock:
                return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)

    before = user_timeout_ms()
    seen: list[int] = []
    assert _in_a_task_of(HARD_S, lambda: seen.append(user_timeout_ms())) is None
    assert before == PG_NETWORK["tcp_user_timeout"]
    assert 0 < seen[0] <= (HARD_S - WAY_OUT_S) * 1000 < before
    assert user_timeout_ms() == PG_NETWORK["tcp_user_timeout"]  # the same pooled connection
    start = time.monotonic()
    with timelimits.running(timelimits.Deadline(start + 1, hard_at=start + HARD_S)):
        assert network_bounds()[0] == 2  # libpq's connect_timeout: 2 s at least
    assert network_bounds() == (PG_NETWORK["connect_timeout"], PG_NETWORK["tcp_user_timeout"])


@postgres_only
def test_a_task_waits_for_a_free_pooled_connection_only_its_time_left(store_env: Env) -> None:
    # Every connection of the pool taken (threads stuck connecting to a store cut off):
    # the pool's own wait is 30 s, past a task's hard limit.
    db = store_env.db
    pool = db.engine.pool
    assert isinstance(pool, TaskBoundPool)
    held = [db.engine.connect() for _ in range(pool.size() + 10)]  # pool_size + max_overflow

    def read() -> None:
        with db.read() as s:
            s.scalar(text("SELECT 1"))

    try:
        started = time.monotonic()
        exc = _in_a_task_of(HARD_S, read)
        assert isinstance(exc, PoolTimeout) and is_transient(exc), exc  # retried by the task
        assert time.monotonic() - started < HARD_S + 1
    finally:
        for conn in held:
            conn.close()
    with db.read() as s:  # outside a task, with connections free again: as before
        assert s.scalar(text("SELECT 1")) == 1
    assert pool.timeout() == 30


@sqlite_only  # SQLite's one write lock, held by another connection past the hard limit
def test_a_sqlite_transaction_in_a_task_waits_for_the_write_lock_only_its_time_left(
    store_env: Env,
) -> None:
    db = store_env.db
    holder = sqlite3.connect(db.url.removeprefix("sqlite:///"), isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")

        def write() -> None:
            with db.transaction() as s:
                leases.take(s, "written", "me", 60)

        exc = _in_a_task_of(HARD_S, write)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert isinstance(exc, DBAPIError) and is_transient(exc), exc
    with db.transaction() as s:  # outside a task: waits as long as before
        leases.take(s, "written", "me", 60)
