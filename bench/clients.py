"""What an upstream HTTP client costs the gateway a request: its own against kept libraries.

Run: ``python -m bench.clients [-n 5000] [--rounds 3]``

The gateway forwards each request over a kept-alive HTTP/1.1 connection to a replica
with :mod:`workers.gateway.http1`, a client of its own on ``httptools``. Issue 30 keeps
it only if a kept library costs more. This measures it against the asyncio clients
that could take its place - ``httpcore`` (httpx's transport, pure Python on h11),
``httpx`` itself and ``aiohttp`` (when installed; its parser is llhttp in C, like
httptools') - each sending ``-n`` GETs one after another on one kept-alive connection to
an ``examples.hello`` replica (a process of its own), on uvloop as the gateway runs,
the body read whole. Per client it prints the p50 of a request's wall time and the CPU
this process spent a request (``time.process_time``: the client's own cost, the
replica's excluded), the best of ``--rounds`` rounds taken in turns.

Each client is asked for what the gateway needs: the request target sent as given (no
normalisation) and no header added. httpcore sends exactly the headers given; httpx and
aiohttp add theirs unless told not to, and normalise the URL (aiohttp keeps it with
``encoded=True``); the figures are for their cheapest configuration.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpcore
import httpx
import uvloop

from testkit.services import free_port
from workers.gateway import http1

ROOT = Path(__file__).resolve().parent.parent
Call = Callable[[], Awaitable[int]]


def _replica() -> tuple[subprocess.Popen[bytes], int]:
    """``examples.hello`` on a free loopback port, once it accepts connections."""
    port = free_port()
    env = {**os.environ, "PORT": str(port), "HOST": "127.0.0.1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "examples.hello"], env=env, cwd=ROOT, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.01)


async def _own(port: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    pool = http1.Pool(f"http://127.0.0.1:{port}", 5.0)
    head = f"GET /x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()

    async def call() -> int:
        exchange = await pool.send(head, b"", head_only=False)
        await exchange.head()
        while await exchange.chunk() is not None:
            pass
        exchange.abandon()
        return exchange.status

    async def close() -> None:
        pool.close()

    return call, close


async def _httpcore(port: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    pool = httpcore.AsyncConnectionPool(max_connections=1)
    url = httpcore.URL(scheme=b"http", host=b"127.0.0.1", port=port, target=b"/x")
    headers = [(b"Host", f"127.0.0.1:{port}".encode())]

    async def call() -> int:
        response = await pool.request(b"GET", url, headers=headers)
        return response.status

    return call, pool.aclose


async def _httpx(port: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=1))

    async def call() -> int:
        return (await client.get(f"http://127.0.0.1:{port}/x")).status_code

    return call, client.aclose


async def _aiohttp(port: int) -> tuple[Call, Callable[[], Awaitable[None]]]:
    import aiohttp  # type: ignore[import-not-found,unused-ignore]  # optional: measured when installed
    import yarl  # type: ignore[import-not-found,unused-ignore]

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=1),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        auto_decompress=False,
    )
    url = yarl.URL(f"http://127.0.0.1:{port}/x", encoded=True)

    async def call() -> int:
        async with session.get(url) as response:
            await response.read()
            return int(response.status)

    return call, session.close


CLIENTS = {"http1 (own)": _own, "httpcore": _httpcore, "httpx": _httpx, "aiohttp": _aiohttp}


async def _measure(
    make: Callable[[int], Awaitable[tuple[Call, Any]]], port: int, n: int
) -> tuple[float, float]:
    """(p50 seconds, CPU seconds a request) of ``n`` calls after a warm-up."""
    call, close = await make(port)
    try:
        for _ in range(200):
            assert await call() == 200
        times = []
        cpu = time.process_time()
        for _ in range(n):
            started = time.perf_counter()
            await call()
            times.append(time.perf_counter() - started)
        return statistics.median(times), (time.process_time() - cpu) / n
    finally:
        await close()


def main(argv: list[str] | None = None) -> int:
    """Measure each client; print p50 and CPU a request."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("-n", type=int, default=5000, help="requests per client and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, clients in turns")
    args = parser.parse_args(argv)
    clients = {
        name: make
        for name, make in CLIENTS.items()
        if name != "aiohttp" or importlib.util.find_spec("aiohttp") is not None
    }
    proc, port = _replica()
    best: dict[str, tuple[float, float]] = {}
    try:
        for _ in range(args.rounds):
            for name, make in clients.items():
                p50, cpu = uvloop.run(_measure(make, port, args.n))
                old = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(old[0], p50), min(old[1], cpu))
    finally:
        proc.terminate()
        proc.wait(10)
    print(f"load {os.getloadavg()[0]:.2f}; {args.n} GETs a round, best of {args.rounds}")
    print(f"{'client':<14}{'p50 us':>10}{'CPU us/req':>12}{'x own CPU':>11}")
    own = best["http1 (own)"][1]
    for name, (p50, cpu) in best.items():
        print(f"{name:<14}{p50 * 1e6:>10.0f}{cpu * 1e6:>12.1f}{cpu / own:>11.1f}")
    if "aiohttp" not in clients:
        print("(aiohttp not installed: not measured)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
