"""The gateway's cost: latency and throughput against calling warm replicas directly; cold starts.

Run: ``python -m bench.gateway [-n 3000] [--concurrency 16] [--replicas 4] [--cold 20]
[--seconds 5] [--postgres [URL]]``

Everything runs on this machine, each part in its own process: an embedded Redis, a
SQLite store (or PostgreSQL with ``--postgres``: a throwaway server unless URL is
given), one ``corral worker`` (its default pool), one reference fcdaemon agent
whose replicas are real processes (``examples.hello``: a threaded Python HTTP server
that answers in one send, in about a hundred microseconds), one ``corral gateway``,
and this process as the HTTP client: kept-alive HTTP/1.1 connections on uvloop with
the gateway's own lean client (:mod:`workers.gateway.http1`), so the client costs
little next to what it measures.

1. warm, at one connection and at ``--concurrency`` connections: ``-n`` GETs
   straight to the replicas (**direct**: the outside baseline, no proxy, no claims;
   connection i to replica i mod ``--replicas``), the same GETs through the **relay**
   (:mod:`bench.relay`: ``bench/relay.c``, the cheapest possible proxy - a C TCP relay
   that copies bytes, each accepted connection with an upstream connection of its own,
   to the replicas in turn, so as many connections per replica as direct and the
   gateway; built with ``cc`` into the run's temporary directory, and left out with a
   note when there is no C compiler), through the **gateway** on its Python data plane
   to ``/function/hello`` (each takes an environment the gateway holds, forwards,
   returns it), and through a second gateway on the **haproxy** data plane
   (:mod:`workers.gateway.haproxy`: its HAProxy carries the warm calls, straight to the
   environments the gateway lent it; left out, and said so, without HAProxy). Each
   gateway's claims are given back before the next side runs; each request timed;
2. the same with ``wrk`` (an independent load generator, Debian's package ``wrk``),
   ``--seconds`` per run at ``--concurrency`` and half as long at one connection, when
   it is installed (skipped, and said so, when not): one
   wrk thread per replica on every side, direct thread i on replica i (a Lua script);
3. cold starts, taking turns with their baseline: ``--cold`` times, a CreateReplica
   straight to the agent timed until its new replica answers HTTP (its port tried every
   millisecond, then one GET: what any control plane must wait for), then one GET through
   the gateway to a function at zero replicas (claim, spawn - carried out in the gateway
   unless ``--broker-hop`` - and forward); one such pair first, untimed (a process's first
   cold start also pays for what it sets up once). It prints each cold-start stage's p50 and p99
   (:mod:`workers.observability.stages`: the spawn's from its operation, the gateway's from its
   ``/metrics``).

With ``--pin [CPUS]`` the warm runs (1 and 2) are run twice: on shared cores, as
above, then with the gateway and the relay pinned to CPUS (default: the last CPU) and
everything else - this client, wrk, the replicas, agent, worker and Redis - to the
other CPUs, on every side: direct is measured with the same pinning of client and
replicas, so the one difference is the proxy's hop (:mod:`bench.pinning`). On a small machine the
shared reading caps the gateway at what the processes beside it leave; the pinned one
is the production split (the gateway on cores of its own, the callers and replicas
elsewhere).

It prints, per concurrency, requests/s and p50 / p99 of each side, the CPU a request
costs each proxy (the haproxy side's: HAProxy and the gateway behind it, which reads its
counters, and each part apart), the replicas and the client (with this client, over
the timed requests only, not the warm-up, whose first calls claim the gateways'
environments: the cold path's cost, not a warm request's), the latency the relay and
the gateways add (their p50 and p99 minus those of direct), their throughput ratios to
direct, and the gateways' to the relay (how far each is from the floor any proxy has here); the aims
(issue 24) for the Python gateway are at most 2 ms added at p50 at one connection and a
ratio gateway / direct of at least 0.8 at ``--concurrency``; for the haproxy side
(issue 40) at most 0.3 ms added at p50 at one connection, at least 0.5 of direct and
0.7 of the relay at ``--concurrency``, and at most 25 us of CPU a request. Then the
cold-start p50 / p99 through each gateway minus the agent's own create time of 3 (aims:
at most 20 ms and 50 ms), and the p50 / p99 of each cold start minus the create just
before it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import psutil
from sqlalchemy import func, select

from bench import relay
from bench.localstack import GATEWAY, LocalStack, local_stack
from bench.options import add_counts, add_store_option
from bench.pinning import Pinning, split
from config.settings import get_settings
from corral import api
from protos import fcdaemon_grpc, fcdaemon_pb2
from testkit import otlp_sink
from testkit.services import free_port
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.gateway import http1
from workers.gateway.haproxy.process import Unavailable, find
from workers.observability import stages
from workers.store.models import Claim, Function, Operation, Replica

GATEWAYS = ("gateway", "haproxy")  # the sides that are gateways (each on its data plane)


def _pct(values: list[float], q: float) -> float:
    """The ``q`` quantile by nearest rank (p99 of 100 values: the 99th smallest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


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


@dataclass
class Run:
    """One load run: requests/s and each request's seconds (or wrk's percentiles)."""

    rps: float
    p50: float
    p99: float
    errors: int
    requests: int  # sent in all, warm-up included
    cpu_us: dict[str, float] | None = None  # CPU microseconds a request, per process group
    warm: float | None = None  # the share of the requests HAProxy carried (haproxy side)

    @classmethod
    def of(cls, rps: float, latencies: list[float], errors: int, requests: int) -> Run:
        """A run from its requests/s and latencies (seconds)."""
        return cls(rps, statistics.median(latencies), _pct(latencies, 0.99), errors, requests)


Timed = Callable[[int], None]  # told, as the timed part of a run begins, how many it sends


async def _load(urls: list[str], n: int, concurrency: int, timed: Timed) -> Run:
    """``n`` GETs, ``concurrency`` connections, connection i on ``urls[i % len(urls)]``.

    Every connection is warmed first (and the gateways' environments); ``timed`` is
    called as the ``n`` timed GETs begin, so CPU is counted over those only.
    """
    pools: dict[str, http1.Pool] = {}
    heads: dict[str, bytes] = {}
    for url in urls:
        parts = urlsplit(url)
        pools[url] = http1.Pool(f"http://{parts.netloc}", 5.0)
        heads[url] = f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()
    latencies: list[float] = []
    errors = 0
    left = n

    async def call(url: str) -> bool:
        exchange = await pools[url].send(heads[url], b"", head_only=False)
        await exchange.head()
        while await exchange.chunk() is not None:
            pass
        return exchange.status == 200

    async def worker(i: int) -> None:
        nonlocal errors, left
        url = urls[i % len(urls)]
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            ok = await call(url)
            latencies.append(time.perf_counter() - t0)
            errors += not ok

    warm_up = max(concurrency * 50, 200)

    async def warm(i: int) -> None:  # each connection, as many at once as the run has
        for _ in range(i, warm_up, concurrency):
            await call(urls[i % len(urls)])

    # every connection warm first, and the gateways' environments too: on the haproxy
    # side, those the activator claimed for calls HAProxy had no room for are lent to it
    await asyncio.gather(*(warm(i) for i in range(concurrency)))
    timed(n)
    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    for pool in pools.values():
        pool.close()
    return Run.of(n / elapsed, latencies, errors, n + warm_up)


class CpuMeter:
    """CPU time of each proxy, the replicas and this process, per request of a run.

    A gateway's CPU is its process's and its children's (its HAProxy); a proxy with
    children has them counted apart too, as ``NAME/children``.
    """

    def __init__(self, proxies: dict[str, int], agent_pid: int) -> None:
        self.proxies = {name: psutil.Process(pid) for name, pid in proxies.items()}
        self.agent = psutil.Process(agent_pid)

    def _now(self) -> dict[str, float]:
        def cpu(procs: list[psutil.Process]) -> float:
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except psutil.NoSuchProcess:
                    continue
                total += times.user + times.system
            return total

        def tree(proc: psutil.Process) -> list[psutil.Process]:
            try:
                return [proc, *proc.children(recursive=True)]  # a gateway's HAProxy with it
            except psutil.NoSuchProcess:
                return [proc]

        trees = {name: tree(proc) for name, proc in self.proxies.items()}
        return {
            **{name: cpu(procs) for name, procs in trees.items()},
            **{f"{name}/children": cpu(procs[1:]) for name, procs in trees.items() if procs[1:]},
            "replicas": cpu(self.agent.children(recursive=True)),
            "client": time.process_time(),
        }

    def measure(self, run: Callable[[Timed], Run | None]) -> Run | None:
        """Run ``run`` and attach each group's CPU microseconds a request.

        A run that calls the :data:`Timed` it is given has its CPU counted from then,
        over the requests it said; else over the whole run and all it sent.
        """
        start: list[Any] = [self._now(), None]

        def timed(requests: int) -> None:
            start[:] = [self._now(), requests]

        result = run(timed)
        if result is None:
            return None
        after = self._now()
        before, requests = start[0], start[1] or result.requests
        result.cpu_us = {k: (after[k] - before.get(k, 0.0)) * 1e6 / requests for k in after}
        return result


def _run_load(urls: list[str], n: int, concurrency: int, timed: Timed) -> Run:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_load(urls, n, concurrency, timed))
    return uvloop.run(_load(urls, n, concurrency, timed))


_WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


# Thread i of wrk connects to the i-th address (wrk's own recipe: thread.addr in setup).
_WRK_SPREAD = """
local ports = {%s}
local i = 0
function setup(thread)
  i = i + 1
  thread.addr = wrk.lookup("%s", tostring(ports[(i - 1) %% #ports + 1]))[1]
end
"""


def _wrk(
    urls: list[str], connections: int, seconds: int, threads: int, _timed: Timed | None = None
) -> Run | None:
    """One ``wrk`` run, thread i on ``urls[i % len(urls)]`` (None when wrk is not installed)."""
    wrk = shutil.which("wrk")
    if wrk is None:
        return None
    argv = [wrk, f"-t{threads}", f"-c{connections}", f"-d{seconds}s", "--latency"]
    if len(urls) > 1:
        hosts = {urlsplit(u).hostname for u in urls}
        ports = ", ".join(str(urlsplit(u).port) for u in urls)
        fd, name = tempfile.mkstemp(prefix="corral-bench-wrk-", suffix=".lua")
        os.close(fd)
        script = Path(name)
        script.write_text(_WRK_SPREAD % (ports, hosts.pop()))
        argv += ["-s", str(script)]
    try:
        out = subprocess.run(
            [*argv, urls[0]],
            capture_output=True,
            text=True,
            timeout=seconds + 30,
            check=True,
        ).stdout
    finally:
        if len(urls) > 1:
            script.unlink()
    pct = {
        m[0]: float(m[1]) * _WRK_UNITS[m[2]]
        for m in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    }
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if rps is None or "50" not in pct or "99" not in pct:
        raise RuntimeError(f"cannot read wrk's output:\n{out}")
    errors = (int(bad[1]) if bad else 0) + (sum(int(x) for x in errs.groups()) if errs else 0)
    sent = re.search(r"^\s*(\d+) requests in", out, re.M)
    return Run(float(rps[1]), pct["50"], pct["99"], errors, int(sent[1]) if sent else 1)


def _listening(host: str, port: int, timeout: float = 30.0) -> None:
    """Wait until ``host:port`` takes a connection, trying every millisecond (no slop)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host}:{port} did not listen within {timeout:g}s") from None
            time.sleep(0.001)


def _agent_create_time(stub: Any, i: int) -> float:
    """One CreateReplica straight to the agent, timed until its replica answers HTTP."""
    t0 = time.perf_counter()
    reply = stub.CreateReplica(
        fcdaemon_pb2.CreateRequest(
            kernelImagePath="/boot/vmlinux",
            imageName="examples.hello",
            numReplica=1,
            cpu=1,
            mem=128,
        ),
        timeout=30,
    )
    if not reply.port:  # the reference agent's extension: the replica's HTTP port
        raise RuntimeError(f"CreateReply without a port (call {i})")
    _listening(reply.ip, reply.port)
    answer = httpx.get(f"http://{reply.ip}:{reply.port}", timeout=10)
    took = time.perf_counter() - t0
    if answer.status_code != 200:
        raise RuntimeError(f"replica {i} answered {answer.status_code}")
    stub.ReleaseVMSetup(fcdaemon_pb2.ReleaseRequest(vmid=reply.vmid), timeout=30)
    return took


def _cold_and_create(
    gateways: dict[str, str], agent: str, n: int
) -> tuple[dict[str, list[float]], list[float]]:
    """``n`` cold starts through each gateway and ``n`` creates straight to the agent, in turns.

    Taking turns, all see the machine as it is at the moment (others' load comes and goes).
    One round first, untimed: a process's first cold start pays once for what it sets up
    (the gateway's first spawn compiles its SQL, opens its channel to the agent).
    """
    stub = fcdaemon_grpc.FcServiceStub(grpc.insecure_channel(agent))
    _agent_create_time(stub, -1)
    for name, url in gateways.items():
        _cold_start(url, f"warm-up-{name}")
    cold: dict[str, list[float]] = {name: [] for name in gateways}
    create: list[float] = []
    for i in range(n):
        create.append(_agent_create_time(stub, i))
        for name, url in gateways.items():
            cold[name].append(_cold_start(url, f"cold-{name}-{i}"))
    return cold, create


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_counts(
        parser,
        {
            "-n": (3000, "requests per warm run"),
            "--concurrency": (16, "connections of the second warm runs (the first: one)"),
            "--seconds": (5, "seconds per wrk run at --concurrency (at one connection: half)"),
            "--replicas": (4, "warm replicas"),
            "--envs": (4, "environments per warm replica"),
            "--cold": (20, "cold starts measured (0: none)"),
        },
    )
    add_store_option(parser)
    parser.add_argument(
        "--cold-only",
        action="store_true",
        help="skip the warm runs: cold starts and their stages only",
    )
    parser.add_argument(
        "--broker-hop",
        action="store_true",
        help="cold starts' spawns go through the broker to the worker "
        "(CORRAL_GATEWAY_SPAWN_HERE=0), as before they ran in the gateway",
    )
    parser.add_argument(
        "--pin",
        nargs="?",
        const="",
        default=None,
        metavar="CPUS",
        help="after the warm runs on shared cores, run them again with the gateway pinned to "
        "CPUS (default: the last CPU) and every other process - client, wrk, replicas, agent, "
        "worker, Redis - to the other CPUs, on both sides (bench.pinning)",
    )
    parser.add_argument(
        "--otlp",
        action="store_true",
        help="tracing on: every process sends its spans to a loopback OTLP sink "
        "(testkit.otlp_sink), to measure what tracing costs",
    )
    args = parser.parse_args(argv)
    args.cpus = None  # (the gateway's CPUs, everyone else's) with --pin
    if args.pin is not None:
        try:
            args.cpus = split(args.pin or None)
        except ValueError as exc:
            parser.error(f"--pin: {exc}")
    return args


@dataclass
class Row:
    """One load generator at one connection count: a run per side (None: wrk not installed)."""

    tool: str
    conns: int
    runs: dict[str, Run | None]  # "direct", "relay" (when built), "gateway"


def _carried(gateway: str) -> tuple[float, float]:
    """Requests for hello so far: (carried by HAProxy, answered by the gateway behind it)."""
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    warm = python = 0.0
    for line in text.splitlines():
        if line.startswith('corral_warm_requests_total{function="hello"}'):
            warm += float(line.rsplit(" ", 1)[1])
        elif line.startswith("corral_function_invocations_total{") and '"hello"' in line:
            python += float(line.rsplit(" ", 1)[1])
    return warm, python


def _settled(db: Any, side: str) -> None:
    """Before a gateway's run: no environment held (the other gateway's keep window over)."""
    if side not in GATEWAYS:
        return
    deadline = time.monotonic() + 30
    while True:
        with db.read() as s:
            if not s.scalar(select(func.count()).select_from(Claim)):
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the gateways still hold environments after 30 s")
        time.sleep(0.05)


def _warm_runs(
    args: argparse.Namespace, meter: CpuMeter, sides: dict[str, list[str]], db: Any
) -> list[Row]:
    """Each side (direct, relay, gateways): our client, then wrk, at 1 and N connections."""
    warm: list[Row] = []
    if args.cold_only:
        return warm

    def run(side: str, load: Callable[[Timed], Run | None]) -> Run | None:
        _settled(db, side)
        if side != "haproxy":
            return meter.measure(load)
        base = sides[side][0].rsplit("/function/", 1)[0]
        before = _carried(base)
        done = meter.measure(load)
        if done is not None:
            after = _carried(base)
            warm, python = after[0] - before[0], after[1] - before[1]
            done.warm = warm / max(1.0, warm + python)
        return done

    for conns in (1, args.concurrency):
        warm.append(
            Row(
                "client",
                conns,
                {
                    side: run(side, functools.partial(_run_load, urls, args.n, conns))
                    for side, urls in sides.items()
                },
            )
        )
    for conns in (1, args.concurrency):
        # As many wrk threads as replicas, on every side: direct, each thread's connections
        # go to one replica, so direct uses every replica, as the relay and the gateway do.
        threads = max(1, min(conns, len(sides["direct"])))
        if conns % threads:
            threads = 1
        # At one connection wrk measures latency: half the time still gives some 30,000
        # requests a side, and keeps three sides' runs about as long as two sides' were.
        seconds = args.seconds if conns > 1 else max(1, math.ceil(args.seconds / 2))
        warm.append(
            Row(
                "wrk",
                conns,
                {
                    side: run(side, functools.partial(_wrk, urls, conns, seconds, threads))
                    for side, urls in sides.items()
                },
            )
        )
    return warm


def _warm_readings(
    args: argparse.Namespace, meter: CpuMeter, sides: dict[str, list[str]], db: Any
) -> None:
    """The warm runs on shared cores, then (``--pin``) with the proxies on CPUs of their own."""
    _report_warm("shared cores: every process on every CPU", _warm_runs(args, meter, sides, db))
    if args.cpus is None or args.cold_only:
        return
    with Pinning({name: p.pid for name, p in meter.proxies.items()}, *args.cpus) as pinned:
        warm = _warm_runs(args, meter, sides, db)
    _report_warm(f"pinned: {pinned.describe()}", warm)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    args = _parse(argv)
    settings = {"CORRAL_GATEWAY_SPAWN_HERE": "0"} if args.broker_hop else {}
    sink = otlp_sink.serve(keep=0) if args.otlp else None
    if sink is not None:
        settings["CORRAL_OTLP_ENDPOINT"] = sink.endpoint
    try:
        with local_stack(args, "corral-bench-gw-", settings) as running:
            gateways = _gateways(running)
            addresses = _warm_replicas(args, running.db, running.agent_port)
            _header(args)
            sides, proxies = _sides(args, running, addresses, gateways)
            meter = CpuMeter({name: p.pid for name, p in proxies.items()}, running.procs[1].pid)
            _warm_readings(args, meter, sides, running.db)
            if args.cold > 0:
                urls = {name: url for name, (url, _) in gateways.items()}
                agent = f"127.0.0.1:{running.agent_port}"
                cold, create = _cold_and_create(urls, agent, args.cold)
                _report_cold(create, cold)
                _report_stages(running.db, urls["gateway"], cold["gateway"])
        return 0
    finally:
        if sink is not None:
            print(f"  tracing on: {sink.sink.count} spans reached the OTLP sink")
            sink.stop()


Gateways = dict[str, tuple[str, subprocess.Popen[bytes]]]


def _gateways(running: LocalStack) -> Gateways:
    """The two gateways, each on a data plane: ``gateway`` (Python) and ``haproxy``.

    The haproxy side is left out, and said so, where HAProxy cannot be had.
    """
    planes = {"gateway": "python"}
    try:
        find(get_settings().gateway_haproxy)
        planes["haproxy"] = "haproxy"
    except Unavailable as exc:
        print(f"  haproxy side skipped: {exc} (apt-get install haproxy)")
    out: Gateways = {}
    for name, plane in planes.items():
        port = free_port()
        argv = [*GATEWAY, "--listen", f"127.0.0.1:{port}"]
        proc = running.start(name, argv, CORRAL_GATEWAY_DATAPLANE=plane)
        out[name] = (f"http://127.0.0.1:{port}", proc)
    for url, _ in out.values():
        _wait_http(url + "/healthz")
    return out


def _sides(
    args: argparse.Namespace, running: LocalStack, addresses: list[str], gateways: Gateways
) -> tuple[dict[str, list[str]], dict[str, subprocess.Popen[bytes]]]:
    """What the warm runs call (direct, the relay, the gateways) and the proxies' processes.

    The relay (bench.relay) is built and started here, in front of the same replicas,
    unless there are no warm runs or it cannot be built (then it says why and is left out).
    """
    sides = {"direct": addresses}
    proxies = {}
    if not args.cold_only:
        binary, why = relay.build(running.tmp)
        if binary is None:
            print(f"  relay (the cheapest proxy, bench/relay.c) skipped: {why}")
        else:
            floor = relay.start(binary, addresses, running.tmp / "relay.log")
            running.procs.append(floor.proc)
            sides["relay"] = [floor.url]
            proxies["relay"] = floor.proc
    for name, (url, proc) in gateways.items():
        sides[name] = [f"{url}/function/hello"]
        proxies[name] = proc
    return sides, proxies


def _warm_replicas(args: argparse.Namespace, db: Any, agent_port: int) -> list[str]:
    """Register the agent, deploy hello and the cold functions, start hello's replicas."""
    settings = get_settings()
    with db.transaction() as s:
        upsert_node(s, f"127.0.0.1:{agent_port}", name="bench-agent", capacity=1000)
        deploy(
            s,
            spec_from(
                name="hello",
                image="examples.hello",
                kernel="/boot/vmlinux",
                max=args.replicas,
                exec_envs=args.envs,
            ),
            settings,
        )
        cold = [f"{kind}-{side}" for kind in ("warm-up", "cold") for side in GATEWAYS]
        for name in [*cold[:2], *(f"{c}-{i}" for c in cold[2:] for i in range(args.cold))]:
            deploy(
                s,
                spec_from(name=name, image="examples.hello", kernel="/boot/vmlinux", max=1),
                settings,
            )
    view = api.wait(api.spawn("hello", args.replicas), timeout=120)
    if view["status"] != "succeeded":
        raise RuntimeError(f"warm replicas did not start: {view}")
    with db.read() as s:
        addresses = [a for a in s.scalars(select(Replica.address)) if a]
    for address in addresses:
        _wait_http(address)
    return addresses


def _cold_start(gateway: str, name: str) -> float:
    """Seconds from the first request to function ``name`` (at zero replicas) to its answer."""
    t0 = time.perf_counter()
    response = httpx.get(f"{gateway}/function/{name}", timeout=120)
    took = time.perf_counter() - t0
    if response.status_code != 200:
        raise RuntimeError(f"cold start of {name}: {response.status_code} {response.text}")
    return took


def _header(args: Any) -> None:
    print(
        f"gateway benchmark: {args.n} GETs per warm run (wrk: {args.seconds} s at "
        f"{args.concurrency} connections, {max(1, math.ceil(args.seconds / 2))} s at one), "
        f"{args.replicas} warm replicas x {args.envs} environments (examples.hello), "
        f"{args.cold} cold starts; {'PostgreSQL' if args.postgres is not None else 'SQLite'} "
        f"store, one gateway process; load average {os.getloadavg()[0]:.2f}"
    )


def _report_warm(reading: str, warm: list[Row]) -> None:
    """One reading's warm runs: each side's requests/s and latencies, CPU, added latency, ratios."""
    if not warm:
        return
    ms = 1000.0
    print(f"  {reading} (load average {os.getloadavg()[0]:.2f})")
    for row in warm:
        tag = f"  [{row.tool}, {row.conns} conn]"
        runs = {side: run for side, run in row.runs.items() if run is not None}
        if len(runs) < len(row.runs):
            print(f"{tag} skipped: wrk is not installed (apt-get install wrk)")
            continue
        for side, run in runs.items():
            carried = f"   {run.warm:.0%} through HAProxy" if run.warm is not None else ""
            print(
                f"{tag} {side:<7} {run.rps:8.0f} req/s   p50 {run.p50 * ms:7.2f} ms   p99 "
                f"{run.p99 * ms:7.2f} ms   errors {run.errors}{carried}"
            )
        direct = runs["direct"]
        cpu = {side: run.cpu_us for side, run in runs.items() if run.cpu_us}
        if len(cpu) == len(runs):
            proxies = [_proxy_cpu(side, cpu[side]) for side in runs if side != "direct"]
            groups = ["replicas"] + (["client"] if row.tool == "client" else [])
            print(
                f"{tag} CPU a request: "
                + ", ".join(proxies)
                + "".join(
                    f"; {group} " + ", ".join(f"{cpu[side][group]:4.0f} us {side}" for side in runs)
                    for group in groups
                )
            )
        for side, run in runs.items():
            if side == "direct":
                continue
            added = (run.p50 - direct.p50) * ms
            ratio = run.rps / direct.rps
            aim = ""
            if side == "gateway":
                aim = (
                    f" (added p50 aim <= 2 ms: {'met' if added <= 2 else 'MISSED'})"
                    if row.conns == 1
                    else f" (ratio aim >= 0.8: {'met' if ratio >= 0.8 else 'MISSED'})"
                )
                if "relay" in runs:
                    aim += f"; gateway / relay {run.rps / runs['relay'].rps:.2f}"
            elif side == "haproxy":
                aim = _haproxy_aims(row, run, ratio, added, runs)
            print(
                f"{tag} {side} adds p50 {added:6.2f} ms, p99 "
                f"{(run.p99 - direct.p99) * ms:6.2f} ms; ratio to direct {ratio:.2f}{aim}"
            )


def _proxy_cpu(side: str, cpu: dict[str, float]) -> str:
    """A proxy's CPU a request; a gateway with HAProxy says which part was HAProxy's."""
    text = f"{side} {cpu[side]:4.0f} us"
    children = cpu.get(f"{side}/children")
    if side == "haproxy" and children is not None:
        text += f" (HAProxy {children:.0f}, its gateway {cpu[side] - children:.0f})"
    return text


def _haproxy_aims(row: Row, run: Run, ratio: float, added: float, runs: dict[str, Run]) -> str:
    """The haproxy side against issue 40's aims."""

    def met(ok: bool) -> str:
        return "met" if ok else "MISSED"

    if row.conns == 1:
        return f" (added p50 aim <= 0.3 ms: {met(added <= 0.3)})"
    aims = [f"ratio aim >= 0.5: {met(ratio >= 0.5)}"]
    if "relay" in runs:
        to_relay = run.rps / runs["relay"].rps
        aims.append(f"haproxy / relay {to_relay:.2f}, aim >= 0.7: {met(to_relay >= 0.7)}")
    if run.cpu_us:
        cpu = run.cpu_us["haproxy"]
        aims.append(f"CPU {cpu:.0f} us, aim <= 25 us: {met(cpu <= 25)}")
    return " (" + "; ".join(aims) + ")"


def _report_cold(create: list[float], colds: dict[str, list[float]]) -> None:
    """Cold starts against the agent's own create-until-HTTP, through each gateway."""
    ms = 1000.0
    a50, a99 = statistics.median(create) * ms, _pct(create, 0.99) * ms
    print(f"  agent create+ready p50 {a50:7.1f} ms   p99 {a99:7.1f} ms")
    for side, cold in colds.items():
        print(f"  {side}:")
        _report_cold_side(create, cold)


def _report_cold_side(create: list[float], cold: list[float]) -> None:
    """One gateway's cold starts against the agent's own create-until-HTTP."""
    ms = 1000.0
    c50, c99 = statistics.median(cold) * ms, _pct(cold, 0.99) * ms
    a50, a99 = statistics.median(create) * ms, _pct(create, 0.99) * ms
    print(f"  cold start (gw)    p50 {c50:7.1f} ms   p99 {c99:7.1f} ms")
    m50, m99 = c50 - a50, c99 - a99
    print(
        f"  cold start minus agent create   p50 {m50:7.1f} ms   p99 {m99:7.1f} ms "
        f"(aims <= 20 and <= 50 ms: {'met' if m50 <= 20 else 'MISSED'}, "
        f"{'met' if m99 <= 50 else 'MISSED'})"
    )
    pairs = [c - a for c, a in zip(cold, create, strict=True)]
    print(
        f"  each cold start minus the create before it   p50 "
        f"{statistics.median(pairs) * ms:7.1f} ms   p99 {_pct(pairs, 0.99) * ms:7.1f} ms   "
        f"max {max(pairs) * ms:7.1f} ms"
    )


def _report_stages(db: Any, gateway: str, cold: list[float]) -> None:
    """Where the cold starts' time went: each stage's p50 / p99 (workers.observability.stages)."""
    with db.read() as s:
        stored = [
            op.result["stages"]
            for op in s.scalars(
                select(Operation).where(
                    Operation.kind == "spawn",
                    Operation.function_id.in_(
                        select(Function.id).where(Function.name.like("cold-gateway-%"))
                    ),
                )
            )
            if op.result and isinstance(op.result.get("stages"), dict)
        ]
    text = httpx.get(f"{gateway}/metrics", timeout=10).text
    means = {}
    for stage in ("ask", "claim", "first_byte"):
        total = re.search(rf'^{stages.METRIC}_sum{{stage="{stage}"}} (\S+)', text, re.M)
        count = re.search(rf'^{stages.METRIC}_count{{stage="{stage}"}} (\S+)', text, re.M)
        if total and count and float(count[1]):
            means[stage] = float(total[1]) / float(count[1])
    ms = 1000.0
    print(
        f"  cold-start stages ({len(stored)} spawns stored theirs; the gateway's: means "
        "over its histogram):"
    )
    parts = []
    for stage in stages.STAGES:
        values = [float(v[stage]) for v in stored if stage in v]
        if values:
            parts.append(
                f"{stage} {statistics.median(values) * ms:.1f}/{_pct(values, 0.99) * ms:.1f}"
            )
        elif stage in means:
            parts.append(f"{stage} ~{means[stage] * ms:.1f}")
    print("    " + ", ".join(parts) + " ms (p50/p99)")
    worker = [sum(float(x) for x in v.values()) for v in stored]
    if worker and cold:
        print(
            f"    cold start p50 {statistics.median(cold) * ms:.1f} ms, of which worker and "
            f"registry stages p50 {statistics.median(worker) * ms:.1f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
