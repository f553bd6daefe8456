"""The suite's order: each xdist worker's first share starts with its part of the long tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from xdist.scheduler.worksteal import WorkStealingScheduling

from tests.ordering import share_sizes, spread_long


@dataclass
class _Gateway:
    id: str


@dataclass(eq=False)  # hashed by identity, as the real ones
class _Worker:
    """What the scheduler uses of an xdist worker: it records the tests sent to it."""

    gateway: _Gateway
    shutting_down: bool = False
    sent: list[int] = field(default_factory=list)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.extend(indices)


class _Config:
    def __init__(self, workers: int) -> None:
        self.workers = workers

    def getvalue(self, name: str) -> Any:
        assert name == "tx"
        return [f"{self.workers}*popen"]


def _first_shares(collection: list[str], workers: int) -> list[list[str]]:
    """What pytest-xdist's own ``worksteal`` scheduler sends each worker first."""
    sched = WorkStealingScheduling(_Config(workers))
    nodes = [_Worker(_Gateway(f"gw{i}")) for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [[collection[i] for i in node.sent] for node in nodes]


@pytest.mark.parametrize(("total", "workers"), [(2234, 4), (10, 4), (7, 3), (5, 2)])
def test_the_share_sizes_are_the_ones_xdist_sends(total: int, workers: int) -> None:
    shares = _first_shares([f"t{i}" for i in range(total)], workers)
    assert [len(s) for s in shares] == share_sizes(total, workers)
    assert sum(share_sizes(total, workers)) == total


LONG = {"soak": 75.0, "partition": 95.0, "corral_up": 70.0, "cut": 35.0, "keep": 30.0}


def test_each_worker_starts_on_long_tests_the_longest_apart() -> None:
    names = [f"t{i}" for i in range(40)]
    names[3:3] = ["soak", "partition"]  # queued one behind the other, as in cis99
    names[30:30] = ["corral_up", "cut", "keep"]
    shares = _first_shares(spread_long(names, 4, LONG.get), 4)
    heads = [share[0] for share in shares]
    assert sorted(heads) == ["corral_up", "cut", "partition", "soak"]  # one apiece
    # the fifth goes behind the least of the four
    assert next(s for s in shares if s[0] == "cut")[1] == "keep"


def test_the_other_tests_keep_their_order_and_none_is_lost() -> None:
    names = [f"t{i}" for i in range(21)]
    names[5:5] = list(LONG)
    ordered = spread_long(names, 4, LONG.get)
    assert sorted(ordered) == sorted(names)
    assert [n for n in ordered if n not in LONG] == [n for n in names if n not in LONG]


def test_one_worker_runs_the_collection_as_it_is() -> None:
    names = ["a", "soak", "b", "partition"]
    assert spread_long(names, 1, LONG.get) == names


def test_a_long_test_goes_to_the_least_loaded_share_with_room() -> None:
    long = {"partition": 95.0, "cut": 35.0, "keep": 30.0, "warm": 30.0}
    ordered = spread_long(["cut", "keep", "partition", "warm"], 2, long.get)  # two shares of two
    # warm would go with cut and keep (65 s against 95 s), but that share is full
    assert _first_shares(ordered, 2) == [["partition", "warm"], ["cut", "keep"]]
