"""Housekeeping sends no task events, so Flower lists operations; what a pass did stays visible.

A real prefork worker and a real beat on the test broker, and a real event receiver (the
consumer Flower runs): after beat's passes have run several times and one scale, the
task events are the scale's tasks and nothing else, the worker's log shows every pass,
and the one pass that changed something (the reap of the scaled replicas) is an
operation in the store. Called directly, a health or reconcile pass leaves an operation
only when it changed something.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select, update

from agents.drivers import VMSpec
from agents.fcdaemon import serve_fcdaemon
from config.celery import HOUSEKEEPING, ROUTES, beat_schedule
from config.settings import get_settings
from corral import api
from stack.supervisor import stop_process
from tasks import maintenance
from testkit.processes import WorkerProcess, start_beat
from testkit.services import log_tail
from tests.fixtures import Env, StartAgents
from tests.helpers import deploy_fn, passes_until_heard
from workers.celery import app
from workers.store.models import Node, Operation

# Every housekeeping pass every half second (the test waits for each to run three times).
FAST_BEAT = {
    "CORRAL_HEALTH_INTERVAL_S": "0.5",
    "CORRAL_REAP_INTERVAL_S": "0.5",
    "CORRAL_RECONCILE_INTERVAL_S": "0.5",
    "CORRAL_AUTOSCALE_INTERVAL_S": "0.5",
    "CORRAL_CALLS_SWEEP_INTERVAL_S": "0.5",
}


class Events:
    """Every event on the broker's event exchange, received in a thread as Flower does."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.ready = threading.Event()
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._run, name="events", daemon=True)

    def _run(self) -> None:
        with app.connection_for_read() as conn:
            self._receiver = app.events.Receiver(conn, handlers={"*": self.seen.append})
            self.ready.set()
            self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def __enter__(self) -> Events:
        self._thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._receiver.should_stop = True
        self._thread.join(10)

    def of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one type (``task-received``, ``worker-online``...)."""
        return [e for e in list(self.seen) if e.get("type") == kind]

    def wait_for(self, kind: str, timeout: float = 30) -> None:
        """Until an event of this type arrives."""
        deadline = time.monotonic() + timeout
        while not self.of(kind):
            assert time.monotonic() < deadline, f"no {kind} event in {timeout}s"
            time.sleep(0.1)


def test_beat_and_the_passes_agree_that_housekeeping_sends_no_events() -> None:
    sent_by_beat = {entry["task"] for entry in beat_schedule(get_settings()).values()}
    assert sent_by_beat == set(HOUSEKEEPING)
    app.loader.import_default_modules()  # every task module, as a worker loads them
    for name in ROUTES:
        assert app.tasks[name].send_events is (name not in HOUSEKEEPING), name


@pytest.mark.timeout(120)
def test_after_housekeeping_and_a_scale_the_events_are_the_scales_tasks_only(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
) -> None:
    start_agents(1, env=broker_env)
    deploy_fn(broker_env, idle_timeout=1)  # the scaled replicas are reaped a second later
    with Events() as events:
        worker = WorkerProcess(broker_env.tmp, extra_env=FAST_BEAT)
        worker_processes.append(worker.start())
        events.wait_for("worker-online")  # the worker's events reach the receiver
        beat = start_beat(broker_env.tmp, "events", FAST_BEAT)
        try:
            view = api.wait(api.scale("hello", 2), timeout=60)
            assert view["status"] == "succeeded", view
            reaped = _wait_for_the_reap_pass(broker_env, worker, beat)
            _wait_for_every_pass_in_the_log(worker, times=3)
        finally:
            stop_process(beat, 20)
        # the last events of tasks in flight: worker-offline is the worker's last event
        worker.stop()
        events.wait_for("worker-offline")

    received = {e["uuid"]: e["name"] for e in events.of("task-received")}
    names = set(received.values())
    assert "corral.scale" in names, names
    assert not names & set(HOUSEKEEPING), names
    # no started / succeeded / failed event of a task whose receipt was not an operation's
    task_events = [e for e in events.seen if str(e.get("type", "")).startswith("task-")]
    assert {e["uuid"] for e in task_events} <= set(received), task_events

    # What housekeeping did is still on record: the reap that deleted the two replicas is
    # an operation already over; passes that changed nothing (health, reconcile, autoscale,
    # the later reaps) left none.
    assert sum(op.total for op in reaped) == 2 and {op.status for op in reaped} == {"succeeded"}
    assert all(op.params == {"by": "beat"} for op in reaped)
    with broker_env.db.read() as s:
        kinds = {op.kind for op in s.scalars(select(Operation))}
    assert kinds == {"scale", "reap"}, kinds


def _wait_for_the_reap_pass(
    env: Env, worker: WorkerProcess, beat: subprocess.Popen[bytes]
) -> list[Operation]:
    """The reap operations beat's passes recorded once both replicas were deleted."""
    deadline = time.monotonic() + 30
    while True:
        with env.db.read() as s:
            reaped = list(s.scalars(select(Operation).where(Operation.kind == "reap")))
        if sum(op.total for op in reaped) >= 2:
            return reaped
        if time.monotonic() > deadline:
            raise AssertionError(f"{worker.tail()}\nbeat:\n{_beat_log(env, beat)}")
        time.sleep(0.2)


def _beat_log(env: Env, beat: subprocess.Popen[bytes]) -> str:
    """The end of beat's log; every thread's stack in it if beat never sent a pass.

    (cis370, cis410 and cis420: beat printed that it was starting, then nothing for 30 s;
    cis440: still importing corral's modules, compiling them from source.)
    """
    log = env.tmp / "beat-events.log"
    if b"Sending due task" not in log.read_bytes() and beat.poll() is None:
        beat.send_signal(signal.SIGABRT)  # faulthandler (start_beat) writes the stacks
        with contextlib.suppress(subprocess.TimeoutExpired):
            beat.wait(10)
    return log_tail(log, 120)


def _wait_for_every_pass_in_the_log(worker: WorkerProcess, *, times: int) -> None:
    """Until the worker logged each housekeeping pass succeeding ``times`` times."""
    deadline = time.monotonic() + 30
    while True:
        log = worker.log_path.read_text(errors="replace")
        counts = {name: log.count(f"Task {name}[") for name in HOUSEKEEPING}
        if all(n >= 2 * times for n in counts.values()):  # received, then succeeded
            return
        assert time.monotonic() < deadline, (counts, worker.tail())
        time.sleep(0.2)


def _ops(env: Env) -> list[Operation]:
    with env.db.read() as s:
        return list(s.scalars(select(Operation).order_by(Operation.created_at)))


def test_a_health_pass_is_an_operation_only_when_a_node_changed(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(health_misses="1", node_dead_grace_s="3600")
    (agent,) = start_agents(1, env=corral_env)
    assert maintenance.check_health()["probed"] == 1
    assert _ops(corral_env) == []  # healthy before and after: nothing to record
    port = agent.port
    agent.stop(grace=0)
    result = maintenance.check_health()
    assert result["became_unhealthy"] == ["node1"]
    (op,) = _ops(corral_env)
    assert (op.id, op.kind, op.status, op.params) == (
        result["op_id"],
        "health",
        "succeeded",
        {"by": "beat"},
    )
    assert op.result is not None and op.result["became_unhealthy"] == ["node1"]
    assert "op_id" not in maintenance.check_health()  # still down: no change, no record
    back = serve_fcdaemon(f"127.0.0.1:{port}")
    try:
        passes = passes_until_heard(maintenance.check_health, lambda p: p["missed"])
        assert passes[-1]["recovered"] == ["node1"], passes
        assert all("op_id" not in p for p in passes[:-1]), passes  # still down: no record
    finally:
        back.stop(grace=0)
    assert [op.kind for op in _ops(corral_env)] == ["health", "health"]


def test_a_health_pass_marks_the_replicas_of_a_node_gone_past_its_grace_dead(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(health_misses="1", node_dead_grace_s="0")
    (agent,) = start_agents(1, env=corral_env)
    with corral_env.db.transaction() as s:  # a node that lists its VMs: reconcile finds
        s.execute(update(Node).values(can_list=True))  # any left (a seed one's rows wait)
    deploy_fn(corral_env)
    api.wait(api.spawn("hello", 1), timeout=10)
    agent.stop(grace=0)
    result = maintenance.check_health()
    assert (result["became_unhealthy"], result["replicas_lost"]) == (["node1"], 1)
    assert [r["status"] for r in api.replicas(all=True, settings=corral_env.settings)] == ["dead"]
    (op,) = [op for op in _ops(corral_env) if op.kind == "health"]
    assert op.result is not None and op.result["replicas_lost"] == 1
    again = maintenance.check_health()  # still down: nothing more to lose, nothing recorded
    assert again["replicas_lost"] == 0 and "op_id" not in again


def test_a_reconcile_pass_that_destroyed_an_orphan_is_an_operation(
    corral_env: Env, start_agents: StartAgents
) -> None:
    corral_env.set(orphan_grace_s="0")
    (agent,) = start_agents(1, env=corral_env)
    assert "op_id" not in maintenance.reconcile_pass()  # nothing to do, nothing recorded
    orphan = agent.driver.start(VMSpec(image="examples.hello"))  # behind corral's back
    result = maintenance.reconcile_pass()
    (op,) = _ops(corral_env)
    assert (op.id, op.kind, op.status) == (result["op_id"], "reconcile", "succeeded")
    assert op.result is not None and op.result["orphans_destroyed"] == [f"node1/{orphan.vmid}"]
    assert agent.driver.list() == []
