"""Recording the VMs that came back: each answer's row moved, in one transaction, surely.

A VM that came back is recorded (:func:`record`) for sure: a store that refuses is asked
again inside the task until near its hard time limit, and from the first refusal the
answers are also kept in Redis (:mod:`workers.replicas.landed`), where whoever takes the
row next finds and records them. A create that answered is never sent again. A VM whose
row moved or ended meanwhile is released (:func:`workers.replicas.lifecycle.arrive` is
conditional on the node), and kept as an orphan (:mod:`workers.replicas.orphans`) in the
transaction that found it late, until its release is done: on an agent that speaks only
the seed protocol nothing else would ever find it again. What the arrivals settle is
settled with them.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy.orm import Session

from config.settings import Settings
from workers import backends
from workers.base import timelimits
from workers.base.errors import BackendError
from workers.observability import stages
from workers.operations import settle
from workers.replicas import landed as landed_answers
from workers.replicas import maybes, orphans
from workers.replicas.lifecycle import arrive, lock_replica, recount
from workers.replicas.maybes import Settled
from workers.replicas.notices import Readied
from workers.replicas.outcomes import Next, Outcome
from workers.replicas.owners import (
    Budget,
    Pending,
)
from workers.replicas.reports import apply_early_reports
from workers.store.db import Database, is_transient
from workers.store.models import ReplicaState
from workers.store.states import MOVES, SETTLING

log = logging.getLogger(__name__)

RECORD_MARGIN_S = 2.0  # recording is not tried again with less than this left before the hard limit
RECORD_BACKOFF_S = (0.05, 1.0)  # between tries: from, doubling up to


def record(
    db: Database,
    settings: Settings,
    landed: Sequence[tuple[Pending, backends.Vm]],
    nxt: Next,
    budget: Budget,
) -> None:
    """Record VMs that came in, in one transaction; release those whose row moved or ended.

    A store that refuses is asked again until near the task's hard time limit; from the
    first refusal the answers are kept in Redis (:mod:`workers.replicas.landed`) for the
    next handler of their rows, and dropped from there once recorded.
    """
    if not landed:
        return
    readied = Readied()
    late = _record_surely(db, settings, landed, nxt, readied, budget)
    readied.tell(settings)  # claims waiting on these functions: look now
    _release_late(db, settings, [(p, vm) for p, vm in late if not _kept(db, settings, p, vm, nxt)])


def _record_surely(  # noqa: PLR0913 - one recording and its retries
    db: Database,
    settings: Settings,
    landed: Sequence[tuple[Pending, backends.Vm]],
    nxt: Next,
    readied: Readied,
    budget: Budget,
) -> list[tuple[Pending, backends.Vm]]:
    """:func:`_arrivals` in one transaction, again while the store refuses and time is left."""
    kept = False
    delay, most = RECORD_BACKOFF_S
    tries = 0
    while True:
        tries += 1
        try:
            with db.transaction() as s:
                late = _arrivals(s, settings, landed, nxt, readied)
        except timelimits.OutOfTime:
            continue  # the soft limit, delivered: the task wraps up, and recording goes ahead
        except Exception as exc:
            if not kept:
                answers = [landed_answers.Landed(p.replica_id, p.node.id, vm) for p, vm in landed]
                kept = landed_answers.keep(settings, answers)
            left = budget.hard_at - time.monotonic()
            if not is_transient(exc) or left < RECORD_MARGIN_S + delay:
                log.error(
                    "could not record %d VM(s) after %d tries (%s); %s",
                    len(landed),
                    tries,
                    exc,
                    "their answers are kept in Redis for the next handler"
                    if kept
                    else "their rows are left to their next handler",
                )
                raise
            log.warning(
                "recording %d VM(s) failed (%s); trying again for up to %.0fs",
                len(landed),
                exc,
                left - RECORD_MARGIN_S,
            )
            time.sleep(delay)
            delay = min(delay * 2, most)
            continue
        if kept or any(p.sent for p, _ in landed):
            landed_answers.forget(settings, [p.replica_id for p, _ in landed])
        return late


def _kept(db: Database, settings: Settings, p: Pending, vm: backends.Vm, nxt: Next) -> bool:
    """Whether a VM that came too late for its row is kept: its row became a maybe, adopting it."""
    if nxt.states.get(p.request_id) != Outcome.MAYBE:
        return False
    kept = maybes.settle_vm(db, settings, p.replica_id, vm.vmid, vm.address) == Settled.ADOPTED
    nxt.states[p.request_id] = Outcome.MAYBE_ADOPTED if kept else Outcome.MAYBE_RELEASED
    if kept:  # a live row holds it: no orphan after all
        _forget(db, p.node.id, vm.vmid)
    return kept


def _arrivals(
    s: Session,
    settings: Settings,
    landed: Sequence[tuple[Pending, backends.Vm]],
    nxt: Next,
    readied: Readied,
) -> list[tuple[Pending, backends.Vm]]:
    """Record new VMs (operations counted once each); returns those to release."""
    late = []
    done: dict[str, list[str]] = defaultdict(list)
    starts: dict[str, dict[str, str]] = defaultdict(dict)  # op -> replica -> how it started
    counts: dict[str, int] = defaultdict(int)
    starting: dict[str, str] = {}  # vmid -> request id
    for p, vm in landed:
        arrived = arrive(
            s,
            p.replica_id,
            p.operation_id,
            (vm.vmid, vm.address),
            p.function,
            settings,
            node_id=p.node.id,
            settle_op=False,
            count=False,
        )
        if arrived is None:
            state, release = _late(s, p, vm)
            nxt.states[p.request_id] = state
            if release:  # kept until released, whatever becomes of this task
                orphans.note(s, settings, p.node.id, vm.vmid)
                late.append((p, vm))
            continue
        nxt.states[p.request_id] = Outcome.of(arrived)
        counts[p.function.id] += MOVES[(ReplicaState.CREATING, arrived)].count
        stages.recorded(s, p.operation_id, p.replica_id, p.request_id)
        if vm.start and p.operation_id:
            starts[p.operation_id][p.replica_id] = vm.start
        if arrived == ReplicaState.STARTING:
            starting[vm.vmid] = p.request_id
        else:
            readied.functions.add(p.function.name)
        if p.operation_id and arrived in SETTLING:
            done[p.operation_id].append(p.replica_id)
    for op_id, how in starts.items():
        stages.vm_starts(s, op_id, how)
    recount(s, counts)
    for op_id, parts in done.items():
        settle(s, op_id, parts=parts, ok=True)
    if starting:  # guests that said READY before their VM was recorded: Idle now
        for vmid in apply_early_reports(s, settings, starting, readied):
            nxt.states[starting[vmid]] = Outcome.IDLE
    return late


def _late(s: Session, pending: Pending, vm: backends.Vm) -> tuple[Outcome, bool]:
    """A VM its row did not take: the row's state, and whether to release the VM."""
    replica = lock_replica(s, pending.replica_id)
    if replica is None:
        return Outcome.GONE, True
    if replica.vmid == vm.vmid and replica.node_id == pending.node.id:
        return Outcome.of(replica.state), False  # a second answer for the VM already recorded
    return Outcome.of(replica.state), True


def _release_late(
    db: Database, settings: Settings, late: list[tuple[Pending, backends.Vm]]
) -> None:
    """Release VMs no row took (nothing runs without a row); a failed release is kept."""
    for pending, vm in late:
        log.info(
            "replica %s: VM %s on %s came too late for its row; releasing it",
            pending.replica_id,
            vm.vmid,
            pending.node.name,
        )
        try:
            backends.release_vm(pending.node, vm.vmid, settings)
        except (BackendError, timelimits.OutOfTime) as exc:  # its kept orphan row: reconcile
            log.warning("release of %s failed (reconcile will retry): %s", vm.vmid, exc)
            continue
        _forget(db, pending.node.id, vm.vmid)


def _forget(db: Database, node_id: str, vmid: str) -> None:
    """End a kept orphan whose release is done; one left behind is released again, harmlessly."""
    try:
        orphans.end(db, node_id, vmid)
    except Exception as exc:  # the store is away: reconcile's release finds it already gone
        log.warning("could not forget released orphan %s on %s: %s", vmid, node_id, exc)
