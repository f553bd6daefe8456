"""Who may send a replica's create: one owner at a time, and never a blind second send.

The model
---------
The broker delivers at least once: a message can reach two workers at the same moment,
come back after its worker was SIGKILLed mid-call, or be re-sent by redrive while a retry
chain for the same replica still runs. The replica row, not the message, decides who
sends its create, so every handler of every delivery obeys the same rule:

* **Taking a row.** Before sending a create a handler *takes* the Creating row in a
  committed transaction: one conditional ``UPDATE`` sets ``owner`` (a token of this
  handler) and ``owner_until`` (when its task's hard time limit kills it, on the
  store's clock: :mod:`workers.clock`), where ``owner`` is NULL - so of two handlers
  exactly one wins, on SQLite and PostgreSQL alike. A row someone else owns is left to
  them: a second delivery while the owner lives changes nothing.
* **"Create sent".** An owner is only ever cleared by the owner itself, and only when
  the create's outcome is known: its VM recorded (the row leaves Creating), an answer
  that proves nothing was created (an error reply from the agent, a connection refused
  before the request went out: the row is *disowned* and may be taken again), or a
  create never sent (cut by the batch's budget or a failing node). So a row whose owner
  has lapsed had a create sent whose outcome nobody knows.
* **No blind re-send.** Such a row is taken over only on a node that deduplicates
  creates (:func:`dedups`: corral's ``requestId`` extension, known from the node
  answering ``ListReplicas``; probed once per node and remembered in
  ``nodes.can_list``): sending the same ``requestId`` again returns the VM the agent
  already made, or makes the one it never made. On an agent that speaks only the seed
  protocol the row is never sent again: it keeps its slot and its count until its
  deadline, when the reaper ends it Dead (giving both back once); a VM that shows up
  for it reports READY to the registry and, with no row to take it, is released
  (:mod:`workers.replicas.reports`), or is destroyed by reconcile where the node can
  list its VMs.
* **Fencing.** Every write an owner makes about its create checks its token and the
  node it sent to: moving the row to another node, failing it, disowning it. A VM is
  recorded only on a row still Creating on the node that made it
  (:func:`workers.replicas.lifecycle.arrive`); a late answer for a row that moved or
  ended is released, so nothing runs without a row.

:class:`Budget` is a handler's time: its calls start only while they can end before the
task's soft time limit, and its ownership lasts until the hard limit.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeAlias

from sqlalchemy import Row, bindparam, or_, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers import backends
from workers.clock import now
from workers.errors import BackendError, Unsupported
from workers.store.db import Database
from workers.store.models import Function, Node, Replica, ReplicaState

log = logging.getLogger(__name__)

MARGIN_S = 1.0  # a call must end this long before the soft time limit


@dataclass(frozen=True)
class Budget:
    """A handler's time: when it started, its task's time limits, its longest call."""

    started: float  # time.monotonic()
    soft_s: float
    hard_s: float
    call_s: float

    @classmethod
    def of(
        cls,
        settings: Settings,
        *,
        started: float | None = None,
        soft_s: float | None = None,
        hard_s: float | None = None,
    ) -> Budget:
        """The budget of a task started at ``started`` (now) under ``settings``' limits."""
        return cls(
            started=time.monotonic() if started is None else started,
            soft_s=settings.task_soft_time_limit_s if soft_s is None else soft_s,
            hard_s=settings.task_time_limit_s if hard_s is None else hard_s,
            call_s=settings.call_timeout_s,
        )

    @property
    def send_until(self) -> float:
        """``time.monotonic()`` after which no new call starts (it could outlive the task)."""
        return self.started + self.soft_s - self.call_s - MARGIN_S

    def own_until(self) -> datetime:
        """When ownership taken now lapses: the task's hard limit, on the store's clock."""
        left = max(0.0, self.started + self.hard_s - time.monotonic())
        return now() + timedelta(seconds=left)


def owner_token() -> str:
    """A fresh owner token for one handler's creates."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Owner:
    """One handler as the owner of rows: its token, and when its ownership lapses."""

    token: str
    until: datetime


@dataclass(frozen=True)
class Pending:
    """A Creating replica this handler owns: where to create it and for which function."""

    replica_id: str
    request_id: str
    node: Node
    function: Function
    operation_id: str | None  # the operation waiting for this replica
    placements: int = 1  # nodes tried so far, this one included


@dataclass
class Taken:
    """What :func:`take` found for some requests."""

    pending: list[Pending] = field(default_factory=list)  # now ours, to send
    busy: list[str] = field(default_factory=list)  # another live handler owns them
    unknown: list[str] = field(default_factory=list)  # sent, outcome unknown, seed protocol


# Built once: the Creating rows of some requests that have no VM yet, with node and function.
_CANDIDATES = (
    select(
        Replica.id,
        Replica.request_id,
        Node,
        Function,
        Replica.operation_id,
        Replica.placements,
        Replica.owner,
        Replica.owner_until,
    )
    .join(Node, Node.id == Replica.node_id)
    .join(Function, Function.id == Replica.function_id)
    .where(
        Replica.request_id.in_(bindparam("request_ids", expanding=True)),
        Replica.status == int(ReplicaState.CREATING),
        Replica.vmid.is_(None),
    )
)
_TAKE = (
    update(Replica)
    .where(
        Replica.id.in_(bindparam("ids", expanding=True)),
        Replica.status == int(ReplicaState.CREATING),
        Replica.vmid.is_(None),
        or_(Replica.owner.is_(None), Replica.owner_until <= bindparam("at")),
    )
    .values(owner=bindparam("token"), owner_until=bindparam("until"))
    .returning(Replica.id)
    .execution_options(synchronize_session=False)
)
_DISOWN = (
    update(Replica)
    .where(Replica.id.in_(bindparam("ids", expanding=True)), Replica.owner == bindparam("token"))
    .values(owner=None, owner_until=None)
    .execution_options(synchronize_session=False)
)


def dedups(node: Node) -> bool:
    """Whether a create sent twice to ``node`` makes one VM (corral's ``requestId`` extension)."""
    return backends.backend(node.kind).keyed_creates and node.can_list is True


def probe_dedup(db: Database, settings: Settings, node: Node) -> bool:
    """Ask a node once whether it speaks corral's extensions, and remember the answer."""
    if node.can_list is not None or not backends.backend(node.kind).keyed_creates:
        return dedups(node)
    try:
        backends.list_vms(node, settings)
        can = True
    except Unsupported:
        can = False
    except BackendError as exc:  # not now: ask again next time
        log.info("node %s did not say whether it deduplicates creates: %s", node.name, exc)
        return False
    with db.transaction() as s:
        s.execute(
            update(Node)
            .where(Node.id == node.id)
            .values(can_list=can)
            .execution_options(synchronize_session=False)
        )
    node.can_list = can
    log.info(
        "node %s %s",
        node.name,
        "deduplicates creates (requestId)" if can else "speaks only the seed protocol",
    )
    return can


def take(
    db: Database, settings: Settings, request_ids: list[str], token: str, until: datetime
) -> Taken:
    """Own the Creating rows of ``request_ids`` that may be sent now; what became of each.

    Free rows are taken; a row whose owner lapsed is taken over only on a node that
    deduplicates creates; rows another live handler owns, and rows sent to a
    seed-protocol node with an unknown outcome, are left alone.
    """
    out = Taken()
    if not request_ids:
        return out
    with db.transaction() as s:  # the common case: read and take in one transaction
        rows = s.execute(_CANDIDATES, {"request_ids": request_ids}).all()
        wanted, ask = _sort_candidates(rows, out)
        won = _take(s, wanted, token, until)
    # Lapsed owners on nodes not asked yet whether they deduplicate: ask, outside the
    # transaction; those that do are taken as the others were.
    for rid, pending in list(ask.items()):
        if not probe_dedup(db, settings, pending.node):
            del ask[rid]
            out.unknown.append(pending.request_id)
    if ask:
        with db.transaction() as s:
            won |= _take(s, ask, token, until)
        wanted |= ask
    for rid, pending in wanted.items():
        if rid in won:
            out.pending.append(pending)
        else:
            out.busy.append(pending.request_id)  # taken by another handler meanwhile
    return out


_Candidate: TypeAlias = (
    "Row[str, str, Node, Function, str | None, int, str | None, datetime | None]"
)


def _sort_candidates(
    rows: Sequence[_Candidate], out: Taken
) -> tuple[dict[str, Pending], dict[str, Pending]]:
    """The rows to take now, and those to take once their node was asked (:func:`dedups`)."""
    at = now()
    wanted: dict[str, Pending] = {}
    ask: dict[str, Pending] = {}
    for rid, request_id, node, fn, op_id, placements, owner, owner_until in rows:
        if owner is not None and owner_until is not None and owner_until > at:
            out.busy.append(request_id)
            continue
        pending = Pending(rid, request_id, node, fn, op_id, placements)
        if owner is None or dedups(node):
            wanted[rid] = pending
        elif node.can_list is None and backends.backend(node.kind).keyed_creates:
            ask[rid] = pending
        else:
            out.unknown.append(request_id)
    return wanted, ask


def _take(s: Session, wanted: dict[str, Pending], token: str, until: datetime) -> set[str]:
    """Own these rows where no live handler does; the ids won."""
    if not wanted:
        return set()
    return set(s.scalars(_TAKE, {"ids": list(wanted), "at": now(), "token": token, "until": until}))


def disown(session: Session, token: str, replica_ids: list[str]) -> None:
    """Give up rows this handler owns whose create was never sent, or proved to make nothing."""
    if replica_ids:
        session.connection().execute(_DISOWN, {"ids": replica_ids, "token": token})


def owns(replica: Replica, token: str, node_id: str) -> bool:
    """Whether a locked row is still Creating on ``node_id`` with this handler's create out."""
    return (
        replica.status == ReplicaState.CREATING
        and replica.owner == token
        and replica.node_id == node_id
    )
