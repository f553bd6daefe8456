"""Host clocks that are wrong take nothing early and stop nothing, with real ``corral worker``s.

The worker's host clock jumps 600 s ahead (``clock.step_host``, run in the worker by a
test-only task) after the worker measured the store's clock. Its reaper pass must still
find the reap lease another beat holds for 60 s held, a gateway's 30 s claim held, and a
Creating row a live handler owns owned: the worker's clock moves with its monotonic
clock between syncs, and expiries of leases and claims are judged by the database.

A worker whose whole process runs 600 s ahead of beat's (libfaketime, Debian's
``faketime``, preloaded into it) still runs beat's passes and reaps: passes carry no
expiry stamped by beat's clock and judged by the worker's. Its offset from the store's
clock is exported (``corral_clock_offset_seconds``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from stack.supervisor import stop_process
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from tests.faults.test_time_limits import TASKS
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, spawn_ok
from workers import leases
from workers.celery import app
from workers.maintenance.reaper import LEASE
from workers.observability import clock_offsets
from workers.replicas.claims import claim
from workers.store.models import Claim, Replica, ReplicaState

STEP_S = 600
POOLS = pytest.mark.parametrize("pool", ["threads", "prefork"])


def _reap_pass(worker: WorkerProcess) -> str:
    """Send beat's reaper pass to the worker and wait for it; what it returned."""
    sent = app.send_task("corral.reap_pass")
    pattern = re.compile(rf"Task corral\.reap_pass\[{sent.id}\] succeeded in [^:]+: (.*)")
    found = eventually(
        lambda: pattern.findall(worker.log_path.read_text(errors="replace")),
        30,
        "the reaper pass",
        detail=worker.tail,
    )
    return str(found[0])


@pytest.mark.slow
@pytest.mark.timeout(120)
@POOLS
def test_a_600_s_host_clock_step_takes_no_lease_claim_or_row_early(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess], pool: str
) -> None:
    (agent,) = start_agents(1, env=broker_env)
    fn_id = deploy_fn(broker_env)
    # one process runs every task (a prefork worker's one child): the stepped one
    worker = WorkerProcess(broker_env.tmp, concurrency=1, pool=pool, include=TASKS)
    worker_processes.append(worker.start())
    spawn_ok("hello", 1, timeout=60)  # the worker has measured the store's clock
    held = claim(broker_env.db, broker_env.settings, "hello", ttl_s=30)  # a gateway's claim
    owned = creating(broker_env, fn_id, "owned-by-a-live-handler")  # its create out
    assert leases.acquire(broker_env.db, LEASE, "another-beat", 60)

    step = app.send_task("corral.test.step_clock", args=(STEP_S,))
    eventually(
        lambda: f"Task corral.test.step_clock[{step.id}] succeeded" in worker.tail(),
        30,
        "the step",
        detail=worker.tail,
    )
    report = _reap_pass(worker)
    assert "'skipped': True" in report and "another-beat" in report, report
    lease = leases.current(broker_env.db, LEASE)
    assert lease is not None and lease.holder == "another-beat"

    assert leases.release(broker_env.db, LEASE, "another-beat")
    report = _reap_pass(worker)  # a pass that runs, on the stepped host
    assert "'skipped': False" in report, report
    with broker_env.db.read() as s:
        assert s.get(Claim, held.claim_id) is not None  # a 30 s claim, seconds old: held
        row = s.scalars(select(Replica).where(Replica.request_id == owned.request_id)).one()
        assert row.status == ReplicaState.CREATING and row.owner is not None, row.error
    assert len(agent.driver.list()) == 1  # nothing released


LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
AHEAD_S = 600
BEAT = {
    "CORRAL_REAP_INTERVAL_S": "1",
    "CORRAL_RECONCILE_INTERVAL_S": "1",
    "CORRAL_HEALTH_INTERVAL_S": "1",
}


def ahead(seconds: int) -> dict[str, str]:
    """The environment that runs a process (and what it starts) ``seconds`` ahead: libfaketime.

    Its wall clock only: monotonic clocks are left alone, as a wrong host clock leaves them.
    Skipped where Debian's ``faketime`` is not installed, except in CI (``.ci/run`` installs it).
    """
    if LIBFAKETIME is None:
        message = "libfaketime not found in /usr/lib/*/faketime (apt-get install faketime)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}, but CI=true: .ci/run installs it", pytrace=False)
        pytest.skip(message)
    return {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"+{seconds}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_600_s_ahead_of_beat_still_reaps(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    (agent,) = start_agents(1, env=broker_env)
    deploy_fn(broker_env, idle_timeout=1)
    worker = WorkerProcess(broker_env.tmp, extra_env={**BEAT, **ahead(AHEAD_S)})
    worker_processes.append(worker.start())
    spawn_ok("hello", 2, timeout=60)
    assert len(agent.driver.list()) == 2
    beat = start_beat(broker_env.tmp, "behind", BEAT)  # this host's clock: 600 s behind it

    def reaped() -> bool:  # the VMs released, and then their rows retired
        with broker_env.db.read() as s:
            statuses = {row.status for row in s.scalars(select(Replica))}
        return not agent.driver.list() and statuses == {ReplicaState.DELETED}

    try:
        eventually(reaped, 90, "the idle replicas reaped", detail=worker.tail)
    finally:
        stop_process(beat, 20)
    # its log line goes through the worker's log queue: it may come a moment after the rows
    eventually(lambda: worker.succeeded("corral.reap_pass") >= 1, 30, "a reap pass logged")
    if not broker_env.db.is_sqlite:  # SQLite's clock is the faked process's own: no offset
        client = redis.Redis.from_url(broker_env.settings.broker_url)
        (offset,) = clock_offsets.offsets(client).values()
        assert AHEAD_S - 5 < offset < AHEAD_S + 5, offset
