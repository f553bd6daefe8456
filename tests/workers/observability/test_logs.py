"""A worker's log records go out through a bounded queue: a stalled sink never blocks a logger.

A sink that blocks in its write (a stalled pipe) holds up only the listener thread: a
thread that logs past the queue's bound drops records instead of waiting, and once the
sink takes lines again the listener says how many were dropped and adds them to the
fleet's total in Redis (the metric ``corral_log_records_dropped_total``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator

import pytest
import redis
from celery.utils.log import LoggingProxy

from testkit.eventually import eventually
from testkit.services import RedisServer
from tests.fixtures import Env, sqlite_only
from workers.observability import logs

BOUND = 50


class _StalledSink(logging.Handler):
    """A handler whose writes wait until it is let go, as a write to a full pipe does."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.go.wait()
        self.lines.append(self.format(record))


@pytest.fixture
def bounded(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A small bound, and a queue and listener of this test's own."""
    monkeypatch.setattr(logs, "MAX_RECORDS", BOUND)
    monkeypatch.setattr(logs, "_process", None)
    yield
    monkeypatch.setattr(logs, "_process", None)


@contextlib.contextmanager
def _logger_to(sink: logging.Handler, name: str) -> Iterator[logging.Logger]:
    """A logger of its own whose one handler is ``sink``, behind the bounded queue."""
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logs.BoundedHandler(sink)
    logger.addHandler(handler)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)


@sqlite_only  # no store: one run is enough
def test_a_stalled_sink_drops_and_counts_records_instead_of_blocking_the_thread_that_logs(
    broker_env: Env, bounded: None
) -> None:
    sink = _StalledSink()
    sink.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    before = logs.dropped_total(client)
    sent = 3 * BOUND
    with _logger_to(sink, "corral.test.logs") as logger, contextlib.ExitStack() as undo:
        undo.callback(sink.go.set)  # a failure must not leave the listener waiting
        done = threading.Event()

        def log_them() -> None:
            for n in range(sent):
                logger.info("line %d", n)
            done.set()

        threading.Thread(target=log_them, daemon=True).start()
        # the sink takes nothing, and yet every call returns: none waits for it
        assert done.wait(30), "a thread that logs waited for the stalled sink"
        assert sink.lines == []

        sink.go.set()
        note = "log record(s) dropped: the log's reader did not keep up"

        def accounted() -> bool:  # each record written, or counted in a report
            reports = [int(line.split()[0]) for line in sink.lines if note in line]
            return len(sink.lines) - len(reports) + sum(reports) == sent

        eventually(accounted, 30, "every record written or counted")
        written = [line for line in sink.lines if note not in line]
        (report,) = [line for line in sink.lines if note in line]
        dropped = int(report.split()[0])
        assert written[0] == "INFO corral.test.logs: line 0"  # formatted as the sink would
        # in the order logged, none twice; which were dropped depends on when the handler's
        # thread took its first record (the slot it freed may take a later one)
        numbers = [int(line.rsplit(" ", 1)[1]) for line in written]
        assert numbers == sorted(set(numbers))
        assert BOUND <= len(written) <= BOUND + 1  # the queue, and the one in the sink's hands
        eventually(  # the fleet's total, added by the sender's thread
            lambda: logs.dropped_total(client) == before + dropped, 10, "the fleet's total"
        )
    client.close()


class _BrokenFilter(logging.Filter):
    """A filter that raises on some records (a handler's own code failing, not its pipe)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "boom" in record.getMessage():
            raise ValueError("a broken filter")
        return True


@sqlite_only  # no store: one run is enough
def test_a_record_whose_handler_raises_is_dropped_and_counted_and_the_next_is_written(
    broker_env: Env, bounded: None
) -> None:
    sink = _StalledSink()
    sink.go.set()
    sink.addFilter(_BrokenFilter())
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    before = logs.dropped_total(client)
    with _logger_to(sink, "corral.test.logs.broken") as logger:
        for line in ("first", "boom", "after"):
            logger.info(line)
        eventually(lambda: len(sink.lines) >= 3, 10, "the lines after the failure")
        first, after, note = sink.lines
        assert (first, after) == ("first", "after")  # the listener outlived the failure
        assert note == (
            "1 log record(s) dropped: the log's reader did not keep up, or its handler "
            "failed (the last time: ValueError: a broken filter)"
        )
        eventually(lambda: logs.dropped_total(client) == before + 1, 10, "the fleet's total")
    client.close()


@sqlite_only  # no store: one run is enough
def test_a_broker_that_does_not_answer_holds_up_no_line_and_gets_the_total_once_it_does(
    broker_env: Env, redis_server: RedisServer, bounded: None
) -> None:
    # Adding the drops to the fleet's total waits for the broker (3 s at most each time);
    # the listener must not: every line after the report is written while it is away.
    sink = _StalledSink()
    client = redis.Redis.from_url(broker_env.settings.broker_url)
    before = logs.dropped_total(client)
    with _logger_to(sink, "corral.test.logs.away") as logger, contextlib.ExitStack() as undo:
        undo.callback(sink.go.set)
        for n in range(2 * BOUND):  # the sink takes none: half of them dropped
            logger.info("before %d", n)
        with redis_server.frozen():
            sink.go.set()
            eventually(  # the queue written out (the report among its lines)
                lambda: sum(line.startswith("before") for line in sink.lines) >= BOUND,
                2,
                "the queued lines",
            )
            logger.info("after")
            eventually(lambda: "after" in sink.lines, 2, "the line after the report")
            reports = [line for line in sink.lines if "dropped" in line]
            assert len(reports) == 1, sink.lines
        dropped = int(reports[0].split()[0])
        eventually(  # sent once the broker answers again
            lambda: logs.dropped_total(client) == before + dropped, 15, "the fleet's total"
        )
    client.close()


@sqlite_only  # no store: one run is enough
def test_a_sink_whose_writes_fail_counts_its_records_and_makes_no_more(
    broker_env: Env, bounded: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    read, write = os.pipe()
    os.close(read)  # nobody reads the pipe any more: each write fails (EPIPE)
    stream = os.fdopen(write, "w")
    sink = logging.StreamHandler(stream)
    with _logger_to(sink, "corral.test.logs.epipe") as logger:
        # as in a Celery worker, what is written to stderr is logged: logging's own report
        # of a failed write went there, and came back as one more record to write
        monkeypatch.setattr(sys, "stderr", LoggingProxy(logger, logging.WARNING))
        for n in range(5):
            logger.info("line %d", n)
        process = logs._current()
        eventually(lambda: process.queue.unfinished_tasks == 0, 10, "the queue to drain")
        assert process.dropped == 5, process.dropped  # each record once, nothing more
        assert process.failure is not None and "BrokenPipeError" in process.failure
    monkeypatch.undo()
    with contextlib.suppress(OSError):
        stream.close()
