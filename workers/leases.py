"""Named leases: a lock in the database with an owner and an expiry.

A lease is one row of the ``leases`` table: ``(name, holder, expires_at)``. Whoever
holds an unexpired row owns the name; everyone else is refused. Both steps are
single conditional statements, so two processes racing for a name get exactly
one winner on SQLite and on PostgreSQL alike:

* take over an existing row - ``UPDATE ... WHERE name = :n AND (holder = :me OR
  expires_at <= now)``: an expired lease (its holder crashed) is taken over, our
  own lease is renewed, anyone else's live lease matches nothing. On PostgreSQL
  the second of two concurrent updaters waits for the first's row lock and then
  re-checks the condition against the new row, so it loses;
* create a missing row - ``INSERT ... ON CONFLICT DO NOTHING RETURNING name``: of two
  concurrent inserts exactly one writes (and returns) the row; the other returns nothing.

The expiry is the safety net, not the protocol: a holder releases its lease when
done (:func:`release` deletes the row only if it still holds it), and a crashed
holder's lease lapses after ``ttl_s`` - for a housekeeping pass, just after its task's
hard limit (:func:`pass_ttl`). Whether a lease has lapsed is judged by the
database on its own clock (:func:`workers.store.db.store_now`), whatever this host's
says; its expiry is written from :mod:`workers.base.clock` (the same clock, measured), so
tests can let a lease expire with ``clock.travel``.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from sqlalchemy import Table, delete, or_, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base import timelimits
from workers.base.clock import now
from workers.base.errors import InputError
from workers.store.db import Database, insert_for, store_now
from workers.store.models import Lease

PASS_SLACK_S = 5.0  # a pass's lease outlives its task's hard limit by this much
POLL_S = 0.2  # how often a holder waiting for a lease looks again
MAX_NAME = 64
MAX_HOLDER = 128
LEASES = cast(Table, Lease.__table__)


@dataclass(frozen=True)
class LeaseInfo:
    """Who holds a lease and until when."""

    name: str
    holder: str
    expires_at: datetime


def keyed_name(prefix: str, key: str) -> str:
    """A lease name for ``key`` under ``prefix`` (the key hashed if the name would be long)."""
    room = MAX_NAME - len(prefix)
    if len(key) <= room:
        return prefix + key
    return prefix + "#" + hashlib.sha256(key.encode()).hexdigest()[: room - 1]


def holder_name(tag: str | None = None) -> str:
    """A holder name unique to this process and ``tag`` (a task id; a fresh one if None)."""
    return f"{socket.gethostname()}:{os.getpid()}:{tag or uuid.uuid4().hex}"[:MAX_HOLDER]


def _check(name: str, holder: str, ttl_s: float | None = None) -> None:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise InputError(f"lease name must be 1-{MAX_NAME} characters, got {name!r}")
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER:
        raise InputError(f"lease holder must be 1-{MAX_HOLDER} characters, got {holder!r}")
    if ttl_s is not None and not ttl_s > 0:
        raise InputError(f"lease ttl must be positive, got {ttl_s!r}")


def take(session: Session, name: str, holder: str, ttl_s: float) -> bool:
    """Acquire or renew ``name`` inside the caller's transaction; True if ``holder`` has it."""
    _check(name, holder, ttl_s)
    expires = now() + timedelta(seconds=ttl_s)
    conn = session.connection()
    table = LEASES
    took = conn.execute(
        update(table)
        .where(Lease.name == name, or_(Lease.holder == holder, Lease.expires_at <= store_now()))
        .values(holder=holder, expires_at=expires)
        .returning(table.c.name)
    ).first()
    if took is not None:
        return True
    values = {"name": name, "holder": holder, "expires_at": expires}
    insert = insert_for(session)
    stmt = insert(table).values(**values).on_conflict_do_nothing()
    # RETURNING names the row only if this statement wrote it (a driver's rowcount for
    # ON CONFLICT DO NOTHING is not to be trusted: psycopg reports -1 for it).
    return conn.execute(stmt.returning(table.c.name)).first() is not None


def first_seen(session: Session, name: str, holder: str, ttl_s: float) -> datetime:
    """When ``name`` expires: written now for ``ttl_s`` if missing, else as first written.

    A clock for "seen for this long": the first call starts it, later ones read it.
    """
    _check(name, holder, ttl_s)
    conn = session.connection()
    insert = insert_for(session)
    conn.execute(
        insert(LEASES)
        .values(name=name, holder=holder, expires_at=now() + timedelta(seconds=ttl_s))
        .on_conflict_do_nothing()
    )
    expires: datetime = conn.execute(
        select(Lease.expires_at).where(Lease.name == name)
    ).scalar_one()
    return expires


def drop(session: Session, name: str, holder: str) -> bool:
    """Release ``name`` inside the caller's transaction if ``holder`` still holds it."""
    _check(name, holder)
    table = LEASES
    gone = (
        session.connection()
        .execute(
            delete(table).where(Lease.name == name, Lease.holder == holder).returning(table.c.name)
        )
        .first()
    )
    return gone is not None


def pass_ttl(settings: Settings) -> float:
    """How long a housekeeping pass takes its lease for: until just after its task's hard limit.

    A pass cannot outlive its task, which is killed at its hard limit; a lease that lived
    ``CORRAL_LEASE_TTL_S`` (300 s) past a kill stopped every pass of its kind that long.
    Outside a task (no hard limit), ``CORRAL_LEASE_TTL_S``.
    """
    left = timelimits.hard_left()
    if left is None:
        return settings.lease_ttl_s
    return min(settings.lease_ttl_s, max(0.0, left) + PASS_SLACK_S)


def acquire_within(
    db: Database, name: str, holder: str, ttl_s: float, wait_s: float
) -> tuple[bool, str | None]:
    """Take ``name``, waiting up to ``wait_s`` for it to be free; (taken, else who holds it)."""
    give_up = time.monotonic() + wait_s
    while not acquire(db, name, holder, ttl_s):
        if time.monotonic() < give_up:
            time.sleep(min(POLL_S, max(0.0, give_up - time.monotonic())))
            continue
        info = current(db, name)
        return False, info.holder if info else None
    return True, None


def acquire(db: Database, name: str, holder: str, ttl_s: float) -> bool:
    """Take the lease ``name`` for ``ttl_s`` seconds; False if someone else holds it."""
    with db.transaction() as s:
        return take(s, name, holder, ttl_s)


def release(db: Database, name: str, holder: str) -> bool:
    """Give the lease back; False if ``holder`` no longer held it (expired, taken over)."""
    with db.transaction() as s:
        return drop(s, name, holder)


def current(db: Database, name: str) -> LeaseInfo | None:
    """The unexpired holder of ``name``, or None."""
    with db.read() as s:
        row = s.scalars(
            select(Lease).where(Lease.name == name, Lease.expires_at > store_now())
        ).first()
        return None if row is None else LeaseInfo(row.name, row.holder, row.expires_at)
