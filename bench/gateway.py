"""The gateway's cost: throughput and latency against calling warm replicas directly, cold starts.

Run: ``python -m bench.gateway [-n 2000] [--concurrency 16] [--replicas 4] [--cold 20]
[--postgres [URL]]``

Everything runs on this machine, each part in its own process: an embedded Redis, a
SQLite store (or PostgreSQL with ``--postgres``: a throwaway server unless URL is
given), one ``celery -A workers worker`` (prefork x2), one reference fcdaemon agent
whose replicas are real processes (``examples.hello``: a threaded Python HTTP
server), one ``corral gateway``, and this process as the HTTP client
(httpx ``AsyncClient``, ``--concurrency`` requests in flight).

1. warm, direct - ``-n`` GETs spread round-robin straight over the addresses of
   ``--replicas`` Idle replicas (the outside baseline: no proxy, no claims);
2. warm, gateway - the same ``-n`` GETs, same client and concurrency, to
   ``/function/hello`` (each takes an environment the gateway holds - claimed from
   the store when it holds none free - forwards, and returns it);
3. agent create - ``--cold`` CreateReplica calls straight to the agent, each timed
   until the new replica answers HTTP (what any control plane must wait for);
4. cold, gateway - one GET each to ``--cold`` functions at zero replicas (claim,
   shared cold start through the broker and worker, forward), one at a time.

It prints requests/s of 1 and 2 and their ratio (aim >= 0.5), the latency the
gateway adds (p50 / p99 of 2 minus those of 1), and the cold-start p50 / p99 minus
the agent's own create time of 3.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from sqlalchemy import select

from bench.options import add_counts, add_store_option, store_for
from config.celery import QUEUES
from config.settings import get_settings, reset_settings
from protos import fcdaemon_grpc, fcdaemon_pb2
from stack.redis import free_port, redis_argv
from tasks import api
from workers.celery import configure
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.db import get_database
from workers.store.migrate import upgrade
from workers.store.models import Replica

ROOT = Path(__file__).resolve().parent.parent


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not answer within {timeout:g}s") from None
            time.sleep(0.01)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _load(urls: list[str], n: int, concurrency: int) -> tuple[float, list[float], int]:
    """``n`` GETs over ``urls`` round-robin, ``concurrency`` at once: (req/s, latencies, errors)."""
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        todo = iter(range(n))

        async def worker() -> None:
            nonlocal errors
            for i in todo:
                t0 = time.perf_counter()
                response = await client.get(urls[i % len(urls)])
                latencies.append(time.perf_counter() - t0)
                if response.status_code != 200:
                    errors += 1

        for _ in range(min(50, n // 10)):  # warm the connections first
            await client.get(urls[0])
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return n / elapsed, latencies, errors


def _agent_create_times(agent: str, count: int) -> list[float]:
    """CreateReplica straight to the agent, each timed until its replica answers HTTP."""

    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(agent))
    times: list[float] = []
    for i in range(count):
        t0 = time.perf_counter()
        reply = stub.CreateReplica(fcdaemon_pb2.CreateRequest(
            kernelImagePath="/boot/vmlinux", imageName="examples.hello", numReplica=1,
            cpu=1, mem=128), timeout=30)
        if not reply.port:  # the reference agent's extension: the replica's HTTP port
            raise RuntimeError(f"CreateReply without a port (call {i})")
        _wait_http(f"http://{reply.ip}:{reply.port}")
        times.append(time.perf_counter() - t0)
        stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=30)
    return times


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_counts(parser, {
        "-n": (2000, "requests per warm phase"),
        "--concurrency": (16, "requests in flight"),
        "--replicas": (4, "warm replicas"),
        "--envs": (4, "environments per warm replica"),
        "--cold": (20, "cold starts measured"),
    })
    add_store_option(parser)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-gw-"))
    redis_port = free_port()
    db_url, pg_server = store_for(args, tmp)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")},
           "CORRAL_BROKER_URL": f"redis://127.0.0.1:{redis_port}/0",
           "CORRAL_RESULT_BACKEND": f"redis://127.0.0.1:{redis_port}/1",
           "CORRAL_DATABASE_URL": db_url,
           "CORRAL_STATE_DIR": str(tmp / "state"), "PYTHONPATH": str(ROOT)}
    os.environ.update({k: v for k, v in env.items() if k.startswith("CORRAL_")})
    reset_settings()  # settings read on import (bench.spawn's imports) are not this run's
    configure(get_settings())  # this run's broker
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str]) -> None:
        log = (tmp / f"{name}.log").open("wb")
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT))

    try:
        start("redis", redis_argv(tmp, redis_port))
        db = get_database(env["CORRAL_DATABASE_URL"])
        upgrade(db)
        agent_port, gw_port = _free_port(), _free_port()
        py = sys.executable
        start("agent", [py, "-m", "agents.fcdaemon", "--listen", f"127.0.0.1:{agent_port}",
                        "--driver", "process", "--log-level", "WARNING"])
        start("worker", [py, "-m", "celery", "-A", "workers", "worker", "-P", "prefork", "-c",
                         "2", "-l", "WARNING", "--without-gossip", "--without-mingle", "-Q",
                         ",".join(QUEUES)])
        start("gateway", [py, "-m", "tasks.cli", "gateway", "--listen",
                          f"127.0.0.1:{gw_port}"])
        gateway = f"http://127.0.0.1:{gw_port}"
        _wait_http(gateway + "/healthz")
        addresses = _warm_replicas(args, db, agent_port)
        direct = asyncio.run(_load(addresses, args.n, args.concurrency))
        through = asyncio.run(_load([f"{gateway}/function/hello"], args.n, args.concurrency))
        create = _agent_create_times(f"127.0.0.1:{agent_port}", args.cold)
        _report(args, direct, through, create, _cold_starts(gateway, args.cold))
        return 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if pg_server is not None:
            pg_server.stop()


def _warm_replicas(args: argparse.Namespace, db: Any, agent_port: int) -> list[str]:
    """Register the agent, deploy hello and the cold functions, start hello's replicas."""
    settings = get_settings()
    with db.transaction() as s:
        upsert_node(s, f"127.0.0.1:{agent_port}", name="bench-agent", capacity=1000)
        deploy(s, spec_from(name="hello", image="examples.hello", kernel="/boot/vmlinux",
                            max=args.replicas, exec_envs=args.envs), settings)
        for i in range(args.cold):
            deploy(s, spec_from(name=f"cold-{i}", image="examples.hello",
                                kernel="/boot/vmlinux", max=1), settings)
    view = api.wait(api.spawn("hello", args.replicas), timeout=120)
    if view["status"] != "succeeded":
        raise RuntimeError(f"warm replicas did not start: {view}")
    with db.read() as s:
        addresses = [a for a in s.scalars(select(Replica.address)) if a]
    for address in addresses:
        _wait_http(address)
    return addresses


def _cold_starts(gateway: str, n: int) -> list[float]:
    """Seconds from the first request to its answer, for each of ``n`` functions at zero."""
    cold: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        response = httpx.get(f"{gateway}/function/cold-{i}", timeout=120)
        cold.append(time.perf_counter() - t0)
        if response.status_code != 200:
            raise RuntimeError(f"cold start {i}: {response.status_code} {response.text}")
    return cold


def _report(args: Any, direct: tuple[float, list[float], int],
            through: tuple[float, list[float], int], create: list[float],
            cold: list[float]) -> None:
    ms = 1000.0
    d_rps, d_lat, d_err = direct
    g_rps, g_lat, g_err = through
    d50, d99 = statistics.median(d_lat) * ms, _pct(d_lat, 0.99) * ms
    g50, g99 = statistics.median(g_lat) * ms, _pct(g_lat, 0.99) * ms
    print(f"gateway benchmark: {args.n} GETs per warm phase, {args.concurrency} in flight, "
          f"{args.replicas} warm replicas x {args.envs} environments (examples.hello), "
          f"{args.cold} cold starts; {'PostgreSQL' if args.postgres is not None else 'SQLite'} "
          "store, one gateway process")
    print(f"  direct to replicas   {d_rps:8.0f} req/s   p50 {d50:7.2f} ms   p99 {d99:7.2f} ms"
          f"   errors {d_err}")
    print(f"  through the gateway  {g_rps:8.0f} req/s   p50 {g50:7.2f} ms   p99 {g99:7.2f} ms"
          f"   errors {g_err}")
    ratio = g_rps / d_rps
    verdict = "met" if ratio >= 0.5 else "MISSED"
    print(f"  ratio gateway / direct  {ratio:.2f} (aim >= 0.5: {verdict})")
    print(f"  added latency      p50 {g50 - d50:7.2f} ms   p99 {g99 - d99:7.2f} ms")
    c50, c99 = statistics.median(cold) * ms, _pct(cold, 0.99) * ms
    a50, a99 = statistics.median(create) * ms, _pct(create, 0.99) * ms
    print(f"  agent create+ready p50 {a50:7.1f} ms   p99 {a99:7.1f} ms")
    print(f"  cold start (gw)    p50 {c50:7.1f} ms   p99 {c99:7.1f} ms")
    print(f"  cold start minus agent create   p50 {c50 - a50:7.1f} ms   p99 {c99 - a99:7.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
