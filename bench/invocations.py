"""Asynchronous calls' cost: the gateway's 202, and calls completed per second, against sync calls.

Run: ``python -m bench.invocations [-n 2000] [--calls 3000] [--concurrency 16] [--workers 2]``

Everything runs on this machine (:class:`bench.async_soak.Fleet`, without faults):
PostgreSQL and Redis from ``tests/services.py``, ``corral gateway`` in a process of its
own, ``--workers`` ``corral worker`` processes (threads, 16 each) on every queue, celery
beat, one fcdaemon agent with the process driver running ``tests.workers.gateway.callee``
(a threaded Python HTTP server; it appends each call to a ledger). This process is the
client, on uvloop with the gateway's own lean HTTP/1.1 client
(:mod:`workers.gateway.http1`), kept-alive connections. Replicas are warmed first.

1. **The 202**, at one connection: ``-n`` ``POST /async-function/callee/work`` one after
   the other (the call stored, its message sent, 202), each timed, with the workers
   stopped meanwhile (SIGSTOP: on two cores they would take the gateway's CPU running the
   calls; the calls wait in the queue, and run after); the baseline in the same run is
   the same POST made synchronously (``/function/callee/work``: claimed, forwarded to a
   warm replica, answered). Aims (issue 39): p50 at most 5 ms, p99 at most 20 ms.
2. **Completed per second**, at ``--concurrency`` connections: ``--calls`` calls sent
   asynchronously, timed from the first POST until the store has every one over (run by
   the workers, each through their own gateway's flow); against the same number of the
   same calls made synchronously through the gateway at the same concurrency.

It prints each side's p50 / p99 and rate, the ratios async / sync, and the CPU one call
costs each part (the gateway, the workers, PostgreSQL, Redis, the replicas, this client):
on a machine other work shares, the CPU a call costs says more than its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import uvloop
from sqlalchemy import func, select

from bench.async_soak import Fleet
from workers.gateway import http1
from workers.store.models import CALL_OPEN, Call

BODY = b'{"work": 1}'


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class Timed:
    """One run: requests (or calls) per second, and each request's seconds."""

    rate: float
    p50: float
    p99: float
    errors: int
    cpu_ms: dict[str, float] | None = None  # CPU milliseconds a request costs, per part


class Cpu:
    """The CPU time the fleet's parts have used, read from ``/proc`` (psutil)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def read(self) -> dict[str, float]:
        """Seconds of CPU each part has used so far (its processes alive now)."""
        roots: dict[str, list[int | None]] = {
            "gateway": [self.fleet.gateway.pid],
            "workers": [w.proc.pid for w in self.fleet.workers if w.proc is not None],
            "postgres": [self.fleet.pg.pid],
            "redis": [self.fleet.redis.pid],
        }
        known = {pid for pids in roots.values() for pid in pids if pid is not None}
        me = psutil.Process()
        out = {name: _cpu(pids) for name, pids in roots.items()}
        out["replicas"] = _cpu([c.pid for c in me.children() if c.pid not in known])
        times = me.cpu_times()
        out["client"] = times.user + times.system
        return out


def _cpu(pids: list[int | None]) -> float:
    total = 0.0
    for pid in pids:
        if pid is None:
            continue
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def _metered(cpu: Cpu, run: Timed, before: dict[str, float], requests: int) -> Timed:
    after = cpu.read()
    per = {k: (after[k] - before[k]) * 1000 / requests for k in before}
    return Timed(run.rate, run.p50, run.p99, run.errors, per)


class Client:
    """Kept-alive connections to the gateway, POSTing one request at a time on each."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.netloc = parts.netloc
        self.pool = http1.Pool(f"http://{parts.netloc}", 5.0)

    def head(self, path: str) -> bytes:
        """A POST's head with the benchmark's body."""
        return (
            f"POST {path} HTTP/1.1\r\nHost: {self.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode()

    async def post(self, head: bytes) -> int:
        """Send one request and read its answer; its status."""
        exchange = await self.pool.send(head, BODY, head_only=False)
        await exchange.head()
        while await exchange.chunk() is not None:
            pass
        return exchange.status

    async def run(self, path: str, n: int, concurrency: int, ok: int) -> Timed:
        """``n`` POSTs to ``path`` on ``concurrency`` connections, each timed."""
        head = self.head(path)
        latencies: list[float] = []
        errors = 0
        left = n

        async def worker() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                status = await self.post(head)
                latencies.append(time.perf_counter() - t0)
                errors += status != ok

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        return Timed(n / elapsed, statistics.median(latencies), _pct(latencies, 0.99), errors)


def _open_calls(fleet: Fleet) -> int:
    with fleet.db.read() as s:
        return int(s.scalar(select(func.count()).where(Call.status.in_(CALL_OPEN))) or 0)


async def _completed(fleet: Fleet, client: Client, calls: int, concurrency: int) -> Timed:
    """``calls`` asynchronous calls at ``concurrency``: accepted, then all over; calls/s."""
    started = time.perf_counter()
    accepted = await client.run("/async-function/callee/work", calls, concurrency, ok=202)
    while _open_calls(fleet):
        await asyncio.sleep(0.02)
    elapsed = time.perf_counter() - started
    return Timed(calls / elapsed, accepted.p50, accepted.p99, accepted.errors)


async def _bench(fleet: Fleet, args: argparse.Namespace) -> dict[str, Timed]:
    client = Client(fleet.gateway_url)
    cpu = Cpu(fleet)
    warm = args.concurrency * 20  # replicas up, connections open, workers' gateways warm
    await client.run("/function/callee/work", warm, args.concurrency, ok=200)
    await _completed(fleet, client, warm, args.concurrency)
    out: dict[str, Timed] = {}
    n, c = args.n, args.concurrency
    for name, path, count, concurrency, ok in (
        ("sync, 1 connection", "/function/callee/work", n, 1, 200),
        ("202, 1 connection", "/async-function/callee/work", n, 1, 202),
        (f"sync, {c} connections", "/function/callee/work", args.calls, c, 200),
    ):
        paused = ok == 202
        fleet.pause_workers(paused)
        try:
            before = cpu.read()
            run = await client.run(path, count, concurrency, ok=ok)
            out[name] = _metered(cpu, run, before, count)
        finally:
            if paused:
                fleet.pause_workers(False)
        while _open_calls(fleet):  # the calls just accepted run before the next side
            await asyncio.sleep(0.05)
    before = cpu.read()
    run = await _completed(fleet, client, args.calls, c)
    out[f"async, {c} connections"] = _metered(cpu, run, before, args.calls)
    client.pool.close()
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def report(runs: dict[str, Timed], concurrency: int) -> str:
    """The figures and ratios, for people."""
    parts = ("gateway", "workers", "postgres", "redis", "replicas", "client")
    lines = [
        f"{'':<24}{'rate /s':>10}{'p50':>12}{'p99':>12}{'errors':>8}   CPU ms a call: "
        + " ".join(f"{p:>8}" for p in parts)
    ]
    for name, run in runs.items():
        cpu = run.cpu_ms or {}
        lines.append(
            f"{name:<24}{run.rate:>10.0f}{_ms(run.p50):>12}{_ms(run.p99):>12}{run.errors:>8}"
            + " " * 17
            + " ".join(f"{cpu.get(p, 0.0):>8.2f}" for p in parts)
        )
    sync1, accepted = runs["sync, 1 connection"], runs["202, 1 connection"]
    syncn = runs[f"sync, {concurrency} connections"]
    asyncn = runs[f"async, {concurrency} connections"]
    lines += [
        f"202 at one connection: p50 {_ms(accepted.p50)} (aim <= 5 ms), p99 {_ms(accepted.p99)} "
        f"(aim <= 20 ms); {accepted.p50 / sync1.p50:.2f}x the p50 of the same call made "
        "synchronously",
        f"completed per second at {concurrency} connections: async {asyncn.rate:.0f}/s, sync "
        f"{syncn.rate:.0f}/s (async / sync = {asyncn.rate / syncn.rate:.2f}); the async calls' "
        f"202s took p50 {_ms(asyncn.p50)}, p99 {_ms(asyncn.p99)} meanwhile",
        f"CPU a call, all parts: async {sum((asyncn.cpu_ms or {}).values()):.2f} ms, sync "
        f"{sum((syncn.cpu_ms or {}).values()):.2f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures; non-zero if a request was not answered right."""
    parser = argparse.ArgumentParser(prog="python -m bench.invocations")
    parser.add_argument("-n", type=int, default=2000, help="requests timed at one connection")
    parser.add_argument("--calls", type=int, default=3000, help="calls of the throughput runs")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2, help="`corral worker` processes")
    args = parser.parse_args(argv)
    if min(args.n, args.calls, args.concurrency, args.workers) <= 0:
        parser.error("every count must be positive")
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-invocations-"))
    fleet = Fleet(tmp, lambda m: print(m, flush=True), watch=False, workers=args.workers)
    try:
        fleet.start()
        runs = uvloop.run(_bench(fleet, args))
    finally:
        fleet.stop()
    print(report(runs, args.concurrency), flush=True)
    return 1 if any(run.errors for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
