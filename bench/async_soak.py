"""Asynchronous calls under fire: thousands of calls while workers are killed and Redis crashes.

Run: ``python -m bench.async_soak [--calls 10000] [--clients 32] [--kill-every 10] [--json F]``

What runs, all on loopback, started by this command: PostgreSQL (the store) and Redis
(the broker, append-only) from ``tests/services.py``; ``corral gateway`` as its own
process; two ``corral worker`` processes (threads, 16 each) on every queue; ``celery
beat`` (the calls' sweep every second); one fcdaemon agent with the process driver,
running ``tests.workers.gateway.callee`` - a function that appends every call it runs,
with its attempt number, to a ledger file as the call arrives.

The load: ``--calls`` calls of ``POST /async-function/callee`` from ``--clients``
concurrent clients, each call with an ``Idempotency-Key`` of its own, so a client whose
request failed (503 while Redis is down, a timeout, 429) sends it again and still gets
one call; one call in twenty is sent a second time after its 202, which must answer the
same id. At the same time: a worker SIGKILLed (its whole process group, mid-call) every
``--kill-every`` seconds and started again, and Redis crashed once (SIGKILL: its last
second of appends may be lost, messages with it) and started again on its port after
``--redis-down`` seconds.

Then it waits, up to ``--settle`` seconds, for every call to be over, and checks:

* ``lost`` - a call id answered 202 that is not in the store, or not over: must be 0;
* ``terminal_records`` - calls whose terminal record was written more than once (a
  trigger logs every one the store sees): must be 0;
* ``open_calls`` - calls in the store (some made by requests whose client never saw the
  202) not over: must be 0;
* ``key_mismatches`` - a repeated key answered with another id: must be 0;

and reports the duplicate executions (calls the ledger saw more than once, and the extra
runs; at least once allows them, each one had a new ``X-Call-Attempt``), the outcomes,
the faults, and the rate calls were accepted and completed at. Exit status 0 only when
every check holds and every fault fired.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select

from agents import ProcessDriver, serve_fcdaemon
from config.settings import get_settings, reset_settings
from stack.supervisor import stop_process
from testkit import terminals
from testkit.processes import WorkerProcess, start_beat
from testkit.services import (
    PostgresServer,
    RedisServer,
    free_port,
    make_shared_tempdir,
    remove_trees,
)
from workers.celery import configure
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.store.db import get_database
from workers.store.migrate import upgrade
from workers.store.models import CALL_OPEN, Call

ROOT = Path(__file__).resolve().parent.parent
CALLEE = "tests.workers.gateway.callee"
WORKERS = 2
CONCURRENCY = 16
REPEAT_EVERY = 20  # one call in this many is sent again with its key after its 202

# Every process's settings: attempts' leases short enough that a killed worker's calls
# are taken over within the run, the sweep every second.
SOAK_ENV = {
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "8",
    "CORRAL_CREATE_TIMEOUT_S": "5",
    "CORRAL_RPC_TIMEOUT_S": "3",
    "CORRAL_LAMBDO_TIMEOUT_S": "3",
    "CORRAL_TASK_TIME_LIMIT_S": "10",
    "CORRAL_VISIBILITY_TIMEOUT_S": "30",
    "CORRAL_CALLS_BACKOFF_S": "0.2",
    "CORRAL_CALLS_BACKOFF_MAX_S": "2",
    "CORRAL_CALLS_RESEND_S": "5",
    "CORRAL_CALLS_SWEEP_INTERVAL_S": "1",
    "CORRAL_CALLS_QUEUE_MAX": "1000000",
    "CORRAL_GATEWAY_CLAIM_TTL_S": "10",
    "CORRAL_GATEWAY_STORE_THREADS": "16",
    "CORRAL_IDLE_TIMEOUT_S": "600",
    "CORRAL_RETRY_BACKOFF_S": "0.1",
    "CORRAL_RETRY_BACKOFF_MAX_S": "1",
}


@dataclass
class Results:
    """What one soak saw."""

    calls: int = 0
    accepted: int = 0  # distinct call ids answered 202
    client_retries: int = 0  # requests sent again after a failure (same key)
    answers: Counter[str] = field(default_factory=Counter)  # status codes the clients got
    outcomes: Counter[str] = field(default_factory=Counter)  # calls by final status
    faults: Counter[str] = field(default_factory=Counter)
    checks: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    duplicate_calls: int = 0  # calls the function ran more than once
    duplicate_executions: int = 0  # the extra runs
    max_attempts_seen: int = 0
    accept_s: float = 0.0  # first POST to the last 202
    complete_s: float = 0.0  # first POST to every call over
    settled_after_s: float | None = None
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        """Every check holds and every fault fired."""
        faults = self.faults.get("worker_kill", 0) >= 1 and self.faults.get("redis_crash", 0) == 1
        return faults and bool(self.checks) and all(v == 0 for v in self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        """The figures as JSON."""
        data = {
            k: dict(v) if isinstance(v, Counter) else v
            for k, v in ((f.name, getattr(self, f.name)) for f in fields(self))
        }
        data["ok"] = self.ok
        data["accepted_per_s"] = round(self.accepted / self.accept_s, 1) if self.accept_s else None
        data["completed_per_s"] = (
            round(self.accepted / self.complete_s, 1) if self.complete_s else None
        )
        return data


class Fleet:
    """The soak's processes: store, broker, gateway, workers, beat, agent."""

    def __init__(self, tmp: Path, log: Any, *, watch: bool = True, workers: int = WORKERS) -> None:
        """``watch``: log every terminal record (a trigger); ``workers``: how many workers."""
        self.tmp = tmp
        self.say = log
        self.watch = watch
        self.count = workers
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True)
        self.ledger = tmp / "ledger"
        self.workers: list[WorkerProcess] = []
        self.generation = 0
        self.lock = threading.Lock()
        self.env: dict[str, str] = {}

    def start(self) -> None:
        """Start everything; returns once the gateway answers."""
        (self.tmp / "redis").mkdir()
        self.redis = RedisServer(self.tmp / "redis")
        self.redis.start()
        self.pg = PostgresServer(make_shared_tempdir("corral-async-soak-pg-"))
        self.pg.start()
        port = free_port()
        self.gateway_url = f"http://127.0.0.1:{port}"
        self.env = {
            **SOAK_ENV,
            "CORRAL_DATABASE_URL": self.pg.create_database("soak"),
            "CORRAL_BROKER_URL": self.redis.url_for(0),
            "CORRAL_RESULT_BACKEND": self.redis.url_for(1),
            "CORRAL_STATE_DIR": str(self.tmp / "state"),
            "CORRAL_GATEWAY_LISTEN": f"127.0.0.1:{port}",
            "CORRAL_EAGER": "0",
        }
        os.environ.update(self.env)
        reset_settings()
        configure(get_settings())
        self.db = get_database(get_settings().database_url)
        upgrade(self.db)
        if self.watch:
            terminals.install(self.db)
        self.agent = serve_fcdaemon("127.0.0.1:0", driver=ProcessDriver(allow_images=[CALLEE]))
        with self.db.transaction() as s:
            upsert_node(s, self.agent.address, name="node1", capacity=64)
            spec = spec_from(
                name="callee",
                image=CALLEE,
                kernel="/k",
                max=16,
                exec_envs=4,
                env={"CALLEE_LEDGER": str(self.ledger)},
                call_attempts=20,
            )
            deploy(s, spec, get_settings())
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "corral.cli", "gateway"],
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdout=(self.logs / "gateway.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(self.count):
            self.workers.append(self._new_worker(i))
        self.beat = start_beat(self.logs, "soak", self.env)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.gateway_url}/healthz", timeout=1).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.1)

    def _new_worker(self, slot: int) -> WorkerProcess:
        self.generation += 1
        worker = WorkerProcess(
            self.logs,
            concurrency=CONCURRENCY,
            name=f"w{slot + 1}g{self.generation}",
            extra_env=self.env,
        )
        return worker.start(timeout=90)

    def kill_worker(self, n: int) -> None:
        """SIGKILL worker ``n % WORKERS`` (its whole process group) and start another."""
        slot = n % len(self.workers)
        with self.lock:
            worker = self.workers[slot]
            worker.kill()
            self.workers[slot] = self._new_worker(slot)

    def pause_workers(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) every worker, its whole process group."""
        for worker in self.workers:
            pid = worker.worker_pid()
            if pid is not None:
                os.killpg(pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def crash_redis(self, seconds: float) -> None:
        """SIGKILL Redis (no clean shutdown: its last appends may be lost); start it again."""
        pid = self.redis.pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):  # the executor notices the process is gone
            self.redis.stop()
        time.sleep(seconds)
        self.redis.start()

    def stop(self) -> None:
        """Stop everything this soak started."""
        for worker in self.workers:
            worker.ask_to_stop()
        for worker in self.workers:
            worker.stop()
        for proc in (getattr(self, "beat", None), getattr(self, "gateway", None)):
            if proc is not None:
                stop_process(proc, 15)
        if getattr(self, "agent", None) is not None:
            self.agent.stop(grace=0)
        if self.watch:
            with contextlib.suppress(Exception):
                terminals.remove(self.db)
        for server in (self.redis, self.pg):
            with contextlib.suppress(Exception):  # a slow stop is killed: it is over either way
                server.stop()


class Load:
    """The clients: each call POSTed with a key of its own until a 202 names its id."""

    def __init__(self, url: str, calls: int, clients: int, seed: int, results: Results) -> None:
        self.url = url
        self.calls = calls
        self.clients = clients
        self.random = random.Random(seed)
        self.results = results
        self.ids: dict[int, str] = {}
        self.mismatches: list[str] = []
        self.last_accept = 0.0

    async def run(self) -> None:
        """Send every call."""
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(self.calls):
            queue.put_nowait(i)
        limits = httpx.Limits(max_connections=self.clients, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(limits=limits, timeout=30) as client:
            await asyncio.gather(*(self._client(client, queue) for _ in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, queue: asyncio.Queue[int]) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            call_id = await self._send(client, i)
            self.ids[i] = call_id
            self.last_accept = time.monotonic()
            if i % REPEAT_EVERY == 0:  # the same key again: the same call, nothing new runs
                again = await self._send(client, i)
                if again != call_id:
                    self.mismatches.append(f"key soak-{i}: {call_id} then {again}")

    async def _send(self, client: httpx.AsyncClient, i: int) -> str:
        """POST call ``i`` until it is accepted; its id."""
        pause = 0.05
        delay = self.random.choice((0, 0.01, 0.1, 0.5))  # some calls run long: kills land mid-call
        while True:
            try:
                answer = await client.post(
                    f"{self.url}/async-function/callee/work?delay={delay}",
                    content=f"call {i}".encode(),
                    headers={"Idempotency-Key": f"soak-{i}"},
                )
            except httpx.HTTPError as exc:
                self.results.answers[type(exc).__name__] += 1
            else:
                self.results.answers[str(answer.status_code)] += 1
                if answer.status_code == 202:
                    return answer.headers["x-call-id"]
            self.results.client_retries += 1
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


def _faults(
    fleet: Fleet, results: Results, stop: threading.Event, kill_every: float, redis_down: float
) -> None:
    """Kill a worker every ``kill_every`` seconds; crash Redis once, a little after the first."""
    kills = 0
    crashed = False
    next_kill = time.monotonic() + kill_every
    crash_at = time.monotonic() + kill_every / 2  # between the first kills, under load
    while not stop.is_set():
        now = time.monotonic()
        if not crashed and now >= crash_at:
            fleet.say("fault: Redis crashed")
            fleet.crash_redis(redis_down)
            results.faults["redis_crash"] += 1
            crashed = True
        elif now >= next_kill:
            fleet.say(f"fault: worker {kills % WORKERS + 1} SIGKILLed")
            fleet.kill_worker(kills)
            kills += 1
            results.faults["worker_kill"] += 1
            next_kill = time.monotonic() + kill_every
        stop.wait(0.2)


def check(fleet: Fleet, load: Load, results: Results) -> bool:
    """Every check now (True: every call is over); the figures into ``results``."""
    ids = set(load.ids.values())
    with fleet.db.read() as s:
        rows = dict(s.execute(select(Call.id, Call.status)).all())
        open_count = s.scalar(select(func.count()).where(Call.status.in_(CALL_OPEN))) or 0
        attempts = s.scalar(select(func.max(Call.attempts))) or 0
    missing = sorted(i for i in ids if i not in rows)
    not_over = sorted(i for i in ids if i in rows and rows[i] in CALL_OPEN)
    seen = terminals.seen(fleet.db)
    twice = sorted(cid for cid, n in seen.items() if n > 1)
    results.checks = {
        "lost": len(missing) + len(not_over),
        "terminal_records": len(twice),
        "open_calls": int(open_count),
        "key_mismatches": len(load.mismatches),
    }
    results.examples = {
        "lost": (missing + not_over)[:3],
        "terminal_records": twice[:3],
        "key_mismatches": load.mismatches[:3],
    }
    results.outcomes = Counter(str(status) for status in rows.values())
    results.max_attempts_seen = int(attempts)
    runs = (
        Counter(line.split()[0] for line in fleet.ledger.read_text().splitlines() if line.strip())
        if fleet.ledger.exists()
        else Counter()
    )
    results.duplicate_calls = sum(1 for n in runs.values() if n > 1)
    results.duplicate_executions = sum(n - 1 for n in runs.values() if n > 1)
    return not open_count and not missing and not not_over


def run(  # noqa: PLR0913 - the soak's knobs
    calls: int,
    clients: int,
    kill_every: float,
    redis_down: float,
    settle_s: float,
    seed: int,
    log: Any = print,
) -> Results:
    """Start the fleet, send the calls under faults, wait for them all, check; the results."""
    results = Results(calls=calls)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="corral-async-soak-"))
    fleet = Fleet(tmp, log)
    try:
        log(f"starting the fleet under {tmp}")
        fleet.start()
        load = Load(fleet.gateway_url, calls, clients, seed, results)
        stop = threading.Event()
        faults = threading.Thread(
            target=_faults, args=(fleet, results, stop, kill_every, redis_down), daemon=True
        )
        t0 = time.monotonic()
        faults.start()
        asyncio.run(load.run())
        results.accepted = len(set(load.ids.values()))
        results.accept_s = load.last_accept - t0
        log(f"[{time.monotonic() - t0:6.1f}s] {results.accepted} calls accepted")
        while results.faults.get("redis_crash", 0) == 0 and faults.is_alive():
            time.sleep(0.2)  # a short run: its Redis crash still happens
        stop.set()
        faults.join()
        quiet = time.monotonic()
        while True:
            if check(fleet, load, results):
                results.complete_s = time.monotonic() - t0
                results.settled_after_s = time.monotonic() - quiet
                break
            if time.monotonic() > quiet + settle_s:
                break
            time.sleep(1.0)
        results.wall_s = time.monotonic() - began
    finally:
        fleet.stop()
    if results.ok:  # kept (its logs, its database) when a check failed
        remove_trees(tmp, fleet.pg.directory if hasattr(fleet, "pg") else None)
    return results


def report(results: Results) -> str:
    """The figures, for people."""
    data = results.as_dict()
    lines = [
        f"calls: {results.calls} sent, {results.accepted} accepted "
        f"({data['accepted_per_s']}/s), all over after {results.complete_s:.1f}s "
        f"({data['completed_per_s']}/s)",
        f"client answers: {dict(results.answers)}; sent again: {results.client_retries}",
        f"outcomes: {dict(results.outcomes)}; most attempts of one call: "
        f"{results.max_attempts_seen}",
        f"duplicate executions: {results.duplicate_executions} extra runs of "
        f"{results.duplicate_calls} calls (at least once; each with a new X-Call-Attempt)",
        f"faults: {dict(results.faults)}",
        "checks (all must be 0):",
    ]
    for name, n in results.checks.items():
        example = results.examples.get(name)
        lines.append(f"  {name:<18} {n}" + (f"   e.g. {example}" if n and example else ""))
    lines.append(f"wall time {results.wall_s:.0f}s; RESULT: {'ok' if results.ok else 'FAILED'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its figures; 0 only if every check held."""
    parser = argparse.ArgumentParser(prog="python -m bench.async_soak")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients")
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills")
    parser.add_argument("--redis-down", type=float, default=3.0, help="seconds Redis stays down")
    parser.add_argument("--settle", type=float, default=180.0, help="seconds to wait for calls")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.calls <= 0 or args.clients <= 0 or args.kill_every <= 0:
        parser.error("--calls, --clients and --kill-every must be positive")
    results = run(
        args.calls,
        args.clients,
        args.kill_every,
        args.redis_down,
        args.settle,
        args.seed,
        log=lambda m: print(m, flush=True),
    )
    print(report(results), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results.as_dict(), indent=2, default=str))
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
