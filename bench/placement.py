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
from sqlalchemy import select
from sqlalchemy.engine import make_url

from testkit.fleets import decide, populate
from workers.base.kinds import POLICIES
from workers.fleet.placement import FITS
from workers.store.db import Database
from workers.store.migrate import upgrade
from workers.store.models import Node

SMALL = (10, 40)
LARGE = (1_000, 4_000)
AIM = 3.0


@dataclass(frozen=True)
class Timing:
    """Decision times of one (fleet, policy, fit) in milliseconds."""

    median_ms: float
    p95_ms: float


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
