"""A worker's log records go out through a bounded queue: logging never blocks a task.

Python's logging writes in the thread that logs, under the handler's lock, with a
blocking ``write()``. When what reads a worker's stdout stalls - a log shipper that
stops reading its pipe, a disk that throttles its writers - the thread in ``write()``
blocks, every other thread that logs waits behind its lock, and a task waiting there
reaches no safe point: it meets its hard time limit and its worker is killed (12 s of a
stalled pipe did that to a worker of churning tasks).

So when a worker starts (:func:`install`, from ``workers.celery``) every handler of its
loggers is put behind one bounded queue (:class:`logging.handlers.QueueHandler`, one
:class:`~logging.handlers.QueueListener` thread per process). A thread that logs formats
its record as the handler would - in its own context, so a task's name and id are its
own - and puts it on the queue without waiting; the listener writes the records out, in
order. When the queue is full (:data:`MAX_RECORDS`: the sink has not taken a line for
that long), the record is dropped and counted: once the listener writes again it says
how many were dropped, and a thread of its own adds them to a total in the broker's Redis
(:data:`DROPPED_KEY`, exported as ``corral_log_records_dropped_total``): the listener
never waits on the network, so a broker that does not answer (each command may wait
seconds for it) holds up no line. A record whose handler raises, or
whose write fails (a pipe nobody reads any more), is dropped and counted the same way,
and the report names the error: the listener thread never ends on one (its end would
silence the worker's log for good, with the traceback itself lost in the queue it no
longer reads), and never writes about it elsewhere. Logging's own ``handleError`` prints
the error to ``sys.stderr``, which in a Celery worker is a logger: each failed write made
the next record, and a worker whose stdout pipe had lost its reader spent a core on that
loop for good. A forked child (a prefork pool's) starts with an empty queue and a
listener of its own: nothing taken across the fork.
"""

from __future__ import annotations

import atexit
import copy
import logging
import os
import queue
import sys
import threading
import time
from logging.handlers import QueueHandler, QueueListener
from typing import Any

import redis

from config.settings import get_settings
from workers.base.redis_client import redis_client

MAX_RECORDS = 10_000
DROPPED_KEY = "corral:metrics:log_records_dropped"
FLUSH_AT_EXIT_S = 2.0
SEND_AGAIN_S = 1.0  # after a failed try to add the drops to the fleet's total
_AS_IS = logging.Formatter("%(message)s")
_SINK = "corral_sink"  # the attribute a queued record carries its handler in


class _Listener(QueueListener):
    """Writes each queued record to the handler it was formatted for; reports drops."""

    def handle(self, record: logging.LogRecord) -> None:
        """Write one record out (this thread may wait on the sink; no task does)."""
        sink = record.__dict__.pop(_SINK, None)
        if not isinstance(sink, logging.Handler):
            return
        process = _current()
        process.sink_failed = False
        try:
            sink.handle(record)
            if not process.sink_failed:  # (a report would fail as the record did)
                _report_drops(sink)
        except Exception as exc:  # this thread must go on: its end would lose every later line
            _count_dropped(f"{type(exc).__name__}: {exc}")


class _Process:
    """This process's queue and listener (a forked child makes its own)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.queue: queue.Queue[Any] = queue.Queue(MAX_RECORDS)
        self.listener = _Listener(self.queue)
        self.listener.start()
        self.dropped = 0  # not yet reported
        self.failure: str | None = None  # the last error a sink raised, not yet reported
        self.sink_failed = False  # the listener's last write failed (its thread's only)
        self.unsent = 0  # reported, not yet added to the fleet's total
        self.lock = threading.Lock()  # around the counts above only, never held across a wait
        self.wake = threading.Event()  # the sender has counts to add
        self.sender: threading.Thread | None = None


_process: _Process | None = None
_making = threading.Lock()


def _current() -> _Process:
    global _process
    process = _process
    if process is None or process.pid != os.getpid():
        with _making:
            process = _process
            if process is None or process.pid != os.getpid():
                process = _process = _Process()
    return process


def _after_fork_in_child() -> None:
    """A forked child takes nothing of its parent's: no queue, no listener, no held lock."""
    global _process, _making
    _process = None
    _making = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class BoundedHandler(QueueHandler):
    """Stands in for one handler: formats a record as it would, and queues it without waiting."""

    def __init__(self, sink: logging.Handler) -> None:
        super().__init__(None)  # type: ignore[arg-type]  # the process's queue, per process
        self.sink = sink
        self.sink_format = sink.formatter or logging.Formatter()
        self.setLevel(sink.level)
        sink.setFormatter(_AS_IS)  # records reach it formatted already
        sink.handleError = _sink_failed  # type: ignore[method-assign]  # counted, not printed

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        """The record as its sink would write it, formatted here, in the logging thread."""
        text = self.sink_format.format(record)
        out = copy.copy(record)
        out.msg = out.message = text
        out.args = out.exc_info = out.exc_text = out.stack_info = None
        setattr(out, _SINK, self.sink)
        return out

    def enqueue(self, record: logging.LogRecord) -> None:
        """Queue the record; when the queue is full, drop it and count it."""
        try:
            _current().queue.put_nowait(record)
        except queue.Full:
            _count_dropped()


def _sink_failed(record: logging.LogRecord) -> None:
    """A sink's write of ``record`` failed (its ``handleError``): count it, write nothing."""
    exc = sys.exc_info()[1]
    _count_dropped(f"{type(exc).__name__}: {exc}" if exc is not None else "its write failed")
    _current().sink_failed = True


def _count_dropped(failure: str | None = None) -> None:
    """Count one record dropped (``failure``: the error its sink raised, if that was why)."""
    process = _current()
    with process.lock:
        process.dropped += 1
        if failure is not None:
            process.failure = failure


def _report_drops(sink: logging.Handler) -> None:
    """Say how many records were dropped since the last report, and add them to the total."""
    process = _process
    if process is None or not process.dropped:
        return
    with process.lock:
        dropped, process.dropped = process.dropped, 0
        failure, process.failure = process.failure, None
        process.unsent += dropped
        if process.sender is None:
            process.sender = threading.Thread(
                target=_send_totals, args=(process,), name="corral-log-drops", daemon=True
            )
            process.sender.start()
    process.wake.set()
    text = f"{dropped} log record(s) dropped: the log's reader did not keep up"
    if failure is not None:
        text += f", or its handler failed (the last time: {failure})"
    sink.handle(logging.LogRecord("corral.logs", logging.WARNING, __file__, 0, text, None, None))


def _send_totals(process: _Process) -> None:
    """The sender's thread: add the reported drops to the fleet's total, as they come."""
    while True:
        process.wake.wait()
        process.wake.clear()
        with process.lock:
            dropped, process.unsent = process.unsent, 0
        if dropped and not _add_to_total(dropped):  # kept, and tried again a while later
            with process.lock:
                process.unsent += dropped
            time.sleep(SEND_AGAIN_S)
            process.wake.set()


def _add_to_total(dropped: int) -> bool:
    """Add ``dropped`` to the fleet's total in the broker's Redis; whether it was."""
    try:
        client = redis_client(get_settings().broker_url)
        if client is not None:
            client.incrby(DROPPED_KEY, dropped)
    except Exception:  # a metric: never worth a log line about the log
        return False
    return True


def dropped_total(client: redis.Redis) -> int:
    """The fleet's total of dropped log records (``client``: the broker's Redis)."""
    value = client.get(DROPPED_KEY)
    return int(value) if isinstance(value, bytes | str | int) else 0


def install() -> int:
    """Put every handler of this process's loggers behind the bounded queue; how many."""
    known = logging.root.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(lg for lg in known if isinstance(lg, logging.Logger))]
    moved = 0
    for logger in loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, BoundedHandler | logging.NullHandler):
                continue
            logger.removeHandler(handler)
            logger.addHandler(BoundedHandler(handler))
            moved += 1
    _current()
    return moved


@atexit.register
def _flush() -> None:
    """At exit, give the listener a moment to write what is queued, and the sender to send
    its counts (never waits long)."""
    process = _process
    if process is None or process.pid != os.getpid():
        return
    deadline = time.monotonic() + FLUSH_AT_EXIT_S
    while (not process.queue.empty() or process.unsent) and time.monotonic() < deadline:
        time.sleep(0.01)
