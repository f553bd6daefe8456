"""A whole corral fleet on namespace hosts: started as an operator would, faulted by the nemesis.

:class:`Fleet` starts, on the hosts :class:`testkit.nsprocs.Layout` describes, the broker
and the store (each with a password), ``corral db upgrade``'s migrations, the registry,
the agents (which register themselves), ``corral nodes add`` for each node's capacity and
replica network, the functions, the workers, beat and the gateway. Every process gets
the same ``CORRAL_*`` environment (:data:`PT_ENV`: the soak's short intervals, so what a
fault leaves behind is repaired within a quiet period), except the agents, which get
only their own tokens.

The process faults are here too: workers SIGKILLed (``corral worker``'s process group;
its Celery worker dies with it) and new ones started on the same hosts, an agent frozen
(SIGSTOP) and thawed, Redis stopped and started, PostgreSQL restarted, a worker host's
clock set off (:meth:`Fleet.skew`: every worker's Python reads its wall clock through
``testkit/skewclock/sitecustomize.py``, offset by the seconds in a file of its host's,
``+0`` but during a skew; the monotonic clock is left alone)
and a worker's log pipe left unread (:meth:`Fleet.stall`: a worker's output reaches its
log through a small pipe the harness reads).
:meth:`Fleet.dead` lists processes that died without the nemesis killing them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select

from config.settings import get_settings, reset_settings
from testkit.netns import Launcher, Network
from testkit.nsprocs import (
    AGENT_PORT,
    LAMBDO_PORT,
    REPLICA_PORTS,
    ROOT,
    Layout,
    NsPostgres,
    NsRedis,
    Proc,
    _port_open,
    _python,
    new_secret,
    vms_by_host,
    worker_argv,
)
from testkit.soak_plan import SOAK_ENV
from workers.celery import configure
from workers.functions import deploy, spec_from
from workers.store.db import Database, get_database
from workers.store.migrate import upgrade
from workers.store.models import Node

#: Every corral process's settings (the agents' are their own): the soak's.
PT_ENV = {
    **SOAK_ENV,
    "CORRAL_GATEWAY_TIMEOUT_S": "10",
    "CORRAL_GATEWAY_COLD_START_TIMEOUT_S": "15",
    "CORRAL_EAGER": "0",
    # below a node's capacity, so that a kill or a freeze that left more maybes on a node
    # than calls could have been in flight to it shows (checker.maybes_beyond_inflight)
    "CORRAL_NODE_MAX_INFLIGHT": "2",
    # the Python data plane: HAProxy tries a warm call again elsewhere only when it cannot
    # connect (no L7 retries: issue 40), where the Python path retries an idempotent call
    # on another replica. One --ci run saw a call closed unanswered the moment HAProxy's
    # server for a replica deleted behind the gateway's back was closed. What this run
    # checks is the control plane under faults; the HAProxy plane's own are tests/workers/gateway.
    "CORRAL_GATEWAY_DATAPLANE": "python",
}
FUNCTIONS: dict[str, dict[str, Any]] = {
    "pt-a": {"image": "examples.hello", "kernel": "/k", "min": 1, "max": 10, "exec_envs": 2},
    "pt-b": {
        "image": "examples.hello",
        "kernel": "/k",
        "min": 0,
        "max": 8,
        "placement": "roundrobin",
    },
    "pt-l": {
        "image": "examples.hello",
        "min": 0,
        "max": 4,
        "backend": "lambdo",
        "rootfs": "https://objects.example/pt/rootfs.ext4",
    },
}
#: The directory whose ``sitecustomize`` offsets a worker's wall clock (``PT_CLOCK_FILE``).
SKEWCLOCK = ROOT / "testkit" / "skewclock"


#: The functions the gateway callers call (one on fcdaemon nodes, one on the Lambdo host).
CALLED = ("pt-a", "pt-l")


class Fleet:
    """The processes of one run on their hosts, and what the nemesis does to them."""

    def __init__(  # noqa: PLR0913 - the run's parts, by name
        self,
        layout: Layout,
        net: Network,
        launcher: Launcher,
        tmp: Path,
        say: Callable[[str], None],
        inject: str | None = None,
        seed_delay: float = 0.0,
    ) -> None:
        self.layout, self.net, self.launcher, self.tmp, self.say = layout, net, launcher, tmp, say
        self.inject = inject
        self.seed_delay = seed_delay  # seconds each create takes on a seed-only agent
        self.logs = tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.procs: dict[str, Proc] = {}  # by role: "reg", "w1", "fc3"...
        self.killed: set[int] = set()  # pids the nemesis killed
        self.exits: list[str] = []  # workers that exited by themselves, restarted
        self._restarting: set[str] = set()
        self.generation = 0
        self.tokens = {k: new_secret() for k in ("registry", "agent", "lambdo", "gateway")}
        self.env: dict[str, str] = {}
        self.redis: NsRedis | None = None
        self.pg: NsPostgres | None = None

    # -- start -------------------------------------------------------------------------

    def start(self) -> None:
        """Start everything, in order; raise with the failing process's log if one fails."""
        lay = self.layout
        self.redis = NsRedis(
            self.tmp / "redis", self.launcher, "redis", lay.ip("redis"), new_secret()
        )
        self.redis.start()
        self.pg = NsPostgres(self.tmp / "pg", self.launcher, "pg", lay.ip("pg"), new_secret())
        self.pg.start()
        self.env = {
            **PT_ENV,
            "CORRAL_NODE_CAPACITY": str(lay.capacity),
            "CORRAL_DATABASE_URL": self.pg.create_database("corral"),
            "CORRAL_BROKER_URL": self.redis.url_for(0),
            "CORRAL_RESULT_BACKEND": self.redis.url_for(1),
            "CORRAL_STATE_DIR": str(self.tmp / "state"),
            "CORRAL_REGISTRY_LISTEN": f"{lay.ip('reg')}:50052",
            "CORRAL_GATEWAY_LISTEN": f"{lay.ip('gw')}:8080",
            "CORRAL_REGISTRY_TOKEN": self.tokens["registry"],
            "CORRAL_AGENT_TOKEN": self.tokens["agent"],
            "CORRAL_LAMBDO_TOKEN": self.tokens["lambdo"],
            "CORRAL_GATEWAY_TOKEN": self.tokens["gateway"],
        }
        os.environ.update(self.env)  # the harness's own producers and checks
        reset_settings()
        configure(get_settings())
        upgrade(self.db())
        self._corral("reg", ["-m", "corral.cli", "registry"], port=50052)
        agents = [self._agent(a) for a in lay.agent_names] + [self._lambdo()]
        for proc in agents:
            proc.wait_ready(60)
        self._add_nodes()
        with self.db().transaction() as s:
            for name, spec in FUNCTIONS.items():
                deploy(s, spec_from(name=name, **spec), get_settings())
        workers = [self._worker(w) for w in lay.worker_names]
        for proc in workers:
            proc.wait_ready(120)
        schedule = str(self.tmp / "beat-schedule")
        beat = ["-m", "workers.command", "beat", "-l", "INFO", "--max-interval", "1"]
        self._corral("beat", [*beat, "-s", schedule])
        self._corral("gw", ["-m", "corral.cli", "gateway"], port=8080)

    def db(self) -> Database:
        """The store, as the harness reaches it."""
        return get_database(get_settings().database_url)

    def _child_env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        return {**base, **extra, "PYTHONPATH": str(ROOT)}

    def _proc(self, role: str, host: str, argv: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(role, host, argv, env, self.logs / f"{role}.log").start(self.launcher)
        with self.lock:  # only once it runs: the supervisor reads every registered one
            self.procs[role] = proc
        return proc

    def _corral(self, role: str, args: list[str], port: int | None = None) -> Proc:
        """A corral process on host ``role``, waited for until it listens on ``port``."""
        proc = self._proc(role, role, _python(args, self.inject), self._child_env(**self.env))
        ip = self.layout.ip(role)
        if port is not None:
            proc.ready = lambda: _port_open(ip, port)
            proc.wait_ready(90)
        return proc

    def _agent(self, host: str) -> Proc:
        lay = self.layout
        argv = [
            sys.executable, "-m", "agents.fcdaemon",
            "--listen", f"{lay.ip(host)}:{AGENT_PORT}",
            "--registry", self.env["CORRAL_REGISTRY_LISTEN"],
            "--node-id", lay.node_name(host),
            "--driver", "process",
            "--port-range", "{}-{}".format(*REPLICA_PORTS),
            "--replica-ip", lay.replica_ip(host),
            "--heartbeat", "2",
            *(["--seed-only", "--create-delay", str(self.seed_delay)] if lay.seed(host) else []),
        ]  # fmt: skip
        env = self._child_env(
            CORRAL_AGENT_TOKEN=self.tokens["agent"], CORRAL_REGISTRY_TOKEN=self.tokens["registry"]
        )
        proc = self._proc(host, host, argv, env)
        proc.ready = lambda: self._registered(lay.node_name(host))
        return proc

    def _lambdo(self) -> Proc:
        ip = self.layout.ip("lb")
        argv = [sys.executable, "-m", "agents.lambdo", "--listen", f"{ip}:{LAMBDO_PORT}",
                "--driver", "process"]  # fmt: skip
        proc = self._proc(
            "lb", "lb", argv, self._child_env(CORRAL_LAMBDO_TOKEN=self.tokens["lambdo"])
        )
        proc.ready = lambda: _port_open(ip, LAMBDO_PORT)
        return proc

    def _registered(self, external_id: str) -> bool:
        with self.db().read() as s:
            return s.scalar(select(Node.id).where(Node.external_id == external_id)) is not None

    def _add_nodes(self) -> None:
        """``corral nodes add`` for every agent: capacity and replica network, as an operator."""
        lay = self.layout
        for host in lay.agent_names:
            self.cli("nodes", "add", f"{lay.ip(host)}:{AGENT_PORT}", "--name", lay.node_name(host),
                     "--capacity", str(lay.capacity),
                     "--replica-network", lay.replica_network(host))  # fmt: skip
        self.cli("nodes", "add", f"http://{lay.ip('lb')}:{LAMBDO_PORT}", "--kind", "lambdo",
                 "--name", lay.node_name("lb"), "--capacity", str(lay.capacity))  # fmt: skip

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``corral ARGS`` on the harness's host, as an operator would."""
        done = subprocess.run(
            [sys.executable, "-m", "corral.cli", *args],
            cwd=ROOT, env=self._child_env(**self.env), capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"corral {' '.join(args)}: {done.stdout}{done.stderr}")
        return done

    def _clock_file(self, host: str) -> Path:
        """The offset of ``host``'s clock that libfaketime reads (``+0``: none)."""
        return self.tmp / f"clock-{host}"

    def _clock_env(self, host: str) -> dict[str, str]:
        clock_file = self._clock_file(host)
        if not clock_file.exists():
            clock_file.write_text("+0\n")
        return {"PT_CLOCK_FILE": str(clock_file)}

    def _worker(self, host: str) -> Proc:
        with self.lock:
            self.generation += 1
            name = f"{host}g{self.generation}"
        log = self.logs / f"{host}.log"
        size = log.stat().st_size if log.exists() else 0  # its "ready." comes after this
        env = {**self._child_env(**self.env, **self._clock_env(host))}
        env["PYTHONPATH"] = f"{SKEWCLOCK}{os.pathsep}{env['PYTHONPATH']}"
        proc = Proc(host, host, worker_argv(name, self.inject), env, log, piped=True)
        proc.start(self.launcher)
        with self.lock:
            self.procs[host] = proc
        proc.ready = lambda: b" ready." in log.read_bytes()[size:]
        return proc

    # -- faults ------------------------------------------------------------------------

    def kill_workers(self, hosts: tuple[str, ...]) -> None:
        """SIGKILL the workers on ``hosts`` (each its whole group), then start new ones there."""
        with self.lock:
            procs = [self.procs[host] for host in hosts]
            self.killed.update(p.pid for p in procs if p.popen is not None)
        for proc in procs:
            proc.kill()
        for fresh in [self._worker(host) for host in hosts]:
            fresh.wait_ready(120)

    def skew(self, host: str, offset_s: float, seconds: float, stop: threading.Event) -> None:
        """Set the wall clock of ``host``'s workers ``offset_s`` off for ``seconds``."""
        clock_file = self._clock_file(host)
        clock_file.write_text(f"{offset_s:+.0f}\n")
        try:
            stop.wait(seconds)
        finally:
            clock_file.write_text("+0\n")

    def stall(self, host: str, seconds: float, stop: threading.Event) -> None:
        """Leave the log pipe of ``host``'s worker unread for ``seconds``."""
        with self.lock:
            proc = self.procs[host]
        proc.stall(seconds, stop)

    def freeze(self, host: str, seconds: float, stop: threading.Event) -> None:
        """SIGSTOP the agent on ``host`` (its VMs run on) for ``seconds``, then SIGCONT."""
        proc = self.procs[host]
        proc.signal(signal.SIGSTOP)
        try:
            stop.wait(seconds)
        finally:
            proc.signal(signal.SIGCONT)

    def restart_redis(self, down_s: float, stop: threading.Event) -> None:
        """Stop the broker for ``down_s``, then start it on the same address."""
        assert self.redis is not None
        self.redis.stop()
        try:
            stop.wait(down_s)
        finally:
            self.redis.start()

    def restart_postgres(self) -> None:
        """Restart the store (every connection drops)."""
        assert self.pg is not None
        self.pg.restart()

    # -- watch -------------------------------------------------------------------------

    def vms(self) -> dict[str, set[str]]:
        """What runs on each agent host now, by node name (from /proc, not the agents)."""
        hosts = [*self.layout.agent_names, "lb"]
        inodes = {self.net.inode(h): h for h in hosts}
        return {self.layout.node_name(h): v for h, v in vms_by_host(inodes).items()}

    def gateway(self) -> httpx.Client:
        """A client of the gateway, with its token."""
        return httpx.Client(
            base_url=f"http://{self.layout.ip('gw')}:8080",
            headers={"Authorization": f"Bearer {self.tokens['gateway']}"},
        )

    def supervise(self) -> None:
        """Restart, as a supervisor would, a worker that exited by itself (in the background).

        ``corral worker`` restarts its worker itself when a task outlives its hard time limit
        (:meth:`hard_limit_restarts` counts those); a ``corral worker`` that exits at all is
        restarted here and stays in :meth:`dead`.
        """
        for host in self.layout.worker_names:
            with self.lock:
                proc = self.procs[host]
                if proc.alive or proc.pid in self.killed or host in self._restarting:
                    continue
                code = proc.popen.returncode if proc.popen is not None else None
                self.exits.append(f"{host} exited with {code}")
                self._restarting.add(host)
            threading.Thread(target=self._restart, args=(host,), daemon=True).start()

    def hard_limit_restarts(self) -> list[str]:
        """What ``corral worker`` said each time it killed and restarted its worker."""
        out = []
        for host in self.layout.worker_names:
            text = (self.logs / f"{host}.log").read_text(errors="replace")
            out += [f"{host}: {line}" for line in text.splitlines() if "outlived its hard" in line]
        return out

    def _restart(self, host: str) -> None:
        try:
            self._worker(host).wait_ready(120)
        except Exception as exc:
            self.say(f"worker {host} did not come back: {exc}")
        finally:
            with self.lock:
                self._restarting.discard(host)

    def dead(self) -> list[str]:
        """Processes that exited without the nemesis killing them."""
        with self.lock:
            procs = list(self.procs.values())
            killed = set(self.killed)
        return [
            f"{p.name} (exit {p.popen.returncode}): {p.tail(3)}"
            for p in procs
            if p.popen is not None and p.popen.poll() is not None and p.pid not in killed
        ]

    def stop(self) -> None:
        """Stop everything this fleet started (clients first, the store last)."""
        with self.lock:
            procs = list(self.procs.values())
        order = ["gw", "beat", *self.layout.worker_names, "reg"]
        procs.sort(key=lambda p: order.index(p.name) if p.name in order else len(order))
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop(timeout=5)
        with contextlib.suppress(Exception):
            self.db().dispose()
        for server in (self.redis, self.pg):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
