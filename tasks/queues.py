"""The task queues: :class:`workers.dispatch.TaskQueue` over Celery, and carried out here.

The logic asks a :class:`~workers.dispatch.TaskQueue` for work (:mod:`workers.dispatch`);
the implementations are here, beside the tasks, and hold the task objects themselves
(:class:`Tasks`: each operation kind's first task, the delete, the release), so nothing
looks a task up by its name. :data:`tasks.maintenance.QUEUE` is the one every process
uses, built from the task modules.

* :class:`CeleryQueue` sends a message: the task's own ``apply_async``, routed by name to
  its queue (``config.celery.ROUTES``) as ``delay()`` is; a first task's message says when
  it was sent (:data:`workers.observability.stages.SENT_HEADER`, its ``queue`` stage). In eager mode
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
  operation that redrive sends again, rows whose owner's lease lapses). Celery sets
  itself up lazily (the app's finalization, each thread's result backend, the broker
  connection; the nodes' backend modules are imported on first use too), so
  :func:`prepare` and each thread's first job do that when the queue is made - at the
  gateway's start, not inside a cold start, where a failure (descriptors run out) would
  leave it undone. And a task that does not get through here - it failed before it ran
  (:class:`NotCarriedOut`), it failed, or Celery crashed around it - is sent to the
  broker once: a worker elsewhere may not share this process's trouble, and every task
  may run twice (an operation that finished makes it do nothing). Before, such an
  operation stayed open, and the cold starts of its function waited on it.
"""

from __future__ import annotations

import asyncio
import contextlib
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

from celery import Signature, signals, states
from celery.app.trace import build_tracer

from config.settings import get_settings
from workers.backends import inflight
from workers.backends.base import backend
from workers.base import timelimits
from workers.base.kinds import NODE_KINDS
from workers.celery import CorralTask, inject_fault, inline
from workers.dispatch import Work
from workers.observability import stages

log = logging.getLogger(__name__)

HERE_THREADS = 4  # first tasks the gateway carries out itself at once; more are sent
HAND_ON_S = 60.0  # how long a task that did not get through here is tried at the broker
HAND_ON_PAUSE_S = 0.1  # the first pause between those tries (doubling, up to 2 s)


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


class NotCarriedOut(Exception):
    """A task carried out here failed before it ran (Celery's set-up, say): nothing was done."""


# The task id carried out in this context, and whether it has started (Celery's prerun).
_started: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "corral_started", default=None
)


@signals.task_prerun.connect
def _mark_started(task_id: str | None = None, **_: Any) -> None:
    """Celery is about to run a task: if it is the one carried out here, it has started."""
    box = _started.get()
    if box is not None and box[0] == task_id:
        box[1] = True


def carry_out(call: Call, headers: Mapping[str, Any] | None = None) -> Any:
    """Run a task in this thread as a worker runs its message, inline; what it returned.

    Its deadline is the soft limit from now, and nothing enforces a hard limit: the
    caller's own calls have their deadlines, and a hard limit must not end the caller.
    What it raised is logged (and ended its operation failed, :class:`CorralTask`); a
    retry it asked for is sent, never run here at once. What fails before the task ran
    raises :class:`NotCarriedOut`.
    """
    return _carry_out(call, headers)[1]


def _carry_out(call: Call, headers: Mapping[str, Any] | None) -> tuple[bool, Any]:
    """:func:`carry_out`, saying too whether the task failed (raised) or ran through."""
    task = call.task
    task_id = str(uuid.uuid4())
    box = [task_id, False]
    token = _started.set(box)
    try:
        return _trace(call, task_id, headers)
    except Exception as exc:
        if box[1]:
            raise
        raise NotCarriedOut(f"{task.name} failed before it ran: {exc!r}") from exc
    finally:
        _started.reset(token)


def _trace(call: Call, task_id: str, headers: Mapping[str, Any] | None) -> tuple[bool, Any]:
    task = call.task
    settings = get_settings()
    inject_fault(settings, f"{task.name}@here")  # tests: a crash before the task ran
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
    soft_s = settings.task_soft_time_limit_s
    with inline(timelimits.Deadline(time.monotonic() + soft_s)):
        traced = tracer(task_id, list(call.args), dict(call.kwargs), request)
    failed = traced.info is not None and traced.info.state == states.FAILURE
    if failed:
        log.warning("task %s carried out here failed: %s", task.name, traced.retval)
    return not failed, traced.retval


def prepare(tasks: Tasks) -> None:
    """Finish the lazy set-up a task carried out here would do in its first run: Celery's
    app, its tasks' tracers, this thread's result backend, what sending a message takes,
    the nodes' backend modules."""
    app = tasks.delete.app
    app.finalize()
    amqp = app.amqp
    _ = (amqp.create_task_message, amqp.send_task_message, amqp.router, app.producer_pool)
    for name, task in app.tasks.items():
        if isinstance(task, CorralTask):
            build_tracer(name, task, eager=True, propagate=False, app=app)
    _ = app.backend  # made per thread for Redis (not thread-safe), on a task's first failure
    for kind in NODE_KINDS:
        backend(kind)


def _warm(tasks: Tasks, ready: threading.Barrier | None, first: bool) -> None:
    """Set up one thread of the pool (each takes one such job: they meet at ``ready``); the
    first also starts the event loop that sends agent calls (:mod:`workers.backends.inflight`)
    and puts a connection to the broker in the producer pool (a broker that is down now is
    logged, and connected to when a message needs it)."""
    if ready is not None:
        with contextlib.suppress(threading.BrokenBarrierError):
            ready.wait(10)
    app = tasks.delete.app
    _ = app.backend  # this thread's
    if not first:
        return
    inflight.run(asyncio.sleep(0))
    try:
        with app.producer_or_acquire() as producer:
            producer.connection.ensure_connection(max_retries=1)
    except Exception as exc:
        log.warning("no connection to the broker yet: %s", exc)


class HereFirst:
    """The gateway's queue: first tasks carried out on a few threads here, the rest sent."""

    def __init__(self, queue: CeleryQueue, threads: int = HERE_THREADS) -> None:
        self.queue = queue
        self.here = InProcessQueue(queue.tasks)
        self.threads = threads
        self._lock = threading.Lock()
        self._busy = 0
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="first-task")
        prepare(queue.tasks)  # at the gateway's start, not in its first cold start
        ready = threading.Barrier(threads) if threads > 1 else None
        for i in range(max(threads, 1)):  # ahead of the first cold start, off its path
            self._pool.submit(_warm, queue.tasks, ready, i == 0)

    def close(self) -> None:
        """Stop its threads once the tasks running on them end (nothing queued is run)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

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
        self._pool.submit(contextvars.copy_context().run, self._run, call, work)

    def _run(self, call: Call, work: Work) -> None:
        """Carry the task out; one that did not get through here goes to the broker."""
        try:
            try:
                done = _carry_out(call, stages.sent_header())[0]
            except NotCarriedOut as exc:  # nothing was done
                log.warning("%s", exc)
                done = False
            except Exception:  # Celery's own handling crashed, around the task
                log.exception("task %s carried out here crashed", call.task.name)
                done = False
            if not done:
                self._hand_on(call, work)
        finally:
            with self._lock:
                self._busy -= 1

    def _hand_on(self, call: Call, work: Work) -> None:
        """Send a task that did not get through here to the broker (a worker may not share
        this process's trouble, descriptors run out say; its operation, if it finished,
        makes it do nothing: every task may run twice). Sending may fail for the same
        trouble: it is tried again for :data:`HAND_ON_S`, then left to redrive."""
        pause, give_up = HAND_ON_PAUSE_S, time.monotonic() + HAND_ON_S
        while True:
            try:
                self.queue.send(work)
            except Exception as exc:
                if time.monotonic() + pause > give_up:
                    log.error("task %s could not be sent either: %s", call.task.name, exc)
                    return
                time.sleep(pause)
                pause = min(pause * 2, 2.0)
            else:
                log.warning("task %s did not get through here: sent to the broker", call.task.name)
                return

    def delete_replica(self, replica_id: str) -> None:
        """Send the delete of one replica."""
        self.queue.delete_replica(replica_id)

    def release_orphan(self, node_id: str, vmid: str) -> None:
        """Send the release of an orphan VM."""
        self.queue.release_orphan(node_id, vmid)
