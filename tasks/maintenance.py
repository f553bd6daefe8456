"""Housekeeping: health checks, reap, reconcile and the autoscaler, periodic or asked for.

Beat sends the periodic passes (``config.celery.HOUSEKEEPING``) on the
``corral.maintenance`` queue. They carry no expiry (judged by a worker's clock against
beat's, it dropped passes whenever the two disagreed): a pass that waited behind a later
one that ran is skipped by number instead (:mod:`workers.beat_passes`), so a stopped
worker does not come back to a pile of stale passes to run. They are declared with
``send_events=False``: a worker sends no task events for them, so Flower lists the
operations' tasks instead of a health check every 5 s and an autoscaler pass every
2 s. What a pass did stays visible: its log lines (the worker logs every task it
receives and how it ended), the metrics, and, when it changed something, an operation
already over (:func:`workers.operations.record_pass`: ``corral ops``). The spawns and
scales a pass asks for are operations like any producer's
(:func:`workers.dispatch.submit`), with their tasks in Flower.

An operator's ``corral reap`` / ``corral reconcile`` is an operation whose first task
is ``corral.reap`` / ``corral.reconcile``: the same pass, with task events, its report
stored on the operation.

The passes ask for every kind of work - spawns, scales, deletes, and the first task of
any operation that stopped moving, a reap's or a reconcile's included - so this module,
the task module above the others, is where the queue of every operation's first task
is put together (:func:`first_task`, :data:`QUEUE`: :mod:`tasks.queues`), and handed to
the logic that asks for work.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from functools import partial
from typing import Any

from config.settings import Settings
from tasks import hogs as hog_tasks
from tasks import replicas as replica_tasks
from tasks.queues import Call, CeleryQueue, Tasks
from workers import dispatch, leases
from workers.autoscale.passes import run_pass
from workers.base.errors import CorralError
from workers.base.kinds import OpKind
from workers.base.redis_client import redis_client
from workers.celery import CorralTask, app
from workers.dispatch import Work
from workers.fleet import health
from workers.maintenance import reap_report, reaper, redrive
from workers.maintenance import reconcile as reconciler
from workers.observability.exporter import count_reaped
from workers.operations import record_pass
from workers.replicas.lost import mark_lost
from workers.replicas.requests import request_scale, request_spawn
from workers.store.db import Database

log = logging.getLogger(__name__)


@app.task(bind=True, name="corral.check_health", send_events=False)
def check_health(self: CorralTask) -> dict[str, Any]:
    """Probe every node and update its health (beat, every ``CORRAL_HEALTH_INTERVAL_S``)."""
    holder = leases.holder_name(self.request.id)
    report = health.check_health(self.db, self.settings, holder=holder)
    lost = 0 if report.skipped else mark_lost(self.db, self.settings)
    result = {**asdict(report), "replicas_lost": lost}
    if report.changed or lost:
        result["op_id"] = record_pass(self.db, OpKind.HEALTH, dict(result))
    return result


@app.task(bind=True, name="corral.reap")
def reap(
    self: CorralTask, idle_timeout: float | None = None, op_id: str | None = None
) -> dict[str, Any]:
    """An operator's reaper pass (the first task of a reap operation); returns its report."""
    return _reap(self, idle_timeout, op_id)


@app.task(bind=True, name="corral.reap_pass", send_events=False)
def reap_pass(self: CorralTask) -> dict[str, Any]:
    """Beat's reaper pass (every ``CORRAL_REAP_INTERVAL_S``); returns its report."""
    return _reap(self, None, None)


def _reap(task: CorralTask, idle_timeout: float | None, op_id: str | None) -> dict[str, Any]:
    """One reaper pass, recorded on ``op_id`` or, if it changed anything, as a pass.

    Stale replicas kept only for their function's min are replaced: the pass reports how
    many fresh replicas each such function needs, and this task asks for them (a later
    pass then retires the stale ones). Operations that stopped moving get their first
    task sent again (:mod:`workers.maintenance.redrive`).
    """
    settings = task.settings
    holder = leases.holder_name(task.request.id)
    if op_id:
        reap_report.start(task.db, op_id)
    # An operator's pass waits a little for a periodic one to end instead of failing.
    # Any error fails the operation (CorralTask).
    wait = settings.task_soft_time_limit_s / 4 if op_id else 0.0
    report = reaper.reap(
        task.db,
        settings,
        idle_timeout=idle_timeout,
        holder=holder,
        lease_wait_s=wait,
        idle_times=redis_client(settings.broker_url),
    )
    _count_reaped(settings, report.counts)
    extra: dict[str, Any] = {
        "replacements": _spawn_each(task.db, report.replace),
        "redriven": redrive.resend_due(task.db, settings, QUEUE),
    }
    if op_id:
        reap_report.record(task.db, op_id, report, extra)
    elif report.changed or extra["redriven"]:
        extra["op_id"] = record_pass(
            task.db,
            OpKind.REAP,
            reap_report.outcome(report, extra),
            total=len(report.deleted),
            failed=report.failed,
        )
    return {**report.as_dict(), **extra}


def _spawn_each(db: Database, wanted: dict[str, int]) -> dict[str, str]:
    """Ask for ``n`` more replicas of each function; name -> the operation id (or the error)."""
    asked: dict[str, str] = {}
    for name, n in wanted.items():
        try:
            asked[name] = dispatch.submit(db, QUEUE, partial(request_spawn, function=name, count=n))
        except CorralError as exc:
            asked[name] = f"error: {exc}"
    return asked


def _count_reaped(settings: Settings, counts: dict[str, int]) -> None:
    """Add the pass's deletions to the shared per-reason totals (``corral_reaped_total``)."""
    client = redis_client(settings.broker_url)
    if client is None or not any(counts.values()):
        return
    try:
        count_reaped(client, counts)
    except Exception as exc:  # a metric is not worth failing the pass over
        log.warning("could not count reaped replicas: %s", exc)


@app.task(bind=True, name="corral.autoscale", send_events=False)
def autoscale(self: CorralTask) -> dict[str, Any]:
    """One autoscaler pass (beat sends one every ``CORRAL_AUTOSCALE_INTERVAL_S``).

    Its scales are ``scale`` operations, its pre-warms (adaptive keep-alive) ``spawn``
    operations of one replica.
    """
    settings = self.settings
    client = redis_client(settings.broker_url)
    if client is None:
        return {"skipped": True, "reason": "the autoscaler needs a Redis broker"}
    db = self.db

    def scale(name: str, target: int) -> str:
        return dispatch.submit(db, QUEUE, partial(request_scale, function=name, target=target))

    def prewarm(name: str) -> str:
        return dispatch.submit(db, QUEUE, partial(request_spawn, function=name, count=1))

    return run_pass(db, settings, client, scale, prewarm).as_dict()


@app.task(bind=True, name="corral.reconcile")
def reconcile(self: CorralTask, op_id: str | None = None) -> dict[str, Any]:
    """An operator's reconcile pass (the first task of a reconcile operation)."""
    return _reconcile(self, op_id)


@app.task(bind=True, name="corral.reconcile_pass", send_events=False)
def reconcile_pass(self: CorralTask) -> dict[str, Any]:
    """Beat's reconcile pass (every ``CORRAL_RECONCILE_INTERVAL_S``)."""
    return _reconcile(self, None)


def _reconcile(task: CorralTask, op_id: str | None) -> dict[str, Any]:
    """One reconcile pass: orphans destroyed, vanished VMs' rows Dead, functions back to min.

    An operator's pass waits a little for a periodic one to end; skipped, it says so.
    """
    settings = task.settings
    report = reconciler.reconcile(
        task.db,
        settings,
        holder=leases.holder_name(task.request.id),
        queue=QUEUE,
        budget=task.budget,
        lease_wait_s=settings.task_soft_time_limit_s / 4 if op_id else 0.0,
    )
    result: dict[str, Any] = {**report.as_dict(), "spawned": _spawn_each(task.db, report.top_up)}
    if op_id:
        reconciler.record(task.db, op_id, report, result)
    elif report.changed:
        result["op_id"] = record_pass(task.db, OpKind.RECONCILE, dict(result))
    return result


def first_task(work: Work) -> Call:
    """The task that carries out an operation of ``work.kind``, called with its params."""
    op_id, params = work.op_id, work.params
    match work.kind:
        case OpKind.SPAWN:
            return Call(replica_tasks.spawn, (op_id,))
        case OpKind.SCALE:
            return Call(replica_tasks.scale, (op_id,))
        case OpKind.DELETE:
            return Call(replica_tasks.delete_replica, (params["replica"], op_id))
        case OpKind.HOGS:
            kwargs = {k: params[k] for k in ("action", "n", "node")}
            return Call(hog_tasks.hogs, kwargs={**kwargs, "op_id": op_id})
        case OpKind.REAP:
            return Call(reap, kwargs={"idle_timeout": params.get("idle_timeout"), "op_id": op_id})
        case OpKind.RECONCILE:
            return Call(reconcile, kwargs={"op_id": op_id})
    raise ValueError(f"no task carries out operations of kind {str(work.kind)!r}")


#: The queue of every operation's first task, a replica's delete and an orphan's release:
#: what the producer API, the CLI's services and these passes ask for work through.
QUEUE = CeleryQueue(
    Tasks(first_task, delete=replica_tasks.delete_replica, release=replica_tasks.release_orphan)
)
