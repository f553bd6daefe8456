"""Time limits that cannot wedge a worker: a soft deadline the work checks, a hard one from outside.

Nothing is ever raised into a running thread. An exception raised asynchronously lands
wherever the thread happens to be - inside ``logging``'s handler lock, half-way through
returning a connection to the pool - and leaves that lock held or that connection lost
for good. Celery's own soft limit does exactly that (billiard's SIGUSR1 handler raises
``SoftTimeLimitExceeded`` wherever a prefork child is), so corral does not use it in
either pool (:class:`workers.celery.CorralTask` turns it off), and enforces its limits
in two parts:

* **The soft limit is a deadline the work checks at safe points.** The task base sets
  the running task's :class:`Deadline` (its start plus ``CORRAL_TASK_SOFT_TIME_LIMIT_S``)
  in a context variable for the task's thread (:func:`running`). The work looks at it
  where stopping is clean: the first store transaction to start past it is refused
  (:mod:`workers.store.db` calls :func:`check`, which raises :class:`OutOfTime`), a
  batch of agent calls waiting in slices cancels its asyncio calls (cancelling is
  cooperative) and returns what came of them (:mod:`workers.replicas.calls`), a pause
  ends at it (:func:`sleep`). The limit is delivered once, as Celery's exception was:
  then the task is *wrapping up* (:func:`wrap_up`) and what it does on its way out -
  record the VMs that landed, hand the rest on, disown rows, release a lease in a
  ``finally`` - goes ahead, bounded by the hard limit. The task base treats
  :class:`OutOfTime` as it treated the soft limit: the task is retried within its
  budget or left to redrive, its operation is never failed for it. Threads that run no
  task (a gateway's, the event loop's) have no deadline: a gateway that carries out a
  first task itself (:func:`workers.celery.inline`) gives the task a deadline that ends the
  task, never the gateway.
* **No wait outlasts the hard limit.** The deadline also knows when the hard limit
  falls (:func:`hard_left`): a store transaction's statement and lock timeouts are cut
  to the time left (:mod:`workers.store.db`), the way out after the soft limit included;
  a wait for an agent call (:func:`workers.backends.inflight.run`: a release, a listing,
  its node's call slot first) ends at the soft limit, or once the task is wrapping up
  :data:`WAY_OUT_S` before the hard one (:func:`wait_left`), and the call is cancelled.
* **The hard limit is enforced from outside the work.** Work stuck where no safe point
  comes (a C call that does not return) is ended by killing its process.
  In a prefork pool billiard's parent kills the child at ``CORRAL_TASK_TIME_LIMIT_S``
  (Celery's own, kept; the message is given back and the kill counted,
  :mod:`workers.base.poison`). A thread pool runs under ``corral worker``
  (:mod:`stack.worker`), a supervisor outside the worker process: the worker reports
  each task's start, hard limit and end to it over a pipe (:func:`reported`: one
  ``os.write`` of a short line per event, atomic below ``PIPE_BUF``, under no lock), and
  each message it takes and settles (:func:`received`, :func:`settled`: its delivery
  tag). The supervisor SIGKILLs the worker whose task outlived its hard limit, writes
  one line saying which task (``os.write``, never blocking), counts the kill, puts every
  message the worker held back on its queue at once and starts the worker again: its
  other tasks run again within seconds; the rows its tasks owned lapse at the same limit.

The pipe's write end reaches the worker as the file descriptor named in
:data:`WATCH_FD_ENV` with the supervisor's pid (``FD:PID``): :func:`attach` checks that
the descriptor is a pipe and that its parent is that supervisor before reporting to it,
and takes the variable out of the environment so no other program inherits it.
"""

from __future__ import annotations

import contextlib
import contextvars
import faulthandler
import os
import re
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

WATCH_FD_ENV = "CORRAL_WORKER_WATCH_FD"
#: The signal a supervisor sends a worker whose task outlived its hard limit, just before
#: it kills it: the worker writes every thread's stack to its stderr (faulthandler, in C,
#: no lock), so the log says where the task was stuck.
STACKS_SIGNAL = signal.SIGRTMIN + 1
#: Seconds kept for a task's way out after a wait its time cut short: the error, the rollback,
#: the retry.
WAY_OUT_S = 0.5
MAX_LINE = 512  # a report line, well below PIPE_BUF (4096): one write, never interleaved
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@\-]")


class OutOfTime(Exception):
    """The running task passed its soft time limit: nothing new is started."""


@dataclass
class Deadline:
    """When the running task's soft time limit falls, and its hard one (``time.monotonic()``)."""

    at: float
    hard_at: float | None = None  # None: nothing ends the task from outside (inline)
    wrapping_up: bool = False  # the limit was delivered: the task is on its way out

    def left(self) -> float:
        """Seconds until the deadline (negative past it)."""
        return self.at - time.monotonic()

    def hard_left(self) -> float | None:
        """Seconds until the hard limit kills the task (negative past it); None: no hard limit."""
        return None if self.hard_at is None else self.hard_at - time.monotonic()

    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.at


_deadline: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar(
    "corral_deadline", default=None
)


@contextlib.contextmanager
def running(deadline: Deadline | None) -> Iterator[Deadline | None]:
    """Run the body under ``deadline`` (None: none), restoring the previous one after."""
    token = _deadline.set(deadline)
    try:
        yield deadline
    finally:
        _deadline.reset(token)


def current() -> Deadline | None:
    """The running task's deadline in this thread, if any."""
    return _deadline.get()


def hard_left() -> float | None:
    """Seconds before the running task's hard limit ends it; None: no task, or no hard limit.

    What a wait inside the task may take at most: a store transaction's statement and lock
    timeouts are cut to it (:mod:`workers.store.db`), its way out after the soft limit
    included.
    """
    deadline = _deadline.get()
    return None if deadline is None else deadline.hard_left()


def wait_left() -> float | None:
    """Seconds a wait in the running task may last (may be negative): to its soft limit, or
    once it is wrapping up, to :data:`WAY_OUT_S` before its hard limit; None: no bound."""
    deadline = _deadline.get()
    if deadline is None:
        return None
    if not deadline.wrapping_up:
        return deadline.left()
    left = deadline.hard_left()
    return None if left is None else left - WAY_OUT_S


def passed() -> bool:
    """Whether this thread runs a task that is past its soft time limit."""
    deadline = _deadline.get()
    return deadline is not None and deadline.passed()


def check(what: str) -> None:
    """Refuse to start ``what`` past the running task's soft time limit (:class:`OutOfTime`).

    Once: the refusal is the limit delivered, and the task is wrapping up from then on.
    """
    deadline = _deadline.get()
    if deadline is not None and not deadline.wrapping_up and deadline.passed():
        deadline.wrapping_up = True
        raise OutOfTime(f"past the task's soft time limit: {what} not started")


def wrap_up() -> None:
    """The running task met its soft limit and stopped its work: let it record what it did.

    :func:`check` says so when it refuses; a batch of agent calls cut at the deadline
    (:mod:`workers.replicas.calls`) says so itself. The transactions on the way out go
    ahead (recording what landed, handing the rest on, releasing what the task held), as
    they did when the soft limit was an exception raised once; the hard limit bounds them.
    """
    deadline = _deadline.get()
    if deadline is not None:
        deadline.wrapping_up = True


def sleep(seconds: float) -> None:
    """Pause ``seconds``, or until the running task's deadline; then :func:`check` it."""
    deadline = _deadline.get()
    time.sleep(max(0.0, seconds if deadline is None else min(seconds, deadline.left())))
    check("the work after a pause")


# -- the hard limit: reports to the supervising ``corral worker`` ------------------------------

_report_fd: int | None = None


def attach() -> bool:
    """Take the supervisor's pipe from the environment, if this process is its worker."""
    global _report_fd
    value = os.environ.pop(WATCH_FD_ENV, "")
    fd_text, _, pid_text = value.partition(":")
    if not (fd_text.isdigit() and pid_text.isdigit()) or os.getppid() != int(pid_text):
        return False  # not set, or inherited by some other program: not ours to write to
    fd = int(fd_text)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        os.set_inheritable(fd, False)  # the worker's own children (agents, hogs) get none
    except OSError:
        return False
    _report_fd = fd
    stderr = sys.__stderr__
    if stderr is not None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            faulthandler.register(STACKS_SIGNAL, file=stderr, all_threads=True)
    return True


def supervised() -> bool:
    """Whether a supervisor enforces this worker's hard time limits."""
    return _report_fd is not None


def _safe(text: str, limit: int = 120) -> str:
    """A task's name or id as a report carries it: no spaces, no newlines, bounded."""
    return _UNSAFE.sub("?", text)[:limit] or "?"


def _write(line: str) -> None:
    fd = _report_fd
    if fd is None:
        return
    with contextlib.suppress(OSError):  # the supervisor is gone: its death kills us anyway
        os.write(fd, line.encode()[:MAX_LINE])


@contextlib.contextmanager
def reported(name: str, task_id: str, hard_s: float) -> Iterator[None]:
    """Tell the supervisor (if any) this thread runs a task with ``hard_s`` to finish it."""
    key = threading.get_ident()
    _write(f"start {key} {hard_s:.3f} {_safe(name)}[{_safe(task_id)}]\n")
    try:
        yield
    finally:
        _write(f"end {key}\n")


def received(delivery_tag: str, name: str, task_id: str) -> None:
    """Tell the supervisor (if any) this worker holds a message, unacknowledged, by its tag."""
    _write(f"got {_safe(delivery_tag, 64)} {_safe(name)}[{_safe(task_id)}]\n")


def settled(delivery_tag: str) -> None:
    """Tell the supervisor (if any) the message is acknowledged or given back: no longer held."""
    _write(f"done {_safe(delivery_tag, 64)}\n")


@dataclass(frozen=True)
class Report:
    """One line a worker sent.

    A task started (``hard_s`` to run) or ended, on one thread (``key``: the thread); or a
    message received or settled (``key``: its delivery tag).
    """

    event: str  # "start", "end", "got" or "done"
    key: str
    hard_s: float = 0.0
    task: str = ""

    @property
    def task_id(self) -> str:
        """The task id in ``task`` (``name[id]``), or "" if it carries none."""
        name, _, rest = self.task.partition("[")
        return rest[:-1] if name and rest.endswith("]") else ""


def parse(line: bytes) -> Report | None:
    """A report line as the supervisor reads it; None if it is not one."""
    parts = line.decode("ascii", "replace").split()
    match parts:
        case ["start", key, hard, task]:
            try:
                hard_s = float(hard)
            except ValueError:
                return None
            return Report("start", key, hard_s, task) if hard_s >= 0 else None
        case ["end", key]:
            return Report("end", key)
        case ["got", tag, task]:
            return Report("got", tag, task=task)
        case ["done", tag]:
            return Report("done", tag)
    return None
