"""A partly used fleet written straight into a store, and one placement decision over it.

:func:`populate` fills a migrated store with nodes (some full, unhealthy or draining) and
GPUs (partly used, their used slots held by replica rows) in a few bulk INSERTs, so that a
fleet of thousands is ready in a second. :func:`decide` makes one placement decision as
:func:`workers.replicas.spawn.place` makes it - the Creating row, the function's count
(conditional UPDATE), a node slot by the policy and a GPU by the fit - and rolls it back,
so every decision sees the same fleet. ``python -m bench.placement`` times decisions on a
small and a large fleet; the tests check that a decision leaves the fleet as it found it.
"""

from __future__ import annotations

import random
from typing import Any

from sqlalchemy import insert, update

from workers.fleet.placement import reserve_gpu, reserve_node
from workers.store.models import Function, Gpu, Node, Replica, ReplicaState, new_id

GPU_MEM_MB = 16_000
SLOTS = 4
NEED_MB = 3_000


def populate(db: Any, nodes: int, gpus: int, seed: int = 7) -> str:
    """Fill a migrated store with a partly used fleet; returns the function's id."""

    rng = random.Random(seed)
    fn_id = new_id()
    other_fn = new_id()
    node_rows = []
    for i in range(nodes):
        roll = rng.random()
        node_rows.append(
            {
                "id": new_id(),
                "name": f"node{i:05d}",
                "kind": "fcdaemon",
                "address": f"10.{i // 250}.{i % 250}.1:50051",
                "capacity": 64,
                "live": rng.randrange(0, 64),
                "healthy": roll > 0.03,
                "draining": 0.03 < roll < 0.05,
                "misses": 0,
            }
        )
    gpu_rows, replica_rows = [], []
    for j in range(gpus):
        used = rng.randrange(0, SLOTS)
        mem_used = sum(rng.choice((1_000, 2_000, 4_000)) for _ in range(used))
        gid = new_id()
        gpu_rows.append(
            {
                "id": gid,
                "uuid": f"GPU-{j:06d}",
                "server": f"gpu{j // 4}:50053",
                "mngr_addr": f"gpu{j // 4}:3333",
                "mem_total_mb": GPU_MEM_MB,
                "mem_free_mb": GPU_MEM_MB - mem_used,
                "slots_total": SLOTS,
                "slots_free": SLOTS - used,
                "first_port": 4000 + (j % 4) * SLOTS,
            }
        )
        for slot in range(used):
            replica_rows.append(
                {
                    "id": new_id(),
                    "request_id": new_id(),
                    "function_id": other_fn,
                    "node_id": node_rows[rng.randrange(nodes)]["id"],
                    "status": int(ReplicaState.IDLE),
                    "build_version": "b1",
                    "gpu_id": gid,
                    "gpu_slot": slot,
                    "gpu_mem_mb": mem_used // max(used, 1),
                    "envs_total": 1,
                    "envs_in_use": 0,
                }
            )
    functions = [
        {
            "id": fid,
            "name": name,
            "image": "bench",
            "build_version": "b1",
            "gpu_mem_mb": mb,
            "min_replicas": 0,
            "max_replicas": 10_000,
            "labels": {},
            "env": {},
            "ports": [],
        }
        for fid, name, mb in ((fn_id, "bench", NEED_MB), (other_fn, "other", 1_000))
    ]
    with db.transaction() as s:
        s.execute(insert(Function), functions)
        s.execute(insert(Node), node_rows)
        s.execute(insert(Gpu), gpu_rows)
        if replica_rows:
            s.execute(insert(Replica), replica_rows)
    return fn_id


def decide(db: Any, fn_id: str, policy: str, fit: str, pinned: str | None) -> None:
    """One place-equivalent placement decision, rolled back."""

    with db.session() as s:
        s.begin()
        fn = s.get(Function, fn_id)
        assert fn is not None
        replica = Replica(
            request_id=new_id(),
            function_id=fn.id,
            build_version="b1",
            status=int(ReplicaState.CREATING),
        )
        s.add(replica)
        counted = s.execute(  # count toward max, as place does (locks the function)
            update(Function)
            .where(Function.id == fn.id, Function.replica_count < Function.max_replicas)
            .values(replica_count=Function.replica_count + 1)
            .execution_options(synchronize_session=False)
        )
        assert counted.rowcount == 1
        s.flush()
        node = reserve_node(s, fn, policy, pinned=pinned)
        grant = reserve_gpu(s, fn, fit)
        replica.node_id, replica.gpu_id, replica.gpu_slot = node.id, grant.gpu_id, grant.slot
        s.flush()
        s.rollback()
