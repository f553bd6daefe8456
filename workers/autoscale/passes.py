"""One autoscaler pass: read the store and the demand, decide, ask for scale operations.

Beat sends ``corral.autoscale`` every ``CORRAL_AUTOSCALE_INTERVAL_S`` (2 s); the
task calls :func:`run_pass`. It looks at functions deployed with ``--autoscale``
and at those with ``--keep-alive adaptive``: every other function keeps its plain
scale / min semantics.

For each autoscaled function the pass reads the facts (min, max, environments per
replica, ready replicas, the current target, whether a ``scale`` operation of it is
still open), the summed demand of every gateway (:func:`workers.autoscale.demand.read`)
and the function's window state, runs :func:`workers.autoscale.decision.decide`, stores
the new state, and - when the target moves and no scale of that function is still
open - asks for an ordinary ``scale`` operation (also when the target stands but fewer
replicas exist: the reaper took some, or spawns failed) through the ``scale`` callable
the ``corral.autoscale`` task passes in (:func:`workers.dispatch.submit` of
:func:`workers.replicas.requests.request_scale`), so every change shows in ``corral ops``
and Flower.

Adaptive keep-alive
-------------------
For the functions with adaptive keep-alive the pass reads their idle times
(:func:`workers.autoscale.idletimes.plans`) and applies the windows
(:class:`workers.autoscale.keepalive.Plan`): an autoscaled one gets them as the
decision's ``warm`` (one replica while the next call is due, none outside); for any
other, the pass **pre-warms**: when the next call is due and the function has no
replica at all (nor a spawn or scale of it open), it asks for one through the
``spawn`` callable (an ordinary ``spawn`` operation). Letting replicas go is the
reaper's (:mod:`workers.maintenance.reaper`). Every adaptive function's windows are
published for the metrics exporter in ``corral:autoscale:keepalive``.

Where the window state lives, and why
-------------------------------------
Gateways publish only their latest sample, so the history the stable and panic
windows need exists nowhere else: the pass keeps it in Redis (the broker's
server), one JSON value per function at ``corral:autoscale:<function id>``,
written back each pass and expiring after two stable windows without a pass.
Losing it is survivable: the decision treats a missing, expired or malformed
window as *fresh* and starts it in panic mode with the ready replicas as the
floor (never a scale-down on one sample), and a function parked at zero stays
there until demand comes (:mod:`workers.autoscale.decision`).
Beat may restart, and the pass runs on whichever worker takes the task: the
state outlives both. Passes are serialized by a Redis lock
(``corral:autoscale:lock``, ``SET NX PX`` and a compare-and-delete release);
a pass that finds the lock held is skipped, as a reap pass is.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import func, select

from config.settings import Settings
from workers.autoscale import decision as decision_mod
from workers.autoscale import demand as demand_mod
from workers.autoscale import idletimes
from workers.autoscale.keepalive import Plan
from workers.base import clock
from workers.base.errors import CorralError
from workers.base.kinds import OpKind
from workers.operations import open_of
from workers.store.db import Database
from workers.store.models import Function, Operation, Replica, ReplicaState

log = logging.getLogger(__name__)

STATE_PREFIX = "corral:autoscale:"
LOCK_KEY = STATE_PREFIX + "lock"
# function name -> its last decision as JSON ({"desired": n, "panicking": b}), for metrics
DECISIONS_KEY = STATE_PREFIX + "decisions"
# function name -> its keep-alive windows now as JSON (adaptive functions), for metrics
KEEPALIVE_KEY = STATE_PREFIX + "keepalive"
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('del', KEYS[1]) else return 0 end"
)
READY_STATES = (ReplicaState.IDLE, ReplicaState.ALLOCATED)

ScaleFn = Callable[[str, int], str]  # (function, target) -> operation id
SpawnFn = Callable[[str], str]  # function -> the operation id of one more replica
ADAPTIVE = "adaptive"


@dataclass
class Outcome:
    """One function's result in a pass."""

    function: str
    target: int
    decision: decision_mod.Decision
    action: str  # kept | scaled | waiting (a scale is open) | error

    op_id: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the task's result."""
        return {
            "target": self.target,
            **self.decision.as_dict(),
            "action": self.action,
            "op_id": self.op_id,
            "error": self.error,
        }


@dataclass
class PassReport:
    """What one pass did."""

    skipped: bool = False
    functions: dict[str, Outcome] = field(default_factory=dict)  # autoscaled functions
    keep_alive: dict[str, dict[str, Any]] = field(default_factory=dict)  # adaptive: windows
    prewarmed: dict[str, str] = field(default_factory=dict)  # name -> spawn op id (or error)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the task's result."""
        return {
            "skipped": self.skipped,
            "functions": {k: v.as_dict() for k, v in self.functions.items()},
            "keep_alive": self.keep_alive,
            "prewarmed": self.prewarmed,
        }


def state_key(function_id: str) -> str:
    """The Redis key of a function's window state."""
    return STATE_PREFIX + function_id


@dataclass(frozen=True)
class Subject:
    """One function a pass looks at, as the store has it."""

    id: str
    name: str
    autoscale: bool
    adaptive: bool  # keep_alive == "adaptive"
    facts: decision_mod.Facts
    scale_open: bool  # a scale of it is open
    spawn_open: bool  # a spawn of it is open (a cold start, or a pre-warm on its way)


def load_facts(db: Database) -> dict[str, Subject]:
    """Every autoscaled or adaptive function, by id."""
    with db.read() as s:
        fns = list(
            s.scalars(
                select(Function).where(
                    Function.autoscale.is_(True) | (Function.keep_alive == ADAPTIVE)
                )
            )
        )
        if not fns:
            return {}
        ids = [f.id for f in fns]
        ready: dict[str, int] = {
            fid: n
            for fid, n in s.execute(
                select(Replica.function_id, func.count())
                .where(Replica.function_id.in_(ids), Replica.status.in_(READY_STATES))
                .group_by(Replica.function_id)
            )
        }
        open_ops = {
            (fid, kind)
            for fid, kind in s.execute(
                select(Operation.function_id, Operation.kind).where(
                    open_of(OpKind.SCALE, OpKind.SPAWN), Operation.function_id.in_(ids)
                )
            )
        }
        return {
            f.id: Subject(
                f.id,
                f.name,
                f.autoscale,
                f.keep_alive == ADAPTIVE,
                decision_mod.Facts(
                    min_replicas=f.min_replicas,
                    max_replicas=f.max_replicas,
                    exec_envs=f.exec_envs,
                    ready=int(ready.get(f.id, 0)),
                    target=f.target if f.target is not None else f.replica_count,
                    scale_to_zero_after_s=f.scale_to_zero_after_s,
                    counted=f.replica_count,
                    at_zero=f.target == 0 and f.replica_count == 0,
                ),
                (f.id, OpKind.SCALE) in open_ops,
                (f.id, OpKind.SPAWN) in open_ops,
            )
            for f in fns
        }


def run_pass(  # noqa: PLR0913 - what a pass reads, and how it asks (the task's callables)
    db: Database,
    settings: Settings,
    client: redis.Redis,
    scale: ScaleFn,
    spawn: SpawnFn | None = None,
    *,
    now: float | None = None,
) -> PassReport:
    """One pass over the autoscaled and adaptive functions (skipped if another holds the lock).

    ``spawn`` asks for one replica of a function (pre-warming); without it nothing is
    pre-warmed.
    """
    token = uuid.uuid4().hex
    lock_ms = int(max(settings.autoscale_interval_s * 5, settings.task_time_limit_s) * 1000)
    if not client.set(LOCK_KEY, token, nx=True, px=lock_ms):
        return PassReport(skipped=True)
    try:
        return _pass(db, settings, client, scale, spawn, clock.epoch() if now is None else now)
    finally:
        client.eval(_RELEASE, 1, LOCK_KEY, token)


def _pass(  # noqa: PLR0913 - run_pass's
    db: Database,
    settings: Settings,
    client: redis.Redis,
    scale: ScaleFn,
    spawn: SpawnFn | None,
    now: float,
) -> PassReport:
    report = PassReport()
    subjects = load_facts(db)
    if not subjects:
        return report
    plans = _plans(client, settings, [f.name for f in subjects.values() if f.adaptive])
    policy = decision_mod.Policy.from_settings(settings)
    keep_ms = int(policy.stable_window_s * 2 * 1000) + 60_000
    pipe = client.pipeline(transaction=False)
    scaled = [f for f in subjects.values() if f.autoscale]
    if scaled:
        demands = demand_mod.read(
            client,
            [f.name for f in scaled],
            now=now,
            stale_after_s=settings.autoscale_demand_stale_s,
        )
        windows = client.mget([state_key(f.id) for f in scaled])
        for fn, raw in zip(scaled, windows, strict=True):
            plan = plans.get(fn.name)
            outcome, window = _decide(
                policy, fn, raw, demands.get(fn.name), now, None if plan is None else plan.warm(now)
            )
            _apply(outcome, fn, scale)
            report.functions[fn.name] = outcome
            pipe.set(state_key(fn.id), window.to_json(), px=keep_ms)
            pipe.hset(
                DECISIONS_KEY,
                fn.name,
                json.dumps(
                    {"desired": outcome.decision.desired, "panicking": outcome.decision.panicking}
                ),
            )
        pipe.expire(DECISIONS_KEY, keep_ms // 1000)
    for fn in subjects.values():
        plan = plans.get(fn.name)
        if plan is None:
            continue
        warm = plan.warm(now)
        report.keep_alive[fn.name] = {**plan.windows.as_dict(), "warm": warm}
        pipe.hset(KEEPALIVE_KEY, fn.name, json.dumps(report.keep_alive[fn.name]))
        if warm and not fn.autoscale and spawn is not None:
            _prewarm(fn, spawn, report)
    if report.keep_alive:
        pipe.expire(KEEPALIVE_KEY, keep_ms // 1000)
    pipe.execute()
    return report


def _plans(client: redis.Redis, settings: Settings, names: list[str]) -> dict[str, Plan]:
    """The adaptive functions' keep-alive plans (none when Redis cannot say: fixed)."""
    if not names:
        return {}
    try:
        return idletimes.plans(client, settings, names)
    except redis.RedisError as exc:
        log.warning("autoscale: could not read idle times, keep-alive falls back to fixed: %s", exc)
        return {}


def _decide(  # noqa: PLR0913 - an Observation's parts
    policy: decision_mod.Policy,
    fn: Subject,
    raw: bytes | str | None,
    seen: demand_mod.Demand | None,
    now: float,
    warm: bool | None,
) -> tuple[Outcome, decision_mod.Window]:
    """One autoscaled function's decision, and its window for the next pass."""
    obs = decision_mod.Observation(
        at=now,
        demand=seen.concurrency if seen is not None else 0.0,
        last_request_at=seen.last_request_at if seen is not None else None,
        warm=warm,
    )
    decision, window = decision_mod.decide(
        policy, fn.facts, decision_mod.Window.from_json(raw), obs
    )
    return Outcome(fn.name, fn.facts.target, decision, "kept"), window


def _apply(outcome: Outcome, fn: Subject, scale: ScaleFn) -> None:
    """Ask for the scale a decision calls for (or say why not)."""
    decision = outcome.decision
    if decision_mod.should_scale(decision, fn.facts, fn.scale_open):
        try:
            outcome.op_id = scale(fn.name, decision.desired)
            outcome.action = "scaled"
            log.info(
                "autoscale %s: %d -> %d (%s)",
                fn.name,
                fn.facts.target,
                decision.desired,
                decision.as_dict(),
            )
        except CorralError as exc:  # min / max changed under us, broker down...
            outcome.action, outcome.error = "error", str(exc)
            log.warning("autoscale %s: could not scale to %d: %s", fn.name, decision.desired, exc)
    elif fn.scale_open:
        outcome.action = "waiting"


def _prewarm(fn: Subject, spawn: SpawnFn, report: PassReport) -> None:
    """Start one replica of a function whose next call is due and that has none."""
    if (fn.facts.counted or 0) > 0 or fn.scale_open or fn.spawn_open:
        return
    try:
        report.prewarmed[fn.name] = spawn(fn.name)
        log.info("keep-alive %s: pre-warming one replica (%s)", fn.name, report.keep_alive[fn.name])
    except CorralError as exc:  # at its max, broker down...
        report.prewarmed[fn.name] = f"error: {exc}"
        log.warning("keep-alive %s: could not pre-warm: %s", fn.name, exc)
