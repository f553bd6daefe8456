"""The order the suite runs in: slow tests first, the long ones spread over the xdist workers.

pytest-xdist's ``worksteal`` scheduler (pyproject's ``addopts``) starts by sending each of
its n workers one contiguous share of the collection: the first ``len // n`` tests, the
next a fair part of what is left, and so on. From then on a worker that runs dry gets the
back half of the longest queue. A worker always has the test after its running one queued
already, and no other worker can take that one: a long test queued behind another long
test runs alone at the end. In one run (cis99) the short soak (75 s) was queued behind
the partition run (97 s) and ran by itself for a minute after the three other workers
were done; a third of the two cores sat idle meanwhile.

So the long tests start the run. Each one is marked ``long(seconds)``, the wall time it
takes on the CI machine (two cores, four workers), roughly. :func:`spread_long` deals
them out longest first, each to the share with the fewest seconds of long tests so far,
and puts them at the head of their share; every other test keeps its place in the order.
What is left at the end is short tests, stolen in small pieces.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice
from typing import TypeVar

T = TypeVar("T")


def share_sizes(total: int, workers: int) -> list[int]:
    """The sizes of the first shares ``worksteal`` sends ``workers`` workers of ``total`` tests."""
    sizes: list[int] = []
    left = total
    for i in range(workers):
        size = left // (workers - i)
        sizes.append(size)
        left -= size
    return sizes


def spread_long(items: list[T], workers: int, seconds: Callable[[T], float | None]) -> list[T]:
    """``items`` in an order whose first share for each worker starts with its long tests.

    ``seconds`` gives a long test's wall time and None for any other test.
    """
    if workers < 2:
        return list(items)
    long = sorted(
        ((s, i) for i, s in ((i, seconds(i)) for i in items) if s is not None),
        key=lambda pair: -pair[0],
    )
    marked = {id(item) for _, item in long}
    rest = iter([item for item in items if id(item) not in marked])
    sizes = share_sizes(len(items), workers)
    heads: list[list[T]] = [[] for _ in sizes]
    loads = [0.0] * workers
    for s, item in long:
        room = [k for k in range(workers) if len(heads[k]) < sizes[k]]
        k = min(room, key=lambda k: loads[k])
        heads[k].append(item)
        loads[k] += s
    ordered: list[T] = []
    for head, size in zip(heads, sizes, strict=True):
        ordered.extend(head)
        ordered.extend(islice(rest, size - len(head)))
    return ordered
