"""A task killed at its hard time limit costs only itself: its neighbours, seconds; itself, 3 tries.

Real ``corral worker`` processes, both pools: a poison message (a task that hangs on every
delivery) beside tasks in flight on the same worker. A thread-pool worker is killed whole
at the poison's hard limit; what it held is put back on the queues at once, so the
neighbours run again and finish within seconds, not after the visibility timeout (120 s
here). A prefork child is killed alone and its message given back. Each kill is counted
per task id: delivered after its third, the poison is not run, its message is
acknowledged and its operation failed with that reason.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.faults.conftest import POOL_PER_STORE
from tests.faults.test_time_limits import TASKS
from tests.fixtures import Env
from tests.helpers import broker_drained, operation
from workers.base.kinds import OpKind
from workers.base.poison import MAX_KILLS
from workers.celery import app
from workers.operations import create_operation
from workers.store.models import OpStatus

LIMITS = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "1.5",
    "CORRAL_TASK_TIME_LIMIT_S": "3",
    "CORRAL_VISIBILITY_TIMEOUT_S": "120",
    "CORRAL_RETRY_MAX": "0",
    "CORRAL_RPC_TIMEOUT_S": "0.1",  # (no agent here; a soft limit must exceed the calls)
    "CORRAL_CREATE_TIMEOUT_S": "0.1",
    "CORRAL_LAMBDO_TIMEOUT_S": "0.1",
}
NEIGHBOURS = 3
NEIGHBOUR_LIMITS = {"soft_time_limit": 60, "time_limit": 90}  # theirs: no limit meets them
BACK_WITHIN_S = 60  # half the visibility timeout: only a message put back comes back by then


def _log(worker: WorkerProcess) -> str:
    return worker.log_path.read_text(errors="replace")


def _killed(pool: str, task_id: str) -> re.Pattern[str]:
    if pool == "threads":  # the supervisor kills the worker
        return re.compile(rf"task corral\.test\.poison\[{task_id}\] outlived its hard time limit")
    return re.compile(rf"Hard time limit \(3\.0s\) exceeded for corral\.test\.poison\[{task_id}\]")


@pytest.mark.slow
@pytest.mark.timeout(300)
@POOL_PER_STORE
def test_a_poison_message_is_failed_after_3_kills_and_its_neighbours_finish_within_seconds(
    broker_env: Env, worker_processes: list[WorkerProcess], tmp_path: Path, pool: str
) -> None:
    broker_env.set(**{k[len("CORRAL_") :].lower(): v for k, v in LIMITS.items()})
    worker = WorkerProcess(
        broker_env.tmp, concurrency=NEIGHBOURS + 1, pool=pool, extra_env=LIMITS, include=TASKS
    )
    worker_processes.append(worker.start())
    with broker_env.db.transaction() as s:
        op_id = create_operation(s, OpKind.HOGS, {}).id

    go = tmp_path / "go"
    for n in range(NEIGHBOURS):
        app.send_task("corral.test.wait_for", args=(str(go), f"n{n}"), **NEIGHBOUR_LIMITS)
    eventually(
        lambda: _log(worker).count(": waiting in pid") == NEIGHBOURS,
        60,
        "the neighbours to run",
        detail=worker.tail,
    )
    poison = app.send_task("corral.test.poison", args=(op_id,))
    killed = _killed(pool, poison.id)
    eventually(lambda: killed.search(_log(worker)), 60, "the first kill", detail=worker.tail)

    go.touch()  # the neighbours may end now: the ones killed with the worker are back at once
    eventually(
        lambda: all(f"wait_for n{n}: done" in _log(worker) for n in range(NEIGHBOURS)),
        BACK_WITHIN_S,
        "every neighbour to finish",
        detail=worker.tail,
    )

    eventually(
        lambda: operation(broker_env, op_id).status == OpStatus.FAILED,
        120,
        "the poison's operation to fail",
        detail=worker.tail,
    )
    op = operation(broker_env, op_id)
    assert f"killed at its hard time limit {MAX_KILLS} times" in (op.error or ""), op.error
    assert op.error is not None and op.error.startswith("corral.test.poison: "), op.error
    log = _log(worker)
    assert len(killed.findall(log)) == MAX_KILLS, worker.tail(100)
    assert log.count(f"poison {poison.id}: delivered") == MAX_KILLS  # the 4th never ran
    eventually(lambda: broker_drained(broker_env), 30, "the poison acknowledged")
    if pool == "threads":  # killed whole three times: every neighbour ran twice at most
        assert log.count(": waiting in pid") <= 2 * NEIGHBOURS
        assert log.count(" ready.") == MAX_KILLS + 1
    else:
        assert log.count(": waiting in pid") == NEIGHBOURS  # a child's kill costs only itself
    assert worker.proc is not None and worker.proc.poll() is None
