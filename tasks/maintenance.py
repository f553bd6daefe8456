"""Periodic and operator-triggered maintenance: health checks, reap and reconcile.

Beat sends these on the ``corral.maintenance`` queue; each expires before the next
one is due, so a stopped worker does not come back to a pile of stale passes.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from workers import leases
from workers.celery import CorralTask, app
from workers.fleet import health

log = logging.getLogger(__name__)


@app.task(bind=True, name="corral.check_health")
def check_health(self: CorralTask) -> dict[str, Any]:
    """Probe every node and update its health."""
    holder = leases.holder_name(self.request.id)
    return asdict(health.check_health(self.db, self.settings, holder=holder))


@app.task(bind=True, name="corral.reap")
def reap(
    self: CorralTask, idle_timeout: float | None = None, op_id: str | None = None
) -> dict[str, Any]:
    """One reaper pass (beat sends one every ``CORRAL_REAP_INTERVAL_S``); returns its report.

    Stale replicas kept only for their function's min are replaced: the pass reports how
    many fresh replicas each such function needs, and this task asks for them (a later
    pass then retires the stale ones). Operations that stopped moving get their first
    task sent again (:mod:`workers.maintenance.redrive`).
    """
    from tasks import api
    from workers.errors import CorralError
    from workers.maintenance import reaper

    settings = self.settings
    holder = leases.holder_name(self.request.id)
    if op_id:
        reaper.start(self.db, op_id)
    # An operator's pass waits a little for a periodic one to end instead of failing.
    # Any error fails the operation (CorralTask).
    wait = settings.task_soft_time_limit_s / 4 if op_id else 0.0
    report = reaper.reap(self.db, settings, idle_timeout=idle_timeout, holder=holder,
                         lease_wait_s=wait)
    _count_reaped(settings, report.counts)
    replacements: dict[str, str] = {}
    for name, n in report.replace.items():
        try:
            replacements[name] = api.spawn(name, n, settings=settings)
        except CorralError as exc:
            replacements[name] = f"error: {exc}"
    extra = {"replacements": replacements, "redriven": _redrive(self)}
    if op_id:
        reaper.record(self.db, op_id, report, extra)
    return {**report.as_dict(), **extra}


def _count_reaped(settings: Any, counts: dict[str, int]) -> None:
    """Add the pass's deletions to the shared per-reason totals (``corral_reaped_total``)."""
    from workers.metrics import count_reaped
    from workers.redis_client import redis_client

    client = redis_client(settings.broker_url)
    if client is None or not any(counts.values()):
        return
    try:
        count_reaped(client, counts)
    except Exception as exc:  # a metric is not worth failing the pass over
        log.warning("could not count reaped replicas: %s", exc)


def _redrive(task: CorralTask) -> dict[str, str]:
    """Re-send the first task of every operation that stopped moving; op id -> outcome."""
    from tasks import api
    from workers.maintenance import redrive

    sent = {op_id: f"failed: {reason}"
            for op_id, reason in redrive.give_up(task.db, task.settings, api.RESENDABLE).items()}
    for due in redrive.due(task.db, task.settings, api.RESENDABLE):
        try:
            api.resend(due)
        except Exception as exc:  # the broker is down again: the next pass retries
            sent[due.op_id] = f"error: {type(exc).__name__}: {exc}"
        else:
            sent[due.op_id] = f"re-sent {due.kind} ({due.attempt} of {redrive.REDRIVE_MAX})"
    return sent


@app.task(bind=True, name="corral.autoscale")
def autoscale(self: CorralTask) -> dict[str, Any]:
    """One autoscaler pass (beat sends one every ``CORRAL_AUTOSCALE_INTERVAL_S``)."""
    from tasks import api
    from workers.autoscale.passes import run_pass
    from workers.redis_client import redis_client

    settings = self.settings
    client = redis_client(settings.broker_url)
    if client is None:
        return {"skipped": True, "reason": "the autoscaler needs a Redis broker"}

    def scale(name: str, target: int) -> str:
        return api.scale(name, target, settings=settings)

    return run_pass(self.db, settings, client, scale).as_dict()


@app.task(bind=True, name="corral.reconcile")
def reconcile(self: CorralTask, op_id: str | None = None) -> dict[str, Any]:
    """One reconcile pass: orphans destroyed, vanished VMs' rows Dead, functions back to min."""
    from tasks import api
    from workers.errors import CorralError
    from workers.maintenance import reconcile as reconciler
    from workers.operations import record_result

    holder = leases.holder_name(self.request.id)
    report = reconciler.reconcile(self.db, self.settings, holder=holder)
    spawned: dict[str, str] = {}
    for name, n in report.top_up.items():
        try:
            spawned[name] = api.spawn(name, n, settings=self.settings)
        except CorralError as exc:
            spawned[name] = f"error: {exc}"
    result = {**report.as_dict(), "spawned": spawned}
    if op_id:
        record_result(self.db, op_id, result)
    return result
