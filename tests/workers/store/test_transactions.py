"""Transactions and the task's deadline: none opened past it, no connection outliving its own.

A transaction is refused before it takes a connection once the running task is past its
soft limit; one that ends by any exception - ``BaseException`` included - gives its
connection back (invalidated when the exception may have cut the connection's state
short); PostgreSQL ends a session left idle inside a transaction
(``CORRAL_DB_IDLE_IN_TRANSACTION_TIMEOUT_S``). Counted with the pool's checked-out
connections and PostgreSQL's ``pg_stat_activity``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager as ContextManager

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from testkit.eventually import eventually
from tests.fixtures import Env, postgres_only
from workers import leases, timelimits
from workers.store.db import Database, get_database

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
