"""Test-only tasks a real worker loads (``corral worker --include tests.faults.limit_tasks``).

Work that meets its time limits, and a way to step the worker's host clock:

* ``corral.test.churn``: logs and uses the store without pause (a line inside each
  transaction too) until its soft limit stops it - where an exception raised into the
  thread would most likely land inside a handler's lock or a pool's bookkeeping;
* ``corral.test.probe``: logs how many of this process's pool connections are checked
  out (after each task, too, in a prefork child, where no other task runs beside it);
* ``corral.test.stuck``: blocks in one C call, reaching no safe point, until its hard
  limit ends it - once per marker file (a redelivered message returns at once);
* ``corral.test.poison``: blocks in one C call on every delivery (a poison message), an
  operation's task;
* ``corral.test.wait_for``: waits at safe points until a file exists (a neighbour of the
  poison message, in flight when it is killed);
* ``corral.test.step_clock``: steps this process's host clock (``clock.step_host``);
* ``corral.test.where``: says where it runs (:func:`workers.celery.runs`), how long its
  deadline leaves it, and its process's garbage collector's state.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from pathlib import Path
from typing import Any

from celery import signals

from config.settings import get_settings
from workers import leases
from workers.base import clock, timelimits
from workers.celery import CorralTask, app, runs
from workers.store.db import get_database

log = logging.getLogger("corral.test")


def _checked_out() -> int:
    """Connections of this process's pool now checked out."""
    pool = get_database(get_settings().database_url).engine.pool
    return int(pool.checkedout())  # type: ignore[attr-defined]


@app.task(bind=True, name="corral.test.churn")
def churn(self: CorralTask, n: int) -> None:
    """Log and use the store until the soft time limit stops the task."""
    name = f"churn-{n}"
    while True:
        log.info("churn %d: %s", n, "x" * 200)
        with self.db.transaction() as s:
            leases.take(s, name, str(self.request.id), 60)
            log.info("churn %d holds %s", n, name)
        with self.db.read() as s:
            leases.first_seen(s, name, "reader", 60)


@app.task(bind=True, name="corral.test.probe")
def probe(self: CorralTask, tag: str) -> None:
    """Log this process's checked-out connections (and that logging works)."""
    log.info("probe %s: pid %d checked out %d", tag, os.getpid(), _checked_out())


@app.task(bind=True, name="corral.test.stuck")
def stuck(self: CorralTask, marker: str) -> str:
    """Block in one C call until killed; a second delivery (the marker exists) returns."""
    path = Path(marker)
    if path.exists():
        return "again"
    path.write_text(str(self.request.id))
    log.info("stuck %s: blocking", self.request.id)
    threading.Event().wait()  # one lock wait in C: no safe point ever comes
    return "never"


@app.task(bind=True, name="corral.test.poison")
def poison(self: CorralTask, op_id: str) -> str:
    """Block in one C call until killed, on every delivery (its operation: ``op_id``)."""
    log.info("poison %s: delivered, blocking", self.request.id)
    threading.Event().wait()
    return "never"


@app.task(bind=True, name="corral.test.wait_for")
def wait_for(self: CorralTask, marker: str, tag: str) -> str:
    """Wait until ``marker`` exists (looking at the deadline every 50 ms), then end."""
    log.info("wait_for %s: waiting in pid %d", tag, os.getpid())
    while not Path(marker).exists():
        timelimits.sleep(0.05)
    log.info("wait_for %s: done", tag)
    return tag


@app.task(bind=True, name="corral.test.step_clock")
def step_clock(self: CorralTask, seconds: float) -> None:
    """Step this process's host clock by ``seconds``."""
    clock.step_host(seconds)
    log.info("stepped the host clock by %gs in pid %d", seconds, os.getpid())


@app.task(bind=True, name="corral.test.where")
def where(self: CorralTask, tag: str) -> dict[str, object]:
    """Say where this task runs, how long its deadline leaves it, and whether collection is on."""
    deadline = timelimits.current()
    left = deadline.left() if deadline is not None else None
    log.warning(
        "where %s: %s, collecting %s, %d frozen",
        tag,
        runs().value,
        gc.isenabled(),
        gc.get_freeze_count(),
    )
    return {
        "runs": runs().value,
        "left": left,
        "gc": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
    }


@signals.task_postrun.connect
def _after_task(**_: Any) -> None:
    """In a prefork child (one task at a time): the connections left checked out."""
    if threading.current_thread() is threading.main_thread():
        log.info("after a task: pid %d checked out %d", os.getpid(), _checked_out())
