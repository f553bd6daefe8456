"""The warm path's routing under churn: calls at a steady rate while replicas come and go.

Run: ``python -m bench.warmroutes [--rate 1000] [--seconds 10] [--low 2] [--high 8]
[--envs 2] [--every-ms 500] [--postgres [URL]]``

Everything runs on this machine, each part a process: an embedded Redis, a SQLite store
(or PostgreSQL), one ``corral worker``, one reference fcdaemon agent whose replicas are
real processes (``examples.hello``), and one ``corral gateway`` with HAProxy in front of
it (:mod:`workers.gateway.haproxy`), its keep window short (``--keep-ms``, 300) so that
environments go back to the store soon after they are unused.

For ``--seconds``, this process sends ``--rate`` GETs a second to the function, open
loop (each at its time, however long the others take; kept-alive connections of the
gateway's own lean client, :mod:`workers.gateway.http1`), while a thread scales the
function between ``--low`` and ``--high`` replicas every ``--every-ms``: replicas come
(the scale's spawns; the gateway claims their environments when its calls overflow to
the activator, then lends them to HAProxy) and go (scale-down takes only replicas with no
environment claimed: those HAProxy stopped using and the gateway gave back).

It prints the calls sent, those that did not answer 200 (the aim, issue 40: none at 1,000
a second), their p50 / p99, how many replicas were made and deleted meanwhile, the share
of calls HAProxy carried, and how long routing changes took to reach HAProxy - from the
gateway's decision (a server put in or taken out, a function's backend mapped or not) to
HAProxy's answer on its runtime socket (``corral_warm_route_change_seconds``; aim: within
50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import func, select

from bench.gateway import _pct, _wait_http
from bench.localstack import GATEWAY, local_stack
from bench.options import add_counts, add_store_option
from config.settings import get_settings
from corral import api
from testkit.services import free_port
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.gateway import http1
from workers.gateway.haproxy.process import Unavailable, find
from workers.store.models import Replica, ReplicaState


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.warmroutes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_counts(
        parser,
        {
            "--rate": (1000, "calls a second"),
            "--seconds": (10, "how long the calls come"),
            "--low": (2, "replicas at the low end of the churn"),
            "--high": (8, "replicas at the high end"),
            "--envs": (2, "environments per replica"),
            "--every-ms": (500, "milliseconds between two scales"),
            "--keep-ms": (300, "the gateway's keep window"),
        },
    )
    add_store_option(parser)
    return parser.parse_args(argv)


async def _calls(url: str, rate: int, seconds: int) -> tuple[list[float], list[str]]:
    """``rate`` GETs a second for ``seconds``, open loop; their seconds, and the failures."""
    parts = urlsplit(url)
    pool = http1.Pool(f"http://{parts.netloc}", 5.0)
    head = f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()
    times: list[float] = []
    failed: list[str] = []

    async def one() -> None:
        began = time.perf_counter()
        try:
            exchange = await pool.send(head, b"", head_only=False)
            await exchange.head()
            while await exchange.chunk() is not None:
                pass
        except http1.Broken as exc:
            failed.append(f"broken: {exc}")
            return
        times.append(time.perf_counter() - began)
        if exchange.status != 200:
            failed.append(str(exchange.status))

    started = time.perf_counter()
    tasks = []
    for i in range(rate * seconds):
        wait = started + i / rate - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.ensure_future(one()))
    await asyncio.gather(*tasks)
    pool.close()
    return times, failed


def _churn(args: argparse.Namespace, stop: threading.Event, scales: list[int]) -> None:
    """Scale the function between ``--low`` and ``--high`` until ``stop``."""
    while not stop.is_set():
        target = args.high if len(scales) % 2 == 0 else args.low
        api.wait(api.scale("hello", target), timeout=120)
        scales.append(target)
        stop.wait(args.every_ms / 1000)


def _changes(metrics: str) -> dict[str, tuple[int, float, float]]:
    """Per change kind: (count, share within 50 ms, mean seconds) from the histogram."""
    out = {}
    for change in ("add", "remove"):
        count = re.search(
            rf'^corral_warm_route_change_seconds_count{{change="{change}"}} (\S+)', metrics, re.M
        )
        total = re.search(
            rf'^corral_warm_route_change_seconds_sum{{change="{change}"}} (\S+)', metrics, re.M
        )
        within = re.search(
            rf'^corral_warm_route_change_seconds_bucket{{change="{change}",le="0.05"}} (\S+)',
            metrics,
            re.M,
        )
        if count and total and within and float(count[1]):
            n = float(count[1])
            out[change] = (int(n), float(within[1]) / n, float(total[1]) / n)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    args = _parse(argv)
    try:
        binary = find(get_settings().gateway_haproxy)
    except Unavailable as exc:
        print(f"bench.warmroutes skipped: it needs HAProxy: {exc} (apt-get install haproxy)")
        return 0
    settings = {
        "CORRAL_GATEWAY_DATAPLANE": "haproxy",
        "CORRAL_GATEWAY_KEEP_S": str(args.keep_ms / 1000),
    }
    with local_stack(args, "corral-bench-routes-", settings) as running:
        gw_port = free_port()
        running.start("gateway", [*GATEWAY, "--listen", f"127.0.0.1:{gw_port}"])
        gateway = f"http://127.0.0.1:{gw_port}"
        _wait_http(gateway + "/healthz")
        url = f"{gateway}/function/hello"
        before = _prepare(args, running.db, running.agent_port, url)
        carried = _carried(httpx.get(f"{gateway}/metrics", timeout=10).text)
        stop, scales = threading.Event(), list[int]()
        churn = threading.Thread(target=_churn, args=(args, stop, scales), daemon=True)
        print(
            f"warm routes: {args.rate} calls/s for {args.seconds} s while the function scales "
            f"{args.low} <-> {args.high} replicas ({args.envs} environments each) every "
            f"{args.every_ms} ms; keep window {args.keep_ms} ms; {binary}; "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        churn.start()
        try:
            times, failed = _run(_calls(url, args.rate, args.seconds))
        finally:
            stop.set()
            churn.join(120)
        metrics = httpx.get(f"{gateway}/metrics", timeout=10).text
        _report(args, (times, failed, scales), running.db, (before, carried), metrics)
    return 0 if not failed else 1


def _prepare(args: argparse.Namespace, db: Any, agent_port: int, url: str) -> int:
    """The agent registered, ``hello`` deployed at ``--low`` replicas and warm; replicas so far."""
    with db.transaction() as s:
        upsert_node(s, f"127.0.0.1:{agent_port}", name="bench-agent", capacity=1000)
        spec = spec_from(
            name="hello",
            image="examples.hello",
            kernel="/boot/vmlinux",
            max=args.high,
            exec_envs=args.envs,
        )
        deploy(s, spec, get_settings())
    view = api.wait(api.scale("hello", args.low), timeout=120)
    assert view["status"] == "succeeded", view
    for _ in range(20):  # warm: the activator's environments lent to HAProxy
        assert httpx.get(url, timeout=30).status_code == 200
    with db.read() as s:
        return int(s.scalar(select(func.count()).select_from(Replica)) or 0)


def _run(work: object) -> tuple[list[float], list[str]]:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(work)  # type: ignore[arg-type]
    return uvloop.run(work)  # type: ignore[arg-type]


def _carried(metrics: str) -> float:
    """Calls of hello HAProxy carried so far."""
    found = re.search(r'^corral_warm_requests_total{function="hello"} (\S+)', metrics, re.M)
    return float(found[1]) if found else 0.0


def _report(
    args: argparse.Namespace,
    seen: tuple[list[float], list[str], list[int]],
    db: Any,
    before: tuple[int, float],
    metrics: str,
) -> None:
    """The run's figures: failures, latency, churn, HAProxy's share, routing changes."""
    times, failed, scales = seen
    sent = args.rate * args.seconds
    ms = 1000.0
    print(
        f"  calls {sent}, not 200: {len(failed)} (aim: none: {'met' if not failed else 'MISSED'})"
        + (f" - {sorted(set(failed))[:5]}" if failed else "")
    )
    if times:
        print(f"  p50 {statistics.median(times) * ms:.2f} ms   p99 {_pct(times, 0.99) * ms:.2f} ms")
    with db.read() as s:
        made = (s.scalar(select(func.count()).select_from(Replica)) or 0) - before[0]
        gone = s.scalar(
            select(func.count()).select_from(Replica).where(Replica.status == ReplicaState.DELETED)
        )
    print(f"  scales {len(scales)}; replicas made {made}, deleted {gone} meanwhile")
    carried = _carried(metrics) - before[1]
    print(f"  carried by HAProxy: {carried / max(1, sent):.0%} of the calls")
    for change, (count, within, mean) in _changes(metrics).items():
        print(
            f"  routing changes ({change}): {count}, within 50 ms {within:.0%}, mean "
            f"{mean * ms:.1f} ms (aim: all within 50 ms: {'met' if within >= 1 else 'MISSED'})"
        )


if __name__ == "__main__":
    sys.exit(main())
