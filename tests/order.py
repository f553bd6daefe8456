"""The order the suite's tests are handed to xdist's workers.

``--dist worksteal`` gives each of the ``-n`` workers one contiguous run of the collected
tests to start with, in order, and later moves tests from the *end* of a busy worker's run
to an idle one. A test at the head of a run therefore stays where it is, and a long test
that lands behind others is run late by the worker it was given to, alone at the end
while the others have stopped (cis628: the two longest fault runs, 113 s and 73 s, were
next to each other in one worker's run, which ended 45 s after the other three).

So: tests that start worker processes or whole stacks (``slow``) come before the rest,
as before, and the few that run for tens of seconds (``@pytest.mark.long(SECONDS)``, about
how long one runs on the CI machine) are dealt out to the heads of the runs, longest first,
each to the run whose head is shortest so far: each worker starts on its share of them,
and what is moved at the end are the short ones. Elsewhere the collected order (modules
together, for their fixtures) is kept. The order is made of what ``-k`` and ``-m`` left
(the hook runs last), so that the runs it plans are the runs xdist deals.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TypeVar

import pytest

from testkit.mutation import kill_order

_T = TypeVar("_T")


def run_sizes(total: int, workers: int) -> list[int]:
    """The length of each worker's first run of ``total`` tests, as worksteal deals them."""
    sizes = []
    left = total
    for i in range(workers):
        sizes.append(left // (workers - i))
        left -= sizes[-1]
    return sizes


def dealt(items: Sequence[_T], workers: int, seconds: Callable[[_T], float]) -> list[_T]:
    """``items`` reordered so that the long ones (``seconds`` > 0) head the workers' runs."""
    longs = sorted((item for item in items if seconds(item) > 0), key=seconds, reverse=True)
    rest = [item for item in items if seconds(item) <= 0]
    if workers < 2 or not longs:
        return [*longs, *rest]
    sizes = run_sizes(len(items), workers)
    heads: list[list[_T]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for item in longs:
        k = loads.index(min(loads))
        heads[k].append(item)
        loads[k] += seconds(item)
    out: list[_T] = []
    taken = 0
    for size, head in zip(sizes, heads, strict=True):
        fill = max(0, size - len(head))
        out += head + rest[taken : taken + fill]
        taken += fill
    return out + rest[taken:]


def _long_seconds(item: pytest.Item) -> float:
    """How long a ``@pytest.mark.long(SECONDS)`` test runs; 0 for the others."""
    mark = item.get_closest_marker("long")
    return float(mark.args[0]) if mark is not None else 0.0


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the ``slow`` tests first, the ``long`` ones at the heads of the workers' runs."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = dealt(items, workers, _long_seconds)
    kill_order(items)  # under mutmut: a mutant's likeliest killers first
