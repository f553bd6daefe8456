"""Who may send a replica's create: one owner at a time, a "sent" mark, and never a blind resend.

The model
---------
The broker delivers at least once: a message can reach two workers at the same moment,
come back after its worker was SIGKILLed mid-call, or be re-sent by redrive while a retry
chain for the same replica still runs. The replica row, not the message, decides who
sends its create, so every handler of every delivery obeys the same rules:

* **Taking a row.** Before sending a create a handler *takes* the Creating row in a
  committed transaction: one conditional ``UPDATE`` sets ``owner`` (a token of this
  handler) and ``owner_until`` (when its task's hard time limit kills it, on the
  store's clock: :mod:`workers.base.clock`) where no live handler owns it - so of two
  handlers exactly one wins, on SQLite and PostgreSQL alike. Whether an owner is still
  live is judged in SQL, by the database on its own clock
  (:func:`workers.store.db.store_now`), never by the handler's host. A row someone else owns
  is left to them: a second delivery while the owner lives changes nothing.
* **"Sent".** Owning is not sending. A create is marked sent (``sent_at``) when its call
  holds its node's call slot, right before it goes out (:mod:`workers.replicas.calls`
  admits it): one thread per process marks the calls of all its batches that got slots
  meanwhile in one transaction (:func:`mark_sent_soon`: an ``UPDATE`` per owner,
  conditional on still owning the rows, committed before any of them starts), and only
  the rows it returned are sent. So a handler killed
  mid-batch leaves marked only creates that held a slot - at most the node's in-flight
  bound (``CORRAL_NODE_MAX_INFLIGHT``, fleet-wide), plus answers that landed in the last
  moments before the kill and were not yet recorded - never the rows still queued behind
  them. The owner clears the mark of an answer that proves nothing was made and of a call
  admitted but cut before it started; an exception anywhere in a batch lets go of every
  row it owns and has not sent (:func:`let_go`). So a row with no mark was never sent: any
  handler may take it once its owner lapsed, on every kind of node. A row marked sent
  whose owner lapsed had a create sent whose outcome nobody knows - unless its answer was
  kept while the store was down (:mod:`workers.replicas.landed`): then its VM is recorded.
* **Whose token.** A token is derived from the Celery message it handles (its task id and
  retry number, plus a nonce per run: :func:`owner_token`). A retry of the task (a higher
  retry number: the earlier run ended when it asked for the retry) takes back what the
  earlier run owned, sent or not. A delivery of the same message with the same retry
  number - a redelivery after a kill, or a second delivery at the same moment - may
  take back only rows not yet marked sent: the mark is conditional on the owner, so of
  two runs exactly one marks (and sends) each row, and a row already marked stays its
  sender's until that owner lapses.
* **No blind resend.** A sent row whose outcome is unknown is sent again only on a node
  that deduplicates creates (:func:`dedups`: corral's ``requestId`` extension, known
  from the node answering ``ListReplicas``; probed once per node and remembered in
  ``nodes.can_list``): the same ``requestId`` again returns the VM the agent already
  made. On an agent that speaks only the seed protocol (or a Lambdo host) it is
  *ambiguous*: :func:`take` hands it back as such, and the caller makes it a *maybe*
  and places a replacement at once (:mod:`workers.replicas.maybes`).
* **Fencing.** Every write an owner makes about its create checks its token and the
  node it sent to: moving the row to another node, failing it, disowning it. A VM is
  recorded only on a row still Creating on the node that made it
  (:func:`workers.replicas.lifecycle.arrive`); a late answer for a row that moved or
  ended is released, and one for a row that became a maybe settles the maybe.

Invariant: a Creating row with no owner has no sent mark (every write that clears the
owner of a Creating row clears the mark, or moves the row out of Creating).

:class:`Budget` is a handler's time: its calls start only while they can end before the
task's soft time limit, and its ownership lasts until the hard limit.
"""

from __future__ import annotations

import concurrent.futures
import enum
import hashlib
import logging
import os
import queue
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeAlias

from celery import current_task
from sqlalchemy import Row, and_, bindparam, or_, select, update
from sqlalchemy.orm import Session

from config.settings import Settings
from workers import backends
from workers.backends import Vm
from workers.base.clock import now
from workers.base.errors import BackendError, Unsupported
from workers.replicas import landed
from workers.store.db import Database, store_now
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

    @property
    def hard_at(self) -> float:
        """``time.monotonic()`` at which the task's hard time limit ends it."""
        return self.started + self.hard_s

    def own_until(self) -> datetime:
        """When ownership taken now lapses: the task's hard limit, on the store's clock."""
        left = max(0.0, self.started + self.hard_s - time.monotonic())
        return now() + timedelta(seconds=left)


KEY_CHARS = 20  # of a token: the message's key (its Celery task id, hashed)
RETRY_CHARS = 4  # then its retry number, in hex; the rest is a nonce of this run


def owner_token(message: str | None = None, retries: int | None = None) -> str:
    """A fresh owner token for one handler run of ``message`` (default: the running task's).

    Its key is the message's (the Celery task id: a retry and a redelivery carry the same
    one), then the retry number, then a nonce; outside a task the key is random.
    """
    if message is None:
        message, found = _current_message()
        retries = found if retries is None else retries
    key = hashlib.sha256(message.encode()).hexdigest() if message else uuid.uuid4().hex
    run = f"{min(max(retries or 0, 0), 16**RETRY_CHARS - 1):0{RETRY_CHARS}x}"
    return (key[:KEY_CHARS] + run + uuid.uuid4().hex)[:32]


def _current_message() -> tuple[str | None, int]:
    """The Celery task id and retry number of the task this thread runs (None outside one)."""
    request = getattr(current_task, "request", None) if current_task else None
    task_id = getattr(request, "id", None)
    retries = getattr(request, "retries", 0)
    return (
        task_id if isinstance(task_id, str) else None,
        retries if isinstance(retries, int) else 0,
    )


def _retry_of(token: str) -> int:
    """The retry number a token was made for (-1 when it does not say)."""
    try:
        return int(token[KEY_CHARS : KEY_CHARS + RETRY_CHARS], 16)
    except ValueError:
        return -1


class Reclaim(enum.Enum):
    """How a handler may take back a row another live run of its message owns."""

    EARLIER = "earlier"  # the message's earlier run (or this one): whatever it owns
    UNSENT = "unsent"  # a run with the same retry number: only a row not marked sent


def _reclaim(theirs: str, mine: str, sent: bool) -> Reclaim | None:
    """How ``mine`` may take a row a live ``theirs`` owns (None: not at all).

    :attr:`Reclaim.EARLIER`: the same message's earlier run (it ended when it asked for
    the retry), or this run itself. :attr:`Reclaim.UNSENT`: a run of the same message
    with the same retry number - only a row it has not marked sent (the mark decides
    who sends).
    """
    if theirs == mine:
        return Reclaim.EARLIER
    if theirs[:KEY_CHARS] != mine[:KEY_CHARS]:
        return None
    ours, others = _retry_of(mine), _retry_of(theirs)
    if others < ours:
        return Reclaim.EARLIER
    if others == ours and not sent:
        return Reclaim.UNSENT
    return None


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
    sent: bool = False  # marked sent when taken: its create went out, outcome unknown


@dataclass
class Taken:
    """What :func:`take` found for some requests."""

    pending: list[Pending] = field(default_factory=list)  # now ours, to send
    busy: list[str] = field(default_factory=list)  # another live handler owns them
    # now ours: sent, outcome unknown, on a node that cannot deduplicate (make maybes)
    ambiguous: list[Pending] = field(default_factory=list)
    # now ours: sent, and its answer kept while the store was down (record its VM)
    landed: list[tuple[Pending, Vm]] = field(default_factory=list)


# Built once: the Creating rows of some requests that have no VM yet, with node and
# function, and whether their owner is live - judged by the database, on its own clock.
_CANDIDATES = (
    select(
        Replica.id,
        Replica.request_id,
        Node,
        Function,
        Replica.operation_id,
        Replica.placements,
        Replica.owner,
        Replica.owner_until > store_now(),
        Replica.sent_at,
    )
    .join(Node, Node.id == Replica.node_id)
    .join(Function, Function.id == Replica.function_id)
    .where(
        Replica.request_id.in_(bindparam("request_ids", expanding=True)),
        Replica.status == int(ReplicaState.CREATING),
        Replica.vmid.is_(None),
    )
)
_OWNED = (
    Replica.id.in_(bindparam("ids", expanding=True)),
    Replica.status == int(ReplicaState.CREATING),
    Replica.vmid.is_(None),
)
_TAKE = (
    update(Replica)
    .where(
        *_OWNED,
        or_(
            Replica.owner.is_(None),
            Replica.owner_until <= store_now(),
            Replica.owner.in_(bindparam("earlier", expanding=True)),
            and_(
                Replica.owner.in_(bindparam("unsent", expanding=True)),
                Replica.sent_at.is_(None),
            ),
        ),
    )
    .values(owner=bindparam("token"), owner_until=bindparam("until"))
    .returning(Replica.id)
    .execution_options(synchronize_session=False)
)
_MARK = (
    update(Replica)
    .where(*_OWNED, Replica.owner == bindparam("token"))
    .values(sent_at=bindparam("at"))
    .returning(Replica.id)
    .execution_options(synchronize_session=False)
)
_DISOWN = (
    update(Replica)
    .where(Replica.id.in_(bindparam("ids", expanding=True)), Replica.owner == bindparam("token"))
    .values(owner=None, owner_until=None, sent_at=None)
    .execution_options(synchronize_session=False)
)
_LET_GO = (
    update(Replica)
    .where(*_OWNED, Replica.owner == bindparam("token"), Replica.sent_at.is_(None))
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
    """Own the Creating rows of ``request_ids`` that this handler may take; what became of each.

    A row no live handler owns is taken (one this message's earlier run owned, too); a
    row another live handler owns is left alone. Of the rows taken, those never sent -
    or sent to a node that deduplicates creates (probed here the first time) - are to
    send; those sent whose answer was kept while the store was down
    (:mod:`workers.replicas.landed`) are to record; those sent to a node that cannot
    deduplicate are ambiguous.
    """
    out = Taken()
    if not request_ids:
        return out
    with db.transaction() as s:  # read and take in one transaction
        rows = s.execute(_CANDIDATES, {"request_ids": request_ids}).all()
        wanted, earlier, unsent = _sort_candidates(rows, token, out)
        won = _take(s, wanted, token, until, earlier, unsent)
    kept = landed.find(
        settings, [(rid, p.node.id) for rid, p in wanted.items() if p.sent and rid in won]
    )
    for rid, pending in wanted.items():
        if rid not in won:
            out.busy.append(pending.request_id)  # taken by another handler meanwhile
        elif rid in kept:
            out.landed.append((pending, kept[rid]))
        elif not pending.sent or probe_dedup(db, settings, pending.node):
            out.pending.append(pending)
        else:
            out.ambiguous.append(pending)
    return out


_Candidate: TypeAlias = (
    "Row[str, str, Node, Function, str | None, int, str | None, bool | None, datetime | None]"
)


def _sort_candidates(
    rows: Sequence[_Candidate], token: str, out: Taken
) -> tuple[dict[str, Pending], set[str], set[str]]:
    """The rows to take, and the live owners' tokens they may be taken back from (two kinds)."""
    wanted: dict[str, Pending] = {}
    earlier: set[str] = set()
    unsent: set[str] = set()
    for rid, request_id, node, fn, op_id, placements, owner, live, sent_at in rows:
        sent = sent_at is not None
        if owner is not None and live:
            how = _reclaim(owner, token, sent)  # pragma: no mutate - _TAKE checks sent_at too
            if how is None:
                out.busy.append(request_id)
                continue
            (earlier if how == Reclaim.EARLIER else unsent).add(owner)
        wanted[rid] = Pending(rid, request_id, node, fn, op_id, placements, sent=sent)
    return wanted, earlier, unsent


def _take(  # noqa: PLR0913 - one statement's parameters
    s: Session,
    wanted: dict[str, Pending],
    token: str,
    until: datetime,
    earlier: set[str],
    unsent: set[str],
) -> set[str]:
    """Own these rows where no live handler does (or one this handler may take back from)."""
    if not wanted:
        return set()
    params = {
        "ids": list(wanted),
        "token": token,
        "until": until,
        "earlier": sorted(earlier),
        "unsent": sorted(unsent),
    }
    return set(s.scalars(_TAKE, params))


def mark_sent(db: Database, token: str, pendings: Sequence[Pending]) -> set[str]:
    """Mark these rows' creates sent, in one committed ``UPDATE``; the ids still ours to send.

    A batch's calls use :func:`mark_sent_soon`, one call at a time as each takes its slot.
    """
    if not pendings:
        return set()
    with db.transaction() as s:
        params = {"ids": [p.replica_id for p in pendings], "token": token, "at": now()}
        return set(s.scalars(_MARK, params))


@dataclass(frozen=True)
class _Mark:
    """One create to mark sent, and where to say whether it was."""

    db: Database
    token: str
    replica_id: str
    done: concurrent.futures.Future[bool]


class _Marker:
    """The process's marks: one thread marks every create asked for meanwhile, in one
    transaction per store (one ``UPDATE`` per owner), while the previous one commits."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.waiting: queue.SimpleQueue[_Mark] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="corral-marks", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            group = [self.waiting.get()]
            while True:
                try:
                    group.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            # a mark whose caller gave up waiting (its batch was cut) is not made
            by_db: dict[Database, list[_Mark]] = defaultdict(list)
            for mark in group:
                if mark.done.set_running_or_notify_cancel():
                    by_db[mark.db].append(mark)
            for db, marks in by_db.items():
                try:
                    _mark_group(db, marks)
                except BaseException as exc:  # never leave a caller waiting for ever
                    log.exception("marking %d create(s) sent failed", len(marks))
                    for mark in marks:
                        if not mark.done.done():
                            mark.done.set_exception(exc)


def _mark_group(db: Database, marks: list[_Mark]) -> None:
    """Mark one store's group sent in one transaction; tell each whether it was."""
    by_token: dict[str, list[str]] = defaultdict(list)
    for mark in marks:
        by_token[mark.token].append(mark.replica_id)
    try:
        with db.transaction() as s:
            at = now()
            marked: set[tuple[str, str]] = set()  # (owner, row): two runs may ask for one row
            for token, ids in by_token.items():
                params = {"ids": ids, "token": token, "at": at}
                marked.update(
                    (token, rid) for rid in s.connection().execute(_MARK, params).scalars()
                )
    except Exception as exc:
        for mark in marks:
            mark.done.set_exception(exc)
        return
    for mark in marks:
        mark.done.set_result((mark.token, mark.replica_id) in marked)


_marker: _Marker | None = None
_marker_lock = threading.Lock()


def mark_sent_soon(db: Database, token: str, replica_id: str) -> concurrent.futures.Future[bool]:
    """Mark one create sent, with every other the process asks for meanwhile; whether ours.

    The future is true once the mark is committed (the call may go out), false if the row
    is no longer this handler's to send; it raises what the store raised.
    """
    global _marker
    with _marker_lock:
        if _marker is None or _marker.pid != os.getpid():
            _marker = _Marker()  # a thread does not cross a fork: a new one after it
        marker = _marker
    done: concurrent.futures.Future[bool] = concurrent.futures.Future()
    marker.waiting.put(_Mark(db, token, replica_id, done))
    return done


def let_go(db: Database, token: str, replica_ids: Sequence[str]) -> None:
    """After an exception: give up every one of these rows this handler owns and never sent.

    Best effort (the store may be what failed): a row left owned lapses with its owner.
    """
    if not replica_ids:
        return
    try:
        with db.transaction() as s:
            s.connection().execute(_LET_GO, {"ids": list(replica_ids), "token": token})
    except Exception as exc:
        log.warning("could not give up %d unsent row(s): %s", len(replica_ids), exc)


def disown(session: Session, token: str, replica_ids: list[str]) -> None:
    """Give up rows this handler owns whose create was never sent, or proved to make nothing.

    Their sent mark goes too: whoever takes them next sends them.
    """
    if replica_ids:
        session.connection().execute(_DISOWN, {"ids": replica_ids, "token": token})


def owns(replica: Replica, token: str, node_id: str) -> bool:
    """Whether a locked row is still Creating on ``node_id`` with this handler's create out."""
    return (
        replica.status == ReplicaState.CREATING
        and replica.owner == token
        and replica.node_id == node_id
    )
