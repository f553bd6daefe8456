"""Time limits in a thread pool: the soft one raised in the task's thread, the hard one acted on."""

from __future__ import annotations

import threading
import time

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from workers import timelimits


@pytest.fixture
def hard_limits(monkeypatch: pytest.MonkeyPatch) -> list[timelimits.Watched]:
    """Tasks past their hard limit, recorded instead of ending the test process."""
    seen: list[timelimits.Watched] = []
    monkeypatch.setattr(timelimits, "on_hard_limit", seen.append)
    return seen


def _in_thread(work: object) -> list[object]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(work())  # type: ignore[operator]
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    return out


def test_a_task_past_its_soft_limit_gets_soft_time_limit_exceeded_in_its_thread(
    hard_limits: list[timelimits.Watched],
) -> None:
    def task() -> str:
        with timelimits.watch("t", "1", soft_s=0.3, hard_s=5):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # Python code: reached at once
                time.sleep(0.01)
            return "ran to the end"

    started = time.monotonic()
    (outcome,) = _in_thread(task)
    assert isinstance(outcome, SoftTimeLimitExceeded)
    assert time.monotonic() - started < 2
    assert hard_limits == []


def test_a_task_stuck_where_python_cannot_reach_it_meets_the_hard_limit(
    hard_limits: list[timelimits.Watched],
) -> None:
    def task() -> str:
        with timelimits.watch("stuck", "2", soft_s=0.1, hard_s=0.4):
            time.sleep(1.0)  # one C call: the soft limit waits for it to return
            return "returned"

    _in_thread(task)
    assert [t.name for t in hard_limits][:1] == ["stuck"]


def test_a_task_that_ends_in_time_is_left_alone_and_its_thread_stays_clean(
    hard_limits: list[timelimits.Watched],
) -> None:
    def tasks() -> list[str]:
        done = []
        for i in range(3):  # the same thread runs task after task, as a pool thread does
            with timelimits.watch("quick", str(i), soft_s=0.2, hard_s=1):
                time.sleep(0.05)
            done.append(str(i))
        time.sleep(0.5)  # past every soft limit: nothing is raised outside a task
        return done

    assert _in_thread(tasks) == [["0", "1", "2"]]
    assert hard_limits == []
