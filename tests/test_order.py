"""The long tests head the runs xdist's worksteal scheduler deals its workers first."""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler.worksteal import WorkStealingScheduling

from tests.order import dealt, run_sizes

SECONDS = {"up": 110.0, "partition": 110.0, "soak": 70.0, "cut": 35.0, "keep": 30.0, "hard": 25.0}


def _seconds(name: str) -> float:
    return SECONDS.get(name, 0.0)


class _Node:
    """What the scheduler sends a worker: the indices of its first run."""

    def __init__(self, n: int) -> None:
        self.gateway = type("Gateway", (), {"id": f"gw{n}"})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:  # a worker given nothing is told to end
        self.shutting_down = True


class _Config:
    """The options the scheduler reads: ``-n WORKERS``, as xdist passes it on (``--tx``)."""

    def __init__(self, workers: int) -> None:
        self.tx = [f"{workers}*popen"]

    def getvalue(self, name: str) -> Any:
        return getattr(self, name)


def _first_runs(collection: list[str], workers: int) -> list[list[str]]:
    """The tests xdist's own worksteal scheduler gives each of ``workers`` first, in order."""
    sched = WorkStealingScheduling(_Config(workers))
    assert sched.numnodes == workers
    nodes = [_Node(n) for n in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [[collection[i] for i in node.sent] for node in nodes]


@pytest.mark.parametrize(("total", "workers"), [(10, 4), (2281, 4), (7, 3), (3, 4), (5, 1)])
def test_run_sizes_are_the_runs_xdist_deals(total: int, workers: int) -> None:
    runs = _first_runs([f"t{i}" for i in range(total)], workers)
    assert [len(run) for run in runs] == run_sizes(total, workers)


def test_each_worker_starts_on_its_share_of_the_long_tests() -> None:
    collection = [f"a{i}" for i in range(20)] + list(SECONDS) + [f"b{i}" for i in range(30)]
    runs = _first_runs(dealt(collection, 4, _seconds), 4)
    heads: list[Any] = [[t for t in run if t in SECONDS] for run in runs]
    for run, head in zip(runs, heads, strict=True):
        assert run[: len(head)] == head  # the long ones first in the run
    # longest first, each to the lightest run: 110 | 110 | 70 | 35+30+25
    assert sorted(heads, key=len) == [["up"], ["partition"], ["soak"], ["cut", "keep", "hard"]]
    shorts = [t for run in runs for t in run if t not in SECONDS]
    assert shorts == [t for t in collection if t not in SECONDS]  # the rest keep their order


def test_one_worker_runs_the_long_tests_first_longest_first() -> None:
    order = dealt(["x", "hard", "y", "up", "soak"], 1, _seconds)
    assert order == ["up", "soak", "hard", "x", "y"]


def test_more_long_tests_than_a_run_holds_are_all_still_dealt() -> None:
    collection = ["up", "partition", "soak", "cut", "keep", "hard", "x"]
    order = dealt(collection, 4, _seconds)
    assert sorted(order) == sorted(collection)
