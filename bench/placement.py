"""Placement decision time: does choosing a node and a GPU stay flat as the fleet grows?

Run: ``python -m bench.placement [-n 150] [--database-url URL]``

What is timed is one placement decision as :func:`workers.replicas.spawn.place`
makes it, in one transaction: write the Creating replica row, count it toward
the function's max (conditional UPDATE), reserve a node slot by the
policy (conditional UPDATE) and a GPU's memory and worker slot by the fit
(conditional UPDATE, then the free slot number), flush - and then roll back, so
every decision sees the same fleet.

Two stores are built side by side (SQLite files by default; with
``--database-url`` a PostgreSQL server, two fresh databases on it): a *small*
fleet of 10 nodes and 40 GPUs and a *large* one of 1,000 nodes and 4,000 GPUs,
each with nodes partly full (some unhealthy or draining), GPUs partly used and
replica rows holding the used GPU slots. For every node policy and GPU fit the
median and 95th percentile decision time are printed for both, with the ratio
large / small; the aim is a ratio of at most 3. Most candidate queries walk an
index (``ix_nodes_place``, ``ix_gpus_fit``); ``random`` (ORDER BY random()) and
first fit (ORDER BY recording order) sort their candidates, which grows with the
fleet but stays well inside the aim at this size.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import insert, select, update
from sqlalchemy.engine import make_url

from workers.fleet.placement import FITS, reserve_gpu, reserve_node
from workers.kinds import POLICIES
from workers.store.db import Database
from workers.store.migrate import upgrade
from workers.store.models import Function, Gpu, Node, Replica, ReplicaState, new_id

SMALL = (10, 40)
LARGE = (1_000, 4_000)
GPU_MEM_MB = 16_000
SLOTS = 4
NEED_MB = 3_000
AIM = 3.0


@dataclass(frozen=True)
class Timing:
    """Decision times of one (fleet, policy, fit) in milliseconds."""

    median_ms: float
    p95_ms: float


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


def _pins(db: Any) -> list[str]:
    """Ids of the nodes a ``spread`` spawn could be pinned to."""

    with db.read() as s:
        return list(
            s.scalars(
                select(Node.id).where(
                    Node.healthy.is_(True), Node.draining.is_(False), Node.live < Node.capacity
                )
            )
        )


def measure(fleets: dict[str, tuple[Any, str]], policy: str, fit: str, n: int) -> dict[str, Timing]:
    """Median and p95 of ``n`` decisions per fleet, the fleets taking turns (after warm-up).

    Alternating one decision on each fleet exposes both to the same machine load, so
    the ratio stays meaningful on a busy machine.
    """
    pins = {label: _pins(db) for label, (db, _) in fleets.items()}
    rng = random.Random(11)
    times: dict[str, list[float]] = {label: [] for label in fleets}
    for i in range(n + 10):
        for label, (db, fn_id) in fleets.items():
            pinned = rng.choice(pins[label]) if policy == "spread" else None
            t0 = time.perf_counter()
            decide(db, fn_id, policy, fit, pinned)
            if i >= 10:
                times[label].append((time.perf_counter() - t0) * 1000)
    out = {}
    for label, values in times.items():
        values.sort()
        out[label] = Timing(statistics.median(values), values[int(len(values) * 0.95) - 1])
    return out


def _stores(url: str | None, tmp: Path) -> tuple[str, str, Callable[[], None]]:
    """URLs of the small and large stores, and how to drop them afterwards."""
    if url is None:
        small, large = (f"sqlite:///{tmp / f'{n}.sqlite'}" for n in ("small", "large"))
        return small, large, lambda: None

    base = make_url(url)
    names = [f"corral_bench_{size}_{int(time.time())}" for size in ("small", "large")]
    admin = base.set(drivername="postgresql", database="postgres")
    conninfo = admin.render_as_string(hide_password=False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            for name in names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}"')

    small, large = (base.set(database=n).render_as_string(hide_password=False) for n in names)
    return small, large, drop


def main(argv: list[str] | None = None) -> int:
    """Build both fleets, time every policy and fit, print the figures; 1 if the aim is missed."""
    parser = argparse.ArgumentParser(prog="python -m bench.placement")
    parser.add_argument("-n", type=int, default=150, help="decisions timed per case")
    parser.add_argument("--database-url", help="a PostgreSQL server URL (default: SQLite files)")
    args = parser.parse_args(argv)

    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-placement-"))
    small_url, large_url, drop = _stores(args.database_url, tmp)
    fleets: dict[str, tuple[Database, str]] = {}
    try:
        for label, url, (nodes, gpus) in (("small", small_url, SMALL), ("large", large_url, LARGE)):
            db = Database(url)
            upgrade(db)
            fleets[label] = (db, populate(db, nodes, gpus))
        worst = _report(fleets, args.n, "PostgreSQL" if args.database_url else "SQLite")
    finally:
        for db, _ in fleets.values():
            db.dispose()
        drop()
        shutil.rmtree(tmp, ignore_errors=True)
    verdict = "met" if worst <= AIM else "MISSED"
    print(
        f"worst ratio {worst:.2f} (aim <= {AIM:g}: {verdict}); "
        f"ran in {time.monotonic() - started:.1f} s"
    )
    return 0 if worst <= AIM else 1


def _report(fleets: dict[str, tuple[Any, str]], n: int, kind: str) -> float:
    """Time every policy and fit on both fleets, print a table; returns the worst ratio."""
    print(
        f"placement decision time on {kind}: small = {SMALL[0]} nodes / {SMALL[1]} GPUs, "
        f"large = {LARGE[0]} nodes / {LARGE[1]} GPUs; {n} decisions per case"
    )
    print(
        f"{'policy':<12} {'fit':<6} {'small ms (p50/p95)':>19} {'large ms (p50/p95)':>19} "
        f"{'ratio':>6}"
    )
    worst = 0.0
    for policy in POLICIES:
        for fit in FITS:
            timing = measure(fleets, policy, fit, n)
            small, large = timing["small"], timing["large"]
            ratio = large.median_ms / small.median_ms
            worst = max(worst, ratio)
            print(
                f"{policy:<12} {fit:<6} {small.median_ms:>9.3f}/{small.p95_ms:<9.3f} "
                f"{large.median_ms:>9.3f}/{large.p95_ms:<9.3f} {ratio:>6.2f}"
            )
    return worst


if __name__ == "__main__":
    sys.exit(main())
