"""The suite's order (testkit.ordering): even ranges for xdist's worksteal, names as JUnit's."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from xdist.scheduler import WorkStealingScheduling

from testkit import ordering


@dataclass(eq=False)
class _Node:
    """What worksteal asks of a worker: the test indices it was sent."""

    name: str
    sent: list[int] = field(default_factory=list)
    shutting_down: bool = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    @property
    def gateway(self) -> Any:
        return SimpleNamespace(id=self.name)


def _first_ranges(count: int, workers: int) -> list[list[int]]:
    """The test indices xdist's worksteal scheduler hands each worker at the start."""
    config: Any = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"])
    sched = WorkStealingScheduling(config)
    nodes = [_Node(f"gw{i}") for i in range(workers)]
    collection = [f"t{i}" for i in range(count)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collection)
    sched.schedule()
    return [node.sent for node in nodes]


@pytest.mark.parametrize(("count", "workers"), [(2230, 4), (10, 4), (7, 3), (5, 1)])
def test_range_sizes_are_the_ones_worksteal_hands_out(count: int, workers: int) -> None:
    ranges = _first_ranges(count, workers)
    assert [len(r) for r in ranges] == ordering.range_sizes(count, workers)
    assert [i for r in ranges for i in r] == list(range(count))  # contiguous, in order


def test_each_range_gets_an_even_share_of_the_long_tests() -> None:
    weights = [100.0, 80.0, 67.0, 32.0, 27.0, 27.0, 23.0, 20.0] + [0.1] * 40 + [3.0] * 20
    order = ordering.deal(weights, 4)
    assert sorted(order) == list(range(len(weights)))  # every test, once
    loads = []
    for members in _first_ranges(len(order), 4):
        ran = [order[i] for i in members]
        loads.append(sum(weights[i] for i in ran))
        assert weights[ran[0]] >= 20  # every worker starts on one of the longest
        # its long tests first, then its short ones; each part in collection order
        long_ = [i for i in ran if weights[i] >= ordering.LONG_S]
        assert ran == long_ + [i for i in ran if weights[i] < ordering.LONG_S]
        assert long_ == sorted(long_)
    assert max(loads) - min(loads) <= 20.0  # 109-111 s each; in collection order 2-377 s


def test_one_worker_runs_the_long_tests_first_and_keeps_the_rest_in_order() -> None:
    weights = [0.1, 5.0, 0.2, 9.0, 0.1]
    assert ordering.deal(weights, 1) == [1, 3, 0, 2, 4]
    with pytest.raises(ValueError, match="at least 1"):
        ordering.deal(weights, 0)


def test_junit_names_map_to_node_ids_and_short_tests_are_left_out(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "test_x.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_slow(n): time.sleep(0.5 + 0.1 * n)\n"
        "class TestC:\n"
        "    def test_m(self): time.sleep(0.6)\n"
        "def test_quick(): pass\n"
    )
    report, out = tmp_path / "report.xml", tmp_path / "durations.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:randomly",
         "-p", "no:cacheprovider", f"--junitxml={report}", "pkg"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert ordering.main([str(report), "--out", str(out)]) == 0
    durations = json.loads(out.read_text())
    assert set(durations) == {
        ordering.key("pkg/test_x.py::test_slow[1]"),
        ordering.key("pkg/test_x.py::TestC::test_m"),
    }
    assert durations[ordering.key("pkg/test_x.py::test_slow[2]")] >= 0.6  # the mean of both
    assert ordering.load(out) == durations
    assert ordering.load(tmp_path / "absent.json") == {}
