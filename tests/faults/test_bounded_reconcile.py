"""Reconcile in bounded passes, with real ``corral worker`` processes and beat, both pools.

30 orphan VMs on an agent that takes 1.2 s to release each. One pass releases them all at
once within the node's bound (4 here) and starts none past its soft limit, so no pass
meets its hard limit: beat's passes clean them up between them, and nothing is killed
(before: one at a time, the first pass ran into its hard limit, its killed holder's lease
stopped reconcile for 300 s, and ``corral reconcile`` said ``succeeded`` with orphans left).
An operator's ``corral reconcile`` while another pass holds the lease says it was skipped.
"""

from __future__ import annotations

import pytest
import redis

from agents.drivers import VMSpec
from agents.faults import Fault
from corral import api
from stack.supervisor import stop_process
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from tests.faults.conftest import POOL_PER_STORE
from tests.fixtures import Env, StartAgents
from workers import leases
from workers.base.poison import KEY_PREFIX
from workers.maintenance.reconcile import LEASE

# 30 x 1.2 s / 4 in flight = 9 s of releases: more than a pass may start in its soft
# limit (6 s, less the longest call), so it takes several passes; one at a time (the bug)
# is 36 s, far past the hard limit (10 s). 60 proved the same in twice the time.
ORPHANS = 30
RELEASE_S = 1.2
PASSES = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "6",
    "CORRAL_TASK_TIME_LIMIT_S": "10",
    "CORRAL_VISIBILITY_TIMEOUT_S": "60",
    "CORRAL_RPC_TIMEOUT_S": "2",
    "CORRAL_NODE_MAX_INFLIGHT": "4",
    "CORRAL_ORPHAN_GRACE_S": "0",
    "CORRAL_RECONCILE_INTERVAL_S": "1",
    "CORRAL_REAP_INTERVAL_S": "60",
}


def _env(env: Env) -> None:
    env.set(**{k[len("CORRAL_") :].lower(): v for k, v in PASSES.items()})


@pytest.mark.slow
@pytest.mark.timeout(300)
@POOL_PER_STORE
def test_30_slow_orphans_are_released_across_passes_with_no_kill(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess], pool: str
) -> None:
    _env(broker_env)
    (agent,) = start_agents(1, env=broker_env)
    for _ in range(ORPHANS):
        agent.driver.start(VMSpec(image="examples.hello"))  # behind corral's back
    agent.agent.inject("ReleaseVMSetup", *[Fault.delay(RELEASE_S)] * ORPHANS)
    worker = WorkerProcess(broker_env.tmp, concurrency=4, pool=pool, extra_env=PASSES)
    worker_processes.append(worker.start())

    assert leases.acquire(broker_env.db, LEASE, "another-pass", 60)
    view = api.wait(api.reconcile(), timeout=60)  # it waits a little, then gives up
    assert view["status"] == "failed", view
    assert "skipped: another reconcile pass holds the lease (another-pass)" in (view["error"] or "")
    assert len(agent.driver.list()) == ORPHANS  # nothing done
    assert leases.release(broker_env.db, LEASE, "another-pass")

    beat = start_beat(broker_env.tmp, "reconcile", PASSES)
    try:
        eventually(
            lambda: not agent.driver.list(), 180, "every orphan released", detail=worker.tail
        )
    finally:
        stop_process(beat, 20)
    log = worker.log_path.read_text(errors="replace")
    assert "outlived its hard time limit" not in log, worker.tail(100)
    assert "Hard time limit" not in log, worker.tail(100)
    assert log.count("reconcile left") >= 1, worker.tail(100)  # it took more than one pass
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    assert not client.keys(KEY_PREFIX + "*")  # no kill counted either
    released = [call.vmid for call in agent.agent.calls_of("ReleaseVMSetup")]
    assert len(released) == len(set(released)) == ORPHANS  # each once
