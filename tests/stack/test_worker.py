"""``corral worker``: the supervisor that keeps a worker's hard time limits, and what it passes on.

Its kill-and-restart at a hard limit is shown with real tasks in
``tests/faults/test_time_limits.py``; here: it passes signals on and ends with its
worker, its worker ends with it, and ``-P prefork`` means prefork.
"""

from __future__ import annotations

import os
import signal

import pytest

from stack.worker import pool_option, worker_env
from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.fixtures import Env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]  # noqa: SIM115
    return status != "Z"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_ends_with_its_supervisor_and_a_warm_stop_passes_through(
    broker_env: Env, worker_processes: list[WorkerProcess]
) -> None:
    first = WorkerProcess(broker_env.tmp, name="orphaned").start()
    worker_processes.append(first)
    pid = first.worker_pid()
    assert pid is not None and first.proc is not None
    os.kill(first.proc.pid, signal.SIGKILL)  # the supervisor alone dies
    first.proc.wait(10)
    orphan = pid
    eventually(lambda: not _alive(orphan), 10, "the worker to die with its supervisor")

    second = WorkerProcess(broker_env.tmp, name="stopped").start()
    worker_processes.append(second)
    pid = second.worker_pid()
    assert pid is not None and second.proc is not None
    second.proc.send_signal(signal.SIGTERM)  # passed on: Celery's warm shutdown
    assert second.proc.wait(30) == 0, second.tail()
    assert not _alive(pid)
    assert "restarting" not in second.tail() and "started again" not in second.tail()


@pytest.mark.parametrize(
    ("options", "pool"),
    [
        ([], None),
        (["-P", "prefork", "-c", "2"], "prefork"),
        (["--pool=threads"], "threads"),
        (["-Pprefork"], "prefork"),
        (["-P", "threads", "--pool", "solo"], "solo"),
    ],
)
def test_the_pool_the_command_line_names_is_the_one_the_worker_runs(
    options: list[str], pool: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CORRAL_WORKER_POOL", raising=False)
    assert pool_option(options) == pool
    # Celery takes -P prefork for "no -P" and runs the configured pool: the setting says it
    assert worker_env(options).get("CORRAL_WORKER_POOL") == (
        "prefork" if pool == "prefork" else None
    )
