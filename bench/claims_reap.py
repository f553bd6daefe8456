"""Claim latency and reaper pass cost: do they stay flat as the replica table grows?

Run: ``python -m bench.claims_reap [--sizes 1000 100000] [--claims 200] [--expired 100]``

Two SQLite stores are built (rows bulk-inserted with SQLAlchemy Core): one with
1,000 replicas and one with 100,000, spread over 50 functions and 51 nodes in a
realistic mix - mostly Idle (not yet due for reaping), many Allocated, some
Deleted history. In each store exactly ``--expired`` (100) Idle replicas are past
their idle timeout; they belong to a function with ``min_replicas = 2`` (so the
min guard runs) and live on a real reference fcdaemon agent (gRPC on loopback,
``MemoryDriver``), so a pass makes one real ``ReleaseVMSetup`` RPC per deletion.

Timed:

* claim + release: ``--claims`` (200) pairs of :func:`workers.replicas.claims.claim` /
  :func:`workers.replicas.claims.release` on a function with 2,000 (or 20) replicas, each
  its own write transaction; median and 99th percentile;
* one reaper pass (:func:`workers.maintenance.reaper.reap`, batch 100): the selection
  transaction, the 100 release RPCs and the 100 row retirements, separately and
  in total.

The aim is a 100k / 1k ratio of at most 2 for each figure: claims are one index
probe and a pass walks index ranges with ``LIMIT``, so neither should grow with
the table.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Table, insert, update

from agents.drivers import VMSpec
from agents.fcdaemon import serve_fcdaemon
from config.settings import load_settings
from workers.base.clock import now
from workers.maintenance.reaper import reap
from workers.replicas.claims import claim, release
from workers.store.db import Database
from workers.store.migrate import upgrade
from workers.store.models import COUNTED_STATES, Function, Node, Replica, ReplicaState, new_id

FUNCTIONS = 50
FAKE_NODES = 50
AIM = 2.0


@dataclass
class Figures:
    """What was measured in one store."""

    replicas: int
    build_s: float
    claim_ms: list[float] = field(default_factory=list)
    release_ms: list[float] = field(default_factory=list)
    reap: dict[str, float] = field(default_factory=dict)
    deleted: int = 0
    rpcs: int = 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sql(value: Any) -> Any:
    """A value as SQLAlchemy stores it in SQLite (datetimes as text)."""
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S.%f")
    return value


def _function_rows(fn_ids: list[str], version: str, at: datetime) -> list[dict[str, Any]]:
    """The benchmark's functions; the second keeps a min of 2."""
    return [
        {
            "id": fid,
            "name": f"fn-{i:02d}",
            "backend": "fcdaemon",
            "image": "bench",
            "kernel": "/boot/vmlinux",
            "initrd": "",
            "kernel_args": "",
            "vm_type": "osv",
            "cpu": 1,
            "mem_mb": 128,
            "min_replicas": 2 if i == 1 else 0,
            "max_replicas": 10_000,
            "labels": {},
            "env": {},
            "image_storage": "",
            "inet_dev": "",
            "name_server": "",
            "build_version": version,
            "ports": [8080],
            "idle_timeout_s": 600.0,
            "readiness": "agent",
            "exec_envs": 1,
            "gpu_mem_mb": 0,
            "replica_count": 0,
            "created_at": at,
            "updated_at": at,
        }
        for i, fid in enumerate(fn_ids)
    ]


def _node_rows(
    real_node: str, address: str, node_ids: list[str], at: datetime
) -> list[dict[str, Any]]:
    """The real agent's node, then nodes nobody calls (loopback addresses all the same)."""
    nodes = [
        {
            "id": real_node,
            "name": "agent",
            "kind": "fcdaemon",
            "address": address,
            "capacity": 100_000,
            "live": 0,
            "healthy": True,
            "draining": False,
            "misses": 0,
            "created_at": at,
        }
    ]
    nodes += [
        {
            "id": nid,
            "name": f"node-{i:02d}",
            "kind": "fcdaemon",
            "address": f"127.0.{i}.1:50051",
            "capacity": 100_000,
            "live": 0,
            "healthy": True,
            "draining": False,
            "misses": 0,
            "created_at": at,
        }
        for i, nid in enumerate(node_ids)
    ]
    return nodes


def build(url: str, size: int, expired: int, agent: Any, seed: int = 11) -> tuple[Any, Any]:
    """A migrated SQLite store holding ``size`` replicas; returns (database, settings)."""
    db = Database(url)
    upgrade(db)
    settings = load_settings(database_url=url, reap_batch=100, idle_timeout_s=600)
    rng = random.Random(seed)
    at = now()
    version = at.strftime("%Y%m%d%H%M%S%f")
    fn_ids = [new_id() for _ in range(FUNCTIONS)]
    functions = _function_rows(fn_ids, version, at)
    real_node = new_id()
    node_ids = [new_id() for _ in range(FAKE_NODES)]
    nodes = _node_rows(real_node, agent.address, node_ids, at)
    live: dict[str, int] = dict.fromkeys([real_node, *node_ids], 0)
    counted: dict[str, int] = dict.fromkeys(fn_ids, 0)
    columns = (
        "id",
        "request_id",
        "function_id",
        "node_id",
        "status",
        "vmid",
        "address",
        "build_version",
        "envs_total",
        "envs_in_use",
        "gpu_mem_mb",
        "created_at",
        "updated_at",
        "ready_at",
        "last_used_at",
        "idle_since",
        "reap_at",
        "retired_at",
    )
    rows: list[tuple[Any, ...]] = []
    created, updated = _sql(at - timedelta(hours=3)), _sql(at)
    retired = _sql(at - timedelta(hours=1))
    # Timestamps drawn from a few hundred distinct values, formatted once.
    idle_times = [
        (
            _sql(at - timedelta(seconds=sec)),
            _sql(at - timedelta(seconds=sec) + timedelta(seconds=600)),
        )
        for sec in range(1, 501)
    ]
    busy_times = [_sql(at - timedelta(seconds=sec)) for sec in range(0, 60)]

    def row(  # noqa: PLR0913 - one row's columns, by name
        fid: str,
        status: int,
        node: str,
        *,
        vmid: str | None = None,
        in_use: int = 0,
        used: str | None = None,
        since: tuple[str, str] | None = None,
        gone: str | None = None,
    ) -> None:
        rid = f"{rng.getrandbits(128):032x}"
        rows.append(
            (
                rid,
                rid,
                fid,
                node,
                int(status),
                vmid or rid,
                "http://127.1.0.1:8080",
                version,
                1,
                in_use,
                0,
                created,
                updated,
                created,
                used,
                since and since[0],
                since and since[1],
                gone,
            )
        )
        if status not in (ReplicaState.DELETED, ReplicaState.DEAD):
            live[node] += 1
        if status in COUNTED_STATES:
            counted[fid] += 1

    # The expired ones: Idle for two hours, on the real agent, with a VM there.
    expired_at = (
        _sql(at - timedelta(hours=2)),
        _sql(at - timedelta(hours=2) + timedelta(seconds=600)),
    )
    for _ in range(expired):
        vm = agent.driver.start(VMSpec(image="bench"))
        row(fn_ids[1], ReplicaState.IDLE, real_node, vmid=vm.vmid, since=expired_at)
    # Everything else: Idle but recently used (not yet due), Allocated, or history.
    for i in range(size - expired):
        fid = fn_ids[i % FUNCTIONS]
        node = node_ids[rng.randrange(FAKE_NODES)]
        draw = rng.random()
        if draw < 0.55:
            since = rng.choice(idle_times)
            row(fid, ReplicaState.IDLE, node, used=since[0], since=since)
        elif draw < 0.90:
            row(fid, ReplicaState.ALLOCATED, node, in_use=1, used=rng.choice(busy_times))
        else:
            row(fid, ReplicaState.DELETED, node, gone=retired)
    rows.sort()  # primary-key order: the id index is appended to, not shuffled
    _insert(db, functions, nodes, columns, rows, live, counted)
    return db, settings


def _insert(  # noqa: PLR0913 - the fleet's tables, written at once
    db: Database,
    functions: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    columns: tuple[str, ...],
    rows: list[tuple[Any, ...]],
    live: dict[str, int],
    counted: dict[str, int],
) -> None:
    """Write the rows in one transaction, and the counters that go with them."""
    functions_t, nodes_t, replicas_t = (cast(Table, m.__table__) for m in (Function, Node, Replica))
    with db.engine.begin() as conn:
        conn.execute(insert(functions_t), functions)
        conn.execute(insert(nodes_t), nodes)
        # Replicas straight through the driver (SQLAlchemy's per-value processing would
        # dominate), into the bare table; the indexes are built afterwards, by sorting.
        conn.exec_driver_sql("PRAGMA cache_size=-262144")
        indexes = list(replicas_t.indexes)
        for index in indexes:
            index.drop(conn)
        conn.exec_driver_sql(
            f"INSERT INTO replicas ({', '.join(columns)}) "
            f"VALUES ({', '.join('?' for _ in columns)})",
            rows,
        )
        for index in indexes:
            index.create(conn)
        for nid, n in live.items():
            conn.execute(update(nodes_t).where(Node.id == nid).values(live=n))
        for fid, n in counted.items():
            conn.execute(update(functions_t).where(Function.id == fid).values(replica_count=n))


def measure(db: Any, settings: Any, claims: int, agent: Any) -> Figures:
    """Claim/release latency and one reaper pass in a built store."""
    figures = Figures(replicas=0, build_s=0.0)
    for _ in range(20):  # warm the statement caches
        release(db, settings, claim(db, settings, "fn-00").claim_id)
    for _ in range(claims):
        t0 = time.perf_counter()
        got = claim(db, settings, "fn-00")
        t1 = time.perf_counter()
        release(db, settings, got.claim_id)
        t2 = time.perf_counter()
        figures.claim_ms.append((t1 - t0) * 1000)
        figures.release_ms.append((t2 - t1) * 1000)
    before = len(agent.agent.calls_of("ReleaseVMSetup"))
    t0 = time.perf_counter()
    report = reap(db, settings, holder="bench")
    total = time.perf_counter() - t0
    figures.reap = {**report.timings, "pass_s": total}
    figures.deleted = len(report.deleted)
    figures.rpcs = len(agent.agent.calls_of("ReleaseVMSetup")) - before
    if report.failed or {d.reason for d in report.deleted} - {"idle"}:
        raise SystemExit(f"unexpected reap outcome: {report.as_dict()}")
    return figures


def main(argv: list[str] | None = None) -> int:
    """Build the stores, measure, print the table and the ratios."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.claims_reap",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes", type=int, nargs=2, default=[1_000, 100_000], metavar=("SMALL", "LARGE")
    )
    parser.add_argument("--claims", type=int, default=200)
    parser.add_argument("--expired", type=int, default=100)
    args = parser.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    agent = serve_fcdaemon("127.0.0.1:0")
    results: dict[int, Figures] = {}
    started = time.perf_counter()
    try:
        for size in args.sizes:
            t0 = time.perf_counter()
            db, settings = build(f"sqlite:///{tmp / f'r{size}.sqlite'}", size, args.expired, agent)
            build_s = time.perf_counter() - t0
            figures = measure(db, settings, args.claims, agent)
            figures.replicas, figures.build_s = size, build_s
            results[size] = figures
            db.dispose()
    finally:
        agent.stop(grace=0)
        shutil.rmtree(tmp, ignore_errors=True)

    print("claims and reaper on SQLite; releases are real ReleaseVMSetup RPCs to a reference")
    print(
        "fcdaemon agent (MemoryDriver) on loopback; one reap pass deletes the same "
        f"{args.expired} expired replicas in each store\n"
    )
    head = (
        f"{'replicas':>9}  {'build':>6}  {'claim p50':>9}  {'claim p99':>9}  "
        f"{'release p50':>11}  {'release p99':>11}  {'reap pass':>9}  {'select':>7}  "
        f"{'RPCs':>7}  {'finish':>7}  {'deleted':>7}"
    )
    print(head)
    print("-" * len(head))
    for f in results.values():
        print(
            f"{f.replicas:>9,}  {f.build_s:>5.1f}s  {statistics.median(f.claim_ms):>7.2f}ms  "
            f"{_pct(f.claim_ms, 0.99):>7.2f}ms  {statistics.median(f.release_ms):>9.2f}ms  "
            f"{_pct(f.release_ms, 0.99):>9.2f}ms  {f.reap['pass_s'] * 1000:>7.1f}ms  "
            f"{f.reap['select_s'] * 1000:>5.1f}ms  {f.reap['release_s'] * 1000:>5.1f}ms  "
            f"{f.reap['finish_s'] * 1000:>5.1f}ms  {f.deleted:>4}/{f.rpcs}"
        )
    small, large = (results[s] for s in args.sizes)
    ratios = {
        "claim p50": statistics.median(large.claim_ms) / statistics.median(small.claim_ms),
        "claim p99": _pct(large.claim_ms, 0.99) / _pct(small.claim_ms, 0.99),
        "release p50": statistics.median(large.release_ms) / statistics.median(small.release_ms),
        "reap pass": large.reap["pass_s"] / small.reap["pass_s"],
        "reap select": large.reap["select_s"] / small.reap["select_s"],
    }
    print(f"\nratios {large.replicas:,} / {small.replicas:,} (aim <= {AIM:g}):")
    worst = 0.0
    for name, ratio in ratios.items():
        worst = max(worst, ratio)
        print(f"  {name:<12} {ratio:5.2f}  {'met' if ratio <= AIM else 'MISSED'}")
    print(f"\ntotal run time {time.perf_counter() - started:.1f}s")
    return 0 if worst <= AIM else 1


if __name__ == "__main__":
    sys.exit(main())
