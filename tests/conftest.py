"""Shared fixtures: real services (tests.services) plus a migrated store and the Celery app.

Tests that start a broker, worker processes or a whole stack are marked ``slow`` here, by
the fixtures they use, so the fast local loop (``nox -s fast``) can leave them out. Slow
tests also run first: the xdist workers (``-n``) start on the long ones and share out the
short ones at the end, so that no long test is left to run alone while the other waits.
"""

from __future__ import annotations

import pytest

from tests import requirements

pytest_plugins = ["tests.services", "tests.fixtures", "tests.celery_workers"]

SLOW_FIXTURES = frozenset({"broker_env", "thread_worker", "worker_processes"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that need a broker, worker processes or a whole stack as ``slow``; run
    them first."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or item.nodeid.startswith("tests/stack/"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip or fail a test whose ``needs`` are unmet (tests.requirements)."""
    requirements.check(item)
