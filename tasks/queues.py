"""The task queues: :class:`workers.dispatch.TaskQueue` over Celery, and carried out here.

The logic asks a :class:`~workers.dispatch.TaskQueue` for work (:mod:`workers.dispatch`);
the implementations are here, beside the tasks, and hold the task objects themselves
(:class:`Tasks`: each operation kind's first task, the delete, the release), so nothing
looks a task up by its name. :data:`tasks.maintenance.QUEUE` is the one every process
uses, built from the task modules.

* :class:`CeleryQueue` sends a message: the task's own ``apply_async``, routed by name to
  its queue (``config.celery.ROUTES``) as ``delay()`` is; a first task's message says when
  it was sent (:data:`workers.stages.SENT_HEADER`, its ``queue`` stage). In eager mode
  (``CORRAL_EAGER``, tests) Celery runs it at once, in the caller's thread. It has nowhere
  to run a task here: :meth:`~CeleryQueue.run_here` sends it.
* :class:`InProcessQueue` carries each task out in the caller's thread (:func:`carry_out`):
  as a worker runs a message - Celery's tracer, its signals (a task span), its logs -
  but declared *inline* (:func:`workers.celery.inline`: no hard limit, its deadline the
  soft limit from now). What the task queues in turn (a spawn's other batches, a retry
  after its backoff) goes through Celery as usual: a retry is never run here at once.
* :class:`HereFirst` is the gateway's: a cold start's spawn is carried out on one of
  :data:`HERE_THREADS` threads of this process (the broker hop saved), or sent when they
  are all busy; everything else is sent. Nothing else changes: the operation was written
  first, so a process that dies mid-task leaves what a killed worker leaves (an open
  operation that redrive sends again, rows whose owner's lease lapses).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from celery import Signature, states
from celery.app.trace import build_tracer

from config.settings import get_settings
from workers import stages, timelimits
from workers.backends import inflight
from workers.celery import CorralTask, inline
from workers.dispatch import Work

log = logging.getLogger(__name__)

HERE_THREADS = 4  # first tasks the gateway carries out itself at once; more are sent


@dataclass(frozen=True)
class Call:
    """One task and the arguments it is called with."""

    task: CorralTask
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def signature(self) -> Signature:
        """The call as an immutable Celery signature (its message)."""
        return self.task.si(*self.args, **self.kwargs)


@dataclass(frozen=True)
class Tasks:
    """The tasks a queue runs: each operation kind's first task, a replica's delete, a release."""

    first: Callable[[Work], Call]  # ValueError for a kind no task carries out
    delete: CorralTask  # (replica_id)
    release: CorralTask  # (node_id, vmid)


class CeleryQueue:
    """Tasks sent as Celery messages, each to its queue."""

    def __init__(self, tasks: Tasks) -> None:
        self.tasks = tasks

    def send(self, work: Work) -> None:
        """Send the operation's first task, saying when it was sent."""
        self.tasks.first(work).signature().apply_async(headers=stages.sent_header())

    def run_here(self, work: Work) -> None:
        """Send it: a Celery queue has nowhere here to run a task."""
        self.send(work)

    def delete_replica(self, replica_id: str) -> None:
        """Send the delete of one replica."""
        self.tasks.delete.si(replica_id).apply_async()

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Send the release of an orphan VM."""
        self.tasks.release.si(node_id, vmid).apply_async()


class InProcessQueue:
    """Tasks carried out in the caller's thread, inline (tests; the gateway's threads)."""

    def __init__(self, tasks: Tasks) -> None:
        self.tasks = tasks

    def send(self, work: Work) -> None:
        """Carry out the operation's first task here."""
        carry_out(self.tasks.first(work), headers=stages.sent_header())

    def run_here(self, work: Work) -> None:
        """Carry out the operation's first task here."""
        self.send(work)

    def delete_replica(self, replica_id: str) -> None:
        """Delete one replica here."""
        carry_out(Call(self.tasks.delete, (replica_id,)))

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Release an orphan VM here."""
        carry_out(Call(self.tasks.release, (node_id, vmid)))


def carry_out(call: Call, headers: Mapping[str, Any] | None = None) -> Any:
    """Run a task in this thread as a worker runs its message, inline; what it returned.

    Its deadline is the soft limit from now, and nothing enforces a hard limit: the
    caller's own calls have their deadlines, and a hard limit must not end the caller.
    What it raised is logged (and ended its operation failed, :class:`CorralTask`); a
    retry it asked for is sent, never run here at once.
    """
    task = call.task
    task_id = str(uuid.uuid4())
    request = {
        "id": task_id,
        "task": task.name,
        "root_id": task_id,
        "retries": 0,
        "is_eager": False,  # its retries are messages, not re-runs in this thread
        "hostname": socket.gethostname(),
        "headers": dict(headers or {}),
        "timelimit": [task.time_limit, None],
        "delivery_info": {"is_eager": False},
    }
    tracer = build_tracer(task.name, task, eager=True, propagate=False, app=task.app)
    soft_s = get_settings().task_soft_time_limit_s
    with inline(timelimits.Deadline(time.monotonic() + soft_s)):
        traced = tracer(task_id, list(call.args), dict(call.kwargs), request)
    if traced.info is not None and traced.info.state == states.FAILURE:
        log.warning("task %s carried out here failed: %s", task.name, traced.retval)
    return traced.retval


def _warm() -> None:
    """Start the event loop that sends agent calls (:mod:`workers.backends.inflight`)."""
    inflight.run(asyncio.sleep(0))


class HereFirst:
    """The gateway's queue: first tasks carried out on a few threads here, the rest sent."""

    def __init__(self, queue: CeleryQueue, threads: int = HERE_THREADS) -> None:
        self.queue = queue
        self.here = InProcessQueue(queue.tasks)
        self.threads = threads
        self._lock = threading.Lock()
        self._busy = 0
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="first-task")
        self._pool.submit(_warm)  # ahead of the first cold start, off its path

    @property
    def busy(self) -> int:
        """Threads carrying a first task out now."""
        with self._lock:
            return self._busy

    def send(self, work: Work) -> None:
        """Send the operation's first task."""
        self.queue.send(work)

    def run_here(self, work: Work) -> None:
        """Carry the first task out on a free thread here; send it if none is free."""
        call = self.queue.tasks.first(work)  # an unknown kind: ValueError, before anything
        with self._lock:
            free = self._busy < self.threads
            if free:
                self._busy += 1
        if not free:
            self.queue.send(work)
            return
        # In this context: the caller's trace goes on in the task.
        self._pool.submit(contextvars.copy_context().run, self._run, call)

    def _run(self, call: Call) -> None:
        try:
            carry_out(call, headers=stages.sent_header())
        except Exception:  # nothing escapes a thread unseen
            log.exception("task %s carried out here crashed", call.task.name)
        finally:
            with self._lock:
                self._busy -= 1

    def delete_replica(self, replica_id: str) -> None:
        """Send the delete of one replica."""
        self.queue.delete_replica(replica_id)

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Send the release of an orphan VM."""
        self.queue.release_orphan(node_id, vmid)
