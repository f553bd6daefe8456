"""Real Celery workers for tests: in a thread (``celery.contrib.testing``) or as processes.

``broker_env`` switches the test's settings from eager mode to the session's real
Redis broker (results on the same server), on an empty migrated store: SQLite and
PostgreSQL in turn (``store_url`` in ``tests/fixtures.py``).
``thread_worker`` then runs a real worker in this process, consuming every corral
queue; ``worker_processes`` collects :class:`testkit.processes.WorkerProcess` objects
(``corral worker`` as a child process) a test starts, and stops them after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import signals
from celery.contrib.testing.worker import start_worker

from config.celery import QUEUES
from config.settings import get_settings, reset_settings
from testkit.processes import WorkerProcess
from testkit.services import RedisServer
from tests.fixtures import Env, _apply
from workers.base import clock
from workers.celery import app, configure


@pytest.fixture
def broker_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, redis_url: str, store_url: str
) -> Iterator[Env]:
    """Settings for a real broker: Redis from the session server, not eager, on each store."""
    env = _apply(
        Env(monkeypatch, tmp_path),
        store_url,
        migrate=False,  # store_url's store is migrated already
        broker_url=redis_url,
        result_backend=redis_url,
    )
    env.set(eager="0")
    yield env
    env.db.dispose()
    clock.reset()  # a test that moved time must not move the next one's


@contextlib.contextmanager
def shared_broker_env(tmp: Path, store_url: str, redis: RedisServer) -> Iterator[Env]:
    """``broker_env``'s settings for a wider scope than a test (a module's shared parts).

    ``store_url`` must be migrated; Redis is emptied first. Settings are restored after.
    """
    url = redis.emptied()
    with pytest.MonkeyPatch.context() as mp:
        env = _apply(Env(mp, tmp), store_url, migrate=False, broker_url=url, result_backend=url)
        env.set(eager="0")
        try:
            yield env
        finally:
            env.db.dispose()
            clock.reset()
    reset_settings()
    configure(get_settings())


@contextlib.contextmanager
def worker_thread() -> Iterator[None]:
    """A real Celery worker (thread pool) on the broker in force, in this process.

    Its BRPOP timeout is the settings' ``CORRAL_BROKER_POLL_S``, 0.1 s in every test's
    (:data:`testkit.processes.FAST`): a worker's stop waits for its last BRPOP to return.
    """
    with _started_worker():
        yield


@contextlib.contextmanager
def _started_worker() -> Iterator[None]:
    with start_worker(
        app,
        pool="threads",
        concurrency=4,
        perform_ping_check=False,
        loglevel="WARNING",
        shutdown_timeout=10,
        queues=list(QUEUES),
    ) as worker:
        yield
    # The testing worker ends cold, which says nothing: say it ended, as a warm shutdown
    # does (workers.celery: tasks this process runs from now on are no pool's).
    signals.worker_shutdown.send(sender=worker)


@pytest.fixture
def thread_worker(broker_env: Env) -> Iterator[Env]:
    """A real Celery worker (thread pool) on the test broker, in this process."""
    with worker_thread():
        yield broker_env


@pytest.fixture
def worker_processes(broker_env: Env, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """A list to append started :class:`WorkerProcess` objects to; all killed afterwards.

    Killed (:meth:`WorkerProcess.kill`), not stopped warm: the test is over and its broker
    and store are the next test's only once emptied, so a warm stop (seconds: the
    worker's last BRPOP, a prefork pool's children) would wait for nothing. Tests that
    check what a warm stop does stop their workers themselves.
    """
    started: list[WorkerProcess] = []
    yield started
    for worker in started:
        worker.kill()
