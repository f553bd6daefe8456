"""Replicas: spawning, deleting, scaling and lending them, and their state machine.

The replica tasks (``tasks/replicas.py``) call this package's face and nothing else of
it: one handler per task (:mod:`workers.replicas.handlers`), given a
:class:`Context` (the store, the settings, the task's time, a :class:`Port` to send
messages and retry), and the messages the plan asks to send
(:mod:`workers.replicas.plan`). The handlers are imported on first use, so a process
that only reads replicas (the CLI's listings, the gateway's claims) never loads the
spawn path's broker and Redis clients.

**A spawn, from ``corral scale hello 3`` to the agent's CreateReplica**, module by module:

1. ``corral/cli`` -> ``corral/api.py::scale`` -> :mod:`workers.replicas.requests`
   (``request_scale``: the operation row, its target checked by
   :mod:`workers.replicas.checks`) -> :mod:`workers.dispatch` (written, then its first
   task queued) -> ``tasks/queues.py`` (the ``corral.scale`` message);
2. ``tasks/replicas.py::scale`` -> :func:`scale_operation`
   (:mod:`workers.replicas.handlers`): the task's one call;
3. :mod:`workers.replicas.scale` (``plan_scale``: how many to add and which Idle
   replicas to delete, decided once and stored on the operation; a ``corral spawn``
   takes :mod:`workers.replicas.spawn`'s ``plan_spawn`` instead);
4. :mod:`workers.replicas.plan` (``delete_batches``, ``fan_out``: the messages to send -
   other batches go out first as ``corral.spawn_batch``, the first is worked here);
5. :mod:`workers.replicas.spawn` (``run_batch`` -> ``place``: the Creating rows written
   in one transaction, each on a node slot reserved by ``workers/fleet/placement.py``,
   owned by this handler);
6. :mod:`workers.replicas.creates` (``create``: rows taken and sent a round at a time,
   every answer sorted), with :mod:`workers.replicas.owners` (who may send a row's
   create; ``mark_sent_soon`` marks it sent as its call takes its node's slot);
7. :mod:`workers.replicas.calls` (the batch's calls inside the task's time) ->
   ``workers/backends/inflight.py`` (bounded per node and per process, on the event loop)
   -> :mod:`workers.replicas.sends` (each call admitted - marked sent - then made) ->
   ``workers/backends/__init__.py::send_create`` -> the node's backend
   (``workers/backends/fcdaemon.py``: the agent's **CreateReplica**);
8. the answers: :mod:`workers.replicas.arrivals` records each VM (Idle, or Starting) via
   :mod:`workers.replicas.lifecycle` (with :mod:`workers.replicas.landed` while the store
   refuses); :mod:`workers.replicas.moves` and :mod:`workers.replicas.maybes` handle the
   failed and the unknown; what the batch came to is a :class:`~workers.replicas.outcomes.Next`;
9. back in the handler, :func:`workers.replicas.plan.follow_ups` turns that into
   messages (lone retries as ``corral.spawn_replica``, the unsent rest as
   ``corral.spawn_batch``), which the task sends.

A delete goes :func:`delete_batch` -> :mod:`workers.replicas.delete` ->
:mod:`workers.replicas.calls` -> the node's release, and hands its retries and rest on
through :func:`workers.replicas.plan.delete_follow_ups`.

The rest of the package serves the data path and the passes: claims and cold starts
(:mod:`~workers.replicas.claims`, :mod:`~workers.replicas.coldstarts`,
:mod:`~workers.replicas.notices`), guests' reports (:mod:`~workers.replicas.reports`),
lost nodes (:mod:`~workers.replicas.lost`) and views (:mod:`~workers.replicas.views`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from config import lazy

if TYPE_CHECKING:
    from workers.replicas.handlers import (
        Context,
        Port,
        delete_batch,
        delete_replica,
        release_orphan,
        scale_operation,
        spawn_batch,
        spawn_operation,
        spawn_replica,
    )
    from workers.replicas.plan import DeleteBatch, DeleteOne, Message, SpawnBatch, SpawnOne

# The face: each name, and the module it is imported from on first use.
_FACE = {
    **lazy.names_in(
        "workers.replicas.handlers",
        "Context",
        "Port",
        "spawn_operation",
        "spawn_batch",
        "spawn_replica",
        "delete_batch",
        "delete_replica",
        "release_orphan",
        "scale_operation",
    ),
    **lazy.names_in(
        "workers.replicas.plan", "Message", "SpawnBatch", "SpawnOne", "DeleteBatch", "DeleteOne"
    ),
}

__all__ = [
    "Context",
    "DeleteBatch",
    "DeleteOne",
    "Message",
    "Port",
    "SpawnBatch",
    "SpawnOne",
    "delete_batch",
    "delete_replica",
    "release_orphan",
    "scale_operation",
    "spawn_batch",
    "spawn_operation",
    "spawn_replica",
]


if not TYPE_CHECKING:  # mypy sees the imports above; the face is typed, not Any
    __getattr__ = lazy.module_getattr(__name__, _FACE)
