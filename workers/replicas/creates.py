"""Sending the creates of owned replica rows, and what each answer does to its row.

A handler owns the rows it sends (:mod:`workers.replicas.owners`). :func:`create` takes
the rows of some requests, sends all their creates at once (:mod:`workers.replicas.calls`:
bounded per node and per process, within the task's time; each call, its admission and
what lands are :mod:`workers.replicas.sends`' - the runner calls back there, never
here), records the VMs as they land, then sorts every other answer, in one transaction:

* a VM - the replica becomes Idle (or Starting, when its guest reports readiness); a VM
  whose row moved or ended meanwhile is released (:func:`workers.replicas.lifecycle.arrive`
  is conditional on the node);
* an answer that blames the request (INVALID_ARGUMENT, HTTP 400: every node would
  refuse it) - the replica is Dead at once and no node is counted;
* an answer that blames the node - counted against it
  (:func:`workers.fleet.nodes.note_creates`) and the replica moves to another node, at
  most ``MAX_PLACEMENTS`` in all, then Dead;
* a transport error - when it proves nothing was created (a connection refused) or the
  node deduplicates creates, the row is disowned and tried alone again with backoff
  (``spawn_replica``; after its retries :func:`give_up` moves it). Otherwise the create
  may have been carried out: the row becomes a *maybe* and a replacement is placed at
  once, sent in the next round (:mod:`workers.replicas.maybes`);
* a create a node that failed too often in this batch was never sent - moved elsewhere
  if another node has room, else tried alone with backoff;
* a create the budget left unsent - its sent mark cleared, left for another
  ``spawn_batch`` (:class:`Next`); one the time limit cut off mid-call - sent again
  later where the node deduplicates, else a maybe with a replacement.

A create is marked sent (:func:`workers.replicas.owners.mark_sent_soon`) when its call
holds its node's slot, together with the process's other calls that got slots at the
same moment, committed before any of them starts (:mod:`workers.replicas.calls` admits
them); a row the mark did not return (another delivery of the same message took it back
first) is not sent.
So a handler killed mid-round leaves at most a node's in-flight bound of creates sent
with an unknown outcome. An exception anywhere lets go of every row the handler owns
and has not sent (:func:`~workers.replicas.owners.let_go`).

A VM that came back is recorded for sure (:mod:`workers.replicas.arrivals`): a create
that answered is never sent again.

Every write checks the handler's token and the node it sent to, so a row another
handler took, or one that moved, is never changed by a stale answer.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from sqlalchemy.orm import Session

from config.settings import Settings
from workers.backends import inflight
from workers.base.errors import BackendError
from workers.fleet.nodes import note_creates
from workers.replicas import calls, maybes
from workers.replicas.arrivals import record
from workers.replicas.maybes import Replaced
from workers.replicas.moves import MAX_PLACEMENTS, Moved, fail, lock_for_moves, move
from workers.replicas.outcomes import Next, Outcome, Request, Retry
from workers.replicas.owners import (
    Budget,
    Owner,
    Pending,
    dedups,
    disown,
    let_go,
    owner_token,
    probe_dedup,
    take,
)
from workers.replicas.sends import Sends, blames_node, request_error
from workers.store.db import Database
from workers.store.models import Node

log = logging.getLogger(__name__)

MAX_ROUNDS = 2 * MAX_PLACEMENTS  # rounds of creates one call makes (moves start a new one)


def create(  # noqa: PLR0913 - the rows, and the handler's own ones by name
    db: Database,
    settings: Settings,
    request_ids: list[str],
    budget: Budget,
    *,
    owner: Owner | None = None,
    owned: Sequence[Pending] = (),
) -> Next:
    """Send the creates of these requests' rows that this handler may send; what came of them.

    ``owned``: rows ``owner`` (this handler) wrote as its own; the others are taken first.
    """
    token = owner.token if owner is not None else owner_token()
    nxt = Next()
    held: set[str] = {p.replica_id for p in owned}  # rows this handler may own
    try:
        mine = {p.request_id for p in owned}
        rest = [r for r in request_ids if r not in mine]
        todo = [*owned, *take_to_send(db, settings, rest, token, budget, nxt)]
        for _ in range(MAX_ROUNDS):
            if not todo:
                return nxt
            held.update(p.replica_id for p in todo)
            moved = _round(db, settings, todo, budget, token, nxt)
            if not moved:
                return nxt
            if nxt.cut or time.monotonic() >= budget.send_until:
                break
            todo = take_to_send(db, settings, moved, token, budget, nxt)
        else:
            moved = [p.request_id for p in todo]
    except BaseException:
        let_go(db, token, sorted(held))
        raise
    ops = {p.request_id: p.operation_id for p in todo}  # the round that moved them
    nxt.again += [Request(ops.get(r), r) for r in moved]  # moved more often than one call tries
    return nxt


def take_to_send(  # noqa: PLR0913 - one handler's round
    db: Database,
    settings: Settings,
    request_ids: list[str],
    token: str,
    budget: Budget,
    nxt: Next,
) -> list[Pending]:
    """Take these requests' rows to send (an ambiguous one: a maybe, its replacement taken)."""
    until = budget.own_until()
    taken = take(db, settings, request_ids, token, until)
    record(db, settings, taken.landed, nxt, budget)  # answers kept while the store was down
    pending = taken.pending
    replaced = replace_ambiguous(db, settings, taken.ambiguous, token, nxt)
    if replaced:
        again = take(db, settings, replaced, token, until)
        pending += again.pending
        taken.busy += again.busy
    for request_id in taken.busy:
        nxt.states[request_id] = Outcome.OWNED_ELSEWHERE
    return pending


def replace_ambiguous(
    db: Database, settings: Settings, ambiguous: Sequence[Pending], token: str, nxt: Next
) -> list[str]:
    """Make rows taken after their owner lapsed, sent with an unknown outcome, maybes.

    Returns the request ids whose replacement is placed (to be taken and sent).
    """
    if not ambiguous:
        return []
    lapsed = [Verdict(p, Then.MAYBE, "its owner lapsed after sending it") for p in ambiguous]
    with db.transaction() as s:
        lock_for_moves(s, ambiguous)
        return _replace(s, settings, lapsed, token, nxt)


_REPLACED = {
    Replaced.REPLACED: Outcome.MAYBE_REPLACED,
    Replaced.UNREPLACED: Outcome.MAYBE_UNREPLACED,
    Replaced.LOST: Outcome.OWNED_ELSEWHERE,
}


def _replace(
    s: Session, settings: Settings, verdicts: Sequence[Verdict], token: str, nxt: Next
) -> list[str]:
    """Make rows sent with an unknown outcome maybes (locks held); the request ids replaced."""
    replaced = []
    for v in verdicts:
        p = v.pending
        outcome = maybes.replace(s, settings, p, token, v.why, max_placements=MAX_PLACEMENTS)
        if outcome != Replaced.LOST:
            nxt.maybes.append(p.replica_id)
        if outcome == Replaced.REPLACED:
            replaced.append(p.request_id)
        nxt.states[p.request_id] = _REPLACED[outcome]
    return replaced


class Then(enum.Enum):
    """What happens next to a row whose create brought no VM."""

    DEAD = "dead"  # the request's own fault (every node would refuse it): Dead at once
    MOVE = "move"  # its node failed it: another node, one more placement
    MOVE_UNSENT = "move unsent"  # never sent, its node failed too often: another node
    ELSEWHERE = "elsewhere"  # never sent, its node stopped answering: another, or retry
    DISOWN = "disown"  # to be sent again later (by a retry, or another batch)
    MAYBE = "maybe"  # sent, outcome unknown, on a node that cannot tell: a maybe


@dataclass(frozen=True)
class Verdict:
    """What happens next to one row, and why (``error``: what a retry alone carries)."""

    pending: Pending
    then: Then
    why: str = ""
    error: BackendError | None = None


@dataclass
class _Sorted:
    """A round's answers, sorted by what happens next to each row (in the order found)."""

    verdicts: list[Verdict] = field(default_factory=list)

    def add(self, p: Pending, then: Then, why: str = "", error: BackendError | None = None) -> None:
        """Note what happens next to ``p``."""
        self.verdicts.append(Verdict(p, then, why, error))

    def of(self, *then: Then) -> list[Verdict]:
        """The verdicts of these kinds, in the order found."""
        return [v for v in self.verdicts if v.then in then]


def _round(  # noqa: PLR0913 - one handler's round
    db: Database,
    settings: Settings,
    pendings: list[Pending],
    budget: Budget,
    token: str,
    nxt: Next,
) -> list[str]:
    """One round: every create at once, VMs recorded as they land; the moved request ids.

    Each create is marked sent as its call takes its node's slot, with the others that
    took one at that moment (committed before any of them goes out).
    """
    sends = Sends(db, settings, budget, token, nxt, pendings)
    nodes, by_node = sends.nodes, sends.by_node
    ran = calls.run(
        settings,
        budget,
        by_node,
        sends.lane_of,
        sends.call,
        failed=blames_node,
        on_landed=sends.on_landed,
        admit=sends.admit,
        on_dropped=sends.on_dropped,
    )
    nxt.cut = nxt.cut or ran.cut
    record(db, settings, ran.landed(), nxt, budget)
    if ran.error is not None:
        raise ran.error  # marking failed: what was sent is recorded; the rest is let go
    for p in pendings:
        if ran.not_ours(p):
            nxt.states[p.request_id] = Outcome.OWNED_ELSEWHERE  # another delivery took it back
    _learn(db, settings, by_node, ran)
    out = _sort(by_node, ran, nxt)
    notes = [
        (nodes[str(key)], lane)
        for key, lane in ran.lanes.items()
        if _needs_note(nodes[str(key)], lane)
    ]
    if not (notes or out.verdicts):
        return []
    return _settle(db, settings, pendings, notes, out, token, nxt)


def _learn(
    db: Database,
    settings: Settings,
    by_node: dict[Hashable, list[Pending]],
    ran: calls.Ran[Pending],
) -> None:
    """Ask each node that left a create's outcome unknown whether it deduplicates creates.

    Once per node, ever (``nodes.can_list`` remembers): the answer decides whether the
    create may be sent again.
    """
    for group in by_node.values():
        node = group[0].node
        if node.can_list is not None:
            continue
        unknown = any(
            (r is None and ran.started(p))
            or (
                r is not None
                and isinstance(r.error, BackendError)
                and r.error.retryable
                and not r.error.nothing_done
            )
            for p in group
            for r in [ran.result(p)]
        )
        if unknown:
            probe_dedup(db, settings, node)


def _sort(by_node: dict[Hashable, list[Pending]], ran: calls.Ran[Pending], nxt: Next) -> _Sorted:
    """Sort each create that did not bring a VM by what happens to its row next."""
    out = _Sorted()
    for key, group in by_node.items():
        lane = ran.lanes.get(key)
        late = {id(p) for p in lane.late} if lane is not None else set()
        for p in group:
            result = ran.result(p)
            if (result is not None and result.error is None) or ran.not_ours(p):
                continue  # a VM: recorded; or another delivery's row now
            if result is None and ran.started(p):  # cut off by the soft time limit
                if dedups(p.node):
                    out.add(p, Then.DISOWN)
                    nxt.rest.append(Request(p.operation_id, p.request_id))
                    nxt.states[p.request_id] = Outcome.CUT_OFF
                else:
                    out.add(p, Then.MAYBE, "cut off by the task's time limit mid-call")
            elif result is None and (
                id(p) in late or id(p) in ran.unadmitted or ran.cut or lane is None
            ):
                out.add(p, Then.DISOWN)  # never sent: out of time (a sent mark goes too)
                nxt.rest.append(Request(p.operation_id, p.request_id))
                nxt.states[p.request_id] = Outcome.NOT_SENT
            elif result is None:  # not sent: the node failed too often in this batch
                err = lane.last_error if lane is not None else None
                if isinstance(err, BackendError) and err.retryable:
                    out.add(p, Then.ELSEWHERE, f"not sent: {err}", err)
                else:
                    out.add(p, Then.MOVE_UNSENT, f"not sent: {err}")
            else:
                _sort_error(p, result.error, out, nxt)
    return out


def _sort_error(p: Pending, exc: BaseException | None, out: _Sorted, nxt: Next) -> None:
    """What a create's error does to its row."""
    if isinstance(exc, BackendError) and exc.retryable:
        if exc.nothing_done or dedups(p.node):
            out.add(p, Then.DISOWN)
            nxt.retry.append(Retry(p.operation_id, p.request_id, exc, p.node.id))
            nxt.states[p.request_id] = Outcome.RETRYING
            log.warning("spawn %s: %s; retrying it alone", p.request_id, exc)
        else:
            out.add(p, Then.MAYBE, str(exc))
            log.warning(
                "spawn %s: %s; the node may have made the VM and cannot tell: a maybe, "
                "replaced at once",
                p.request_id,
                exc,
            )
    elif exc is not None and request_error(exc):
        out.add(p, Then.DEAD, str(exc))
    else:
        out.add(p, Then.MOVE, str(exc))


def _needs_note(node: Node, lane: inflight.Lane) -> bool:
    """Whether a batch's creates on ``node`` change what placement knows of it."""
    outcomes = _outcomes(lane)
    if not outcomes:
        return False
    return not (
        all(o is None for o in outcomes)
        and node.create_failures == 0
        and node.last_create_ok_at is not None
    )


def _outcomes(lane: inflight.Lane) -> list[str | None]:
    """A lane's creates that count for its node, in order (transport errors only after retries)."""
    return [
        None if e is None else str(e)
        for e in lane.log
        if e is None or (not (isinstance(e, BackendError) and e.retryable) and blames_node(e))
    ]


def _settle(  # noqa: PLR0913 - one handler's round
    db: Database,
    settings: Settings,
    pendings: list[Pending],
    notes: list[tuple[Node, inflight.Lane]],
    out: _Sorted,
    token: str,
    nxt: Next,
) -> list[str]:
    """Note the nodes' creates, end the Dead, move the rest; returns the moved request ids."""
    moved: list[str] = []
    with db.transaction() as s:
        lock_for_moves(s, pendings)
        for node, lane in notes:
            why = note_creates(s, settings, node.id, _outcomes(lane))
            if why:
                log.warning("node %s %s", node.name, why)
        disown(s, token, [v.pending.replica_id for v in out.of(Then.DISOWN)])
        moved += _replace(s, settings, out.of(Then.MAYBE), token, nxt)
        for v in out.of(Then.DEAD):
            if fail(s, settings, v.pending, token, v.why):
                nxt.states[v.pending.request_id] = Outcome.DEAD
        for v in out.of(Then.MOVE, Then.MOVE_UNSENT):
            p = v.pending
            tried = nxt.tried.setdefault(p.request_id, [])
            tried.append(p.node.id)
            counted = v.then == Then.MOVE
            outcome = move(s, settings, p, token, v.why, counted=counted, avoid=tried)
            if outcome == Moved.MOVED:
                moved.append(p.request_id)
            elif outcome == Moved.DEAD:
                nxt.states[p.request_id] = Outcome.DEAD
        # A node that stopped answering: its unsent creates go to another node if one has
        # room, else they wait for it, retried alone with backoff.
        for v in out.of(Then.ELSEWHERE):
            p = v.pending
            outcome = move(s, settings, p, token, v.why, counted=False, or_stay=True)
            if outcome == Moved.MOVED:
                moved.append(p.request_id)
            elif outcome == Moved.STAY and v.error is not None:
                disown(s, token, [p.replica_id])
                nxt.retry.append(Retry(p.operation_id, p.request_id, v.error, p.node.id))
                nxt.states[p.request_id] = Outcome.RETRYING
    for request_id in moved:
        if nxt.states.get(request_id) != Outcome.MAYBE_REPLACED:
            nxt.states[request_id] = Outcome.MOVED
    return moved
