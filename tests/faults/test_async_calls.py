"""Asynchronous calls under a worker SIGKILLed mid-call: none lost, one terminal record each.

A real gateway, ``corral worker`` processes (the first SIGKILLed, with its whole process
group, while calls run at the replica), celery beat (the calls' sweep) and a process
agent running a function that records every attempt it receives. Every call must end
succeeded, with exactly one terminal record (a trigger logs each one the store sees
written), and each call that reached the replica more than once is a duplicate
execution the function could tell by ``X-Call-Attempt``.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from agents import ProcessDriver, serve_fcdaemon
from tasks.invocations import CALLS
from tasks.maintenance import QUEUE
from tasks.queues import HereFirst
from testkit import httpcalls, terminals
from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from tests.fixtures import Env
from tests.helpers import deploy_fn
from tests.workers.gateway.conftest import CALLEE
from workers.fleet.nodes import upsert_node
from workers.gateway import serve_gateway
from workers.store.models import Call, CallStatus

SHORT = {  # attempts' leases and redelivery within the test; the sweep every second
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "6",
    "CORRAL_TASK_TIME_LIMIT_S": "8",
    "CORRAL_VISIBILITY_TIMEOUT_S": "20",
    "CORRAL_CALLS_BACKOFF_S": "0.1",
    "CORRAL_CALLS_BACKOFF_MAX_S": "1",
    "CORRAL_CALLS_RESEND_S": "2",
    "CORRAL_CALLS_SWEEP_INTERVAL_S": "1",
    "CORRAL_GATEWAY_CLAIM_TTL_S": "5",
}
CALLS_SENT = 12


@pytest.fixture
def beat(broker_env: Env, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Celery beat: the calls' sweep every second."""
    proc = start_beat(tmp_path, "calls", SHORT)
    yield proc
    proc.terminate()
    proc.wait(10)


def _statuses(env: Env, ids: list[str]) -> dict[str, tuple[CallStatus, int]]:
    with env.db.read() as s:
        rows = s.execute(select(Call.id, Call.status, Call.attempts).where(Call.id.in_(ids)))
        return {cid: (CallStatus(status), attempts) for cid, status, attempts in rows}


@pytest.mark.timeout(240)
def test_a_worker_killed_with_calls_running_loses_none(
    broker_env: Env,
    worker_processes: list[WorkerProcess],
    beat: subprocess.Popen[bytes],
    tmp_path: Path,
) -> None:
    env = broker_env
    env.set(**{k[len("CORRAL_") :].lower(): v for k, v in SHORT.items()})
    terminals.install(env.db)
    agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver(allow_images=[CALLEE]))
    gateway = None
    try:
        with env.db.transaction() as s:
            upsert_node(s, agent.address, name="node1", capacity=64)
        ledger = tmp_path / "ledger"
        deploy_fn(env, "callee", image=CALLEE, env={"CALLEE_LEDGER": str(ledger)}, call_attempts=5)
        gateway = serve_gateway(env.settings, "127.0.0.1:0", queue=HereFirst(QUEUE), calls=CALLS)
        first = WorkerProcess(tmp_path, concurrency=4, name="first", extra_env=SHORT)
        worker_processes.append(first.start())
        ids = []
        for _ in range(CALLS_SENT):
            accepted = httpcalls.post(f"{gateway.url}/async-function/callee?delay=2", timeout=30)
            assert accepted.status_code == 202, accepted.text
            ids.append(accepted.headers["x-call-id"])

        def running_at_the_replica() -> bool:
            lines = ledger.read_text().splitlines() if ledger.exists() else []
            running = [s for s, _ in _statuses(env, ids).values() if s == CallStatus.RUNNING]
            return len(lines) >= 2 and len(running) >= 2

        eventually(running_at_the_replica, 60, "calls running at the replica", detail=first.tail)
        first.kill()  # SIGKILL: the worker and its calls' gateway, mid-call
        killed_mid_call = {
            cid for cid, (s, _) in _statuses(env, ids).items() if s == CallStatus.RUNNING
        }
        second = WorkerProcess(tmp_path, concurrency=4, name="second", extra_env=SHORT)
        worker_processes.append(second.start())

        def all_over() -> bool:
            return all(s.finished for s, _ in _statuses(env, ids).values())

        eventually(all_over, 120, "every call over", detail=second.tail)
        final = _statuses(env, ids)
        assert len(final) == CALLS_SENT  # none lost
        assert {s for s, _ in final.values()} == {CallStatus.SUCCEEDED}
        assert terminals.seen(env.db) == Counter(dict.fromkeys(ids, 1))  # one record each
        executions = Counter(line.split()[0] for line in ledger.read_text().splitlines())
        assert set(executions) == set(ids)  # every call ran
        assert killed_mid_call  # the kill did land mid-call...
        assert any(final[cid][1] >= 2 for cid in killed_mid_call)  # ...and they ran again
        for cid in killed_mid_call:
            attempts = sorted(
                int(line.split()[1])
                for line in ledger.read_text().splitlines()
                if line.split()[0] == cid
            )
            assert attempts == sorted(set(attempts))  # every execution a new attempt number
    finally:
        if gateway is not None:
            gateway.stop()
        agent.stop(grace=0)
        terminals.remove(env.db)
