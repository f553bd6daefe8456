"""The autoscaler for real: beat, a prefork worker, Redis, agents, and demand as gateways report it.

A thread plays the gateways: it writes demand samples with :func:`workers.autoscale.demand.report`
the way a gateway does each interval. Under sustained demand the autoscaler raises the
replicas of both autoscaled functions; once demand stops it brings one back to its min
and the other (with ``scale_to_zero_after``) to zero, only after its stable window; an
un-autoscaled function beside them is never touched; and no two scale operations of a
function are ever open at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import UTC, datetime

import pytest
import redis
from sqlalchemy import select

from testkit.eventually import eventually
from testkit.processes import WorkerProcess, start_beat
from tests.fixtures import Env, StartAgents
from workers.autoscale import demand
from workers.functions import deploy, spec_from
from workers.store.models import OP_OPEN, Function, Operation, Replica, ReplicaState

STABLE_S = 4.0
FAST_AUTOSCALE = {
    "CORRAL_AUTOSCALE_INTERVAL_S": "0.5",
    "CORRAL_AUTOSCALE_STABLE_WINDOW_S": str(STABLE_S),
    "CORRAL_AUTOSCALE_PANIC_WINDOW_S": "1",
    "CORRAL_AUTOSCALE_DEMAND_STALE_S": "2",
}


class Gateway(threading.Thread):
    """Reports ``load`` (concurrent requests) for some functions every 0.25 s."""

    def __init__(self, client: redis.Redis, names: list[str]) -> None:
        super().__init__(daemon=True)
        self.client, self.names = client, names
        self.load = 0.0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.25):
            load, at = self.load, time.time()
            demand.report(
                self.client,
                "gw-1",
                {
                    n: demand.Sample(
                        inflight=int(load),
                        queued=0,
                        concurrency=load,
                        requests=int(load > 0),
                        at=at,
                    )
                    for n in self.names
                },
            )


def idle(env: Env) -> dict[str, int]:
    with env.db.read() as s:
        rows = s.execute(
            select(Function.name, Replica.status).join(Replica, Replica.function_id == Function.id)
        ).all()
    out: dict[str, int] = {}
    for name, status in rows:
        if status == ReplicaState.IDLE:
            out[name] = out.get(name, 0) + 1
    return out


def open_scales(env: Env) -> int:
    """How many scale operations are still open (pending or running)."""
    with env.db.read() as s:
        return len(
            s.scalars(
                select(Operation.id).where(Operation.kind == "scale", Operation.status.in_(OP_OPEN))
            ).all()
        )


def wait_for(env: Env, want: dict[str, int], timeout: float, worker: WorkerProcess) -> None:
    def reached() -> bool:
        have = idle(env)
        return all(have.get(k, 0) == v for k, v in want.items())

    eventually(
        reached,
        timeout,
        f"wanted idle replicas {want}, have {idle(env)}",
        poll=0.2,
        detail=worker.tail,
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sustained_demand_scales_up_and_back_down_after_the_windows(
    broker_env: Env,
    start_agents: StartAgents,
    worker_processes: list[WorkerProcess],
    redis_url: str,
) -> None:
    start_agents(2, env=broker_env)
    with broker_env.db.transaction() as s:
        for spec in (
            spec_from(
                name="steady", image="examples.hello", kernel="/k", min=1, max=6, autoscale=True
            ),
            spec_from(
                name="zero",
                image="examples.hello",
                kernel="/k",
                min=0,
                max=6,
                autoscale=True,
                scale_to_zero_after=3.0,
            ),
            spec_from(name="plain", image="examples.hello", kernel="/k", min=0, max=6),
        ):
            deploy(s, spec, broker_env.settings)
    gateway = Gateway(redis.Redis.from_url(redis_url), ["steady", "zero", "plain"])
    gateway.load = 2.8  # ceil(2.8 / (1 env x 0.7)) = 4 replicas each
    gateway.start()
    worker = WorkerProcess(broker_env.tmp, concurrency=3, extra_env=FAST_AUTOSCALE)
    worker_processes.append(worker.start())
    beat = start_beat(broker_env.tmp, "one", FAST_AUTOSCALE)
    try:
        wait_for(broker_env, {"steady": 4, "zero": 4, "plain": 0}, 90, worker)
        worker.more_runs(
            "corral.autoscale", 4
        )  # sustained: the target holds, nothing more is asked for
        assert idle(broker_env) == {"steady": 4, "zero": 4}

        stopped = time.time()
        gateway.load = 0.0
        wait_for(broker_env, {"steady": 1, "zero": 0, "plain": 0}, 90, worker)
        worker.more_runs("corral.autoscale", 4)  # and it stays there
        assert idle(broker_env) == {"steady": 1}
        eventually(  # an operation finishes with its deletes, after its replicas leave IDLE
            lambda: open_scales(broker_env) == 0,
            60,
            "the scale operations to finish",
            detail=worker.tail,
        )
    finally:
        gateway.stopped.set()
        beat.terminate()
        beat.wait(20)

    with broker_env.db.read() as s:
        names = {fid: name for fid, name in s.execute(select(Function.id, Function.name))}
        ops = s.scalars(
            select(Operation).where(Operation.kind == "scale").order_by(Operation.created_at)
        ).all()
        targets = {n: t for n, t in s.execute(select(Function.name, Function.target))}
    assert targets == {"steady": 1, "zero": 0, "plain": None}
    assert all(op.status == "succeeded" for op in ops), [(o.params, o.status, o.error) for o in ops]
    by_fn: dict[str, list[Operation]] = {}
    for op in ops:
        by_fn.setdefault(names[op.function_id or ""], []).append(op)
    assert set(by_fn) == {"steady", "zero"}
    for name, mine in by_fn.items():
        for before, after in itertools.pairwise(mine):  # never two open at once
            assert before.finished_at is not None and after.created_at >= before.finished_at
        # scaling down began a stable window after demand stopped, not before
        downs = [o for o in mine if o.created_at >= naive(stopped - 1)]
        assert downs and all(o.params["target"] < 4 for o in downs)
        assert downs[0].created_at >= naive(stopped + STABLE_S - 0.5), (name, stopped)


def naive(epoch: float) -> datetime:
    """Epoch seconds as the store's naive UTC."""
    return datetime.fromtimestamp(epoch, UTC).replace(tzinfo=None)
