"""Queueing a task by its name: how logic in ``workers`` asks for work without importing ``tasks``.

``tasks`` (the task wrappers, the producer API and the CLI) sits above ``workers``, and
an import never goes up. A worker-side module that needs a replica deleted - reconcile
draining a node, the registry answering DESTROY - sends the task by the name it is
registered under, as a signature: where the task is registered in this process (a
worker, eager mode) that is the task's own ``apply_async``, elsewhere (the registry)
``send_task``; either way Celery routes it by name to its queue
(``config.celery.ROUTES``) exactly as it routes ``delay()``.
"""

from __future__ import annotations

from workers.celery import app

DELETE_REPLICA = "corral.delete_replica"


def delete_replica(replica_id: str) -> None:
    """Queue the delete of one replica (already marked Deleting by the caller)."""
    app.signature(DELETE_REPLICA, args=(replica_id,)).apply_async()
