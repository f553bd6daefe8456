"""The reaper: delete replicas nobody needs, at a bounded rate, one pass at a time.

The model
---------
A pass removes three kinds of replica, in this order, at most
``CORRAL_REAP_BATCH`` (or ``batch``) of them in total:

* ``stuck`` - rows left past their ``deadline_at`` in Creating, Starting, Deleting
  or Maybe (a worker died mid-request, a guest never said READY, a maybe whose VM
  never showed up: :mod:`workers.replicas.maybes`), as the database's own clock judges
  it. Creating becomes Dead ("stuck in creating") - never while a live handler still
  owns its create (:mod:`workers.replicas.owners`); Starting goes through StartingLimit to Dead;
  Deleting is finished; a maybe ends Dead, giving its slot back. Their VM, if they
  have one, is released.
* ``stale`` - Idle replicas of an older build than their function's
  (``build_version`` differs): they are never handed out again.
* ``idle`` - Idle replicas with no environment in use whose idle time (since
  their last request ended, or since they became ready if they never served one)
  reached the function's idle timeout: ``reap_at <= now`` on the
  ``(status, reap_at)`` index, or, with an explicit ``idle_timeout`` override,
  ``idle_since <= now - idle_timeout`` on ``(status, idle_since)``.
  A function with adaptive keep-alive whose idle times show a pattern
  (:class:`workers.autoscale.keepalive.Plan`, read from Redis before the pass) is
  left out of that and judged by its windows instead: while its next call is not
  due (before the pre-warm window, or past the keep-alive window) every idle replica
  of it goes - let go right after use - and inside them those idle longer than the
  keep-alive window. Without a pattern (or without Redis) it keeps its fixed timeout.

Before choosing victims a pass gives back the environments of claims past their
expiry (:func:`workers.replicas.claims.expire`; ``claims_expired`` in the report): a
replica whose caller died holding a claim is Idle again, its idle clock starting
now, instead of Allocated for ever.

Idle and stale deletions never take a function below its floor (:func:`keep_at_least`:
its ``min_replicas``, or for an autoscaled function the autoscaler's target if higher)
(replicas in Creating, Starting, Idle or Allocated count: the function row's
``replica_count``, read once per function the pass touches). A stale replica kept for
the minimum is reported in ``replace``: the reap task asks for that many fresh
replicas, and a later pass retires the stale ones once they exist.

A deletion is split at the network call like every other: the pass's one
transaction picks its victims with indexed ``LIMIT`` queries (``FOR UPDATE SKIP
LOCKED`` on PostgreSQL) and marks them Deleting, so no claim can take them and no
other pass can pick them; then every VM is released at once
(:func:`workers.replicas.delete.release_all`, bounded per node and per process; a VM
already gone counts as released) and the rows retired in one transaction
(:func:`workers.replicas.delete.finish_deletes`): Deleted, or Dead with an error when the
node could not be reached (the error says reconcile will destroy the VM) - except on a
node that cannot list its VMs (:func:`workers.replicas.delete.release_waits`), where
nothing would: the row stays Deleting, holding its slot, and a later pass's stuck sweep
releases it, once its node is healthy again (Deleting rows on an unhealthy node are not
swept). After
``CORRAL_NODE_FAILURES`` transport failures in a row from one node, the rest of
that node's VMs are not waited for again in the same pass. A pass
therefore costs in proportion to what it deletes (plus two probes of the
``(function_id, status, build_version)`` index per function for stale builds), not
to the size of the replica table. A pass that dies after marking rows leaves them
Deleting; the next pass finds them past their deadline and finishes them.

Exactly one pass runs at a time: a pass first takes the ``reap`` lease
(:mod:`workers.leases`); a pass that cannot is skipped and says who holds it (one
that an operator asked for may first wait a little for the running pass to end).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import redis
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers import leases
from workers.autoscale import idletimes
from workers.autoscale.keepalive import Plan
from workers.base.clock import iso, now
from workers.base.errors import BackendError, InputError, TransientBackendError, check_seconds
from workers.fleet.health import note_failure
from workers.locks import lock_functions
from workers.maintenance.reap_report import Reaped, ReapReport
from workers.replicas import claims
from workers.replicas.delete import (
    WAITS,
    Doomed,
    finish_deletes,
    release_all,
    release_waits,
    wait_for_node,
)
from workers.replicas.lifecycle import mark_deleting, transition
from workers.store.db import Database, store_now
from workers.store.models import COUNTED_STATES, Function, Node, Replica, ReplicaState

log = logging.getLogger(__name__)

LEASE = "reap"
MAX_EXAMINED = 10  # rows a pass may look at, per unit of batch, while skipping kept ones


@dataclass
class _Victim:
    """A replica marked Deleting by this pass, with what the release needs."""

    reaped: Reaped
    doomed: Doomed
    error: str | None = None  # a stuck replica ends Dead with this error
    retired: bool = False  # already Dead in the pass's transaction (no VM to release)
    left: bool = False  # its release was not done in time: it stays Deleting for a later pass


@dataclass(frozen=True)
class _Limits:
    """What one pass may do: delete at most ``budget`` replicas, by ``idle_timeout`` (None:
    each function's own), adaptive functions by their keep-alive plans (by function id)."""

    budget: int
    idle_timeout: float | None
    plans: Mapping[str, Plan] = field(default_factory=dict)


class _Pass:
    """The selection step of one pass: one transaction, a budget, the min guard."""

    def __init__(self, session: Session, settings: Settings, at: datetime, limits: _Limits) -> None:
        self.s = session
        self.settings = settings
        self.at = at
        self.budget = limits.budget
        self.idle_timeout = limits.idle_timeout
        self.plans = dict(limits.plans)  # function id -> its keep-alive plan (adaptive only)
        self.victims: list[_Victim] = []
        self.kept: dict[str, int] = defaultdict(int)
        self.stale_kept: dict[str, Function] = {}
        self._allow: dict[str, int] = {}
        self.seen: list[str] = []  # rows this pass looked at: never looked at twice

    @property
    def left(self) -> int:
        return self.budget - len(self.victims)

    def _lock(self, query: Any) -> Any:
        # (not mutated: SQLite ignores it; two passes on PostgreSQL are the concurrency
        # tests', test_reaper.py and test_two_beats.py, which the mutation run leaves out)
        return query.with_for_update(of=Replica, skip_locked=True)  # pragma: no mutate

    def _mark(self, replica: Replica, reason: str, detail: str, error: str | None = None) -> None:
        doomed = Doomed(replica.id, replica.vmid, replica.node)
        self.victims.append(
            _Victim(
                Reaped(
                    replica.id,
                    replica.function.name,
                    reason,
                    detail,
                    replica.vmid,
                    replica.node.name if replica.node else None,
                ),
                doomed,
                error,
            )
        )

    # -- stuck ------------------------------------------------------------------------------

    def stuck(self) -> None:
        """Retire rows past their deadline in Creating, Starting, Deleting or Maybe."""
        for state in (
            ReplicaState.CREATING,
            ReplicaState.STARTING,
            ReplicaState.DELETING,
            ReplicaState.MAYBE,
        ):
            if self.left <= 0:  # pragma: no mutate - a shortcut: none left, none taken
                return
            lapsed = Replica.owner_until <= store_now()  # pragma: no mutate - as the deadline
            query = select(Replica).where(
                Replica.status == state,
                # judged by the database, on its own clock (workers.base.clock)
                Replica.deadline_at <= store_now(),  # pragma: no mutate - '<': a microsecond
                # a create still owned by a live handler may yet be recorded
                or_(Replica.owner_until.is_(None), lapsed),
            )
            if state == ReplicaState.DELETING:  # a release waits for its node to answer
                unhealthy = select(Node.id).where(Node.healthy.is_(False))
                query = query.where(
                    or_(Replica.node_id.is_(None), Replica.node_id.not_in(unhealthy))
                )
            # not mutated: SQLite reads the (status, deadline_at) index in this order anyway;
            # test_the_stuck_sweep_stops_at_the_batch[postgres] fails without it
            oldest = query.order_by(Replica.deadline_at)  # pragma: no mutate
            rows = self.s.scalars(self._lock(oldest.limit(self.left))).all()
            for replica in rows:
                self._stuck_one(replica, state)

    def _stuck_one(self, replica: Replica, state: ReplicaState) -> None:
        since = replica.updated_at or replica.created_at
        if state == ReplicaState.DELETING:
            # Someone's delete died midway: finish it (re-stamping the deadline keeps any
            # other sweep off it while we do).
            transition(self.s, replica, ReplicaState.DELETING, self.settings)
            self._mark(replica, "stuck", "stuck in deleting")
            return
        if state == ReplicaState.CREATING:
            error = (
                f"stuck in creating: no answer from the node within "
                f"{self.settings.creating_deadline_s:g}s"
            )
        elif state == ReplicaState.MAYBE:
            error = f"maybe ended: no sign of its VM by its deadline ({replica.error})"
        else:
            limit = ReplicaState.STARTING_LIMIT  # (no deadline: the settings are not read)
            transition(self.s, replica, limit, self.settings)  # pragma: no mutate
            error = (
                f"stuck in starting: the guest did not report ready within "
                f"{self.settings.boot_deadline_s:g}s"
            )
        log.info("replica %s %s (since %s)", replica.id, error, since)
        detail = error.split(":")[0]
        # No VM: Dead at once ('and' would end the same: release_all takes no VM as gone).
        if replica.vmid is None or replica.node is None:  # pragma: no mutate
            self._mark(replica, "stuck", detail)
            self.victims[-1].retired = True
            self.victims[-1].reaped.outcome = "retired"
            self.victims[-1].reaped.error = error
            dead = ReplicaState.DEAD  # (no deadline: the settings are not read)
            transition(self.s, replica, dead, self.settings, error=error)  # pragma: no mutate
            return
        transition(self.s, replica, ReplicaState.DELETING, self.settings)
        self._mark(replica, "stuck", detail, error)

    # -- the min guard ----------------------------------------------------------------------

    def _counted(self, fn: Function) -> int:
        """``fn``'s replicas that count toward its min, read fresh from the function row.

        ``functions.replica_count`` is kept by :func:`workers.replicas.lifecycle.transition` with
        UPDATEs the session does not reflect in loaded objects, so this re-reads it
        (after this pass's own transitions, which the same transaction sees).
        """
        count = self.s.scalar(select(Function.replica_count).where(Function.id == fn.id))
        return int(count or 0)  # pragma: no mutate - the row is there: never None

    def _fresh(self, fn: Function) -> int:
        """How many of ``fn``'s counted replicas are of its current build."""
        fresh = self.s.scalar(
            select(func.count()).where(
                Replica.function_id == fn.id,
                Replica.status.in_(COUNTED_STATES),
                Replica.build_version == fn.build_version,
            )
        )
        return int(fresh or 0)  # pragma: no mutate - a count is never None

    def _may_delete(self, fn: Function) -> bool:
        """Whether one more of ``fn``'s replicas may go without going below its floor."""
        floor = keep_at_least(fn)
        if floor <= 0:  # pragma: no mutate - '< 0': the count would allow every replica
            return True
        if fn.id not in self._allow:
            self._allow[fn.id] = max(0, self._counted(fn) - floor)
        if self._allow[fn.id] <= 0:
            return False
        self._allow[fn.id] -= 1
        return True

    def _take(self, rows: Sequence[Replica], reason: str, note: str) -> None:
        """Mark what the min allows; the rest is kept (and counted as such).

        ``rows`` are at most what the budget has left (the page's ``LIMIT``), and a row
        kept uses none of it: every row taken fits.
        """
        taken: list[Replica] = []
        for replica in rows:
            self.seen.append(replica.id)
            fn = replica.function
            if not self._may_delete(fn):
                self.kept[fn.name] += 1
                if reason == "stale":
                    self.stale_kept[fn.id] = fn
                continue
            if reason == "stale":
                detail = f"build {replica.build_version}, current {fn.build_version}"
            else:
                idle_for = (self.at - (replica.idle_since or self.at)).total_seconds()
                detail = f"idle {idle_for:.0f}s{note}"
            taken.append(replica)
            self._mark(replica, reason, detail)
        mark_deleting(self.s, self.settings, taken, None)  # the page's victims, at once

    def _pages(self, base: Any, reason: str, note: str = "") -> None:
        """Walk an indexed query a page at a time; rows kept for min do not use the budget.

        Each page is one ``LIMIT`` query over the index range; it is repeated only when
        a full page had rows kept for min, and the rows looked at are bounded by
        ``MAX_EXAMINED`` times the batch, so a pass stays bounded whatever the table holds.
        """
        while self.left > 0 and len(self.seen) < MAX_EXAMINED * self.budget:
            limit = self.left
            # not mutated: an empty NOT IN, left out of the first page, would exclude nothing
            # (test_rows_kept_for_min_use_none_of_the_batch_the_pass_reads_on_past_them
            # fails when later pages leave it out)
            seen = Replica.id.not_in(self.seen)
            query = base if not self.seen else base.where(seen)  # pragma: no mutate
            rows = self.s.scalars(self._lock(query.limit(limit))).all()
            self._take(rows, reason, note)
            if len(rows) < limit:
                return  # the range is exhausted

    # -- stale and idle ---------------------------------------------------------------------

    def stale(self) -> None:
        """Idle replicas of an older build than their function's."""
        functions = self.s.execute(
            select(Function.id, Function.build_version).order_by(Function.name)
        ).all()
        for fn_id, version in functions:
            for other in (Replica.build_version < version, Replica.build_version > version):
                if self.left <= 0:  # pragma: no mutate - a shortcut: none left, none taken
                    return
                self._pages(
                    select(Replica).where(
                        Replica.function_id == fn_id,
                        Replica.status == ReplicaState.IDLE,
                        other,
                        Replica.envs_in_use == 0,
                    ),
                    "stale",
                )

    def idle(self) -> None:
        """Idle replicas past their idle timeout (or the override), or their keep-alive windows."""
        if self.left <= 0:  # pragma: no mutate - a shortcut: none left, none taken
            return
        if self.idle_timeout is None:
            base = (
                select(Replica)
                .where(
                    # (not mutated: reap_at and idle_since are NULL outside Idle and while
                    # an environment is in use; status and '<=' keep to the index)
                    Replica.status == ReplicaState.IDLE,  # pragma: no mutate
                    Replica.reap_at <= self.at,  # pragma: no mutate
                    Replica.envs_in_use == 0,  # pragma: no mutate
                )
                .order_by(Replica.reap_at)  # pragma: no mutate - the index's order here
            )
            if self.plans:  # adaptive: judged by their windows below
                base = base.where(Replica.function_id.not_in(list(self.plans)))
        else:
            cutoff = self.at - timedelta(seconds=self.idle_timeout)
            base = (
                select(Replica)
                .where(
                    Replica.status == ReplicaState.IDLE,  # pragma: no mutate - as above
                    Replica.idle_since <= cutoff,  # pragma: no mutate
                    Replica.envs_in_use == 0,  # pragma: no mutate
                )
                .order_by(Replica.idle_since)  # pragma: no mutate - the index's order here
            )
        self._pages(base, "idle")
        if self.idle_timeout is None:
            self.adaptive()

    def adaptive(self) -> None:
        """Idle replicas of adaptive functions that their keep-alive windows let go."""
        at = self.at.replace(tzinfo=UTC).timestamp()
        for fn_id, plan in self.plans.items():
            if self.left <= 0:  # pragma: no mutate - a shortcut: none left, none taken
                return
            cutoff = plan.release_before(at)
            if cutoff is None:
                continue
            since = datetime.fromtimestamp(cutoff, UTC).replace(tzinfo=None)  # the store's UTC
            warm = plan.warm(at)
            note = (
                "; keep-alive: the next call is not due"
                if warm is False
                else f"; keep-alive: over {plan.windows.keep_s:.0f}s"
            )
            self._pages(
                select(Replica)
                .where(
                    Replica.function_id == fn_id,
                    # (not mutated, as in idle(): idle_since is NULL outside Idle and while an
                    # environment is in use; '<' differs only at the very microsecond)
                    Replica.status == ReplicaState.IDLE,  # pragma: no mutate
                    Replica.idle_since <= since,  # pragma: no mutate
                    Replica.envs_in_use == 0,  # pragma: no mutate
                )
                .order_by(Replica.idle_since),  # pragma: no mutate - the index's order here
                "idle",
                note,
            )

    def replacements(self) -> dict[str, int]:
        """Fresh replicas needed before min-protected stale replicas can go."""
        out: dict[str, int] = {}
        for fn in self.stale_kept.values():
            floor = keep_at_least(fn)
            fresh = self._fresh(fn)
            room = fn.max_replicas - self._counted(fn)
            want = min(floor - fresh, room)
            if want > 0:
                out[fn.name] = want
        return out


def keep_at_least(fn: Function) -> int:
    """The replicas the reaper leaves a function: its min, or its autoscaler's target if higher.

    The autoscaler owns an autoscaled function's size (it scales down after its stable
    window, or to zero); reaping idle replicas under its target would only make it scale
    straight back up.
    """
    if fn.autoscale and fn.target is not None:
        return max(fn.min_replicas, fn.target)
    return fn.min_replicas


def check_idle_timeout(value: object) -> float | None:
    """``value`` as a non-negative number of seconds (or None), else :class:`InputError`."""
    return check_seconds(
        value, "idle timeout", lambda v: 0 <= v <= 365 * 86400, "between 0 and one year"
    )


def reap(  # noqa: PLR0913 - keyword-only options with defaults
    db: Database,
    settings: Settings,
    *,
    idle_timeout: float | None = None,
    batch: int | None = None,
    holder: str,
    lease_wait_s: float = 0.0,
    idle_times: redis.Redis | None = None,
) -> ReapReport:
    """Run one reaper pass under the ``reap`` lease; a pass that cannot take it is skipped.

    ``lease_wait_s`` lets a pass someone asked for wait that long for a running pass
    to end instead of being skipped at once (periodic passes do not wait).
    ``idle_times`` is the Redis the functions' idle times are kept in: without it,
    adaptive functions keep their fixed idle timeout.
    """
    idle_timeout = check_idle_timeout(idle_timeout)
    budget = settings.reap_batch if batch is None else batch
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InputError(f"reap batch must be a positive integer, got {budget!r}")
    report = ReapReport(
        holder=holder, idle_timeout=idle_timeout, batch=budget, started_at=iso(now())
    )
    taken, report.held_by = leases.acquire_within(
        db, LEASE, holder, leases.pass_ttl(settings), lease_wait_s
    )
    if not taken:
        report.skipped = True
        log.info("reap pass %s skipped: lease held by %s", holder, report.held_by)
        return report
    try:
        report.claims_expired = claims.expire(db, settings)
        plans = {} if idle_timeout is not None else keep_alive_plans(db, settings, idle_times)
        report.keep_alive = {name: plan.windows.as_dict() for name, (_, plan) in plans.items()}
        _run(
            db,
            settings,
            report,
            _Limits(budget, idle_timeout, {fn_id: plan for fn_id, plan in plans.values()}),
        )
    finally:
        leases.release(db, LEASE, holder)
    return report


def keep_alive_plans(
    db: Database, settings: Settings, client: redis.Redis | None
) -> dict[str, tuple[str, Plan]]:
    """Adaptive functions whose windows decide now: name -> (function id, plan).

    A function whose idle times show no pattern yet is not among them (its fixed idle
    timeout holds), nor is any when Redis does not answer.
    """
    if client is None:
        return {}
    with db.read() as s:
        ids = {
            name: fid
            for name, fid in s.execute(
                select(Function.name, Function.id).where(Function.keep_alive == "adaptive")
            )
        }
    if not ids:
        return {}
    try:
        plans = idletimes.plans(client, settings, ids)
    except redis.RedisError as exc:
        log.warning("reap: could not read idle times, keep-alive falls back to fixed: %s", exc)
        return {}
    return {
        name: (ids[name], plan) for name, plan in plans.items() if plan.windows.keep_s is not None
    }


def _run(db: Database, settings: Settings, report: ReapReport, limits: _Limits) -> None:
    t0 = time.perf_counter()
    with db.transaction() as s:
        lock_functions(s)  # the pass may move counters of any function (workers.locks)
        p = _Pass(s, settings, now(), limits)
        p.stuck()
        p.stale()
        p.idle()
        report.replace = p.replacements()
        report.kept_for_min = dict(p.kept)
        report.more = p.left <= 0
    victims = p.victims
    t1 = time.perf_counter()
    _release_all(db, settings, [v for v in victims if not v.retired])
    t2 = time.perf_counter()
    finish_deletes(
        db, settings, {v.doomed.replica_id: v.error for v in victims if not (v.retired or v.left)}
    )
    t3 = time.perf_counter()
    report.deleted = [v.reaped for v in victims]
    report.timings = {
        "select_s": round(t1 - t0, 6),
        "release_s": round(t2 - t1, 6),
        "finish_s": round(t3 - t2, 6),
        "total_s": round(t3 - t0, 6),
    }
    if victims:
        log.info("reap pass %s: %s", report.holder, report.counts)


def _release_all(db: Database, settings: Settings, victims: list[_Victim]) -> None:
    """Release every victim's VM at once (bounded per node); outcomes on the victims."""
    outcomes = release_all(settings, [v.doomed for v in victims])
    noted: set[str] = set()
    waiting: dict[str, str] = {}
    for v in victims:
        outcome = outcomes[v.doomed.replica_id]
        if outcome is None:  # out of time: the next pass finds it past its deadline
            v.left = True
            v.reaped.outcome = "left"
        elif isinstance(outcome, TransientBackendError):
            node = v.doomed.node
            if node is not None and node.id not in noted:  # one miss per node and pass
                noted.add(node.id)
                note_failure(db, settings, node.id, str(outcome))
            if release_waits(node):  # nothing else would find the VM: the row waits
                v.left = True
                v.reaped.outcome = "waiting"
                v.reaped.error = waiting[v.doomed.replica_id] = f"{outcome}; {WAITS}"
                continue
            _failed(v, f"{outcome}; reconcile will destroy the VM once the node answers")
        elif isinstance(outcome, BackendError):
            _failed(v, str(outcome))
        else:
            _released(v, released=outcome)
    wait_for_node(db, settings, waiting)


def _failed(v: _Victim, error: str) -> None:
    """The victim's VM could not be released: it ends Dead with why."""
    v.error = f"{v.error}; {error}" if v.error else error
    v.reaped.outcome = "failed"
    v.reaped.error = v.error


def _released(v: _Victim, *, released: bool) -> None:
    """The victim's VM was released (or was already gone)."""
    if v.error is not None:  # stuck: VM released, the row still ends Dead
        v.reaped.outcome = "retired"
    else:
        v.reaped.outcome = "deleted" if released else "gone"
    v.reaped.error = v.error
