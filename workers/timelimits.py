"""Time limits for tasks run in a thread pool, as Celery's prefork pool enforces them.

Celery enforces ``task_soft_time_limit`` and ``task_time_limit`` only in its prefork
pool: billiard's parent process sends the child SIGUSR1 at the soft limit (its handler
raises ``SoftTimeLimitExceeded`` in the task) and kills the child at the hard limit. A
thread pool - corral's default (:mod:`config.celery`) - has neither, so a task run on
a pool thread registers here (:class:`workers.celery.CorralTask` does it) and one
watchdog thread per process checks every :data:`WATCH_S`:

* **soft limit**: ``SoftTimeLimitExceeded`` is raised in the task's thread
  (``PyThreadState_SetAsyncExc``), at the next bytecode it runs - as billiard's signal
  handler raises it at the next bytecode of a prefork child. A batch waiting on agent
  calls waits in slices, so it is reached within one slice and cuts its calls cleanly
  (:mod:`workers.replicas.calls`);
* **hard limit**: a thread still running then is stuck where Python cannot reach it (a
  C call that does not return). The worker process logs which task and exits
  (:data:`EXIT_STATUS`), as prefork's hard limit kills the child: the messages it held
  are unacknowledged and come back to other workers after the visibility timeout (every
  task may run twice), and its supervisor (``corral up``, compose) starts it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from celery.exceptions import SoftTimeLimitExceeded

log = logging.getLogger(__name__)

WATCH_S = 0.1
EXIT_STATUS = 70  # EX_SOFTWARE: the worker ends itself, its supervisor starts it again


@dataclass
class Watched:
    """One task running on a pool thread, and when its limits fall (``time.monotonic()``)."""

    thread_id: int
    name: str
    task_id: str
    soft_at: float
    hard_at: float
    soft_sent: bool = False


def _exit_process(task: Watched) -> None:
    log.critical(
        "task %s[%s] is past its hard time limit and cannot be interrupted; the "
        "worker exits (its messages come back to other workers)",
        task.name,
        task.task_id,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_STATUS)


#: What happens to a task past its hard limit (tests replace it).
on_hard_limit: Callable[[Watched], None] = _exit_process

_watched: dict[int, Watched] = {}
_lock = threading.Lock()
_watchdog: threading.Thread | None = None
_watchdog_pid = -1


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in another thread at its next bytecode (None: cancel a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


@contextlib.contextmanager
def watch(name: str, task_id: str, soft_s: float, hard_s: float) -> Iterator[Watched]:
    """Enforce a task's soft and hard time limits while the calling thread runs it."""
    _start_watchdog()
    started = time.monotonic()
    task = Watched(threading.get_ident(), name, task_id, started + soft_s, started + hard_s)
    with _lock:
        _watched[task.thread_id] = task
    try:
        yield task
    finally:
        with _lock:
            _watched.pop(task.thread_id, None)
            if task.soft_sent:  # raised too late to land inside the task: never outside it
                _raise_in(task.thread_id, None)


def _start_watchdog() -> None:
    global _watchdog, _watchdog_pid
    with _lock:
        if _watchdog is not None and _watchdog_pid == os.getpid() and _watchdog.is_alive():
            return
        _watchdog = threading.Thread(target=_run, name="corral-timelimits", daemon=True)
        _watchdog_pid = os.getpid()
        _watchdog.start()


def _run() -> None:
    while True:
        time.sleep(WATCH_S)
        at = time.monotonic()
        hard: list[Watched] = []
        with _lock:
            for task in _watched.values():
                if at >= task.hard_at:
                    hard.append(task)
                elif at >= task.soft_at and not task.soft_sent:
                    task.soft_sent = True
                    log.warning("task %s[%s] is past its soft time limit", task.name, task.task_id)
                    _raise_in(task.thread_id, SoftTimeLimitExceeded)
        for task in hard:
            on_hard_limit(task)
