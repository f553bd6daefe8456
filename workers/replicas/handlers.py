"""What each replica task does, as one call: work its part, send the rest through a port.

A replica task (``tasks/replicas.py``) makes one call here with a :class:`Context` - the
store, the settings, its time :class:`~workers.replicas.owners.Budget`, and a
:class:`Port` to the running task - and returns what the call returns (the task's
result). Each handler works its own part with the logic of its job
(:mod:`~workers.replicas.spawn`, :mod:`~workers.replicas.delete`,
:mod:`~workers.replicas.scale`) and asks the port to send the messages the plan
(:mod:`workers.replicas.plan`) makes of what is left: a spawn's other batches before
its first is worked, then its follow-ups; a delete's retries and rest. The port is also
how a handler retries its own task after a backoff (Celery's retry, raised through it)
and learns how many attempts were made once the retries are spent.

Nothing here sends a task itself or knows Celery: the port's implementation lives with
the tasks, which map each :data:`~workers.replicas.plan.Message` to its task one to one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from config.settings import Settings
from workers.base.errors import TransientBackendError
from workers.observability import stages
from workers.replicas import delete as deleting
from workers.replicas import plan
from workers.replicas import scale as scaling
from workers.replicas import spawn as spawning
from workers.replicas.outcomes import Next
from workers.replicas.owners import Budget
from workers.store.db import Database


class Port(Protocol):
    """What a handler asks of the task that runs it."""

    def send(self, messages: Sequence[plan.Message]) -> None:
        """Queue these messages, in order (each to its task's queue)."""

    def retry(self, what: str, error: Exception) -> int:
        """Run the task again after a backoff (raises) while retries remain; else attempts made."""


@dataclass(frozen=True)
class Context:
    """A handler's surroundings: the store, the settings, the task's time, its port."""

    db: Database
    settings: Settings
    budget: Budget
    port: Port


def spawn_operation(ctx: Context, op_id: str) -> dict[str, Any]:
    """Spawn an operation's replicas: the other batches sent, the first worked here."""
    function_id, jobs = spawning.plan_spawn(ctx.db, op_id)
    _planned()
    first = _fan_out(ctx, op_id, function_id, jobs)
    return {"op_id": op_id, "replicas": len(jobs), "states": first.tally()}


def spawn_batch(ctx: Context, op_id: str, function_id: str, jobs: list[Any]) -> dict[str, Any]:
    """Spawn one batch of a message's jobs; what it left is sent on."""
    parsed = plan.parse_jobs(jobs)
    nxt = spawning.run_batch(ctx.db, ctx.settings, op_id, function_id, parsed, ctx.budget)
    ctx.port.send(plan.follow_ups(function_id, nxt))
    return {"op_id": op_id, "replicas": len(parsed), "states": nxt.tally()}


def spawn_replica(
    ctx: Context, op_id: str | None, request_id: str, function_id: str, node_id: str | None
) -> dict[str, Any]:
    """Create one replica alone; a transport error retries the task, then gives up on it."""
    nxt = spawning.run_one(
        ctx.db, ctx.settings, op_id, request_id, function_id, node_id, ctx.budget
    )
    mine = nxt.retry_of(request_id)
    if mine is not None:
        attempts = ctx.port.retry(request_id, mine.error)
        error = f"{mine.error} (gave up after {attempts} attempts)"
        nxt = spawning.give_up(
            ctx.db, ctx.settings, request_id, error, ctx.budget, failed_on=mine.node_id
        )
    ctx.port.send(plan.follow_ups(function_id, nxt))
    return {"request_id": request_id, "state": nxt.state(request_id).value}


def delete_batch(ctx: Context, op_id: str | None, replica_ids: list[Any]) -> dict[str, Any]:
    """Delete one batch of replicas; transport errors and the undone rest are sent on."""
    out = deleting.delete_batch(ctx.db, ctx.settings, op_id, replica_ids, ctx.budget)
    ctx.port.send(plan.delete_follow_ups(op_id, out.retry, out.rest))
    return {"op_id": op_id, "deleted": out.done, "retrying": len(out.retry), "left": len(out.rest)}


def delete_replica(ctx: Context, replica_id: str, op_id: str | None) -> dict[str, Any]:
    """Delete one replica; a transport error retries the task, then ends the row with it."""
    try:
        state, error = deleting.delete_one(ctx.db, ctx.settings, replica_id, op_id)
    except TransientBackendError as exc:
        ctx.port.retry(replica_id, exc)
        state, error = deleting.delete_one(ctx.db, ctx.settings, replica_id, op_id, error=exc)
    return {"replica_id": replica_id, "state": state, "error": error}


def release_orphan(ctx: Context, node_id: str, vmid: str) -> dict[str, Any]:
    """Release a VM no replica took; a transport error retries the task, then says so."""
    try:
        state = deleting.release_orphan(ctx.db, ctx.settings, node_id, vmid)
    except TransientBackendError as exc:
        ctx.port.retry(vmid, exc)
        state = f"not released: {exc}"
    return {"node_id": node_id, "vmid": vmid, "state": state}


def scale_operation(ctx: Context, op_id: str) -> dict[str, Any]:
    """Bring a function to its target: surplus deletes sent, the missing spawned."""
    decided = scaling.plan_scale(ctx.db, ctx.settings, op_id)
    _planned()
    ctx.port.send(plan.delete_batches(op_id, decided.deletes))
    _fan_out(ctx, op_id, decided.function_id, decided.spawns)
    return {
        "op_id": op_id,
        "spawn": len(decided.spawns),
        "delete": len(decided.deletes),
        "note": decided.note,
    }


def _planned() -> None:
    """Mark the plan's end on the spawn's timer (:mod:`workers.observability.stages`), if any."""
    timer = stages.current()
    if timer is not None:
        timer.mark_planned()


def _fan_out(ctx: Context, op_id: str, function_id: str, jobs: list[plan.SpawnJob]) -> Next:
    """Send a spawn's other batches, then work its first here; the first's outcome."""
    first, others = plan.fan_out(op_id, function_id, jobs)
    ctx.port.send(others)  # every worker, at once
    if not first:
        return Next()
    nxt = spawning.run_batch(ctx.db, ctx.settings, op_id, function_id, first, ctx.budget)
    ctx.port.send(plan.follow_ups(function_id, nxt))
    return nxt
