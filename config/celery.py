"""Celery configuration built from :class:`config.settings.Settings`.

Queues: one per kind of operation, declared explicitly (``task_create_missing_queues``
is off, so a task routed nowhere is an error, not a silently created queue):

* ``corral.spawn`` - spawn fan-out and batches, lone retries of one replica;
* ``corral.delete`` - replica deletions, in batches and alone;
* ``corral.scale`` - scale planning;
* ``corral.maintenance`` - housekeeping (beat's health, reap, reconcile, autoscaler and
  calls' sweep passes, and an operator's reap or reconcile), CPU hogs;
* ``corral.invocations`` - asynchronous calls and their callbacks. A queue of its own,
  consumed by workers of its own (``corral worker -Q corral.invocations``; ``corral up``
  starts one): a backlog of calls never delays a spawn, a delete or housekeeping.
  :data:`CONTROL_QUEUES` are the others.

The pool: a thread pool, eight tasks at once per worker process by default
(``CORRAL_WORKER_POOL`` / ``CORRAL_WORKER_CONCURRENCY``; ``-P`` / ``-c`` still win). A
batch spends its time waiting on agents, and a process's batches share one event loop
and its bounds (:mod:`workers.backends.inflight`), so one process keeps each node's call
slots full across batches and operations instead of one batch at a time; a prefork
process works one message at a time and caps itself at processes x batch size calls in
flight. ``docs/benchmarks.md`` (``bench.spawn``) has the figures that chose it, and
``docs/reliability.md`` why: run it as ``corral worker`` (:mod:`stack.worker`), whose
supervisor enforces the hard time limit a thread pool cannot enforce on itself.

Reliability, chosen on purpose:

* ``task_acks_late`` - a message is acknowledged after its task ran, so a worker
  killed mid-task does not lose it; this is safe because every task is idempotent
  (rows keyed by request id, deletes of deleted replicas succeed).
* ``task_reject_on_worker_lost`` - when a pool process dies mid-task, the message
  goes back to the queue at once instead of being acknowledged as failed (prefork);
  a worker process that dies leaves its messages unacknowledged: ``corral worker``
  puts them back at once (:mod:`stack.worker`), else they come back after the
  visibility timeout.
* ``task_acks_on_timeout`` off - a prefork child killed at its hard time limit has its
  message given back, not acknowledged, and the kill counted: a message killed three
  times is given up and its operation failed with that reason (:mod:`workers.base.poison`),
  as in a thread pool under ``corral worker``. Acknowledged, a spawn stuck in a lock
  wait stayed ``running`` with no rows until redrive.
* ``worker_prefetch_multiplier = 1`` - a worker holds one unacknowledged message
  per pool slot, so a slow agent does not strand a backlog in one worker.
* soft / hard time limits (60 s / 90 s by default) bound every task, and the Redis
  ``visibility_timeout`` (300 s) is kept above the hard limit: a message is only
  redelivered when its worker is really gone, never while it still runs. corral's
  own sweep (stuck Creating / Deleting rows) covers the rest, so correctness does
  not rest on redelivery alone. kombu looks for such abandoned messages every
  few seconds (``unacked_restore_interval`` / ``unacked_restore_throttle``)
  instead of its default of every 100 s.
* retries with exponential backoff and jitter are done per task, for transport
  errors only (:class:`workers.base.errors.TransientBackendError`); bad input and
  permanent agent answers fail at once.
* ``broker_connection_retry_on_startup`` and unlimited connection retries: a
  worker outlives a broker restart. ``redis://`` brokers use
  :mod:`workers.broker` (installed by ``workers.celery``), kombu's transport with a
  fix that keeps a worker from exiting when the broker vanishes while it waits
  for messages.
* results are not stored (``task_ignore_result``): the outcome of every request
  is its operation record in the database, which ``corral ops`` and
  ``corral.api.wait`` read; producers therefore never subscribe to the result
  backend. The backend (``CORRAL_RESULT_BACKEND``) stays configured for tasks
  that ask for a result explicitly and for tools that expect one.
* worker task events are on (``worker_send_task_events``) so Flower shows every
  operation's tasks from the moment a worker receives them - except beat's
  housekeeping passes (:data:`HOUSEKEEPING`), declared with ``send_events=False``
  (``tasks/maintenance.py``): a health check every 5 s and an autoscaler pass every
  2 s would bury the operations an operator looks for. ``task-sent`` events are off:
  they would double the cost of every publish (a spawn fan-out publishes one message
  per replica). Task messages carry only ids, never secrets.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from kombu.entity import Exchange, Queue

from config.settings import Settings

# Each queue and the tasks routed to it (ROUTES is derived from this).
TASKS_BY_QUEUE: dict[str, tuple[str, ...]] = {
    "corral.spawn": ("corral.spawn", "corral.spawn_batch", "corral.spawn_replica"),
    "corral.delete": ("corral.delete_replica", "corral.delete_batch", "corral.release_orphan"),
    "corral.scale": ("corral.scale",),
    "corral.maintenance": (
        "corral.reap",
        "corral.reconcile",
        "corral.check_health",
        "corral.autoscale",
        "corral.reap_pass",
        "corral.reconcile_pass",
        "corral.hogs",
        "corral.noop",
        "corral.calls_pass",
    ),
    "corral.invocations": ("corral.invoke", "corral.call_callback"),
}
QUEUES = tuple(TASKS_BY_QUEUE)
INVOCATIONS = "corral.invocations"
CONTROL_QUEUES = tuple(q for q in QUEUES if q != INVOCATIONS)  # all but the calls' own

# Beat's periodic passes: they send no task events (Flower lists operations), and an
# operator's reap or reconcile is a task of its own (corral.reap, corral.reconcile).
HOUSEKEEPING = (
    "corral.check_health",
    "corral.autoscale",
    "corral.reap_pass",
    "corral.reconcile_pass",
    "corral.calls_pass",
)

ROUTES: dict[str, dict[str, str]] = {
    task: {"queue": queue} for queue, tasks in TASKS_BY_QUEUE.items() for task in tasks
}


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The periodic work celery beat sends.

    No ``expires``: Celery stamps it from beat's wall clock and the worker checks it
    against its own, so a worker a few seconds ahead dropped every short-interval pass,
    and one 600 s ahead every pass. A pass is leased and idempotent; one that waited in
    the queue behind a later one that ran already is skipped by number, on no clock
    (:mod:`workers.beat_passes`).
    """

    def every(seconds: float, task: str) -> dict[str, Any]:
        return {"task": task, "schedule": timedelta(seconds=seconds)}

    return {
        "reap": every(settings.reap_interval_s, "corral.reap_pass"),
        "reconcile": every(settings.reconcile_interval_s, "corral.reconcile_pass"),
        "check-health": every(settings.health_interval_s, "corral.check_health"),
        "autoscale": every(settings.autoscale_interval_s, "corral.autoscale"),
        "calls": every(settings.calls_sweep_interval_s, "corral.calls_pass"),
    }


def celery_config(settings: Settings) -> dict[str, Any]:
    """Everything ``app.conf`` needs, derived from settings."""
    exchange = Exchange("corral", type="direct")
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.backend_url,
        "task_queues": [Queue(name, exchange, routing_key=name) for name in QUEUES],
        "task_default_queue": "corral.maintenance",
        "task_default_exchange": "corral",
        "task_default_routing_key": "corral.maintenance",
        "task_create_missing_queues": False,
        "task_routes": ROUTES,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_timeout": False,
        "worker_prefetch_multiplier": 1,
        "worker_pool": settings.worker_pool,
        "worker_concurrency": settings.worker_concurrency,
        # Celery's soft limit raises into the task wherever it is: off. The soft limit is a
        # deadline the task checks itself (workers.base.timelimits); the hard one is Celery's
        # in prefork and `corral worker`'s in a thread pool.
        "task_soft_time_limit": None,
        "task_time_limit": settings.task_time_limit_s,
        "broker_transport_options": {
            "visibility_timeout": settings.visibility_timeout_s,
            # kombu sweeps for abandoned messages every interval x throttle seconds
            # (100 s by default); sweep every few seconds so a message whose worker
            # died comes back soon after its visibility timeout.
            "unacked_restore_interval": max(1, min(10, settings.visibility_timeout_s // 5)),
            "unacked_restore_throttle": 1,
            # a publish to a broker that vanished without closing the socket fails in
            # seconds (Redis answers in milliseconds): a running task's publishes must
            # end before its hard limit (workers.broker.within)
            "socket_timeout": 5,
            "socket_connect_timeout": 5,
            # kombu's Redis transport: a BRPOP's timeout (a message ends it at once); a
            # closing channel reads the answer of the one in flight, lest a message it
            # popped be lost, so a warm stop waits up to this long
            "polling_interval": settings.broker_poll_s,
        },
        "result_backend_transport_options": {"retry_policy": {"max_retries": 10}},
        "result_expires": 24 * 3600,
        "task_ignore_result": True,
        # A publish (a producer's request, or a fan-out queueing its children) waits
        # out a broker restart of up to ~20 s instead of failing after ~1 s.
        "task_publish_retry": True,
        "task_publish_retry_policy": {
            "max_retries": 12,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 2,
        },
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_send_task_events": True,
        "task_send_sent_event": False,
        "task_track_started": True,
        "worker_hijack_root_logger": False,
        "task_always_eager": settings.eager,
        "task_eager_propagates": False,
        "task_store_eager_result": False,
        "beat_schedule": beat_schedule(settings),
        "timezone": "UTC",
        "enable_utc": True,
    }
