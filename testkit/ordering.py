"""The order the suite runs in: the longest tests first, dealt evenly across the xdist workers.

Most of the suite's time is waiting (on worker processes, agents, timers), so four xdist
workers share two cores; the wall clock is then the busiest worker's sum. pytest-xdist's
``worksteal`` scheduler first cuts the collected list into one contiguous range per
worker, in order, and later moves the back half of the longest queue (by count) to a
worker that ran dry. A 100 s test at the end of a range is a 100 s tail that no
stealing can share.

So the tests are ordered for that cut: each test's expected time comes from
``tests/durations.json`` (the mean over its parameters, from an earlier run's JUnit
report; ``python -m testkit.ordering REPORT.xml`` writes it), a test it does not list
counts as :data:`UNKNOWN_SLOW_S` if it is marked ``slow``, else as :data:`UNKNOWN_S`.
:func:`deal` gives the longest tests out one at a time to the range with the least
expected time (longest-processing-time first, within each range's size), and each range
runs its long tests first, then its short ones, each in collection order (pytest's order
sets up a module's fixtures, and each of their parameters, once). What stealing moves at
the end is short tests.

The order changes only *when* a test runs, never whether: a stale or missing file costs
balance, not correctness.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

#: The file of expected times, per test function (its parameters averaged).
DURATIONS = Path(__file__).resolve().parent.parent / "tests" / "durations.json"
#: A test at least this long (seconds) runs before the short ones of its range.
LONG_S = 1.0
#: The expected time of a test the file does not list: marked ``slow``, or not.
UNKNOWN_SLOW_S = 5.0
UNKNOWN_S = 0.1
#: Tests shorter than this are left out of the file (they count as UNKNOWN_S).
KEEP_S = 0.5


def key(nodeid: str) -> str:
    """The test function a node id names, as JUnit reports it: ``pkg.module.Class::name``."""
    path, *rest = nodeid.split("::")
    names = [path.removesuffix(".py").replace("/", "."), *rest[:-1]]
    return ".".join(names) + "::" + (rest[-1] if rest else "").split("[", 1)[0]


def range_sizes(count: int, workers: int) -> list[int]:
    """How many tests of ``count`` worksteal hands each of ``workers`` at the start."""
    sizes = []
    left = count
    for i in range(workers):
        size = left // (workers - i)
        sizes.append(size)
        left -= size
    return sizes


def deal(weights: Sequence[float], workers: int) -> list[int]:
    """The run order (indices into ``weights``) that gives each worker's range an even load."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers}")
    sizes = range_sizes(len(weights), workers)
    ranges: list[list[int]] = [[] for _ in sizes]
    loads = [0.0] * workers
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        open_ = [w for w in range(workers) if len(ranges[w]) < sizes[w]]
        w = min(open_, key=lambda w: (loads[w], w))
        ranges[w].append(i)
        loads[w] += weights[i]
    order: list[int] = []
    for members in ranges:  # each in collection order: a module's fixtures set up once
        members.sort()
        order += [i for i in members if weights[i] >= LONG_S]
        order += [i for i in members if weights[i] < LONG_S]
    return order


def load(path: Path = DURATIONS) -> dict[str, float]:
    """The expected time of each listed test function; empty if there is no file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    return {str(k): float(v) for k, v in data.items()}


def from_junit(report: Path) -> dict[str, float]:
    """Each test function's mean time over its parameters in a JUnit report, if ≥ KEEP_S."""
    times: dict[str, list[float]] = defaultdict(list)
    for case in ET.parse(report).iter("testcase"):  # noqa: S314 - our own run's report
        name = f"{case.get('classname', '')}::{case.get('name', '').split('[', 1)[0]}"
        times[name].append(float(case.get("time") or 0.0))
    means = {k: sum(v) / len(v) for k, v in times.items()}
    return {k: round(v, 1) for k, v in sorted(means.items()) if v >= KEEP_S}


def main(argv: Sequence[str] | None = None) -> int:
    """Write tests/durations.json from a run's JUnit report (``pytest --junitxml``)."""
    parser = argparse.ArgumentParser(prog="python -m testkit.ordering", description=main.__doc__)
    parser.add_argument("report", type=Path, help="a JUnit XML report of a whole run")
    parser.add_argument("--out", type=Path, default=DURATIONS)
    args = parser.parse_args(argv)
    durations = from_junit(args.report)
    if not durations:
        parser.error(f"{args.report}: no test of {KEEP_S} s or longer")
    args.out.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")
    print(f"{args.out}: {len(durations)} test functions, {sum(durations.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
