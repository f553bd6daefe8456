"""Cold starts: a claimer waiting for a new replica when nothing of its function is Idle.

The model
---------
When nothing is Idle, a producer may wait for a new replica
(:func:`corral.api.claim` with a cold-start timeout, or the gateway). Concurrent waiters of one
function *share* spawns: each waiter is a lease-like row ``cw:<function>:<token>``
in the ``leases`` table (it expires by itself if the waiting process dies, and is
deleted in the very transaction whose claim serves it), each spawn a waiter asked
for is a row ``cs:<function>:<token>`` whose holder is the spawn's operation id.
:func:`plan_cold_start` - one transaction, with the function row locked so
decisions for one function are serialised - counts the waiters and the
environments already on their way (replicas of the current build in Creating /
Starting, and waiter-requested spawns not finished yet, each counted once), all in
one statement so that a claim committing meanwhile is seen whole or not at all, and
asks for one more spawn only when waiters outnumber them and nothing is Idle: it
writes the spawn's operation and its ``cs:`` row in that same transaction, and the
caller queues the operation's first task once it has committed (a process that dies
in between leaves an open operation, which redrive sends again).

:class:`ClaimAttempt` is one caller's whole claim, cold start included, as a series
of short steps (each a few store calls, never a sleep): :func:`corral.api.claim`
runs them with ``time.sleep`` between, the gateway each step in a thread and, between
them, until it is told a replica of the function is ready
(:mod:`workers.replicas.notices`) or the pause is over: both share one mechanism.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, Select, and_, delete, func, or_, select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.errors import CorralError, InputError, NotFound
from workers.functions import get_function
from workers.operations import FINISHED, get_operation
from workers.replicas.claims import (
    Claimed,
    NoIdleReplica,
    Waiter,
    check_ttl,
    claim,
    idle_clause,
)
from workers.replicas.requests import spawn_of
from workers.store.db import Database
from workers.store.models import (
    OP_OPEN,
    Function,
    Lease,
    Operation,
    OpStatus,
    Replica,
    ReplicaState,
    new_id,
)

WAITER_PREFIX = "cw"
SPAWN_PREFIX = "cs"
TOLD_POLL_S = 0.1  # a claim told of ready replicas looks on its own this often at first


class ClaimTimeout(NoIdleReplica):
    """A cold-start claim found no ready replica before its timeout."""


def _range(prefix: str, function_id: str) -> tuple[str, str]:
    """Lease names ``<prefix>:<function id>:*`` as an index range on the primary key."""
    return f"{prefix}:{function_id}:", f"{prefix}:{function_id};"


def _in_range(prefix: str, function_id: str) -> ColumnElement[bool]:
    """SQL: the lease is one of the function's ``<prefix>:`` rows."""
    lo, hi = _range(prefix, function_id)
    return and_(Lease.name >= lo, Lease.name < hi)


def join_waiters(db: Database, function_name: str, wait_s: float) -> Waiter:
    """Register a claimer that waits up to ``wait_s`` seconds for a cold start."""
    with db.transaction() as s:
        waiter, row = _join(get_function(s, function_name), wait_s)
        s.add(row)
        return waiter


def _join(fn: Function, wait_s: float) -> tuple[Waiter, Lease]:
    """A new waiter of ``fn`` and its row, to add to the session."""
    token = f"{_range(WAITER_PREFIX, fn.id)[0]}{new_id()[:16]}"
    # The row outlives the wait a little, then lapses by itself if we never delete it.
    row = Lease(name=token, holder="claim", expires_at=now() + timedelta(seconds=wait_s + 5))
    return Waiter(fn.name, fn.id, token), row


def join_and_plan(
    db: Database, settings: Settings, function_name: str, wait_s: float
) -> tuple[Waiter, ColdStartPlan]:
    """:func:`join_waiters` and :func:`plan_cold_start` in one transaction.

    For a claimer that has just found nothing Idle: one transaction less before its
    spawn is asked for. An environment freed meanwhile shows in the plan (``idle``).
    """
    with db.transaction() as s:
        fn = get_function(s, function_name, lock=True)
        waiter, row = _join(fn, wait_s)
        plan = _plan(s, settings, fn, waiter, joining=True)
        s.add(row)  # written with the plan's rows, in one flush
        return waiter, plan


def leave_waiters(db: Database, waiter: Waiter) -> None:
    """Stop counting this claimer as waiting."""
    with db.transaction() as s:
        s.execute(delete(Lease).where(Lease.name == waiter.token))


def _open_spawns(function_id: str, at: datetime) -> Select[str]:
    """SQL: the operations of the function's spawn rows still coming (unexpired, not over)."""
    return (
        select(Lease.holder)
        .join(Operation, Operation.id == Lease.holder)
        .where(
            _in_range(SPAWN_PREFIX, function_id),
            Lease.expires_at > at,
            Operation.status.in_(OP_OPEN),
        )
    )


def _counts(fn: Function, at: datetime) -> Select[int, int, int, bool, int]:
    """SQL, in one statement: waiters, spawns coming, other envs coming, Idle, and rows.

    ``rows`` counts all the function's waiter and spawn rows: more than the first two
    means some have lapsed or their spawn is over (:func:`_sweep`).

    One statement matters on PostgreSQL (READ COMMITTED: each statement sees the newest
    commits). Read apart, a waiter's claim committing between the reads made the plan
    count that waiter still waiting but its replica no longer free: one spawn too many.
    Each spawn has one row (written with its operation), so rows count spawns.
    """
    spawns = _open_spawns(fn.id, at)
    waiters = select(func.count()).where(_in_range(WAITER_PREFIX, fn.id), Lease.expires_at > at)
    spawning = select(func.count()).select_from(spawns.subquery())
    others = select(func.coalesce(func.sum(Replica.envs_total), 0)).where(
        Replica.function_id == fn.id,
        Replica.status.in_((ReplicaState.CREATING, ReplicaState.STARTING)),
        Replica.build_version == fn.build_version,
        # those of a spawn row are counted through it
        or_(Replica.operation_id.is_(None), Replica.operation_id.not_in(spawns)),
    )
    rows = select(func.count()).where(
        or_(_in_range(WAITER_PREFIX, fn.id), _in_range(SPAWN_PREFIX, fn.id))
    )
    return select(
        waiters.scalar_subquery(),
        spawning.scalar_subquery(),
        others.scalar_subquery(),
        idle_clause(fn),
        rows.scalar_subquery(),
    )


def _sweep(s: Session, function_id: str, at: datetime) -> None:
    """Delete the function's lapsed waiter rows and the rows of spawns no longer coming."""
    s.execute(
        delete(Lease)
        .where(
            or_(
                and_(_in_range(WAITER_PREFIX, function_id), Lease.expires_at <= at),
                and_(
                    _in_range(SPAWN_PREFIX, function_id),
                    or_(
                        Lease.expires_at <= at,
                        Lease.holder.not_in(
                            select(Operation.id).where(Operation.status.in_(OP_OPEN))
                        ),
                    ),
                ),
            )
        )
        .execution_options(synchronize_session=False)
    )


@dataclass(frozen=True)
class ColdStartPlan:
    """What :func:`plan_cold_start` saw and decided."""

    waiters: int
    in_flight: int
    spawn: Operation | None  # the spawn written, when one was due: queue its first task
    idle: bool = False  # no spawn: an environment is free (claim it)
    refused: str | None = None  # a spawn was due but refused (why)
    at_max: bool = False  # refused: the function has as many replicas as its max allows


def plan_cold_start(db: Database, settings: Settings, waiter: Waiter) -> ColdStartPlan:
    """Decide whether this waiter must ask for one more spawn (waiters > environments coming)."""
    with db.transaction() as s:
        fn = s.get(Function, waiter.function_id, with_for_update=True)
        if fn is None:
            raise NotFound(f"function {waiter.function!r} was removed")
        return _plan(s, settings, fn, waiter)


def _plan(
    s: Session, settings: Settings, fn: Function, waiter: Waiter, *, joining: bool = False
) -> ColdStartPlan:
    """:func:`plan_cold_start` inside the caller's transaction (the function row locked).

    ``joining``: the waiter's own row is not written yet (the caller adds it after).
    """
    at = now()
    waiters, spawning, on_the_way, idle, rows = s.execute(_counts(fn, at)).one()
    if rows > waiters + spawning:  # lapsed waiters, spawns over: their rows go
        _sweep(s, fn.id, at)
    waiters += int(joining)
    coming = spawning * fn.exec_envs + int(on_the_way or 0)
    if waiters <= coming or idle:
        return ColdStartPlan(waiters, coming, None, idle)
    try:
        op = spawn_of(s, fn, 1)
    except InputError as exc:  # past the function's max: nothing written
        at_max = fn.replica_count >= fn.max_replicas
        return ColdStartPlan(waiters, coming, None, refused=str(exc), at_max=at_max)
    ttl = settings.creating_deadline_s + settings.boot_deadline_s
    s.add(
        Lease(
            name=f"{_range(SPAWN_PREFIX, fn.id)[0]}{new_id()[:16]}",
            holder=op.id,
            expires_at=at + timedelta(seconds=ttl),
        )
    )
    return ColdStartPlan(waiters, coming, op)


class ClaimAttempt:
    """One caller's claim as steps: claim at once, else wait for a (shared) cold start.

    :meth:`step` returns the :class:`Claimed` environment, or how many seconds to wait
    before the next step; it raises :class:`NoIdleReplica` (no cold start allowed, the
    cold start failed or was refused) or :class:`ClaimTimeout`. :meth:`close` must run
    at the end, whatever happened. ``queue(operation) -> operation id`` queues the first
    task of a spawn the plan wrote (:func:`workers.dispatch.enqueue`: it fails the
    operation and raises when it cannot). With ``wait_at_max`` a spawn refused (or
    failed) because the function is at its max is not an error: the caller waits for an
    environment to be released instead (several gateways may ask for the last replica
    at once).

    ``tried``: the caller has just found nothing Idle itself, so the first step does not
    look again before joining the waiters. ``told``: the caller is told when a replica of
    the function is ready (:mod:`workers.replicas.notices`) and waits for that between
    steps, so after asking for a spawn it does not look again at once, and its own looks
    (a notice can be lost) start :data:`TOLD_POLL_S` apart, not 20 ms: fewer store
    transactions beside the spawn's own.
    """

    def __init__(  # noqa: PLR0913 - keyword-only options with defaults
        self,
        db: Database,
        settings: Settings,
        function: str,
        *,
        queue: Callable[[Operation], str],
        cold_start_timeout: float = 0.0,
        ttl_s: float | None = None,
        wait_at_max: bool = False,
        tried: bool = False,
        told: bool = False,
    ) -> None:
        self.db, self.settings, self.function = db, settings, function
        self.timeout = cold_start_timeout
        self.ttl_s = check_ttl(ttl_s)
        self.spawned: list[str] = []  # operations this caller asked for
        self.started = time.monotonic()
        self.asked_at: float | None = None  # time.monotonic() when its first spawn was asked
        self._queue = queue
        self._wait_at_max = wait_at_max
        self._deadline = self.started + cold_start_timeout
        self._waiter: Waiter | None = None
        self._settled: set[str] = set()
        self._tried = tried
        self._told = told
        self._delay = TOLD_POLL_S if told else 0.02

    @property
    def waiting(self) -> bool:
        """True while this caller is registered as a cold-start waiter (close() needed)."""
        return self._waiter is not None

    @property
    def waited_s(self) -> float:
        """Seconds since the attempt began."""
        return time.monotonic() - self.started

    def step(self) -> Claimed | float:
        """Try once: the claimed environment, or the seconds to wait before trying again."""
        plan = self._join() if self._waiter is None else self._look()
        if isinstance(plan, Claimed):
            return plan
        if plan.idle:
            return 0.0  # an environment came free meanwhile: claim it now
        if plan.refused is not None and not (self._wait_at_max and plan.at_max):
            raise NoIdleReplica(
                f"no idle replica of {self.function}, and a cold start was refused: {plan.refused}"
            )
        if plan.spawn is not None and self._ask(plan.spawn) and not self._told:
            return 0.0  # the new replica may be ready already (eager mode)
        wait = max(0.0, min(self._delay, self._deadline - time.monotonic()))
        self._delay = min(self._delay * 1.5, 0.5)
        return wait

    def _join(self) -> Claimed | ColdStartPlan:
        """The first step: claim (unless the caller just tried), else join the waiters and plan."""
        if not self._tried:
            try:
                return claim(self.db, self.settings, self.function, ttl_s=self.ttl_s)
            except NoIdleReplica:
                if self.timeout <= 0:
                    raise
        elif self.timeout <= 0:
            raise NoIdleReplica(f"no idle replica of {self.function}")
        self._waiter, plan = join_and_plan(self.db, self.settings, self.function, self.timeout)
        return plan

    def _look(self) -> Claimed | ColdStartPlan:
        """A later step: claim as a waiter, else check the spawns asked for and plan again."""
        assert self._waiter is not None  # noqa: S101 - narrows for mypy
        try:
            got = claim(
                self.db, self.settings, self.function, waiter=self._waiter, ttl_s=self.ttl_s
            )
        except NoIdleReplica:
            pass
        else:
            self._waiter = None  # the claim's transaction took this waiter out: close() is free
            return got
        self._check_spawns()
        if time.monotonic() >= self._deadline:
            raise ClaimTimeout(f"no ready replica of {self.function} after {self.timeout:g}s")
        return plan_cold_start(self.db, self.settings, self._waiter)

    def _ask(self, spawn: Operation) -> bool:
        """Queue the spawn the plan wrote; True if queued (False: it could not be, at max)."""
        try:
            op_id = self._queue(spawn)
        except CorralError as exc:  # the operation was failed: no longer counted as coming
            if not (self._wait_at_max and self._at_max()):
                raise NoIdleReplica(
                    f"no idle replica of {self.function}, and a cold start was refused: {exc}"
                ) from None
            return False
        if self.asked_at is None:
            self.asked_at = time.monotonic()
        self.spawned.append(op_id)
        return True

    def _check_spawns(self) -> None:
        """Fail the attempt when a spawn it asked for failed."""
        pending = [o for o in self.spawned if o not in self._settled]
        if not pending:
            return
        with self.db.read() as s:
            for op_id in pending:
                op = get_operation(s, op_id)
                if op.status in FINISHED:
                    self._settled.add(op_id)
                if op.status == OpStatus.FAILED and not (self._wait_at_max and self._at_max()):
                    raise NoIdleReplica(f"cold start of {self.function} failed: {op.error}")

    def _at_max(self) -> bool:
        """True when the function has as many replicas as its max allows."""
        with self.db.read() as s:
            fn = get_function(s, self.function)
            return fn.replica_count >= fn.max_replicas

    def close(self) -> None:
        """Stop counting this caller as a cold-start waiter."""
        if self._waiter is not None:
            leave_waiters(self.db, self._waiter)
            self._waiter = None
