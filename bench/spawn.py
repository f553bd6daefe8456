"""Spawn and delete throughput against a plain Celery no-op task, in one run.

Run: ``python -m bench.spawn [-n 1500] [--slow 2000] [--reap 1000] [-P POOL] [-c N]
[--postgres [URL]]``

Everything runs in this one process and one run, against one embedded Redis, each app
with the worker command its users run (``celery -A APP worker`` for the plain app,
``corral worker`` for corral; each app's own pool and concurrency; ``-P`` / ``-c``
change corral's, never the baseline's):

1. **baseline** - a *plain* Celery app (:mod:`bench.plain`, not corral's: late
   acks, prefetch 1, JSON, results in Redis) runs ``n`` no-op tasks sent over one
   producer; timed from the first send until ``ResultSet.join_native()`` has
   every result;
2. **P1** - ``spawn`` of ``n`` replicas by ``corral worker`` on two
   reference agents (memory driver) that answer at once; enqueue -> every
   replica Idle (the operation succeeded);
3. **delete** - ``scale`` of that function to 0: every one of those replicas
   released and retired; then one **reap** pass of ``--reap`` idle replicas
   (spawned untimed first, ``CORRAL_REAP_BATCH`` raised to match);
4. **direct** - ``--slow`` creates sent straight to 10 agents that take 0.5 s per
   create and serve 32 at once, from one ``grpc.aio`` client with at most 32 calls in
   flight per agent: the agents' own floor, their gRPC handling included, with no
   corral in between;
5. **P5** - ``spawn`` of ``--slow`` replicas on those agents
   (``CORRAL_NODE_MAX_INFLIGHT=32``, the bench's setting for every phase); the agents
   are first proven with one create each (a new node is on probation:
   workers.fleet.nodes).

The agents run in a process of their own (:mod:`bench.agent_host`), as real agents
do, not in this one beside the producer and the polling.

It prints each rate, the worker's peak resident memory, and the ratios. Aims (issue
22): P1 / baseline >= 1.0, delete / baseline >= 1.0, P5 / direct >= 0.8, and every
worker process within 150 MiB. 2,000 creates of 0.5 s, 320 at once, take at least
seven waves (3.5 s): enough that throughput, not one create's latency, decides. The
machine these run on is shared: compare the ratios (both sides measured in the same
run), not the absolute rates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from celery.result import ResultSet

from bench.options import add_counts, add_store_option, store_for
from bench.plain import make_app
from config.settings import get_settings, reset_settings
from corral import api
from protos import fcdaemon_pb2, fcdaemon_pb2_grpc
from stack.supervisor import stop_process
from testkit.services import RedisServer
from workers.celery import configure
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.db import get_database
from workers.store.migrate import upgrade
from workers.store.models import Node

ROOT = Path(__file__).resolve().parent.parent
SLOW_NODES = 10
SLOW_CREATE_S = 0.5
SLOW_SERVED = 32
MAX_RSS_MIB = 150  # issue 22's aim for one worker process


@dataclass
class Run:
    """One run's figures."""

    store: str
    rates: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)


def worker_argv(app: str, args: argparse.Namespace) -> list[str]:
    """The worker command for ``app``: its users' default; corral's as ``-P`` / ``-c`` say.

    corral's users run ``corral worker`` (the worker under its time-limit supervisor).
    """
    command = ["stack.worker"] if app == "workers" else ["celery", "-A", app, "worker"]
    argv = [sys.executable, "-m", *command, "-l", "WARNING", "--without-gossip", "--without-mingle"]
    if app == "workers" and args.pool:
        argv += ["-P", args.pool]
    if app == "workers" and args.concurrency:
        argv += ["-c", str(args.concurrency)]
    return argv


def _shown(argv: list[str]) -> str:
    """A worker command as its users type it."""
    if argv[2] == "stack.worker":
        return " ".join(["corral", "worker", *argv[3:]])
    return " ".join(argv[2:])


def _worker(
    app: str, args: argparse.Namespace, env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """Start the worker command every phase uses, for ``app``."""
    return subprocess.Popen(
        worker_argv(app, args), cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _peak_rss_mib(supervisor: int) -> dict[str, float]:
    """Peak resident memory (VmHWM) of corral's worker, its pool processes and supervisor."""

    def hwm(p: int) -> float:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    (pid,) = _children(supervisor)  # the Celery worker `corral worker` runs
    pool = [hwm(c) for c in _children(pid)]
    return {
        "main": hwm(pid),
        "pool_max": max(pool, default=0.0),
        "supervisor": hwm(supervisor),
        "total": hwm(pid) + sum(pool) + hwm(supervisor),
    }


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None:
        stop_process(proc, 30)


def _wait_op(api: Any, op: str, timeout: float = 600) -> dict[str, Any]:
    """Poll an operation at a light, fixed rate (the CPU is shared with the worker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        view = api.operation(op)
        if view["status"] not in ("pending", "running"):
            return dict(view)
        time.sleep(0.02)
    raise TimeoutError(f"operation {op} did not finish")


def _timed_op(api: Any, start: Any, what: str) -> float:
    """Seconds from sending an operation until it succeeded."""
    started = time.perf_counter()
    view = _wait_op(api, start())
    took = time.perf_counter() - started
    if view["status"] != "succeeded":
        raise RuntimeError(f"{what} ended {view['status']}: {view['error']}")
    return took


def run_once(args: argparse.Namespace) -> Run:
    """One full run: baseline, P1, delete, reap, P5; returns its figures."""
    tmp = Path(tempfile.mkdtemp(prefix="corral-bench-"))
    redis = RedisServer(tmp / "redis")
    redis.start()
    port = redis.port
    assert port is not None
    db_url, pg_server = store_for(args, tmp)
    run = Run(store="PostgreSQL" if args.postgres is not None else "SQLite")
    env = _bench_env(args, tmp, port, db_url)
    worker = None
    agents: _AgentHost | None = None
    try:
        run.rates["baseline"], run.seconds["baseline"] = _baseline(args, env, tmp)
        reset_settings()
        configure(get_settings())  # this run's broker, not an earlier run's
        db = get_database(db_url)
        upgrade(db)
        agents = _AgentHost(tmp)
        worker = _corral_worker(args, db, agents, env, tmp)
        _fast_phases(args, run, agents)
        _slow_phases(args, run, db, agents)
        run.rss_mib = _peak_rss_mib(worker.pid)
    finally:
        _stop(worker)
        if agents is not None:
            agents.stop()
        redis.stop()
        if pg_server is not None:
            pg_server.stop()
    counts = {
        "P1": args.n,
        "delete": args.n,
        "reap": args.reap,
        "P5": args.slow,
        "direct": args.slow,
    }
    for phase, seconds in run.seconds.items():
        if phase != "baseline":
            run.rates[phase] = counts[phase] / seconds
    return run


def _bench_env(args: argparse.Namespace, tmp: Path, port: int, db_url: str) -> dict[str, str]:
    """Point this process (corral's settings) and the workers at this run's Redis and store."""
    broker, results = f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/1"
    os.environ.update(
        {
            "CORRAL_BROKER_URL": broker,
            "CORRAL_RESULT_BACKEND": results,
            "CORRAL_DATABASE_URL": db_url,
            "CORRAL_STATE_DIR": str(tmp / "state"),
            "CORRAL_NODE_MAX_INFLIGHT": str(SLOW_SERVED),
            "CORRAL_REAP_BATCH": str(max(args.reap, 1)),
            "BENCH_BROKER_URL": broker,
            "BENCH_RESULT_BACKEND": results,
        }
    )
    return os.environ.copy()


def _corral_worker(
    args: argparse.Namespace, db: Any, agents: _AgentHost, env: dict[str, str], tmp: Path
) -> subprocess.Popen[bytes]:
    """Register the fast agents, deploy the function, start corral's worker and warm it up."""
    big = args.n + args.reap + args.slow + 100
    with db.transaction() as s:
        for i, address in enumerate(agents.fast):
            upsert_node(s, address, name=f"fast{i}", capacity=big)
        deploy(s, spec_from(name="bench", image="bench", kernel="/k", max=10_000), get_settings())
    worker = _worker("workers", args, env, tmp / "worker.log")
    _wait_op(api, api.spawn("bench", 4), timeout=120)  # warm up: worker up, paths run
    _wait_op(api, api.scale("bench", 0), timeout=120)
    return worker


def _fast_phases(args: argparse.Namespace, run: Run, agents: _AgentHost) -> None:
    """P1, delete and reap on the agents that answer at once."""
    n = args.n
    run.seconds["P1"] = _timed_op(api, lambda: api.spawn("bench", n), "P1 spawn")
    run.counts["P1 VMs"] = agents.count("fast")
    run.seconds["delete"] = _timed_op(api, lambda: api.scale("bench", 0), "delete")
    run.counts["VMs after delete"] = agents.count("fast")
    if args.reap:
        _wait_op(api, api.spawn("bench", args.reap))
        run.seconds["reap"] = _timed_op(api, lambda: api.reap(idle_timeout=0), "reap pass")
        run.counts["VMs after reap"] = agents.count("fast")


def _slow_phases(args: argparse.Namespace, run: Run, db: Any, agents: _AgentHost) -> None:
    """Direct creates and P5 on the slow agents (the fast ones drained)."""
    big = args.n + args.reap + args.slow + 100
    with db.transaction() as s:
        for node in s.query(Node):
            node.draining = True  # the fast agents take no part in P5
        for i, address in enumerate(agents.slow):
            upsert_node(s, address, name=f"slow{i}", capacity=big)
    _wait_op(api, api.spawn("bench", SLOW_NODES))  # one create each: proven nodes
    _wait_op(api, api.scale("bench", 0))
    run.seconds["direct"] = _direct(agents.slow, args.slow)
    before = agents.count("slow")
    run.seconds["P5"] = _timed_op(api, lambda: api.spawn("bench", args.slow), "P5 spawn")
    run.counts["P5 VMs"] = agents.count("slow") - before


def _baseline(args: argparse.Namespace, env: dict[str, str], tmp: Path) -> tuple[float, float]:
    """The plain Celery app's no-op rate: n tasks over one producer, join_native()."""
    app = make_app(env["BENCH_BROKER_URL"], env["BENCH_RESULT_BACKEND"])
    noop = app.tasks["plain.noop"]
    worker = _worker("bench.plain", args, env, tmp / "plain.log")
    try:
        noop.delay().get(timeout=60)  # worker up
        started = time.perf_counter()
        with app.producer_or_acquire() as producer:
            results = [noop.apply_async(producer=producer) for _ in range(args.n)]
        ResultSet(results).join_native(timeout=300)
        took = time.perf_counter() - started
    finally:
        _stop(worker)
    return args.n / took, took


def _direct(addresses: list[str], n: int) -> float:
    """Seconds for ``n`` creates sent straight to the agents (one ``grpc.aio`` client).

    The agents' own floor for P5: their wait plus their gRPC handling, with no corral in
    between, at most ``SLOW_SERVED`` calls in flight per agent (corral's per-node bound
    in this benchmark). The VMs are released again afterwards (untimed).
    """

    async def burst(stubs: list[Any]) -> float:
        # Request ids shaped like corral's (one prefix, then the index), as the agent sees them.
        prefix = secrets.token_hex(16)
        bounds = [asyncio.Semaphore(SLOW_SERVED) for _ in stubs]

        async def create(i: int) -> Any:
            async with bounds[i % len(stubs)]:
                return await stubs[i % len(stubs)].CreateReplica(
                    fcdaemon_pb2.CreateRequest(
                        imageName="bench",
                        kernelImagePath="/k",
                        numReplica=1,
                        guestPort=8080,
                        requestId=f"{prefix}.{i}.0",
                    ),
                    timeout=60,
                )

        started = time.perf_counter()
        replies = await asyncio.gather(*(create(i) for i in range(n)))
        took = time.perf_counter() - started

        async def release(i: int, vmid: str) -> None:
            async with bounds[i % len(stubs)]:
                await stubs[i % len(stubs)].ReleaseVMSetup(
                    fcdaemon_pb2.ReleaseRequest(vmid=vmid), timeout=60
                )

        await asyncio.gather(*(release(i, r.vmid) for i, r in enumerate(replies)))
        return took

    async def go() -> float:
        channels = [grpc.aio.insecure_channel(a) for a in addresses]
        try:
            stubs = [fcdaemon_pb2_grpc.FcServiceStub(c) for c in channels]
            await burst(stubs)  # untimed: the agents' first burst starts their threads
            return await burst(stubs)
        finally:
            for c in channels:
                await c.close()

    return asyncio.run(go())


class _AgentHost:
    """The agents in a process of their own (:mod:`bench.agent_host`), as real agents are.

    Two that answer at once (P1) and ``SLOW_NODES`` that take ``SLOW_CREATE_S`` per
    create and serve ``SLOW_SERVED`` at once (P5).
    """

    def __init__(self, tmp: Path) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.agent_host",
                "--fast",
                "2",
                "--slow",
                str(SLOW_NODES),
                "--create-s",
                str(SLOW_CREATE_S),
                "--served",
                str(SLOW_SERVED),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(tmp / "agents.log").open("ab"),
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent host exited: see {tmp / 'agents.log'}")
        addresses = json.loads(line)
        self.fast: list[str] = addresses["fast"]
        self.slow: list[str] = addresses["slow"]

    def count(self, group: str) -> int:
        """VMs the ``fast`` or ``slow`` agents run."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("count\n")
        self.proc.stdin.flush()
        return int(json.loads(self.proc.stdout.readline())[group])

    def stop(self) -> None:
        """Close its stdin (it stops its agents and exits); kill it if it lingers."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _verdict(value: float, aim: float) -> str:
    return f"{value:.2f} (aim >= {aim:.1f}: {'met' if value >= aim else 'MISSED'})"


def report(run: Run, args: argparse.Namespace) -> None:
    """Print one run's figures and ratios."""
    print(
        f"\nstore: {run.store}; broker: embedded Redis; workers: "
        f"{_shown(worker_argv('bench.plain', args))}; {_shown(worker_argv('workers', args))}"
    )
    print(f"{'phase':<46}{'count':>7}{'seconds':>9}{'per second':>12}")
    rows = [
        ("baseline: plain Celery no-op, join_native", "baseline", args.n),
        ("P1: spawn, agents answer at once", "P1", args.n),
        ("delete: scale those to 0", "delete", args.n),
        (f"reap: one pass of {args.reap} idle", "reap", args.reap),
        (f"direct: {args.slow} creates straight to those agents", "direct", args.slow),
        (
            f"P5: spawn, {SLOW_NODES} agents x {SLOW_CREATE_S:g} s x {SLOW_SERVED} at once",
            "P5",
            args.slow,
        ),
    ]
    for label, key, count in rows:
        if key in run.seconds:
            print(f"{label:<46}{count:>7}{run.seconds[key]:>9.2f}{run.rates[key]:>12.0f}")
    rss = run.rss_mib
    largest = max(rss.get("main", 0), rss.get("pool_max", 0))
    print(
        f"worker peak RSS: main {rss.get('main', 0):.0f} MiB, largest pool process "
        f"{rss.get('pool_max', 0):.0f} MiB, supervisor {rss.get('supervisor', 0):.0f} MiB, "
        f"all {rss.get('total', 0):.0f} MiB "
        f"(each process <= {MAX_RSS_MIB} MiB: {'met' if largest <= MAX_RSS_MIB else 'MISSED'})"
    )
    print(f"VMs: {run.counts}")
    r = run.rates
    waves = -(-args.slow // (SLOW_NODES * SLOW_SERVED))
    ceiling = args.slow / (waves * SLOW_CREATE_S)
    print(f"P1 / baseline      {_verdict(r['P1'] / r['baseline'], 1.0)}")
    print(f"delete / baseline  {_verdict(r['delete'] / r['baseline'], 1.0)}")
    print(f"P5 / direct        {_verdict(r['P5'] / r['direct'], 0.8)}")
    if "reap" in r:
        print(f"reap / baseline    {r['reap'] / r['baseline']:.2f}")
    print(
        f"P5 / agents' ceiling ({ceiling:.0f}/s: {args.slow} creates in waves of "
        f"{SLOW_CREATE_S:g} s) {r['P5'] / ceiling:.2f}; direct / ceiling "
        f"{r['direct'] / ceiling:.2f}; P5 / P1 {r['P5'] / r['P1']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (``--runs`` times) and print its figures."""
    parser = argparse.ArgumentParser(prog="python -m bench.spawn")
    add_counts(
        parser,
        {  # the phases' sizes
            "-n": (1500, "no-op tasks; P1 spawns; deletes"),
            "--slow": (2000, "P5 spawns (slow agents)"),
            "--reap": (1000, "idle replicas one pass reaps"),
        },
    )
    add_counts(parser, {"--runs": (1, "runs; medians printed at the end")})
    parser.add_argument(
        "--concurrency",
        "-c",
        type=int,
        default=None,
        help="corral's worker -c (default: its own; the baseline keeps its)",
    )
    parser.add_argument(
        "--pool",
        "-P",
        default=None,
        help="corral's worker -P (default: its own; the baseline keeps its)",
    )
    add_store_option(parser)
    args = parser.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        run = run_once(args)
        report(run, args)
        runs.append(run)
    if len(runs) > 1:
        print("\nmedians over", len(runs), "runs:")
        for key in runs[0].rates:
            values = [r.rates[key] for r in runs]
            print(
                f"  {key:<10}{statistics.median(values):>8.0f}/s  "
                f"(runs: {', '.join(f'{v:.0f}' for v in values)})"
            )
        for name, num, den in (
            ("P1/baseline", "P1", "baseline"),
            ("P5/P1", "P5", "P1"),
            ("delete/baseline", "delete", "baseline"),
            ("P5/direct", "P5", "direct"),
        ):
            ratios = [r.rates[num] / r.rates[den] for r in runs]
            print(
                f"  {name:<16}{statistics.median(ratios):.2f}  "
                f"(runs: {', '.join(f'{v:.2f}' for v in ratios)})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
