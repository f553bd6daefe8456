"""The suite's worker processes: one that does not start in time is not left running.

A worker the test never got back from :meth:`WorkerProcess.start` is not in the test's
list of workers to kill; left running, it would take the next tests' messages.
"""

from __future__ import annotations

import pytest

from testkit.processes import WorkerProcess
from testkit.services import free_port
from tests.fixtures import Env


def test_a_worker_not_ready_in_time_writes_its_stacks_and_is_killed(broker_env: Env) -> None:
    # a broker nobody listens on: the worker starts, and waits for it without end
    dead = f"redis://127.0.0.1:{free_port()}/0"
    worker = WorkerProcess(broker_env.tmp, extra_env={"CORRAL_BROKER_URL": dead})
    with pytest.raises(TimeoutError, match="not ready after 8s") as failed:
        worker.start(timeout=8)
    assert worker.proc is not None and worker.proc.poll() is not None  # killed
    said = str(failed.value)
    assert "Cannot connect to redis" in said  # the log's tail
    assert "most recent call first" in said  # and the stacks it wrote before the kill
