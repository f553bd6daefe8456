"""A host clock step between two syncs takes nothing early, with real ``corral worker`` processes.

The worker's host clock jumps 600 s ahead (``clock.step_host``, run in the worker by a
test-only task) after the worker measured the store's clock. Its reaper pass must still
find the reap lease another beat holds for 60 s held, a gateway's 30 s claim held, and a
Creating row a live handler owns owned: the worker's clock moves with its monotonic
clock between syncs, and expiries of leases and claims are judged by the database.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from testkit.eventually import eventually
from testkit.processes import WorkerProcess
from tests.faults.test_time_limits import TASKS
from tests.fixtures import Env, StartAgents
from tests.helpers import creating, deploy_fn, spawn_ok
from workers import leases
from workers.celery import app
from workers.maintenance.reaper import LEASE
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
