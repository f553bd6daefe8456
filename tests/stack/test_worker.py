"""``corral worker``: the supervisor that keeps a worker's hard time limits, and what it passes on.

Its kill-and-restart at a hard limit is shown with real tasks in
``tests/faults/test_time_limits.py`` and ``tests/faults/test_hard_limit_kills.py``; here:
it passes signals on and ends with its worker, its worker ends with it, ``-P prefork``
means prefork, and what it says never waits for a stalled stderr.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from stack.worker import pool_option, worker_env
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, alive
from tests.fixtures import Env


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
    eventually(lambda: not alive(orphan), 10, "the worker to die with its supervisor")

    second = WorkerProcess(broker_env.tmp, name="stopped").start()
    worker_processes.append(second)
    pid = second.worker_pid()
    assert pid is not None and second.proc is not None
    second.proc.send_signal(signal.SIGTERM)  # passed on: Celery's warm shutdown
    assert second.proc.wait(30) == 0, second.tail()
    assert not alive(pid)
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


def test_the_supervisor_never_waits_for_a_stderr_pipe_nobody_reads() -> None:
    read_end, write_end = os.pipe()  # nobody reads it: a stalled log shipper
    try:
        lines = 20_000  # about 1.5 MB, twenty pipes' worth
        speaker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from stack.worker import _say\nfor n in range({lines}): _say(f'line {{n}}')",
            ],
            stderr=write_end,
        )
        os.close(write_end)
        write_end = -1
        assert speaker.wait(60) == 0  # it ended: no write waited for the reader
        os.set_blocking(read_end, False)
        said = b""
        while True:
            try:
                chunk = os.read(read_end, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            said += chunk
        kept = said.decode().splitlines()
        assert kept[0] == "corral worker: line 0"
        assert all(line.startswith("corral worker: line ") for line in kept)  # whole lines
        assert 0 < len(kept) < lines  # the rest were dropped
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
