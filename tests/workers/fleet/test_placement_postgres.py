"""GPU memory and slots under concurrent prefork workers on PostgreSQL: never over-committed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import func, select

from agents.gpus import serve_gpus
from corral import api
from corral.api import OperationView
from testkit.processes import WorkerProcess
from tests.fixtures import Env, StartAgents, postgres_only
from tests.helpers import deploy_fn
from tests.workers.fleet.helpers import audit_gpus
from workers.fleet.gpus import add_gpu_server
from workers.functions import get_function
from workers.maintenance.audit import audit
from workers.replicas.plan import SpawnJob
from workers.replicas.spawn import place as place_rows
from workers.store.models import LIVE_STATES, Gpu, Node, Replica, ReplicaState

FUNCTIONS = {"small": 3000, "medium": 5000, "large": 7000}


def _check_invariants(env: Env) -> tuple[int, int]:
    """Assert GPU and node counters match the replicas; returns (live GPU replicas, dead)."""
    with env.db.read() as s:
        held = {
            gid: (int(n), int(mb))
            for gid, n, mb in s.execute(
                select(Replica.gpu_id, func.count(), func.sum(Replica.gpu_mem_mb))
                .where(Replica.status.in_(LIVE_STATES), Replica.gpu_id.is_not(None))
                .group_by(Replica.gpu_id)
            )
        }
        for gpu in s.scalars(select(Gpu)):
            n, mb = held.get(gpu.id, (0, 0))
            assert mb <= gpu.mem_total_mb, (gpu.uuid, mb)
            assert mb == gpu.mem_total_mb - gpu.mem_free_mb, (gpu.uuid, mb, gpu.mem_free_mb)
            assert n <= gpu.slots_total, (gpu.uuid, n)
            assert n == gpu.slots_total - gpu.slots_free, (gpu.uuid, n, gpu.slots_free)
        slots = list(
            s.execute(select(Replica.gpu_id, Replica.gpu_slot).where(Replica.gpu_slot.is_not(None)))
        )
        assert len(slots) == len(set(slots))  # no slot handed out twice
        dead = list(s.scalars(select(Replica).where(Replica.status == ReplicaState.DEAD)))
        assert all(r.gpu_slot is None for r in dead)
        assert {r.error for r in dead} <= {
            f"no GPU capacity for {name} ({mb} MB)" for name, mb in FUNCTIONS.items()
        }
        for node in s.scalars(select(Node)):
            on_node = s.scalar(
                select(func.count())
                .select_from(Replica)
                .where(Replica.node_id == node.id, Replica.status.in_(LIVE_STATES))
            )
            assert node.live == on_node, (node.name, node.live, on_node)
        assert audit_gpus(s) == []
        live_gpu = sum(n for n, _ in held.values())
    return live_gpu, len(dead)


def _wait_all(env: Env, ops: list[str], workers: list[WorkerProcess]) -> list[OperationView]:
    """Each operation's record once finished; on a timeout, what the workers and rows say."""
    try:
        return [api.wait(op, timeout=45) for op in ops]
    except TimeoutError as exc:
        with env.db.read() as s:
            states = dict(
                s.execute(select(Replica.status, func.count()).group_by(Replica.status)).all()
            )
        tails = "\n".join(f"--- {w.name}\n{w.tail(30)}" for w in workers)
        raise AssertionError(f"{exc}\nreplicas by state: {states}\n{tails}") from exc


@postgres_only  # concurrent prefork writers: SQLite serializes them, PostgreSQL races them
@pytest.mark.timeout(120)
def test_sixty_gpu_spawns_on_four_prefork_workers_never_overcommit(
    pg_broker_env: Env, start_agents: StartAgents, worker_processes: list[WorkerProcess]
) -> None:
    env = pg_broker_env
    start_agents(2, env=env, capacity=100)
    with serve_gpus(gpus={"GPU-0": 16000, "GPU-1": 16000}) as server:
        add_gpu_server(env.db, env.settings, server.address)
    for name, mb in FUNCTIONS.items():
        deploy_fn(env, name, gpu_mem=mb)
    workers = [
        WorkerProcess(env.tmp, concurrency=4, name=f"w{i}", pool="prefork") for i in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        worker_processes.extend(pool.map(lambda w: w.start(timeout=45), workers))

    started = time.monotonic()
    ops = [api.spawn(name, 20) for name in FUNCTIONS]
    # `corral db check --fix` in a loop while the spawns race: it locks the counters
    # before counting, so it never sees (or "fixes") a counter mid-change.
    stop = threading.Event()

    def audit_loop() -> list[object]:
        seen: list[object] = []
        while not stop.is_set():
            with env.db.transaction() as s:
                seen.extend(audit(s, fix=True).drifts)
        return seen

    with ThreadPoolExecutor(1) as auditor:
        audits = auditor.submit(audit_loop)
        try:
            views = _wait_all(env, ops, workers)
        finally:
            stop.set()
        assert audits.result() == []
    tails = "\n".join(w.tail(20) for w in workers)
    assert all(v["total"] == 20 and v["done"] + v["failed"] == 20 for v in views), (views, tails)
    placed = sum(v["done"] for v in views)
    live_gpu, dead = _check_invariants(env)
    assert live_gpu == placed and dead == 60 - placed
    assert 4 <= placed <= 8  # 2 GPUs x 4 slots; 16000 MB fits at least two of any size

    # second wave: delete everything while 60 more spawns race for what is freed
    with env.db.read() as s:
        live_ids = list(s.scalars(select(Replica.id).where(Replica.status.in_(LIVE_STATES))))
    ops = [api.delete(rid) for rid in live_ids] + [api.spawn(name, 20) for name in FUNCTIONS]
    views = _wait_all(env, ops, workers)
    assert all(v["status"] in ("succeeded", "partial", "failed") for v in views)
    assert all(v["status"] == "succeeded" for v in views[: len(live_ids)]), views
    placed = sum(v["done"] for v in views[len(live_ids) :])
    live_gpu, _ = _check_invariants(env)
    assert live_gpu == placed and 1 <= placed <= 8
    assert time.monotonic() - started < 60


@pytest.mark.timeout(60)
def test_roundrobin_stays_even_under_concurrent_spawns(
    pg_env: Env, start_agents: StartAgents
) -> None:
    start_agents(3, env=pg_env)
    deploy_fn(pg_env, "rr", placement="roundrobin")
    with pg_env.db.read() as s:
        fn_id = get_function(s, "rr").id

    def place(i: int) -> None:
        place_rows(pg_env.db, pg_env.settings, None, fn_id, [SpawnJob(f"rr-{i}")])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(place, range(30)))
    with pg_env.db.read() as s:
        counts = dict(
            s.execute(
                select(Node.name, func.count(Replica.id))
                .join(Replica, Replica.node_id == Node.id)
                .group_by(Node.name)
            ).all()
        )
    assert counts == {"node1": 10, "node2": 10, "node3": 10}
