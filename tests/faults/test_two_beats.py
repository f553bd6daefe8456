"""Two celery beats at once: each reap / reconcile pass still runs alone; nothing deleted twice."""

from __future__ import annotations

import collections

import pytest
from sqlalchemy import select

from stack.supervisor import stop_process
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, spawn_ok
from workers.store.models import Replica, ReplicaState

FAST_BEAT = {
    "CORRAL_REAP_INTERVAL_S": "0.5",
    "CORRAL_RECONCILE_INTERVAL_S": "0.5",
    "CORRAL_HEALTH_INTERVAL_S": "1",
}


@pytest.mark.timeout(120)
def test_two_beats_reap_each_replica_once(
    broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    a, b = start_agents(2, env=broker_env)
    deploy_fn(broker_env, max=None, min=2, idle_timeout=1)
    worker = WorkerProcess(broker_env.tmp, concurrency=4, extra_env=FAST_BEAT)
    worker_processes.append(worker.start())
    spawn_ok("hello", 12, timeout=60)
    # a second after they became idle, both beats' reap passes cut 12 down to min (2)
    beats = [start_beat(broker_env.tmp, name, FAST_BEAT) for name in ("one", "two")]
    try:

        def cut_to_min() -> bool:  # and their releases done: a pass marks them Deleting first
            with broker_env.db.read() as s:
                states = [r.status for r in s.scalars(select(Replica))]
            return states.count(ReplicaState.IDLE) <= 2 and ReplicaState.DELETING not in states

        eventually(cut_to_min, 60, "the idle replicas cut to min", detail=worker.tail)
        worker.more_runs("corral.reap_pass", 4)  # further passes from both beats find nothing
    finally:
        for beat in beats:
            stop_process(beat, 20)
    releases = [r.vmid for agent in (a, b) for r in agent.agent.calls_of("ReleaseVMSetup")]
    assert len(releases) == 10, worker.tail()
    assert max(collections.Counter(releases).values()) == 1  # nobody released twice
    with broker_env.db.read() as s:
        rows = list(s.scalars(select(Replica)))
    assert sum(r.status == ReplicaState.IDLE for r in rows) == 2  # min kept
    assert sum(r.status == ReplicaState.DELETED for r in rows) == 10
    assert not any(r.status == ReplicaState.DEAD for r in rows)
    assert len(a.driver.list()) + len(b.driver.list()) == 2
