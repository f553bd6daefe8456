"""The Celery app (``celery -A workers ...``) and the base class of corral's tasks.

:func:`create_app` builds the app from settings; the module-level :data:`app` is
the one workers, beat and Flower load. :class:`CorralTask` gives each task the
process's settings and :class:`~workers.store.Database`, validates a message's
arguments against the task's signature before running it (a hand-written message
with a missing or mistyped argument fails with a one-line reason and marks its
operation failed, without disturbing the worker), and turns :class:`InputError`
into a failed operation instead of a retry.

No exception leaves a task's operation open: besides a Celery retry (or
ignore / reject), any exception the task raises ends its operation (the task's
``op_id`` argument) ``failed``, with the task's name, the error's type and its
first line - SQL parameters and secret-looking values removed - as the reason,
so ``wait`` returns at once and ``corral ops`` shows the cause. The exception
is then re-raised for Celery to log. A transient database error
(:func:`~workers.store.db.is_transient`: a deadlock, serialization failure,
lock or statement timeout, lost connection, server shutdown) is first retried
after :func:`backoff_s` (exponential, equal jitter) within the task's retry budget
(``CORRAL_RETRY_MAX``), the whole task again: tasks are idempotent and the
failed transaction was rolled back.

Time limits (:mod:`workers.base.timelimits`): Celery's soft limit is off in every pool (it
raises ``SoftTimeLimitExceeded`` into the task wherever it is, :class:`CorralRequest`
drops it even from a message that asks for one). A task runs under a deadline - its
start plus its soft limit - that its work checks where stopping is clean; past it, the
work raises :class:`~workers.base.timelimits.OutOfTime`, and the task is retried within its
budget or, with none left, left to redrive: its operation is not failed. The hard limit
is enforced from outside: billiard's parent in prefork, ``corral worker``
(:mod:`stack.worker`) in a thread (or solo) pool, to which the task reports its start
and end. Where a task runs is declared, never guessed (:class:`Runs`): a worker declares
its pool when it starts (``worker_init``); a caller that carries a task out itself (the
in-process queue, :mod:`tasks.queues`) declares it :func:`inline` - in the caller's
thread, no hard limit, by the deadline it gives; a process that starts no worker runs
tasks only inline (eager mode).

``CORRAL_FAULT_RAISE_IN`` (test-only, empty by default) names tasks (comma
separated) that raise :class:`FaultInjected` before running: how the tests make
a task fail unexpectedly in a real worker (``NAME@here``: in the caller's process,
before a task carried out there is set up, :func:`tasks.queues.carry_out`).

Per-process resources (the store's engine, gRPC channels, the HTTP client) are dropped
in ``worker_process_init``: each prefork child makes its own (and starts its own tracing,
:mod:`workers.observability.tracing`); a worker refuses an un-migrated database.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import enum
import functools
import inspect
import logging
import random
import threading
import time
import typing
from collections.abc import Iterator
from typing import Any

import pydantic
from celery import Celery, Task, signals
from celery.exceptions import Reject, TaskPredicate
from celery.utils.log import current_process_index
from celery.worker.request import Request
from kombu.exceptions import OperationalError as BrokerUnreachable

from config.celery import HOUSEKEEPING, celery_config
from config.settings import Settings, get_settings
from workers import beat_passes, broker
from workers.backends import inflight, node_slots
from workers.base import poison, timelimits
from workers.base.errors import InputError, SchemaError
from workers.base.redis_client import redis_client
from workers.base.timelimits import OutOfTime
from workers.observability import clock_offsets, logs, tracing
from workers.operations import describe_error, fail_op
from workers.replicas.owners import Budget
from workers.store.db import Database, get_database, is_transient
from workers.store.revisions import check_schema

log = logging.getLogger(__name__)

TASK_MODULES = ["tasks.replicas", "tasks.maintenance", "tasks.hogs", "tasks.invocations"]
_running = threading.local()  # the budget of the task this thread runs (CorralTask.budget)


@contextlib.contextmanager
def budgeted(budget: Budget) -> Iterator[Budget]:
    """Run the body as a task with ``budget`` (its sends bounded by it), restoring the outer one."""
    outer = getattr(_running, "budget", None)  # an eager task run inside another
    _running.budget = budget
    try:
        yield budget
    finally:
        _running.budget = outer


class Runs(enum.Enum):
    """Where a task runs, and so what ends it past its hard time limit."""

    INLINE = "inline"  # in its caller's thread: nothing ends it (it has its deadline only)
    PREFORK = "prefork"  # a prefork pool's child: billiard's parent kills it
    REPORTED = "reported"  # a thread or solo pool: reported to `corral worker`, which kills it


_pool = Runs.INLINE  # what this process's worker declared when it started (none: inline)
_inline: contextvars.ContextVar[bool] = contextvars.ContextVar("corral_inline", default=False)


@contextlib.contextmanager
def inline(deadline: timelimits.Deadline) -> Iterator[None]:
    """Run the tasks called in the body inline: in this thread, no hard limit, by ``deadline``.

    A task's own deadline (its start plus its soft limit) still ends it if that is earlier.
    """
    token = _inline.set(True)
    try:
        with timelimits.running(deadline):
            yield
    finally:
        _inline.reset(token)


def runs() -> Runs:
    """Where a task started now, in this context, runs."""
    return Runs.INLINE if _inline.get() else _pool


class CorralRequest(Request):  # type: ignore[misc]
    """A task message as the worker holds and runs it: under its hard time limit only.

    Celery's soft limit would be raised into the task wherever it is; corral's is a
    deadline the task checks itself (the message's limits still reach the task's
    ``request.timelimit``, from which :class:`CorralTask` takes it).

    The message's delivery tag is reported to a supervising ``corral worker`` when the
    worker takes it and when it is acknowledged or given back (:func:`timelimits.received`,
    :func:`timelimits.settled`): what the worker holds when it dies is put back on its
    queue at once (:mod:`stack.worker`). A prefork child killed at its hard limit has its
    kill counted (:mod:`workers.base.poison`) and its message given back (``task_acks_on_timeout``
    is off), not acknowledged.
    """

    time_limits: tuple[float | None, float | None]  # (hard, soft), as Celery's pool reads them

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.time_limits = (self.time_limits[0], None)
        tag = getattr(self.message, "delivery_tag", None)
        self._tag = None if tag is None else str(tag)
        if self._tag is not None:
            timelimits.received(self._tag, self.name, str(self.id))

    def acknowledge(self) -> None:
        """Acknowledge the message (once), and say it is no longer held."""
        held = not self.acknowledged
        super().acknowledge()
        if held and self._tag is not None:
            timelimits.settled(self._tag)

    def reject(self, requeue: bool = False) -> None:
        """Give the message back or drop it (once), and say it is no longer held."""
        held = not self.acknowledged
        super().reject(requeue=requeue)
        if held and self._tag is not None:
            timelimits.settled(self._tag)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        """Past the hard limit (billiard kills the child): count the kill, give the message back."""
        if not soft:
            poison.count_kill_quietly(redis_client(get_settings().broker_url), str(self.id))
        super().on_timeout(soft, timeout)


class CorralTask(Task):  # type: ignore[misc]
    """Base task: settings, database, argument checks, input errors as failed operations."""

    abstract = True
    acks_late = True
    Request = CorralRequest

    @property
    def settings(self) -> Settings:
        """This process's settings."""
        return get_settings()

    @property
    def db(self) -> Database:
        """This process's database."""
        return get_database(self.settings.database_url)

    @property
    def budget(self) -> Budget:
        """This execution's time: when it started and the limits it runs under."""
        budget = getattr(_running, "budget", None)
        return budget if isinstance(budget, Budget) else Budget.of(self.settings)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.run)

    @functools.cached_property
    def _argument_types(self) -> dict[str, pydantic.TypeAdapter[Any]]:
        """A strict validator per annotated argument: a message is JSON, so no coercion."""
        hints = typing.get_type_hints(self.run)
        return {
            name: pydantic.TypeAdapter(hints[name])
            for name in self._signature.parameters
            if name in hints
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the task after checking its arguments; bad input fails the operation."""
        # its time counts from here: the pool's hard limit counts from just before the call
        started = time.monotonic()
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as exc:
            return self._reject(kwargs.get("op_id") or (args[0] if args else None), str(exc))
        for name, value in bound.arguments.items():
            adapter = self._argument_types.get(name)
            if adapter is None:
                continue
            try:
                adapter.validate_python(value, strict=True)
            except pydantic.ValidationError as exc:
                expected = self.run.__annotations__.get(name)
                return self._reject(
                    bound.arguments.get("op_id"),
                    f"argument {name!r} must be {expected}, got {type(value).__name__}"
                    f" ({exc.errors()[0]['msg']})",
                )
        op_id = bound.arguments.get("op_id")
        killed = self._kills()
        if killed >= poison.MAX_KILLS:
            return self._reject(op_id, poison.given_up(killed))
        if self._superseded():
            return {"skipped": True, "reason": "superseded: a later pass of its kind started"}
        hard, soft = self.request.timelimit or (None, None)
        budget = Budget.of(self.settings, started=started, soft_s=soft, hard_s=hard)
        with budgeted(budget):
            return self._run(budget, op_id, args, kwargs)

    def _run(
        self, budget: Budget, op_id: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the task under its limits, then deal with what it raised."""
        try:
            with self._limits(budget):
                inject_fault(self.settings, self.name)
                return super().__call__(*args, **kwargs)
        except InputError as exc:
            return self._reject(op_id, str(exc))
        except TaskPredicate:  # Retry, Ignore, Reject: Celery's own control flow
            raise
        except BrokerUnreachable as exc:
            # Its messages could not be queued in its time: its own goes back (the task is
            # idempotent), or, with the broker away, comes back after the visibility timeout.
            log.warning("task %s: messages not queued (%s); it goes back", self.request.id, exc)
            raise Reject(exc, requeue=True) from None
        except OutOfTime as exc:
            # Past the soft limit at a safe point (the agent calls themselves end cleanly
            # there: workers.replicas.calls). The operation is not failed: the task is
            # idempotent, so running it again carries on where it stopped.
            self.retry_within_budget("ran into its soft time limit", exc)
            log.error(
                "task %s ran into its soft time limit with no retries left; its "
                "operation %s is left to redrive",
                self.request.id,
                op_id,
            )
            return {"error": "soft time limit"}
        except Exception as exc:
            if is_transient(exc):  # deadlock, lock timeout, connection lost...: run it again
                self.retry_within_budget("hit a transient database error", exc)
            self._fail(op_id, exc)
            raise

    def _kills(self) -> int:
        """How often this message's task was killed at its hard limit (looked up if redelivered)."""
        info = self.request.delivery_info or {}
        if self.request.is_eager or not info.get("redelivered"):
            return 0
        client = redis_client(self.settings.broker_url)
        if client is None:
            return 0
        try:
            return poison.kills(client, str(self.request.id))
        except Exception as exc:  # Redis away: run it (a kill is counted when it happens)
            log.warning("could not read the kills of task %s: %s", self.request.id, exc)
            return 0

    def _superseded(self) -> bool:
        """Whether this is a housekeeping pass a later one covered (:mod:`workers.beat_passes`)."""
        mine = getattr(self.request, beat_passes.HEADER, None)
        if self.name not in HOUSEKEEPING or not isinstance(mine, int):
            return False
        client = redis_client(self.settings.broker_url)
        if client is None:
            return False
        try:
            return beat_passes.superseded(client, self.name, mine)
        except Exception as exc:  # Redis away: run it (passes are leased and idempotent)
            log.warning("could not check pass %s of %s: %s", mine, self.name, exc)
            return False

    @contextlib.contextmanager
    def _limits(self, budget: Budget) -> Iterator[None]:
        """Run the task under its deadline; report its hard limit where a supervisor keeps it.

        The handling of what the task raised (failing its operation, a retry) runs after,
        under no deadline. A task run inside another, or inline by a caller that gave a
        deadline (:func:`inline`), ends by the earlier deadline.
        """
        deadline = timelimits.Deadline(
            budget.started + budget.soft_s, hard_at=budget.started + budget.hard_s
        )
        outer = timelimits.current()
        if outer is not None and outer.at < deadline.at:
            deadline = outer
        with timelimits.running(deadline):
            if runs() is Runs.REPORTED:
                with timelimits.reported(self.name, str(self.request.id), budget.hard_s):
                    yield
            else:  # prefork: billiard's parent ends it; inline: its deadline only
                yield

    def _fail(self, op_id: Any, exc: Exception) -> None:
        """End the operation of a task that raised: failed, with the redacted error."""
        message = f"{self.name}: {describe_error(exc)}"
        log.error("task %s failed: %s", self.request.id, message)
        if not isinstance(op_id, str):
            return

        try:
            fail_op(self.db, op_id, message)
        except Exception as failed:  # the store itself is down: redrive gives up later
            log.error("could not mark operation %s failed: %s", op_id, describe_error(failed))

    def _reject(self, op_id: Any, reason: str) -> dict[str, Any]:
        message = f"{self.name}: {reason}"
        log.error("rejected task %s: %s", self.request.id, message)
        if isinstance(op_id, str):
            try:
                fail_op(self.db, op_id, message)
            except Exception:  # the op id itself may be junk
                log.exception("could not mark operation %r failed", op_id)
        return {"error": message}

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Queue this task; from inside a running task, given up before its hard limit."""
        budget = getattr(_running, "budget", None)
        if isinstance(budget, Budget) and not self.app.conf.task_always_eager:
            attempt = broker.attempt_s(self.app.conf.broker_transport_options or {})
            hard_at = budget.started + budget.hard_s
            options["retry_policy"] = broker.within(options.get("retry_policy"), hard_at, attempt)
        return super().apply_async(args, kwargs, **options)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry, except that a retry the broker would not take gives the message back
        (Celery drops it: the task, a release or a delete, would never run again)."""
        try:
            return super().retry(*args, **kwargs)
        except Reject as rejected:
            if rejected.requeue:
                raise
            why = rejected.reason
            log.warning("task %s: retry not queued (%s); it goes back", self.request.id, why)
            raise Reject(rejected.reason, requeue=True) from None

    def retry_within_budget(self, what: str, exc: Exception | None = None) -> None:
        """Retry this task after :meth:`backoff` unless ``CORRAL_RETRY_MAX`` retries are spent.

        Raises Celery's ``Retry`` while retries remain; returns when they are spent,
        so the caller goes on to record the failure.
        """
        retries, most = self.request.retries, self.settings.retry_max
        if retries < most:
            log.warning(
                "%s %s: %s; retry %d of %d", self.name, what, exc or "retrying", retries + 1, most
            )
            raise self.retry(exc=exc, countdown=self.backoff(), max_retries=most) from None

    def backoff(self) -> float:
        """Seconds before the next retry: exponential, capped, with equal jitter."""
        return backoff_s(self.settings, self.request.retries)


def backoff_s(settings: Settings, retries: int) -> float:
    """Seconds to wait before retry ``retries + 1``: exponential, capped, equal jitter.

    ``CORRAL_RETRY_BACKOFF_S`` doubled per retry made, at most ``CORRAL_RETRY_BACKOFF_MAX_S``,
    drawn between half and all of it: full jitter could spend a budget meant for an agent
    to come back in a fraction of a second (the defaults give at least 7.75 s in all).
    """
    ceiling = min(settings.retry_backoff_max_s, settings.retry_backoff_s * (2**retries))
    return random.uniform(ceiling / 2, ceiling)  # noqa: S311 - retry jitter, not a secret


class FaultInjected(RuntimeError):
    """The test-only fault hook fired (``CORRAL_FAULT_RAISE_IN``)."""


def inject_fault(settings: Settings, task_name: str) -> None:
    """Raise :class:`FaultInjected` if ``CORRAL_FAULT_RAISE_IN`` names this task (tests only)."""
    if settings.fault_raise_in and task_name in settings.fault_raise_in.split(","):
        raise FaultInjected(f"fault injected in {task_name} (CORRAL_FAULT_RAISE_IN)")


def create_app(settings: Settings | None = None) -> Celery:
    """A Celery app configured from ``settings`` (the process's by default)."""
    settings = settings or get_settings()
    broker.install()
    celery = Celery("corral", task_cls=CorralTask)
    celery.conf.update(celery_config(settings))
    celery.conf.include = TASK_MODULES
    return celery


def configure(settings: Settings) -> None:
    """Re-apply settings to the shared app (tests, ``corral up``).

    Connection and producer pools and the result backend were built from the old
    settings, so they are dropped and rebuilt on next use.
    """
    app._pool = None
    if "amqp" in app.__dict__:
        app.amqp._producer_pool = None
    app._local = threading.local()  # the result backend is cached per thread
    app.conf.update(celery_config(settings))
    # A task's hard limit was copied from the config when it was bound, and travels in
    # every message it sends (workers enforce a message's own limit): follow the new one.
    # Celery's soft limit stays off (workers.base.timelimits).
    for task in app.tasks.values():
        if isinstance(task, CorralTask):
            type(task).time_limit = settings.task_time_limit_s
            type(task).soft_time_limit = None
            task._exec_options = None


app = create_app()


@signals.worker_process_init.connect
def _fresh_resources(**_: Any) -> None:
    """Drop resources inherited from the parent: each pool process makes its own."""
    get_database(get_settings().database_url).dispose()
    inflight.reset()  # the loop, its channels and clients: made anew in this process
    tracing.start("corral-worker", get_settings())  # after the fork: its own exporter


_worker_name = ""  # the starting worker's name (``w1@host``), for its pool processes


@signals.worker_init.connect
def _free_dead_slots(sender: Any = None, **_: Any) -> None:
    """Free the node call slots this worker's dead processes left (a restart after a kill).

    A thread (or solo) pool's calls are this process's: its leases go by ``NAME/0``. A
    prefork child takes its own name at its start (:func:`_own_slots`).
    """
    global _worker_name
    _worker_name = str(getattr(sender, "hostname", "") or "")
    if not _worker_name:
        return
    if "prefork" not in _pool_of(sender):
        node_slots.become(f"{_worker_name}/0")
    node_slots.free_dead(get_settings().broker_url, _worker_name)


@signals.worker_process_init.connect
def _own_slots(**_: Any) -> None:
    """A prefork child (a new one, or one replacing a killed one) leases as ``NAME/INDEX``."""
    if _worker_name:
        name = f"{_worker_name}/{current_process_index() or 0}"
        node_slots.become(name)
        node_slots.free_dead(get_settings().broker_url, name)


@signals.worker_process_shutdown.connect
def _send_spans(**_: Any) -> None:
    """A pool process ends without running atexit: send its last spans first."""
    tracing.flush()


def _pool_of(worker: Any) -> str:
    """The module (or alias) of a starting worker's pool: ``...prefork``, ``threads``..."""
    pool = getattr(worker, "pool_cls", None)
    return pool if isinstance(pool, str) else str(getattr(pool, "__module__", ""))


@signals.worker_init.connect
def _declare_pool(sender: Any = None, **_: Any) -> None:
    """Declare where this worker's tasks run (:class:`Runs`): its pool, from its configuration."""
    global _pool
    _pool = Runs.PREFORK if "prefork" in _pool_of(sender) else Runs.REPORTED


@signals.worker_shutdown.connect
def _undeclare_pool(**_: Any) -> None:
    """The worker is gone: tasks this process still runs run inline (a test's own worker)."""
    global _pool
    _pool = Runs.INLINE


@signals.worker_init.connect
def _trace_unforked(sender: Any = None, **_: Any) -> None:
    """Tracing for a worker whose pool does not fork (threads, solo): the process's own.

    A prefork worker's children start theirs; the parent only checks it could.
    """
    try:
        if "prefork" in _pool_of(sender):
            tracing.check(get_settings())
        else:
            tracing.start("corral-worker", get_settings())
    except tracing.TracingUnavailable as exc:
        log.critical("%s", exc)
        raise SystemExit(f"corral worker: {exc}") from None


@signals.task_postrun.connect
def _publish_clock_offset(task: Any = None, **_: Any) -> None:
    """After a task, publish the host's new clock offset (workers.observability.clock_offsets)."""
    if task is None or task.request.is_eager:
        return  # a worker's tasks only: an eager caller is no worker
    client = redis_client(get_settings().broker_url)
    if client is None:
        return
    try:
        clock_offsets.publish(client)
    except Exception as exc:  # a metric: the next task tries again
        log.debug("could not publish the clock offset: %s", exc)


@signals.before_task_publish.connect
def _number_pass(sender: Any = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    """A housekeeping pass being sent takes its number (:mod:`workers.beat_passes`)."""
    if sender not in HOUSEKEEPING or headers is None:
        return
    client = redis_client(get_settings().broker_url)
    if client is None:
        return
    try:
        headers[beat_passes.HEADER] = beat_passes.number(client, sender)
    except Exception as exc:  # unnumbered, it runs whenever it comes
        log.warning("could not number a %s pass: %s", sender, exc)


@signals.celeryd_after_setup.connect
def _bounded_logs(**_: Any) -> None:
    """A command-line worker logs through a bounded queue (:mod:`workers.observability.logs`).

    Sent once the worker's logging is set up and before its pool starts; a test's worker
    in a thread (``celery.contrib.testing``) is not such a worker and keeps its handlers.
    """
    logs.install()


@signals.worker_init.connect
def _hard_limits(sender: Any = None, **_: Any) -> None:
    """Report to a supervising ``corral worker``; warn of a thread pool that has none."""
    if timelimits.attach():
        return
    if "thread" in _pool_of(sender):
        log.warning(
            "this thread-pool worker runs without `corral worker`: nothing ends a task stuck "
            "past its hard time limit (CORRAL_TASK_TIME_LIMIT_S); start it with `corral worker`"
        )


M_ARENA_MAX = -8  # glibc's mallopt parameter
MALLOC_ARENAS = 2


@signals.worker_init.connect
def _fewer_malloc_arenas(**_: Any) -> None:
    """Cap glibc's malloc arenas before the pool's threads start (a thread pool's memory).

    glibc gives threads that allocate at once arenas of their own, up to eight per core,
    and memory freed in one is not reused by another: a worker of eight threads grew past
    150 MiB where two arenas keep it below (docs/benchmarks.md). Elsewhere: nothing.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, MALLOC_ARENAS)


@signals.worker_init.connect
def _check_schema(**_: Any) -> None:
    """Refuse to start a worker on a database that is not migrated."""
    try:
        check_schema(get_database(get_settings().database_url))
    except SchemaError as exc:
        log.critical("%s", exc)
        raise SystemExit(f"corral worker: {exc}") from None
