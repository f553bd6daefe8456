"""Shared fixtures: real services (tests.services) plus a migrated store and the Celery app.

Tests that start a broker, worker processes or a whole stack are marked ``slow`` here, by
the fixtures they use, so the fast local loop (``nox -s fast``) can leave them out. Slow
tests also run first, and the ``long`` ones head the xdist workers' runs (tests.order), so
that the workers share out the short ones at the end and no long test is left to run alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.result import allow_join_result

from tests import requirements

pytest_plugins = ["tests.services", "tests.fixtures", "tests.celery_workers", "tests.order"]

SLOW_FIXTURES = frozenset({"broker_env", "thread_worker", "worker_processes"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that need a broker, worker processes or a whole stack as ``slow``.

    Before ``-m`` deselects (this conftest's hook runs before pytest's own); the order
    they run in is set once the selection is made (tests.order).
    """
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or item.nodeid.startswith("tests/stack/"):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip or fail a test whose ``needs`` are unmet (tests.requirements)."""
    requirements.check(item)


#: This process's network namespace (its main thread's, as the tests start).
HOME_NETNS = os.stat("/proc/thread-self/ns/net").st_ino


def threads_elsewhere() -> list[str]:
    """Threads of this process in another network namespace than it started in (name, tid)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            if os.stat(task / "ns" / "net").st_ino != HOME_NETNS:
                name = names.get(int(task.name)) or (task / "comm").read_text().strip()
                out.append(f"{name} ({task.name})")
        except OSError:  # the thread ended meanwhile
            continue
    return out


@pytest.fixture(autouse=True)
def _joins_allowed() -> Iterator[None]:
    """Start each test with Celery's "inside a task" flag down.

    Celery keeps "a ``.get()`` here would block a worker" in one flag for the whole process.
    Each eager ``apply_async`` raises it and puts back what it found, so threads applying
    eagerly at once (cold starts from a gateway's threads, a registry's sweep) can leave it
    raised once they are all done; every later ``.get()`` in the process then fails with
    "Never call result.get() within a task!" (cis121: a test with no fixture of its own,
    in an xdist worker that had run such a test before).
    """
    with allow_join_result():
        yield


_REPORTED: set[str] = set()  # threads a test was failed for already


@pytest.fixture(autouse=True)
def _no_thread_left_in_a_namespace() -> Iterator[None]:
    """Fail the test that leaves a thread in another network namespace once its fixtures end.

    A thread started inside a test's namespace (``testkit.netns``) stays there: a gRPC or
    HTTP client running on it would reach that namespace's loopback, not this one's, and
    a later test's agents would refuse it.
    """
    yield
    left = [t for t in threads_elsewhere() if t not in _REPORTED]
    _REPORTED.update(left)  # the test that left them fails, not every later one
    assert not left, f"threads left in another network namespace: {left}"
