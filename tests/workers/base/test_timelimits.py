"""The soft limit as a deadline the work checks; the hard limit's reports to the supervisor."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

from workers.base import timelimits
from workers.base.timelimits import Deadline, OutOfTime


def test_nothing_is_refused_outside_a_task_or_before_its_deadline() -> None:
    timelimits.check("work outside any task")
    timelimits.sleep(0)
    with timelimits.running(Deadline(time.monotonic() + 60)):
        timelimits.check("work in time")
        assert not timelimits.passed()


def test_past_the_deadline_new_work_is_refused_once_then_the_task_wraps_up() -> None:
    with timelimits.running(Deadline(time.monotonic() - 0.001)):
        assert timelimits.passed()
        with pytest.raises(OutOfTime, match="a store transaction not started"):
            timelimits.check("a store transaction")
        # delivered: the way out goes ahead (a lease released in a finally, rows disowned)
        timelimits.check("releasing a lease")
        timelimits.sleep(0)
    timelimits.check("the task base's own bookkeeping")  # after the task: no deadline
    assert timelimits.current() is None


def test_a_batch_cut_at_the_deadline_wraps_the_task_up() -> None:
    with timelimits.running(Deadline(time.monotonic() - 0.001)):
        timelimits.wrap_up()  # what calls.run says when it cuts its calls
        timelimits.check("recording the VMs that landed")


def test_a_pause_ends_at_the_deadline_not_after_it() -> None:
    started = time.monotonic()
    with timelimits.running(Deadline(started + 0.05)), pytest.raises(OutOfTime):
        timelimits.sleep(30)
    assert time.monotonic() - started < 5


def test_a_deadline_belongs_to_the_thread_that_runs_the_task() -> None:
    seen: list[bool] = []
    with timelimits.running(Deadline(time.monotonic() - 1)):
        other = threading.Thread(target=lambda: seen.append(timelimits.passed()))
        other.start()
        other.join()
        assert timelimits.passed()
    assert seen == [False]  # a gateway's or the event loop's thread: no deadline


@pytest.fixture
def pipe(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, int]]:
    """A report pipe, as the supervisor hands it to its worker; detached afterwards."""
    read_end, write_end = os.pipe()
    monkeypatch.setattr(timelimits, "_report_fd", None)
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


def test_a_worker_reports_each_task_start_and_end_in_lines_the_supervisor_reads(
    pipe: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    read_end, write_end = pipe
    monkeypatch.setenv(timelimits.WATCH_FD_ENV, f"{write_end}:{os.getppid()}")
    assert timelimits.attach() and timelimits.supervised()
    assert timelimits.WATCH_FD_ENV not in os.environ  # no child of the worker inherits it
    with timelimits.reported("corral.spawn", "id with spaces\nand a newline", 90.0):
        pass
    start, end, _ = os.read(read_end, 4096).split(b"\n")
    started = timelimits.parse(start)
    assert started is not None and started.event == "start" and started.hard_s == 90.0
    assert started.task == "corral.spawn[id?with?spaces?and?a?newline]"
    assert timelimits.parse(end) == timelimits.Report("end", started.key)


@pytest.mark.parametrize(
    "value",
    ["", "junk", "3", "3:1", "999:{ppid}"],
    ids=["unset", "junk", "no-pid", "not-parent", "bad-fd"],
)
def test_a_worker_reports_only_to_its_own_supervisors_pipe(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setattr(timelimits, "_report_fd", None)
    monkeypatch.setenv(timelimits.WATCH_FD_ENV, value.format(ppid=os.getppid()))
    assert not timelimits.attach()
    assert not timelimits.supervised()


def test_a_descriptor_that_is_not_a_pipe_is_never_written_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(timelimits, "_report_fd", None)
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        monkeypatch.setenv(timelimits.WATCH_FD_ENV, f"{fd}:{os.getppid()}")
        assert not timelimits.attach()
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "line",
    [b"", b"start 1 x corral.spawn[1]", b"start 1 -1 t", b"end", b"stop 1", b"start 1 2 a b"],
)
def test_lines_that_are_not_reports_are_ignored(line: bytes) -> None:
    assert timelimits.parse(line) is None
