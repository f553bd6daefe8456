"""One autoscaler pass: read the store and the demand, decide, ask for scale operations.

Beat sends ``corral.autoscale`` every ``CORRAL_AUTOSCALE_INTERVAL_S`` (2 s); the
task calls :func:`run_pass`. Only functions deployed with ``--autoscale`` are
looked at: every other function keeps its plain scale / min semantics.

For each of them the pass reads the facts (min, max, environments per replica,
ready replicas, the current target, whether a ``scale`` operation of it is still
open), the summed demand of every gateway (:func:`workers.autoscale.demand.read`) and the
function's window state, runs :func:`workers.autoscale.decision.decide`, stores the new
state, and - when the target moves and no scale of that function is still open -
asks for an ordinary ``scale`` operation (also when the target stands but fewer
replicas exist: the reaper took some, or spawns failed) through the ``scale`` callable
the ``corral.autoscale`` task passes in (:func:`workers.dispatch.submit` of
:func:`workers.replicas.requests.request_scale`), so every change shows in ``corral ops``
and Flower.

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
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import func, select

from config.settings import Settings
from workers.autoscale import decision as decision_mod
from workers.autoscale import demand as demand_mod
from workers.errors import CorralError
from workers.operations import open_of
from workers.store.db import Database
from workers.store.models import Function, Operation, Replica, ReplicaState

log = logging.getLogger(__name__)

STATE_PREFIX = "corral:autoscale:"
LOCK_KEY = STATE_PREFIX + "lock"
# function name -> its last decision as JSON ({"desired": n, "panicking": b}), for metrics
DECISIONS_KEY = STATE_PREFIX + "decisions"
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end")
READY_STATES = (ReplicaState.IDLE, ReplicaState.ALLOCATED)

ScaleFn = Callable[[str, int], str]


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
        return {"target": self.target, **self.decision.as_dict(), "action": self.action,
                "op_id": self.op_id, "error": self.error}


@dataclass
class PassReport:
    """What one pass did."""

    skipped: bool = False
    functions: dict[str, Outcome] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the task's result."""
        return {"skipped": self.skipped,
                "functions": {k: v.as_dict() for k, v in self.functions.items()}}


def state_key(function_id: str) -> str:
    """The Redis key of a function's window state."""
    return STATE_PREFIX + function_id


def load_facts(db: Database) -> dict[str, tuple[str, decision_mod.Facts, bool]]:
    """Every autoscaled function: id -> (name, facts, a scale of it is open)."""
    with db.read() as s:
        fns = list(s.scalars(select(Function).where(Function.autoscale.is_(True))))
        if not fns:
            return {}
        ids = [f.id for f in fns]
        ready: dict[str, int] = {fid: n for fid, n in s.execute(
            select(Replica.function_id, func.count())
            .where(Replica.function_id.in_(ids), Replica.status.in_(READY_STATES))
            .group_by(Replica.function_id)
        )}
        open_scales = set(s.scalars(
            select(Operation.function_id).where(
                open_of("scale"), Operation.function_id.in_(ids))
        ))
        return {
            f.id: (
                f.name,
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
                f.id in open_scales,
            )
            for f in fns
        }


def run_pass(
    db: Database, settings: Settings, client: redis.Redis, scale: ScaleFn,
    *, now: float | None = None,
) -> PassReport:
    """One pass over the autoscaled functions (skipped if another pass holds the lock)."""
    token = uuid.uuid4().hex
    lock_ms = int(max(settings.autoscale_interval_s * 5, settings.task_time_limit_s) * 1000)
    if not client.set(LOCK_KEY, token, nx=True, px=lock_ms):
        return PassReport(skipped=True)
    try:
        return _pass(db, settings, client, scale, time.time() if now is None else now)
    finally:
        client.eval(_RELEASE, 1, LOCK_KEY, token)


def _pass(db: Database, settings: Settings, client: redis.Redis, scale: ScaleFn,
          now: float) -> PassReport:
    report = PassReport()
    facts = load_facts(db)
    if not facts:
        return report
    policy = decision_mod.Policy.from_settings(settings)
    names = {fid: name for fid, (name, _, _) in facts.items()}
    demands = demand_mod.read(client, names.values(), now=now,
                              stale_after_s=settings.autoscale_demand_stale_s)
    ids = list(facts)
    windows = client.mget([state_key(fid) for fid in ids])
    keep_ms = int(policy.stable_window_s * 2 * 1000) + 60_000
    pipe = client.pipeline(transaction=False)
    for fid, raw in zip(ids, windows, strict=True):
        name, fn_facts, scale_open = facts[fid]
        seen = demands.get(name)
        obs = decision_mod.Observation(
            at=now,
            demand=seen.concurrency if seen is not None else 0.0,
            last_request_at=seen.last_request_at if seen is not None else None,
        )
        window = decision_mod.Window.from_json(raw)
        decision, window = decision_mod.decide(policy, fn_facts, window, obs)
        pipe.set(state_key(fid), window.to_json(), px=keep_ms)
        outcome = Outcome(name, fn_facts.target, decision, "kept")
        if decision_mod.should_scale(decision, fn_facts, scale_open):
            try:
                outcome.op_id = scale(name, decision.desired)
                outcome.action = "scaled"
                log.info("autoscale %s: %d -> %d (%s)", name, fn_facts.target,
                         decision.desired, decision.as_dict())
            except CorralError as exc:  # min / max changed under us, broker down...
                outcome.action, outcome.error = "error", str(exc)
                log.warning("autoscale %s: could not scale to %d: %s", name,
                            decision.desired, exc)
        elif scale_open:
            outcome.action = "waiting"
        report.functions[name] = outcome
        pipe.hset(DECISIONS_KEY, name, json.dumps(
            {"desired": decision.desired, "panicking": decision.panicking}))
    pipe.expire(DECISIONS_KEY, keep_ms // 1000)
    pipe.execute()
    return report

