"""Transient PostgreSQL errors are retried inside the task, not left to redrive.

PostgreSQL only (``postgres_only``): SQLite has neither row locks to time out on nor
server backends to terminate. The faults are real: a row lock held by another
connection past ``lock_timeout`` (55P03), and the task's own backend ended by
``pg_terminate_backend`` while it waits (57P01, connection lost).
"""

from __future__ import annotations

import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

from corral import api
from testkit.eventually import eventually
from tests.fixtures import Env, StartAgents, postgres_only
from tests.helpers import one_agent, spawn_ok

pytestmark = [postgres_only, pytest.mark.timeout(120)]


def _connect(env: Env) -> psycopg.Connection:
    url = make_url(env.settings.database_url)
    return psycopg.connect(
        host=url.host,
        port=url.port,
        user=url.username,
        dbname=url.database,
        autocommit=True,
        connect_timeout=5,
    )


@pytest.fixture
def worker(thread_worker: Env, start_agents: StartAgents) -> Env:
    """A real worker with a deployed function of one replica and a generous retry budget."""
    one_agent(thread_worker, start_agents, max=10)
    spawn_ok("hello", 1, timeout=30)
    thread_worker.set(retry_max="30", retry_backoff_s="0.05", retry_backoff_max_s="0.2")
    return thread_worker


def _hold_function_lock(env: Env) -> psycopg.Connection:
    """Another session holding the function's row lock (as a long transaction would)."""
    conn = _connect(env)
    conn.execute("BEGIN")
    conn.execute("SELECT id FROM functions WHERE name = 'hello' FOR UPDATE")
    return conn


def test_a_lock_timeout_is_retried_until_the_lock_is_free(
    worker: Env, caplog: pytest.LogCaptureFixture
) -> None:
    with _connect(worker) as admin:
        admin.execute(
            f"ALTER DATABASE {make_url(worker.settings.database_url).database} "
            "SET lock_timeout = '200ms'"
        )
    try:
        # new connections take the database's lock_timeout, and the store's own: 0.2 s
        worker.set(db_lock_timeout_s="0.2")
        worker.db.dispose()
        holder = _hold_function_lock(worker)
        op_id = api.scale("hello", 2)  # plan_scale locks the function row: it times out
        deadline = time.monotonic() + 30
        while "transient database error" not in caplog.text:
            assert time.monotonic() < deadline, "the scale never hit the lock timeout"
            time.sleep(0.05)
        eventually(  # a few more timeouts and retries
            lambda: caplog.text.count("transient database error") >= 3, 30, "three retries"
        )
        holder.execute("COMMIT")
        holder.close()
        view = api.wait(op_id, timeout=30)
    finally:
        with _connect(worker) as admin:
            admin.execute(
                f"ALTER DATABASE {make_url(worker.settings.database_url).database} "
                "RESET lock_timeout"
            )
    assert view["status"] == "succeeded", view
    assert view["redrives"] == 0  # recovered in the task, not by a re-send
    assert "LockNotAvailable" in caplog.text or "lock timeout" in caplog.text


def test_a_terminated_backend_is_retried_on_a_new_connection(
    worker: Env, caplog: pytest.LogCaptureFixture
) -> None:
    holder = _hold_function_lock(worker)
    op_id = api.scale("hello", 2)
    database = make_url(worker.settings.database_url).database
    with _connect(worker) as admin:
        deadline = time.monotonic() + 30
        while True:  # the scale task's backend, waiting for the function's lock
            row = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = "
                "'Lock' AND pid <> %s",
                (database, holder.info.backend_pid),
            ).fetchone()
            if row is not None:
                break
            assert time.monotonic() < deadline, "the scale task never waited for the lock"
            time.sleep(0.05)
        admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
    holder.execute("COMMIT")
    holder.close()
    view = api.wait(op_id, timeout=30)
    assert view["status"] == "succeeded", view
    assert view["redrives"] == 0
    assert "transient database error" in caplog.text
