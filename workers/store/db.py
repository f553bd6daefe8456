"""Engines and transactions, one engine per process.

:class:`Database` wraps a SQLAlchemy engine and session factory. It remembers the
process that made it: after a ``fork`` (Celery's prefork pool) the child gets a
fresh connection pool on first use and leaves the parent's sockets alone, so no
connection is ever shared across processes. SQLite runs in WAL mode with a busy
timeout and takes the write lock at ``BEGIN`` (``BEGIN IMMEDIATE``), so two
writers queue instead of failing on a lock upgrade; PostgreSQL runs at READ
COMMITTED and relies on row locks and conditional UPDATEs; every PostgreSQL
connection sets ``lock_timeout`` and ``statement_timeout`` (``CORRAL_DB_LOCK_TIMEOUT_S``,
``CORRAL_DB_STATEMENT_TIMEOUT_S``), so a statement stuck behind a lock fails with an
``OperationalError`` instead of hanging its worker, and
``idle_in_transaction_session_timeout`` (``CORRAL_DB_IDLE_IN_TRANSACTION_TIMEOUT_S``): the
server ends a session left idle inside a transaction (its process stuck or gone), which
would hold its row locks for good; and it gives up on a server it cannot reach within seconds
(:data:`PG_NETWORK`).

Inside a task no wait outlasts the task: a transaction's statement and lock timeouts are
the settings cut to the time left before the task's hard limit, less :data:`WAY_OUT_S`
for its way out (``SET LOCAL`` through ``set_config``, one statement, only when the cut is
below the settings; on SQLite the busy timeout, before ``BEGIN``), its way out after the
soft limit included; and a statement that locks many rows at once
(:func:`one_lock_wait`: ``workers.locks``) runs under a statement timeout of the lock
timeout, so its waits add up to one lock timeout, not one per row (a placement locking
every node waited 11 s with a 2.5 s lock timeout).

The first transaction the running task starts past its soft time limit is refused
(:func:`workers.base.timelimits.check`: :class:`~workers.base.timelimits.OutOfTime` is raised
before any connection is taken; the task's way out then goes ahead), and the connection
a transaction took goes back to the pool when it ends, however it ends: committed,
rolled back on any exception, and on a ``BaseException`` (an interrupt, a generator
closed mid-transaction) invalidated rather than returned with its state unknown.

The database's clock is the one every expiry is judged on (:mod:`workers.base.clock`): the
first transaction a process opens, and one every ``clock.SYNC_EVERY_S`` after, asks the
server for its time once; between two, the process counts on its monotonic clock. An
expiry that decides who owns something can be judged by the database itself:
:func:`store_now` is the server's current time in a statement (shifted by
``clock.travel`` in tests).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Connection,
    DateTime,
    Engine,
    Float,
    bindparam,
    create_engine,
    event,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, DisconnectionError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import QueuePool, StaticPool
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from config.settings import get_settings
from workers.base import clock, timelimits

# A transaction starting with less than WAY_OUT_S left waits MIN_WAIT_S at most.
WAY_OUT_S = timelimits.WAY_OUT_S
MIN_WAIT_S = 0.001  # PostgreSQL reads 0 as "no timeout": never cut to it
SQLITE_BUSY_S = 30.0  # SQLite's busy timeout outside a task
_SET_WAITS = text(
    "SELECT set_config('statement_timeout', :statement, true), "
    "set_config('lock_timeout', :lock, true)"
)
_SET_STATEMENT = text("SELECT set_config('statement_timeout', :statement, true)")

# The server's own time as naive UTC: clock_timestamp() moves during a transaction, unlike now().
_PG_TIME = text("SELECT clock_timestamp() AT TIME ZONE 'UTC'")
_SQLITE_TIME = text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")


class _StoreNow(FunctionElement[datetime]):
    """The database server's current time, naive UTC, plus an offset in seconds (tests)."""

    type = DateTime()
    name = "store_now"
    inherit_cache = True


@compiles(_StoreNow, "postgresql")
def _store_now_pg(element: _StoreNow, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(element.clauses, **kw)
    return f"(timezone('UTC', statement_timestamp()) + make_interval(secs => {offset}))"


@compiles(_StoreNow, "sqlite")
def _store_now_sqlite(element: _StoreNow, compiler: SQLCompiler, **kw: Any) -> str:
    offset = compiler.process(element.clauses, **kw)
    return f"strftime('%Y-%m-%d %H:%M:%f', 'now', printf('%+.6f seconds', {offset}))"


def store_now() -> _StoreNow:
    """The store's clock in a statement: its server's time now (with ``clock.travel``'s offset).

    The offset is read when the statement runs, so a statement built once keeps honouring
    ``clock.travel``.
    """
    return _StoreNow(bindparam(None, callable_=clock.offset_s, type_=Float))


def insert_for(session: Session) -> Any:
    """The store's own ``insert`` (PostgreSQL's or SQLite's), which has ON CONFLICT DO NOTHING."""
    dialect = session.connection().dialect.name
    return postgresql.insert if dialect == "postgresql" else sqlite.insert


class _After(FunctionElement[datetime]):
    """A time plus a number of seconds, in SQL, naive UTC."""

    type = DateTime()
    name = "seconds_after"
    inherit_cache = True


@compiles(_After, "postgresql")
def _after_pg(element: _After, compiler: SQLCompiler, **kw: Any) -> str:
    at, seconds = (compiler.process(c, **kw) for c in element.clauses)
    return f"({at} + make_interval(secs => {seconds}))"


@compiles(_After, "sqlite")
def _after_sqlite(element: _After, compiler: SQLCompiler, **kw: Any) -> str:
    at, seconds = (compiler.process(c, **kw) for c in element.clauses)
    return f"strftime('%Y-%m-%d %H:%M:%f', {at}, printf('%+.6f seconds', {seconds}))"


def seconds_after(at: Any, seconds: Any) -> _After:
    """SQL: the time ``at`` plus ``seconds`` (either a value or a column)."""
    return _After(at, seconds)


class Database:
    """An engine and session factory bound to one URL and one process."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pid = -1
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._options: dict[str, Any] = {}  # what the engine was made with (the settings')
        self._disposed = False  # its connections were closed: look at the settings again

    @property
    def is_sqlite(self) -> bool:
        """Whether this is the embedded SQLite store."""
        return self.url.startswith("sqlite")

    @property
    def engine(self) -> Engine:
        """This process's engine, created on first use after start or fork.

        :meth:`dispose` closes its connections but keeps it - and the statements it has
        compiled, SQLAlchemy's cache, which a new engine starts without - unless the
        settings it was made with have changed since.
        """
        if self._engine is None or self._pid != os.getpid() or self._disposed:
            with self._lock:
                if self._disposed and self._engine is not None and self._pid == os.getpid():
                    self._disposed = False
                    if _engine_options(self.url) != self._options:
                        self._engine = None
                if self._engine is None or self._pid != os.getpid():
                    if self._engine is not None:
                        # Inherited from the parent: drop the pool without closing
                        # the parent's connections.
                        self._engine.dispose(close=False)
                    self._options = _engine_options(self.url)
                    self._engine = _make_engine(self.url, self._options)
                    self._sessions = sessionmaker(self._engine, expire_on_commit=False)
                    self._pid = os.getpid()
                    self._disposed = False
        return self._engine

    def session(self) -> Session:
        """A new session on this process's engine."""
        _ = self.engine
        assert self._sessions is not None  # noqa: S101 - narrows for mypy
        return self._sessions()

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any exception."""
        timelimits.check("a store transaction")
        with _released(self.session()) as session, session.begin():
            self._bound(session)
            if clock.sync_due():
                self._sync_clock(session)
            yield session

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A read-only transaction (on SQLite it does not take the write lock)."""
        timelimits.check("a store read")
        with _released(self.session()) as session:
            # Closing (not rolling back) ends the transaction and keeps loaded rows readable.
            session.connection(execution_options={"corral_read": True})
            self._bound(session)
            if clock.sync_due():
                self._sync_clock(session)
            yield session

    def _bound(self, session: Session) -> None:
        """Cut this transaction's statement and lock timeouts to the running task's time left."""
        if self.is_sqlite or timelimits.hard_left() is None:
            return  # SQLite: its busy timeout is cut before BEGIN (_sqlite_engine)
        settings = get_settings()
        statement, lock = wait_bounds()
        if (statement, lock) != (settings.statement_timeout_s, settings.db_lock_timeout_s):
            session.execute(_SET_WAITS, {"statement": _ms(statement), "lock": _ms(lock)})

    @contextmanager
    def statements(self) -> Iterator[Connection]:
        """A connection on which each statement commits by itself: for a hot path of single
        statements, each atomic alone (PostgreSQL's autocommit: no ``BEGIN`` and ``COMMIT``
        round trips). On SQLite, one write transaction around them all."""
        if self.is_sqlite:
            with self.transaction() as session:
                yield session.connection()
            return
        timelimits.check("a store statement")
        with self.engine.connect() as conn:
            yield conn.execution_options(isolation_level="AUTOCOMMIT")

    def _sync_clock(self, session: Session) -> None:
        """Measure the server's clock against this host's (:mod:`workers.base.clock`)."""

        def server_time() -> datetime:
            if self.is_sqlite:
                return datetime.fromisoformat(session.scalar(_SQLITE_TIME))
            value = session.scalar(_PG_TIME)
            if not isinstance(value, datetime):
                raise TypeError(f"the server's time came back as {type(value).__name__}")
            return value

        # A thread that finds another measuring goes on at once with the estimate it has
        # (a measurement waits on the store: with the store away, threads queued here
        # one connect timeout after another past their hard limits); before the first
        # measurement it waits, but only its task's time left.
        left = timelimits.hard_left()
        wait = -1.0 if left is None else max(0.0, left - WAY_OUT_S)
        clock.sync(server_time, 0.0 if clock.synced() else wait)

    def dispose(self) -> None:
        """Close this process's connections (the next use takes new ones, with the settings
        then in force)."""
        if self._engine is not None and self._pid == os.getpid():
            self._engine.dispose()
            self._disposed = True
        else:
            self._engine = None
            self._sessions = None


def wait_bounds() -> tuple[float, float]:
    """The statement and lock timeouts (s, 0: off) of a statement starting now in this thread.

    The settings, cut to the time left before the running task's hard limit less
    :data:`WAY_OUT_S` (at least :data:`MIN_WAIT_S`); outside a task, the settings.
    """
    settings = get_settings()
    statement, lock = settings.statement_timeout_s, settings.db_lock_timeout_s
    left = timelimits.hard_left()
    if left is None:
        return statement, lock
    room = max(MIN_WAIT_S, left - WAY_OUT_S)
    return (min(statement, room) if statement else room, min(lock, room) if lock else room)


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000))) if seconds else "0"


@contextmanager
def one_lock_wait(session: Session) -> Iterator[None]:
    """Run a statement that locks many rows so its waits add up to one lock timeout at most.

    ``lock_timeout`` bounds each wait for a row lock; a statement locking every node
    waits that long per node held. In the body the statement timeout is the lock timeout
    (PostgreSQL; SQLite takes one lock per transaction), then back to what it was. A body
    that raises leaves the transaction to its rollback, which undoes the change.
    """
    if session.get_bind().dialect.name != "postgresql":
        yield
        return
    statement, lock = wait_bounds()
    if not lock or (statement and statement <= lock):
        yield  # the statement timeout bounds it already
        return
    session.execute(_SET_STATEMENT, {"statement": _ms(lock)})
    yield
    session.execute(_SET_STATEMENT, {"statement": _ms(statement)})


@contextmanager
def _released(session: Session) -> Iterator[Session]:
    """Close ``session`` however its block ends; past a ``BaseException``, drop its connection.

    An ``Exception`` rolls the transaction back (``session.begin()``) and the connection
    goes back to the pool clean. Anything else (``KeyboardInterrupt``, ``SystemExit``,
    ``GeneratorExit``) may have cut a statement or the rollback itself short: the
    connection is invalidated (closed, never reused) instead of pooled in that state.
    """
    try:
        yield session
    except Exception:
        session.close()
        raise
    except BaseException:
        try:
            session.invalidate()
        finally:
            session.close()
        raise
    else:
        session.close()


def pg_options(
    lock_timeout_s: float, statement_timeout_s: float, idle_in_transaction_s: float = 0.0
) -> str:
    """libpq ``options`` setting the session's lock, statement and idle-in-transaction timeouts.

    0 turns one off.
    """
    return (
        f"-c lock_timeout={round(lock_timeout_s * 1000)} "
        f"-c statement_timeout={round(statement_timeout_s * 1000)} "
        f"-c idle_in_transaction_session_timeout={round(idle_in_transaction_s * 1000)}"
    )


#: libpq's network settings: a server that cannot be reached (a partition, a host gone,
#: not one that refuses) fails a connection within ``connect_timeout`` seconds, and a
#: connection in use within about ten (keepalives while it waits for an answer, a
#: ``tcp_user_timeout`` while what it sent goes unacknowledged), instead of the kernel's
#: minutes of SYN retries and retransmissions - long enough that every worker waiting on
#: the store met its hard time limit and exited. The error is a connection error, which a
#: task retries (:func:`is_transient`).
PG_NETWORK: dict[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def network_bounds() -> tuple[int, int]:
    """libpq's ``connect_timeout`` (s) and the socket's ``TCP_USER_TIMEOUT`` (ms) for a
    connection this thread takes now: :data:`PG_NETWORK`'s, cut to the running task's time
    left less :data:`WAY_OUT_S` (libpq waits 2 s at least)."""
    connect, user_ms = PG_NETWORK["connect_timeout"], PG_NETWORK["tcp_user_timeout"]
    left = timelimits.hard_left()
    if left is None:
        return connect, user_ms
    room = left - WAY_OUT_S
    return max(2, min(connect, int(room))), max(500, min(user_ms, int(room * 1000)))


def _bound_socket(dbapi_conn: Any, user_ms: int) -> None:
    """Give a connection's socket this ``TCP_USER_TIMEOUT``, and keep-alives within it."""
    with socket.socket(fileno=os.dup(dbapi_conn.fileno())) as sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return  # a unix socket: no network to wait on
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_ms)
        idle = max(1, min(PG_NETWORK["keepalives_idle"], user_ms // 2000))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1 if idle < 5 else 2)


class TaskBoundPool(QueuePool):
    """SQLAlchemy's queue pool, whose wait for a free connection ends before the running
    task's hard limit (less :data:`WAY_OUT_S`): the pool's own timeout (30 s) outside one.

    The wait is the pool's ``_timeout``, read once per checkout: here it is computed for
    the thread that checks out. A wait that runs out raises SQLAlchemy's ``TimeoutError``,
    which a task retries like a lost connection (:func:`is_transient`).
    """

    _configured: float = 30.0

    @property
    def _timeout(self) -> float:
        left = timelimits.hard_left()
        if left is None:
            return self._configured
        return max(MIN_WAIT_S, min(self._configured, left - WAY_OUT_S))

    @_timeout.setter
    def _timeout(self, value: float) -> None:
        self._configured = value

    def recreate(self) -> QueuePool:
        """A new pool like this one, with this one's configured timeout."""
        pool = super().recreate()
        pool._timeout = self._configured
        return pool


def _bound_by_the_task(engine: Engine) -> None:
    """No network wait of a PostgreSQL connection outlasts the task that takes it.

    :data:`PG_NETWORK` bounds a connect to 5 s and an unanswered send to 10 s; a task
    with less time left would be killed at its hard limit first (a worker recording
    landed VMs after its store was cut off was, in the partition run). So a connection
    is made with ``connect_timeout`` cut to the time left, and one taken from the pool
    gets its socket's ``TCP_USER_TIMEOUT`` (and keep-alives) cut to it before it is
    pinged - corral's own ping on checkout, which SQLAlchemy's ``pool_pre_ping`` would
    make before any checkout hook could bound it - and set back outside a task.
    """

    @event.listens_for(engine, "do_connect")
    def _connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        cparams["connect_timeout"] = network_bounds()[0]

    @event.listens_for(engine, "connect")
    def _fresh(_dbapi_conn: Any, record: Any) -> None:
        record.info["corral_fresh"] = True

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        user_ms = network_bounds()[1]
        if record.info.get("corral_user_ms") != user_ms:
            _bound_socket(dbapi_conn, user_ms)
            record.info["corral_user_ms"] = user_ms
        if record.info.pop("corral_fresh", False):
            return  # just made: nothing to ping
        try:
            engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # dead (the server restarted, the network cut): a new one
            raise DisconnectionError(f"a pooled connection failed its ping: {exc}") from exc


def _engine_options(url: str) -> dict[str, Any]:
    """What an engine for ``url`` is made with that comes from the settings in force."""
    if url.startswith("sqlite"):
        return {}
    settings = get_settings()
    return {
        "options": pg_options(
            settings.db_lock_timeout_s,
            settings.statement_timeout_s,
            settings.db_idle_in_transaction_timeout_s,
        )
    }


def _make_engine(url: str, options: dict[str, Any]) -> Engine:
    if url.startswith("sqlite"):
        return _sqlite_engine(url)
    # hide_parameters: a database error's text (logged, or an operation's error) never
    # carries the statement's parameters, which may hold a function's secrets.
    kwargs: dict[str, Any] = {
        "poolclass": TaskBoundPool,
        "pool_size": 5,
        "max_overflow": 10,
        "hide_parameters": True,
        "connect_args": {**options, **PG_NETWORK},
    }
    engine = create_engine(url, **kwargs)
    _bound_by_the_task(engine)
    return engine


def _sqlite_engine(url: str) -> Engine:
    memory = url in ("sqlite://", "sqlite:///:memory:")
    engine = create_engine(
        url,
        connect_args={"timeout": 30, "check_same_thread": False},
        hide_parameters=True,
        **({"poolclass": StaticPool} if memory else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (pysqlite would not).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        if not memory:
            cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={round(SQLITE_BUSY_S * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        left = timelimits.hard_left()  # a task's transaction waits for the lock its time left
        busy = SQLITE_BUSY_S
        if left is not None:
            busy = min(busy, max(MIN_WAIT_S, left - WAY_OUT_S))
        busy_ms = max(1, round(busy * 1000))
        if conn.info.get("corral_busy_ms") != busy_ms:
            conn.exec_driver_sql(f"PRAGMA busy_timeout={busy_ms}")
            conn.info["corral_busy_ms"] = busy_ms
        read_only = conn.get_execution_options().get("corral_read", False)
        conn.exec_driver_sql("BEGIN" if read_only else "BEGIN IMMEDIATE")

    return engine


# SQLSTATEs worth running a task again for: deadlock, serialization failure, lock
# not available (lock_timeout), query canceled (statement_timeout), server shutting
# down or not yet accepting connections; class 08 (connection exceptions) below.
TRANSIENT_SQLSTATES = frozenset({"40P01", "40001", "55P03", "57014", "57P01", "57P02", "57P03"})


def is_transient(exc: BaseException) -> bool:
    """Whether a database error may pass if the transaction is simply tried again."""
    if isinstance(exc, PoolTimeout):  # no connection free in the time left: later, maybe
        return True
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated:  # the connection was lost mid-statement
        return True
    orig = exc.orig
    code = getattr(orig, "sqlstate", None)
    if code is not None:
        return code in TRANSIENT_SQLSTATES or code.startswith("08")
    if not isinstance(exc, OperationalError):
        return False
    if type(orig).__module__.startswith("psycopg"):
        return True  # no SQLSTATE: the connection failed (refused, closed, reset)
    return "locked" in str(orig) or "busy" in str(orig)  # SQLite past its busy timeout


_databases: dict[str, Database] = {}
_registry_lock = threading.Lock()


def get_database(url: str) -> Database:
    """The shared :class:`Database` for ``url`` in this process."""
    with _registry_lock:
        db = _databases.get(url)
        if db is None:
            db = _databases[url] = Database(url)
        return db
