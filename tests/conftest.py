"""Shared fixtures: real services (tests.services) plus a migrated store and the Celery app.

Tests that start a broker, worker processes or a whole stack are marked ``slow`` here, by
the fixtures they use, so the fast local loop (``nox -s fast``) can leave them out.

Order: the longest tests run first, so that no long one is left to run alone at the end
while the other xdist workers wait. Slow tests come before the others, and among each,
the tests with a longer ``timeout`` marker (a test's own bound on its length) first. The
scheduler (``--dist load`` in pyproject's addopts: :class:`OneTestAtATime`) hands out
the tests one at a time in this order to whichever worker is free, so the short tests at
the end fill the gaps; the modules of :data:`SHARED_SERVER_MODULES` go whole to one worker.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from tests import requirements

pytest_plugins = ["tests.services", "tests.fixtures", "tests.celery_workers"]

SLOW_FIXTURES = frozenset({"broker_env", "thread_worker", "worker_processes"})


def _bound(item: pytest.Item) -> float:
    """The test's own ``timeout`` marker in seconds (0 without one): how long it may take."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
    return float(value or 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that need a broker, worker processes or a whole stack as ``slow``; run
    them first, the longest bounds first."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SLOW_FIXTURES or item.nodeid.startswith("tests/stack/"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -_bound(item)))


#: Modules whose tests share servers a module-scoped fixture starts (seconds each): one
#: xdist worker runs each of them whole, so the servers start once, not on every worker.
SHARED_SERVER_MODULES = frozenset({"tests/workers/gateway/test_hostile_answers.py"})


class OneTestAtATime(LoadScopeScheduling):  # type: ignore[misc]  # xdist: no type hints here
    """xdist's ``loadscope`` with each test a unit of its own (a module of
    :data:`SHARED_SERVER_MODULES` one unit): a free worker gets the next test in
    collection order, the longest first (:func:`pytest_collection_modifyitems`)."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if module in SHARED_SERVER_MODULES else nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> OneTestAtATime | None:
    """``--dist load`` (pyproject's addopts) is :class:`OneTestAtATime`; other modes are xdist's."""
    return OneTestAtATime(config, log) if config.getvalue("dist") == "load" else None


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
