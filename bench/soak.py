"""A fleet under fire: steady load on a PostgreSQL-backed corral while things break together.

Run: ``python -m bench.soak [--minutes 5] [--rate 2] [--seed 1] [--json FILE]``

What runs, all on loopback, started by this command:

* PostgreSQL (the store) and Redis (the broker), from ``tests/services.py``;
* three ``celery -A workers worker`` processes (prefork, two children each), one
  ``celery beat`` (health every second, reap and reconcile every five), and the
  registry (``corral registry``);
* five nodes with the memory driver: three reference fcdaemon agents (which register
  with the registry), one agent that speaks only the seed protocol (``--seed-only``: no
  ``requestId``, no ``ListReplicas``, as faas-backend's agent; it reports READY, so an
  orphan it runs is found through the registry) and one Lambdo host.

A load generator issues, at ``--rate`` actions a second: spawns, scales, deletes of
a random Idle or Creating replica, claims (each released one to four seconds later),
and every 30 s a re-deploy (a new build, so the reaper retires the old one's replicas). At the
same time a fault schedule, scaled to the duration (each window shrinks so that a
45-second run, as CI's, still has every kind at least once), fires:

* ``worker_kill`` - SIGKILL one worker (its whole process group) every 20 s, and
  start a new one;
* ``redis_stop`` - stop Redis for 10 s;
* ``postgres_restart`` - restart PostgreSQL;
* ``agent_stop`` - stop one agent's server for 30 s (its VMs keep running, as
  under a real fcdaemon restart), then serve again on the same port;
* ``agent_delay`` - delay another agent's replies, and the seed agent's, by 2 s for a
  minute (creates in flight when a worker is killed: outcomes no one knows).

Then it quiesces (load stopped, every claim released, faults over) and waits, up
to ``--quiesce`` seconds, for the fleet to settle. It then checks, and prints the
violations of, each invariant (all must be 0):

* ``orphan_vms`` / ``duplicate_rows`` / ``rows_without_vm`` - every VM a node
  lists has exactly one live row, and every live row's VM is listed by its node (the
  seed agent cannot list: the harness reads its driver instead);
* ``ops_not_final`` - every operation the load generator got an id for has
  succeeded, failed or partly failed;
* ``counter_drift`` - ``corral db check`` (:func:`workers.maintenance.audit.audit`) finds none;
* ``claims_outstanding`` - no claim outlives its release;
* ``unexpected_deaths`` - no worker, beat or registry process died except the
  workers the schedule killed.

It also prints operations submitted and completed per minute, faults injected by
kind, and p50 / p99 of spawn completion time (operation created -> finished).
Exit status 0 only when every invariant holds and every fault kind fired.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from agents.faults import Fault
from agents.fcdaemon import serve_fcdaemon
from agents.lambdo import serve_lambdo
from config.settings import get_settings, reset_settings
from corral.api import database
from stack.supervisor import stop_process
from testkit.history import Load, Tracked, compare, not_final, outcomes
from testkit.processes import WorkerProcess, start_beat
from testkit.services import (
    PostgresServer,
    RedisServer,
    free_port,
    make_shared_tempdir,
    remove_trees,
)
from testkit.soak_plan import FAULT_KINDS, SOAK_ENV, FaultEvent, schedule
from workers import backends
from workers.celery import configure
from workers.fleet.nodes import upsert_node
from workers.functions import deploy, spec_from
from workers.maintenance.audit import audit
from workers.store.db import get_database
from workers.store.migrate import upgrade
from workers.store.models import (
    LIVE_STATES,
    Claim,
    Node,
    Replica,
)

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3
FUNCTIONS = ("soak-a", "soak-b", "soak-l")
SEED_NODE = "soak-seed"
DELAYED_METHODS = ("CreateReplica", "ReleaseVMSetup", "ListReplicas")
SPECS: dict[str, dict[str, Any]] = {
    "soak-a": {"image": "examples.hello", "kernel": "/k", "min": 1, "max": 10, "exec_envs": 2},
    "soak-b": {
        "image": "examples.hello",
        "kernel": "/k",
        "min": 0,
        "max": 10,
        "placement": "roundrobin",
    },
    "soak-l": {
        "image": "examples.hello",
        "min": 0,
        "max": 6,
        "backend": "lambdo",
        "rootfs": "https://objects.example/soak/rootfs.ext4",
    },
}


@dataclass
class Results:
    """Everything the soak counts; printed at the end, and as JSON with ``--json``."""

    minutes: float
    ops: list[Tracked] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)  # clear refusals (InputError...)
    errors: Counter[str] = field(default_factory=Counter)  # faults seen by the producer
    claims: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    deaths: list[str] = field(default_factory=list)
    violations: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    per_minute: list[dict[str, int]] = field(default_factory=list)
    spawn_p50_s: float | None = None
    spawn_p99_s: float | None = None
    spawns_timed: int = 0
    settled_after_s: float | None = None
    wall_s: float = 0.0  # start of the fleet to the last check
    final: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)  # why ops failed (first error)

    @property
    def ok(self) -> bool:
        """Every invariant held and every fault kind fired."""
        return all(v == 0 for v in self.violations.values()) and all(
            self.faults[k] > 0 for k in FAULT_KINDS
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        return {
            "minutes": self.minutes,
            "submitted": len(self.ops),
            "final": dict(self.final),
            "refused": dict(self.refused),
            "errors": dict(self.errors),
            "claims": dict(self.claims),
            "faults": dict(self.faults),
            "deaths": self.deaths,
            "violations": self.violations,
            "examples": self.examples,
            "per_minute": self.per_minute,
            "spawn_p50_s": self.spawn_p50_s,
            "spawn_p99_s": self.spawn_p99_s,
            "spawns_timed": self.spawns_timed,
            "settled_after_s": self.settled_after_s,
            "wall_s": self.wall_s,
            "failure_reasons": dict(self.reasons),
            "ok": self.ok,
        }


class Fleet:
    """The processes and in-process nodes of one soak, and the faults done to them."""

    def __init__(self, tmp: Path, log: Callable[[str], None]) -> None:
        self.tmp = tmp
        self.say = log
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True)
        self.lock = threading.Lock()
        self.expected_dead: set[int] = set()
        self.workers: list[Any] = []
        self.generation = 0
        self.agents: list[Any] = []
        self.agent_ports: list[int] = []
        self.seed: Any = None  # the agent that speaks only the seed protocol
        self.lambdo: Any = None
        self.beat: subprocess.Popen[bytes] | None = None
        self.registry: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    # -- start -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start PostgreSQL, Redis, the registry, the nodes, the workers and beat."""
        self.redis = RedisServer(self.tmp / "redis")
        (self.tmp / "redis").mkdir()
        self.redis.start()
        self.pg = PostgresServer(make_shared_tempdir("corral-soak-pg-"))
        self.pg.start()
        database_url = self.pg.create_database("soak")
        reg_port = free_port()
        self.registry_addr = f"127.0.0.1:{reg_port}"
        self.env = {
            **SOAK_ENV,
            "CORRAL_DATABASE_URL": database_url,
            "CORRAL_BROKER_URL": self.redis.url_for(0),
            "CORRAL_RESULT_BACKEND": self.redis.url_for(1),
            "CORRAL_STATE_DIR": str(self.tmp / "state"),
            "CORRAL_REGISTRY_LISTEN": self.registry_addr,
            "CORRAL_EAGER": "0",
        }
        os.environ.update(self.env)

        reset_settings()
        configure(get_settings())

        upgrade(self._db())
        database()
        self.registry = subprocess.Popen(
            [sys.executable, "-m", "corral.cli", "registry"],
            cwd=ROOT,
            env={**os.environ, **self.env},
            stdout=(self.logs / "registry.log").open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._start_nodes()
        self._deploy_all()
        for i in range(WORKERS):
            self.workers.append(self._new_worker(i))

        self.beat = start_beat(self.logs, "soak", self.env)

    def _db(self) -> Any:
        return get_database(get_settings().database_url)

    def _start_nodes(self) -> None:
        for i in range(3):
            port = free_port()
            self.agent_ports.append(port)
            self.agents.append(self._serve_agent(i, port, None))
        self.lambdo = serve_lambdo("127.0.0.1:0")
        self.seed = serve_fcdaemon(
            "127.0.0.1:0",
            registry=self.registry_addr,
            seed_only=True,
            node_id=SEED_NODE,
            heartbeat=2.0,
        )
        with self._db().transaction() as s:
            for i, port in enumerate(self.agent_ports):
                upsert_node(
                    s,
                    f"127.0.0.1:{port}",
                    name=f"soak-fc{i + 1}",
                    external_id=f"soak-fc{i + 1}",
                    capacity=40,
                )
            upsert_node(s, self.seed.address, name=SEED_NODE, external_id=SEED_NODE, capacity=40)
            upsert_node(s, self.lambdo.url, name="soak-lambdo", kind="lambdo", capacity=40)

    def _serve_agent(self, i: int, port: int, driver: Any) -> Any:
        return serve_fcdaemon(
            f"127.0.0.1:{port}",
            driver=driver,
            registry=self.registry_addr,
            node_id=f"soak-fc{i + 1}",
            heartbeat=2.0,
        )

    def _deploy_all(self) -> None:
        with self._db().transaction() as s:
            for name in FUNCTIONS:
                deploy(s, spec_from(name=name, **SPECS[name]), get_settings())

    def _new_worker(self, slot: int) -> Any:
        self.generation += 1
        worker = WorkerProcess(
            self.logs, concurrency=2, name=f"w{slot + 1}g{self.generation}", extra_env=self.env
        )
        return worker.start(timeout=90)

    # -- faults ------------------------------------------------------------------------------

    def kill_worker(self, n: int) -> None:
        """SIGKILL worker ``n % 3`` (its whole process group) and start a replacement."""
        slot = n % len(self.workers)
        worker = self.workers[slot]
        with self.lock:
            if worker.proc is not None:
                self.expected_dead.add(worker.proc.pid)
        worker.kill()
        worker._log.close()
        self.workers[slot] = self._new_worker(slot)

    def stop_redis(self, seconds: float) -> None:
        """Stop the broker for ``seconds``, then start it again on the same port."""
        self.redis.stop()
        time.sleep(seconds)
        self.redis.start()

    def restart_postgres(self) -> None:
        """Restart the store (every connection drops)."""
        self.pg.restart()

    def stop_agent(self, i: int, seconds: float) -> None:
        """Stop agent ``i``'s server (its VMs keep running) and serve again after ``seconds``."""
        agent = self.agents[i]
        if agent.reporter is not None:
            agent.reporter.close()
        agent.server.stop(0).wait()
        time.sleep(seconds)
        for attempt in range(20):  # the port may take a moment to be free again
            try:
                self.agents[i] = self._serve_agent(i, self.agent_ports[i], agent.driver)
                return
            except OSError:
                if attempt == 19:
                    raise
                time.sleep(0.5)

    def delay_agent(self, i: int, seconds: float, delay: float = 2.0) -> None:
        """Delay agent ``i``'s replies, and the seed agent's, by ``delay`` s for ``seconds``."""
        slowed = [self.agents[i], self.seed]
        for agent in slowed:
            for method in DELAYED_METHODS:
                agent.agent.inject(method, *[Fault.delay(delay)] * 100_000)
        time.sleep(seconds)
        for agent in slowed:
            agent.agent.faults.clear()

    def listing(self, node: Node, settings: Any) -> list[Any]:
        """The VMs a node runs: asked over its protocol, or the seed agent's driver read."""
        if node.name == SEED_NODE:
            return list(self.seed.driver.list())
        return list(backends.list_vms(node, settings))

    # -- watch -------------------------------------------------------------------------------

    def dead(self) -> list[str]:
        """Processes (workers, beat, registry) that exited without the schedule killing them."""
        out = []
        with self.lock:
            for worker in self.workers:
                proc = worker.proc
                if (
                    proc is not None
                    and proc.poll() is not None
                    and proc.pid not in self.expected_dead
                ):
                    out.append(f"worker {worker.name} (exit {proc.returncode})")
        for name, proc in (("beat", self.beat), ("registry", self.registry)):
            if proc is not None and proc.poll() is not None:
                out.append(f"{name} (exit {proc.returncode})")
        return out

    def stop(self) -> None:
        """Stop everything this fleet started."""
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.stop(timeout=10)
        for proc in (self.beat, self.registry):
            if proc is not None:
                stop_process(proc, 10)
        for agent in [*self.agents, self.seed]:
            with contextlib.suppress(Exception):
                agent.stop(grace=0)
        if self.lambdo is not None:
            self.lambdo.stop()
        with contextlib.suppress(Exception):
            self._db().dispose()
        self.redis.stop()
        self.pg.stop()


class Faults:
    """Fires the schedule; each event in its own thread, so windows may overlap."""

    def __init__(
        self,
        fleet: Fleet,
        results: Results,
        events: list[FaultEvent],
        t0: float,
        log: Callable[[str], None],
    ) -> None:
        self.fleet, self.results, self.events, self.t0, self.say = fleet, results, events, t0, log
        self.threads: list[threading.Thread] = []
        self.kills = 0

    def run(self) -> None:
        """Wait for each event's time and start it."""
        for event in self.events:
            delay = self.t0 + event.at_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t = threading.Thread(target=self._fire, args=(event,), daemon=True)
            t.start()
            self.threads.append(t)
        for t in self.threads:
            t.join()

    def _fire(self, event: FaultEvent) -> None:
        fleet = self.fleet
        self.say(
            f"[{time.monotonic() - self.t0:6.1f}s] fault {event.kind}"
            + (f" for {event.duration_s:g}s" if event.duration_s else "")
        )
        try:
            if event.kind == "worker_kill":
                with fleet.lock:
                    n = self.kills
                    self.kills += 1
                fleet.kill_worker(n)
            elif event.kind == "redis_stop":
                fleet.stop_redis(event.duration_s)
            elif event.kind == "postgres_restart":
                fleet.restart_postgres()
            elif event.kind == "agent_stop":
                fleet.stop_agent(0, event.duration_s)
            elif event.kind == "agent_delay":
                fleet.delay_agent(1, event.duration_s)
        except Exception as exc:
            self.results.errors[f"fault {event.kind}: {type(exc).__name__}: {exc}"] += 1
            return
        self.results.faults[event.kind] += 1


def check(fleet: Fleet, results: Results) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Every invariant's violations now, with a few examples of each."""
    settings = get_settings()
    db = fleet._db()
    with db.read() as s:
        nodes = list(s.scalars(select(Node).order_by(Node.name)))
        rows = s.execute(
            select(Replica.id, Replica.node_id, Replica.vmid, Replica.status).where(
                Replica.status.in_(LIVE_STATES)
            )
        ).all()
        claims = s.scalar(select(func.count()).select_from(Claim)) or 0
        in_use = (
            s.scalar(
                select(func.coalesce(func.sum(Replica.envs_in_use), 0)).where(
                    Replica.status.in_(LIVE_STATES)
                )
            )
            or 0
        )
    listed: dict[str, tuple[str, list[str] | Exception]] = {}
    for node in nodes:
        try:
            listed[node.id] = (node.name, [vm.vmid for vm in fleet.listing(node, settings)])
        except Exception as exc:
            listed[node.id] = (node.name, exc)
    bad = compare([tuple(r) for r in rows], listed)
    bad["ops_not_final"] = not_final(db, results.ops)
    with db.transaction() as s:
        bad["counter_drift"] = [d.message for d in audit(s).drifts]
    bad["claims_outstanding"] = (
        [f"{claims} claim rows, {in_use} environments in use"] if claims or in_use else []
    )
    bad["unexpected_deaths"] = fleet.dead()
    return {k: len(v) for k, v in bad.items()}, {k: v[:5] for k, v in bad.items() if v}


def figures(fleet: Fleet, results: Results) -> None:
    """Fill in per-minute counts, final states and spawn completion percentiles."""
    got = outcomes(fleet._db(), results.ops, results.minutes)
    results.final, results.reasons, results.per_minute = got.final, got.reasons, got.per_minute
    results.spawn_p50_s, results.spawn_p99_s = got.spawn_p50_s, got.spawn_p99_s
    results.spawns_timed = got.spawns_timed


def report(results: Results) -> str:
    """The figures as text."""
    lines = [
        f"corral soak: {results.minutes:g} min, {WORKERS} prefork workers (2 children "
        f"each), 1 beat, registry, 3 fcdaemon agents + 1 Lambdo host, PostgreSQL store"
    ]
    lines.append(
        f"operations submitted: {len(results.ops)}; final states: "
        f"{dict(sorted(results.final.items()))}"
    )
    lines.append(
        f"refused (clear errors): {dict(results.refused)}; producer errors during "
        f"faults: {dict(results.errors)}"
    )
    lines.append(f"claims: {dict(results.claims)}")
    for reason, n in results.reasons.most_common(8):
        lines.append(f"  failed or partial ({n}): {reason}")
    lines.append("minute  submitted  completed")
    for row in results.per_minute:
        lines.append(f"{row['minute']:>6}  {row['submitted']:>9}  {row['completed']:>9}")
    lines.append("faults injected: " + ", ".join(f"{k} {results.faults[k]}" for k in FAULT_KINDS))

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f}s"

    lines.append(
        f"spawn completion: p50 {fmt(results.spawn_p50_s)}, p99 "
        f"{fmt(results.spawn_p99_s)} ({results.spawns_timed} succeeded spawns)"
    )
    settled = "never" if results.settled_after_s is None else f"{results.settled_after_s:.0f}s"
    lines.append(f"settled after quiescing: {settled}; wall time {results.wall_s:.0f}s")
    lines.append("invariant violations (all must be 0):")
    for name, n in results.violations.items():
        example = results.examples.get(name)
        lines.append(f"  {name:<20} {n}" + (f"   e.g. {example}" if example else ""))
    lines.append("RESULT: " + ("ok" if results.ok else "FAILED"))
    return "\n".join(lines)


def run(
    minutes: float, rate: float, seed: int, quiesce_s: float, log: Callable[[str], None] = print
) -> Results:
    """Start the fleet, run load and faults for ``minutes``, quiesce, check; the results."""
    results = Results(minutes=minutes)
    began = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="corral-soak-"))
    fleet = Fleet(tmp, log)
    try:
        log(f"starting the fleet under {tmp}")
        fleet.start()
        duration = minutes * 60
        t0 = time.monotonic()
        load = Load(fleet._db, SPECS, results, rate, seed, t0)
        faults = Faults(fleet, results, schedule(duration), t0, log)
        threads = [
            threading.Thread(target=load.run, daemon=True),
            threading.Thread(target=faults.run, daemon=True),
        ]
        for t in threads:
            t.start()
        deaths_seen: set[str] = set()
        while time.monotonic() < t0 + duration:
            time.sleep(1.0)
            for death in fleet.dead():
                if death not in deaths_seen:
                    deaths_seen.add(death)
                    log(f"unexpected death: {death}")
        load.stop.set()
        threads[0].join(30)
        threads[1].join()  # every fault window closed
        log(f"[{time.monotonic() - t0:6.1f}s] load stopped; quiescing")
        quiet = time.monotonic()
        load.release_all(within_s=30)
        while True:
            violations, examples = check(fleet, results)
            if all(v == 0 for v in violations.values()):
                results.settled_after_s = time.monotonic() - quiet
                break
            if time.monotonic() > quiet + quiesce_s:
                break
            time.sleep(3)
        results.violations, results.examples = violations, examples
        results.deaths = sorted(deaths_seen | set(fleet.dead()))
        figures(fleet, results)
        results.wall_s = time.monotonic() - began
    finally:
        fleet.stop()
    if results.ok:  # kept (its logs, its database) when a check failed
        remove_trees(tmp, fleet.pg.directory if hasattr(fleet, "pg") else None)
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its figures; 0 only if every invariant held."""
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--minutes", type=float, default=5.0, help="load and faults for this long")
    parser.add_argument("--rate", type=float, default=2.0, help="load actions per second")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--quiesce",
        type=float,
        default=150.0,
        help="seconds to wait for the fleet to settle afterwards",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.rate <= 0:
        parser.error("--minutes and --rate must be positive")
    results = run(
        args.minutes, args.rate, args.seed, args.quiesce, log=lambda m: print(m, flush=True)
    )
    print(report(results), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results.as_dict(), indent=2, default=str))
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
