"""Claims: lending one execution environment of an Idle replica to one caller, as a lease.

The model
---------
A replica runs ``envs_total`` execution environments (the function's
``exec_envs``); ``envs_in_use`` says how many serve a request now. A replica is
*Idle* while at least one environment is free and *Allocated* when all are
taken, so "Idle" always means "can take a request" (the CHECK constraint
``envs_in_use <= envs_total`` backs this up).

:func:`claim` takes one environment of an Idle replica of the function's
**current** build (a replica whose ``build_version`` differs from the
function's is stale: it finishes what it serves but is never handed out again,
and the reaper removes it) and writes a *claim* row: a claim id and an expiry
(``CORRAL_CLAIM_TTL_S``, or the caller's ``ttl_s``). A replica's ``envs_in_use``
is the number of its claim rows, and an environment comes back in exactly one of
three ways, each of which deletes that one row in the transaction that gives the
environment back - so it is given back at most once, whoever comes first:

* :func:`release` of the claim id (a second release, or a release of a claim
  that expired, finds no row and changes nothing: a stale release can never free
  an environment a newer claim holds);
* :func:`expire`, run by every reaper pass, for claims past their expiry (the
  caller died or forgot), as the database's own clock judges it;
* :func:`finish_oldest`, when the guest reports FINISHED: the replica's oldest claim.

Each takes the replica's row lock first and deletes the claim row second, so
concurrent releases, expiries and FINISHED reports of one claim serialise on the
replica and only the first finds the row. Taking an environment and giving one
back are one statement each on the hot path (``_TAKE``, :func:`release`), writing the
columns of the table's moves (:func:`workers.replicas.lifecycle.changes`) as
:func:`~workers.replicas.lifecycle.transition` would (expiry, FINISHED, and a release
whose replica an operation waits on go through it): a replica whose last environment
is released becomes idle *since that moment* (``idle_since = last_used_at``) and gets
its ``reap_at``; a replica that takes a request is busy, with no ``idle_since`` and no
``reap_at``, so the reaper cannot see it.

Two claims never get the same environment. On PostgreSQL the candidate row is
picked with ``SELECT ... FOR UPDATE SKIP LOCKED LIMIT 1`` on the
``(function_id, status, build_version)`` index, so concurrent claimers lock *different* rows
instead of queueing on one. When every candidate is locked, the claimer does not
block on a lock (a blocking ``FOR UPDATE`` keeps the rows it rejected on re-check
locked, and claimers then deadlock on one another); it looks without locking
whether any Idle row exists at all, and if so tries ``SKIP LOCKED`` again a few
milliseconds later, so a replica whose second environment is still free is not
missed. On SQLite the write transaction itself is the lock (``BEGIN
IMMEDIATE``): claims run one at a time. Either way the pick is one index probe,
O(log n) in the number of replicas.

Cold starts - waiting for a replica when nothing is Idle - are
:mod:`workers.replicas.coldstarts`; a cold-start waiter is served by :func:`claim` here.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Exists, bindparam, case, delete, insert, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.errors import CorralError, InputError, NotFound, check_seconds
from workers.base.kinds import OpKind
from workers.base.names import check_name
from workers.operations import create_operation
from workers.replicas.lifecycle import (
    batch_params,
    batch_values,
    changes,
    lock_replica,
    transition,
)
from workers.store.db import Database, store_now
from workers.store.models import (
    Claim,
    Function,
    Lease,
    Operation,
    Replica,
    ReplicaState,
    new_id,
)
from workers.store.states import MOVES

LOCKED_RETRY_S = 2.0  # how long a claim keeps looking while every Idle row is locked
MAX_TTL_S = 86_400.0
EXPIRE_BATCH = 1000  # expired claims one reaper pass gives back at most


class NoIdleReplica(CorralError):
    """No Idle replica of the function's current build could be claimed."""


@dataclass(frozen=True)
class Claimed:
    """One execution environment lent to a caller: the claim, and where to send the request."""

    claim_id: str
    replica_id: str
    address: str | None
    vmid: str | None
    function: str
    expires_at: datetime

    def as_dict(self) -> dict[str, Any]:
        """The claim as a JSON-ready mapping (``expires_at`` as ISO 8601 UTC)."""
        data = asdict(self)
        data["expires_at"] = self.expires_at.isoformat() + "Z"
        return data


def check_ttl(value: object) -> float | None:
    """A claim's time to live in seconds (None: the default), else :class:`InputError`."""
    return check_seconds(
        value, "claim ttl", lambda v: 0 < v <= MAX_TTL_S, f"above 0 and at most {MAX_TTL_S:g}s"
    )


@dataclass(frozen=True)
class Waiter:
    """A claimer registered as waiting for a cold start of one function."""

    function: str
    function_id: str
    token: str


@dataclass(frozen=True)
class _Fn:
    """The columns of a function a claim needs (loading the whole row costs more)."""

    id: str
    name: str
    build_version: str


_FUNCTION = select(Function.id, Function.name, Function.build_version).where(
    Function.name == bindparam("name")
)
# Take ``n`` environments of a chosen replica in one statement: Idle -> still Idle (another
# environment free) or Allocated (the last one), busy either way (no idle clock): the two
# moves of the table write the same columns and values but the status, which the row's
# count of free environments picks. An Idle replica never has an operation waiting on it
# (a move to Idle settles it), so none is due.
_TAKE_ONE = MOVES[(ReplicaState.IDLE, ReplicaState.IDLE)]
_TAKE_LAST = MOVES[(ReplicaState.IDLE, ReplicaState.ALLOCATED)]
_TAKE = (
    update(Replica)
    .where(
        Replica.id == bindparam("replica_id"),
        Replica.status == int(ReplicaState.IDLE),
        Replica.envs_in_use + bindparam("n") <= Replica.envs_total,
        Replica.operation_id.is_(None),
    )
    .values(
        {
            **batch_values(_TAKE_ONE),
            "status": case(
                (
                    Replica.envs_in_use + bindparam("n") >= Replica.envs_total,
                    int(_TAKE_LAST.target),
                ),
                else_=int(_TAKE_ONE.target),
            ),
            "envs_in_use": Replica.envs_in_use + bindparam("n"),
            "last_used_at": bindparam("at"),
            "updated_at": bindparam("at"),
        }
    )
    .returning(Replica.address, Replica.vmid)
    .execution_options(synchronize_session=False)
)


def taken(settings: Settings, at: datetime) -> dict[str, Any]:
    """The columns an environment taken at ``at`` writes, but the status (:data:`_TAKE`)."""
    values = changes(_TAKE_ONE, settings, at, busy=True)
    del values["status"]
    return values


_LEND = insert(Claim)
_HELD = select(Claim.replica_id).where(Claim.id == bindparam("claim_id"))
_LOCK_FOR_RELEASE = (
    select(
        Replica.status,
        Replica.envs_in_use,
        Replica.envs_total,
        Replica.operation_id,
        Function.name,
        Function.idle_timeout_s,
    )
    .join(Function, Function.id == Replica.function_id)
    .where(Replica.id == bindparam("replica_id"))
    .with_for_update(of=Replica)
)
_UNLEND = (
    delete(Claim)
    .where(Claim.id == bindparam("claim_id"), Claim.replica_id == bindparam("replica_id"))
    .returning(Claim.id)
    .execution_options(synchronize_session=False)
)


def _candidates(
    session: Session, fn: _Fn | Function, lock: str = "skip", limit: int = 1
) -> list[tuple[str, int]]:
    """Up to ``limit`` claimable replicas of ``fn``: (id, free environments).

    ``lock``: ``skip`` locks them, skipping rows others hold; ``none`` only looks
    (SQLite ignores row locks: its write transaction is the lock).
    """
    query = select(Replica.id, Replica.envs_total - Replica.envs_in_use)
    query = query.where(*_claimable(fn)).limit(limit)
    if lock == "skip":
        query = query.with_for_update(skip_locked=True)
    return [(rid, int(free)) for rid, free in session.execute(query)]


def _claimable(fn: _Fn | Function) -> tuple[ColumnElement[bool], ...]:
    """The conditions on a replica of ``fn`` that could take a claim now."""
    return (
        Replica.function_id == fn.id,
        Replica.status == ReplicaState.IDLE,
        Replica.build_version == fn.build_version,
        Replica.envs_in_use < Replica.envs_total,
    )


def idle_clause(fn: _Fn | Function) -> Exists:
    """SQL: some replica of ``fn`` could take a claim now."""
    return select(Replica.id).where(*_claimable(fn)).exists()


def idle_exists(session: Session, fn: _Fn | Function) -> bool:
    """Whether any replica of ``fn`` could take a claim now (only looks: locks nothing)."""
    return bool(session.scalar(select(idle_clause(fn))))


def claim(
    db: Database,
    settings: Settings,
    function_name: str,
    *,
    waiter: Waiter | None = None,
    ttl_s: float | None = None,
) -> Claimed:
    """Take one execution environment of an Idle, current-build replica of the function.

    The claim expires ``ttl_s`` (default ``CORRAL_CLAIM_TTL_S``) seconds from now. A
    cold-start ``waiter`` stops being counted in the same transaction that serves it,
    so no other waiter sees it still waiting and asks for a spawn on its behalf.
    """
    return claim_many(db, settings, function_name, 1, waiter=waiter, ttl_s=ttl_s)[0]


def claim_many(  # noqa: PLR0913 - keyword-only options with defaults
    db: Database,
    settings: Settings,
    function_name: str,
    count: int,
    *,
    waiter: Waiter | None = None,
    ttl_s: float | None = None,
) -> list[Claimed]:
    """Take up to ``count`` environments of Idle, current-build replicas in one transaction.

    Each environment is a claim of its own (released on its own); several may be of
    one replica. Fewer than ``count`` when fewer are free; none raises
    :class:`NoIdleReplica`. ``ttl_s`` and ``waiter`` as for :func:`claim`.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InputError(f"claim count must be a positive integer, got {count!r}")
    ttl = check_ttl(ttl_s) or settings.claim_ttl_s
    check_name(function_name)
    give_up = time.monotonic() + LOCKED_RETRY_S
    with db.transaction() as s:
        row = s.execute(_FUNCTION, {"name": function_name}).first()
        if row is None:
            raise NotFound(f"unknown function {function_name!r}")
        fn = _Fn(*row)
        found = _candidates(s, fn, "skip", count)
        pause = 0.001
        while not found and not db.is_sqlite and time.monotonic() < give_up:
            # Nothing unlocked. If Idle rows are merely locked by other claimers (or a
            # reaper pass), they may keep a free environment: look again shortly. Each
            # statement sees the newest commits (READ COMMITTED), and no lock is held
            # while waiting, so claimers can never deadlock on one another.
            if not idle_exists(s, fn):
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
            found = _candidates(s, fn, "skip", count)
        at = now()
        expires = at + timedelta(seconds=ttl)
        conn = s.connection()
        out: list[Claimed] = []
        values = batch_params(taken(settings, at))
        for rid, free in found:
            n = min(free, count - len(out))
            took = conn.execute(_TAKE, {"replica_id": rid, "at": at, "n": n, **values}).first()
            if took is None:
                continue
            ids = [new_id() for _ in range(n)]
            conn.execute(
                _LEND,
                [
                    {
                        "id": cid,
                        "replica_id": rid,
                        "function_id": fn.id,
                        "created_at": at,
                        "expires_at": expires,
                    }
                    for cid in ids
                ],
            )
            out += [Claimed(cid, rid, took.address, took.vmid, fn.name, expires) for cid in ids]
            if len(out) >= count:
                break
        if not out:
            raise NoIdleReplica(f"no idle replica of {function_name}")
        if waiter is not None:
            s.execute(delete(Lease).where(Lease.name == waiter.token))
        return out


def renew(db: Database, claim_ids: Collection[str], ttl_s: float) -> dict[str, bool]:
    """Extend held claims to expire ``ttl_s`` seconds from now, in one transaction.

    Returns, for each of ``claim_ids`` still held (the others were released, expired
    and given back, or taken back by a guest's FINISHED), whether its replica may still
    serve requests: Idle or Allocated and of its function's current build (False: it is
    being deleted, or a newer build was deployed).
    """
    ttl = check_ttl(ttl_s)
    assert ttl is not None  # noqa: S101 - narrows for mypy
    ids = sorted(set(claim_ids))
    if not ids:
        return {}
    with db.transaction() as s:
        conn = s.connection()
        conn.execute(
            update(Claim)
            .where(Claim.id.in_(ids))
            .values(expires_at=now() + timedelta(seconds=ttl))
            .execution_options(synchronize_session=False)
        )
        rows = conn.execute(
            select(Claim.id, Replica.status, Replica.build_version == Function.build_version)
            .join(Replica, Replica.id == Claim.replica_id)
            .join(Function, Function.id == Replica.function_id)
            .where(Claim.id.in_(ids))
        )
        return {
            cid: status in (ReplicaState.IDLE, ReplicaState.ALLOCATED) and bool(current)
            for cid, status, current in rows
        }


def _give_back(session: Session, replica: Replica, settings: Settings) -> None:
    """Return one execution environment of a locked replica: Idle again, last used now."""
    replica.envs_in_use -= 1
    replica.last_used_at = now()
    if replica.status in (ReplicaState.IDLE, ReplicaState.ALLOCATED):
        transition(session, replica, ReplicaState.IDLE, settings)
    else:  # being deleted: just count the environment back
        session.flush()


def _take_back(
    session: Session,
    replica: Replica,
    settings: Settings,
    claim_id: str,
    *,
    expired_by: datetime | ColumnElement[datetime] | None = None,
) -> bool:
    """Delete one claim row of a locked replica and give its environment back, if it is there.

    With ``expired_by``, only a claim that expired by then is taken back.
    """
    query = delete(Claim).where(Claim.id == claim_id, Claim.replica_id == replica.id)
    if expired_by is not None:
        query = query.where(Claim.expires_at <= expired_by)
    taken = query.returning(Claim.id).execution_options(synchronize_session=False)
    if session.execute(taken).first() is None:  # not there (any more): nothing to give back
        return False
    _give_back(session, replica, settings)
    return True


def release(db: Database, settings: Settings, claim_id: str) -> dict[str, Any]:
    """Give back exactly the environment a claim holds; a claim no longer held changes nothing.

    The result's ``released`` says which: False for a second release, or a release of a
    claim the reaper already took back after it expired. The common case runs as four
    Core statements (the hot path of every gateway request): the same bookkeeping as
    :func:`_take_back`, which the rare cases (an operation waiting on the replica) use.
    """
    with db.transaction() as s:
        return _release_in(s, settings, claim_id)


def release_many(db: Database, settings: Settings, claim_ids: Collection[str]) -> int:
    """Give back several claims in one transaction (replicas locked in id order); how many."""
    ids = sorted(set(claim_ids))
    if not ids:
        return 0
    with db.transaction() as s:
        held = s.execute(select(Claim.id, Claim.replica_id).where(Claim.id.in_(ids))).all()
        return sum(
            bool(_release_in(s, settings, cid)["released"])
            for cid, _rid in sorted(held, key=lambda row: (row[1], row[0]))
        )


def _release_in(s: Session, settings: Settings, claim_id: str) -> dict[str, Any]:
    """:func:`release` inside the caller's transaction."""
    conn = s.connection()
    held = conn.execute(_HELD, {"claim_id": claim_id}).first()
    row = (
        conn.execute(_LOCK_FOR_RELEASE, {"replica_id": held[0]}).first()
        if held is not None
        else None
    )
    if (
        held is None
        or row is None
        or conn.execute(_UNLEND, {"claim_id": claim_id, "replica_id": held[0]}).first() is None
    ):
        return {
            "claim_id": claim_id,
            "released": False,
            "detail": f"claim {claim_id} is not held (already released, or expired "
            "and given back): nothing changed",
        }
    rid = held[0]
    status, in_use, total, op_id, fn_name, fn_idle = row
    if op_id is not None:  # an operation waits on this replica: the full transition
        replica = lock_replica(s, rid)
        assert replica is not None  # noqa: S101 - narrows for mypy
        _give_back(s, replica, settings)
        status, in_use = replica.status, replica.envs_in_use
    else:
        at = now()
        in_use -= 1
        values: dict[str, Any] = {"envs_in_use": in_use, "last_used_at": at, "updated_at": at}
        if status in (ReplicaState.IDLE, ReplicaState.ALLOCATED):
            # the move back to Idle (the table's), in the one statement; idle from now on
            # when no other environment is in use: the reaper's clock starts
            back = MOVES[(status, ReplicaState.IDLE)]
            timeout = fn_idle if fn_idle is not None else settings.idle_timeout_s
            values.update(changes(back, settings, at, reap_after_s=timeout, busy=in_use > 0))
            status = back.target
        conn.execute(
            update(Replica)
            .where(Replica.id == rid)
            .values(**values)
            .execution_options(synchronize_session=False)
        )
    return {
        "claim_id": claim_id,
        "released": True,
        "replica_id": rid,
        "function": fn_name,
        "status": ReplicaState(status).label,
        "envs_in_use": in_use,
        "envs_total": total,
    }


def expire(db: Database, settings: Settings, *, batch: int = EXPIRE_BATCH) -> int:
    """Give back the environments of claims past their expiry (oldest first); how many."""
    with db.transaction() as s:
        at = store_now()  # judged by the database, on its own clock
        due = s.execute(
            select(Claim.id, Claim.replica_id)
            .where(Claim.expires_at <= at)
            .order_by(Claim.expires_at)
            .limit(batch)
        ).all()
        taken = 0
        for claim_id, replica_id in sorted(due, key=lambda row: row[1]):  # lock in id order
            replica = lock_replica(s, replica_id)
            if replica is not None and _take_back(s, replica, settings, claim_id, expired_by=at):
                taken += 1
        return taken


def finish_oldest(session: Session, replica: Replica, settings: Settings) -> bool:
    """A guest finished a piece of work: give back the locked replica's oldest claim, if any."""
    oldest = session.scalar(
        select(Claim.id)
        .where(Claim.replica_id == replica.id)
        .order_by(Claim.created_at, Claim.id)
        .limit(1)
    )
    return oldest is not None and _take_back(session, replica, settings, oldest)


def suspect(db: Database, settings: Settings, claim_id: str, reason: str) -> Operation | None:
    """Give a claim back and retire its replica, which failed to answer a request.

    In one transaction the claim is taken back and the replica (if still Idle or
    Allocated) goes Deleting with ``reason`` as its error, so no claim can pick it
    again, under a new delete operation the caller must queue (returned; None when the
    claim was no longer held or the replica is already on its way out).
    """
    with db.transaction() as s:
        held = s.execute(select(Claim.replica_id).where(Claim.id == claim_id)).first()
        replica = lock_replica(s, held[0]) if held is not None else None
        if replica is None or not _take_back(s, replica, settings, claim_id):
            return None
        if replica.status not in (ReplicaState.IDLE, ReplicaState.ALLOCATED):
            return None
        op = create_operation(
            s, OpKind.DELETE, {"replica": replica.id}, function_id=replica.function_id, total=1
        )
        replica.operation_id = op.id
        transition(s, replica, ReplicaState.DELETING, settings, error=reason)
        return op
