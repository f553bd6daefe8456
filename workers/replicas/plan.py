"""The plan of a spawn, a delete or a scale: which task messages to send, as plain values.

A replica task works one batch itself and hands the rest of its operation on as
messages. What those messages are is decided here, by plain functions of plain values
(no store, no broker, no clock), so it can be read and tested on its own:

* :func:`fan_out` cuts a spawn's jobs into batches of :data:`SPAWN_BATCH`: the first, to
  work in the task that planned them, and a :class:`SpawnBatch` for each of the others
  (sent *before* the first is worked, so every worker starts at once);
* :func:`follow_ups` turns what a spawn handler left (:class:`~workers.replicas.outcomes.Next`)
  into messages: a :class:`SpawnOne` after a backoff for each lone retry, a
  :class:`SpawnOne` at once for each replica moved or replaced, and a
  :class:`SpawnBatch` per operation for the creates left unsent;
* :func:`delete_batches` cuts a scale's surplus into :class:`DeleteBatch` messages of
  :data:`DELETE_BATCH`; :func:`delete_follow_ups` turns what a delete batch left into a
  :class:`DeleteOne` after a backoff per transport error and a :class:`DeleteBatch` of the
  releases left undone.

Each message names one Celery task and carries exactly that task's arguments
(``tasks/replicas.py`` maps them one to one); the wire format is the task's, unchanged:
a spawn batch's jobs are ``[[request_id, node_id or null], ...]`` (:func:`parse_jobs`
reads them back).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.base.errors import InputError
from workers.replicas.outcomes import Next

# Replicas per batch: rows written in one transaction and VMs asked for at once. Big
# enough that a batch keeps many calls in flight, small enough that a large spawn is
# shared by every worker process.
SPAWN_BATCH = 100
DELETE_BATCH = 100  # replicas a delete batch marks, releases and retires together


@dataclass(frozen=True)
class SpawnJob:
    """One replica a spawn asks for: its request id and, for ``spread``, a node."""

    request_id: str
    node_id: str | None = None


@dataclass(frozen=True)
class SpawnBatch:
    """``corral.spawn_batch(op_id, function_id, jobs)``: create a batch of replicas."""

    op_id: str | None
    function_id: str
    jobs: tuple[SpawnJob, ...]

    def wire_jobs(self) -> list[list[str | None]]:
        """The jobs as the message carries them: ``[[request_id, node_id or null], ...]``."""
        return [[j.request_id, j.node_id] for j in self.jobs]


@dataclass(frozen=True)
class SpawnOne:
    """``corral.spawn_replica(op_id, request_id, function_id)``: create one replica alone.

    ``after_backoff``: sent with the sending task's backoff as countdown, counted as a
    first retry (a create whose transport failed); otherwise at once (moved, replaced).
    """

    op_id: str | None
    request_id: str
    function_id: str
    after_backoff: bool = False


@dataclass(frozen=True)
class DeleteBatch:
    """``corral.delete_batch(op_id, replica_ids)``: delete a batch of replicas."""

    op_id: str | None
    replica_ids: tuple[str, ...]


@dataclass(frozen=True)
class DeleteOne:
    """``corral.delete_replica(replica_id, op_id)``, after a backoff: one release retried alone."""

    replica_id: str
    op_id: str | None


#: A task message a replica handler asks to be sent.
Message = SpawnBatch | SpawnOne | DeleteBatch | DeleteOne


def parse_jobs(raw: object) -> list[SpawnJob]:
    """``[[request_id, node_id or null], ...]`` from a task message, or :class:`InputError`."""
    if not isinstance(raw, list) or not raw:
        raise InputError(f"jobs must be a non-empty list, got {type(raw).__name__}")
    jobs = []
    for item in raw:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not (item[1] is None or isinstance(item[1], str))
        ):
            raise InputError(f"malformed job {item!r}: expected [request_id, node_id or null]")
        jobs.append(SpawnJob(item[0], item[1]))
    return jobs


def spawn_jobs(op_id: str, plan: dict[str, Any]) -> list[SpawnJob]:
    """The jobs of a stored spawn plan: ``count`` replicas on each planned node."""
    nodes: list[str | None] = plan.get("nodes") or [None]
    return [
        SpawnJob(f"{op_id}.{i}.{n}", node)
        for n, node in enumerate(nodes)
        for i in range(int(plan.get("count", 0)))
    ]


def split(jobs: Sequence[SpawnJob]) -> tuple[list[SpawnJob], list[list[SpawnJob]]]:
    """A spawn's jobs as batches of :data:`SPAWN_BATCH`: the first, to work here, and the rest."""
    batches = [list(jobs[i : i + SPAWN_BATCH]) for i in range(0, len(jobs), SPAWN_BATCH)]
    return (batches[0], batches[1:]) if batches else ([], [])


def fan_out(
    op_id: str | None, function_id: str, jobs: Sequence[SpawnJob]
) -> tuple[list[SpawnJob], list[SpawnBatch]]:
    """A spawn's first batch, to work here, and a message for each other batch, to send first."""
    first, rest = split(jobs)
    return first, [SpawnBatch(op_id, function_id, tuple(batch)) for batch in rest]


def follow_ups(function_id: str, nxt: Next) -> list[Message]:
    """What a spawn handler left, as messages: lone retries, moved replicas, the unsent rest."""
    rest: dict[str | None, list[SpawnJob]] = defaultdict(list)
    for r in nxt.rest:
        rest[r.operation_id].append(SpawnJob(r.request_id))
    return [
        *(
            SpawnOne(r.operation_id, r.request_id, function_id, after_backoff=True)
            for r in nxt.retry
        ),
        *(SpawnOne(r.operation_id, r.request_id, function_id) for r in nxt.again),
        *(SpawnBatch(op, function_id, tuple(jobs)) for op, jobs in rest.items()),
    ]


def delete_batches(op_id: str | None, replica_ids: Sequence[str]) -> list[DeleteBatch]:
    """Replicas to delete as messages of at most :data:`DELETE_BATCH` each, in order."""
    return [
        DeleteBatch(op_id, tuple(replica_ids[i : i + DELETE_BATCH]))
        for i in range(0, len(replica_ids), DELETE_BATCH)
    ]


def delete_follow_ups(
    op_id: str | None, retry: Sequence[str], rest: Sequence[str]
) -> list[Message]:
    """What a delete batch left, as messages: each transport error alone, the undone rest."""
    return [
        *(DeleteOne(replica_id, op_id) for replica_id in retry),
        *([DeleteBatch(op_id, tuple(rest))] if rest else []),
    ]
