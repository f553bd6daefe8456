"""Scaling a function to a target: decided once per operation, carried out as spawns and deletes.

``scale`` sets a target, it does not add one: :func:`plan_scale` compares the target with
the replicas that exist or are being created - plus those other open spawn and scale plans
will add but have not placed yet (:func:`unplaced`) - and decides which to add and which
Idle replicas to remove. The plan is stored on the operation the first time, so a
redelivered scale repeats it instead of making a new one; plans of one function are
serialised on its row lock, so two scales (or a scale and a top-up) never plan the same
missing replicas twice. The spawns go the way of every spawn
(:mod:`workers.replicas.spawn`), the deletes the way of every delete
(:mod:`workers.replicas.delete`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.base.errors import InputError
from workers.base.kinds import OpKind
from workers.operations import finish, maybe_finish, open_of
from workers.replicas.checks import check_target
from workers.replicas.lifecycle import mark_deleting
from workers.replicas.plan import SpawnJob, spawn_jobs
from workers.replicas.spawn import lock_op
from workers.store.db import Database
from workers.store.models import OP_FINISHED, Function, Operation, Replica, ReplicaState


@dataclass(frozen=True)
class ScalePlan:
    """What a scale operation does: spawns to add, replicas to delete."""

    function_id: str
    spawns: list[SpawnJob]
    deletes: list[str]
    note: str | None = None


def planned_requests(op: Operation) -> list[str]:
    """The request ids a spawn or scale operation planned to create (none before its plan)."""
    plan = (op.result or {}).get("plan")
    if not isinstance(plan, dict):
        return []
    if op.kind == OpKind.SCALE:
        return list(plan.get("spawns") or [])
    return [job.request_id for job in spawn_jobs(op.id, plan)]


def unplaced(s: Session, function_id: str, *, exclude: str | None = None) -> int:
    """Replicas that open spawn/scale plans of a function will add but have not written yet.

    ``functions.replica_count`` counts rows; a plan's replicas become rows only when
    its fan-out places them. Anything sizing a function against a target adds these.
    """
    ops = s.scalars(
        select(Operation).where(
            Operation.function_id == function_id, open_of(OpKind.SPAWN, OpKind.SCALE)
        )
    ).all()
    missing = 0
    for op in ops:
        if op.id == exclude:
            continue
        wanted = planned_requests(op)
        written = 0
        for i in range(0, len(wanted), 1000):
            chunk = wanted[i : i + 1000]
            written += int(
                s.scalar(
                    select(func.count()).select_from(Replica).where(Replica.request_id.in_(chunk))
                )
                or 0
            )
        missing += max(0, len(wanted) - written)
    return missing


def plan_scale(db: Database, settings: Settings, op_id: str) -> ScalePlan:
    """Decide (once per operation) how to reach the operation's target.

    A finished operation plans nothing.
    """
    with db.transaction() as s:
        op, fn = lock_op(s, op_id)
        stored = (op.result or {}).get("plan")
        op.progress_at = now()  # its task ran (a late one, too)
        if op.status in OP_FINISHED:
            return ScalePlan(op.function_id or "", [], [], None)
        if stored is not None:
            return ScalePlan(
                stored["function_id"],
                [SpawnJob(r) for r in stored["spawns"]],
                stored["deletes"],
                stored.get("note"),
            )
        if fn is None:
            raise InputError("the function of this scale no longer exists")
        target = check_target(fn, op.params.get("target"))
        counted = fn.replica_count + unplaced(s, fn.id, exclude=op.id)
        spawns = [SpawnJob(f"{op.id}.{i}") for i in range(target - counted)]
        deletes: list[str] = []
        note = None
        if target < counted:
            deletes = _mark_surplus(s, settings, fn, op.id, counted - target)
            if len(deletes) < counted - target:
                note = (
                    f"removed {len(deletes)} of {counted - target}: the other replicas are "
                    "serving requests or still starting"
                )
        fn.target = target
        op.total = len(spawns) + len(deletes)
        op.result = {
            "plan": {
                "function_id": fn.id,
                "spawns": [j.request_id for j in spawns],
                "deletes": deletes,
                "note": note,
            },
            "before": counted,
            "target": target,
        }
        if op.total == 0:
            finish(op, failed=0, total=0)
        else:
            maybe_finish(op)
        return ScalePlan(fn.id, spawns, deletes, note)


def _mark_surplus(s: Session, settings: Settings, fn: Function, op_id: str, want: int) -> list[str]:
    """Mark up to ``want`` unclaimed Idle replicas Deleting, old builds and longest idle first."""
    idle = s.scalars(
        select(Replica)
        .where(
            Replica.function_id == fn.id,
            Replica.status == ReplicaState.IDLE,
            Replica.envs_in_use == 0,
        )
        .order_by(
            (Replica.build_version == fn.build_version).asc(),
            Replica.idle_since.asc(),
        )
        .limit(want)
        # OF replicas: the eagerly joined function/node/GPU are outer joins,
        # whose nullable side PostgreSQL refuses to lock.
        .with_for_update(of=Replica, skip_locked=s.get_bind().dialect.name != "sqlite")
    ).all()
    mark_deleting(s, settings, idle, op_id)
    return [replica.id for replica in idle]
