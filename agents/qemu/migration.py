"""Saving a running guest to a snapshot file and resuming one from it, over QMP.

A snapshot is QEMU's migration stream written to a file: ``stop`` the VM, hand QEMU the
open file (``getfd``, SCM_RIGHTS over the QMP socket: QEMU opens no path of ours),
``migrate`` to it, wait until the migration completes, ``cont``. A VM started with
``-incoming fd:N`` on such a file loads it and stays paused (its source was stopped)
until ``cont``. QEMU's default migration bandwidth cap (32 MiB/s) is lifted for the
save: nothing else is on the wire.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from agents.qemu.control import StartFailed
from agents.qemu.qmp import Monitor, QmpError

__all__ = ["resume", "save"]

log = logging.getLogger(__name__)


def resume(monitor: Monitor, deadline: float, alive: Callable[[], bool]) -> None:
    """Wait for an incoming snapshot to be loaded, then run the VM; StartFailed if not."""
    while True:
        status = monitor.execute("query-status", timeout=max(0.1, deadline - time.monotonic()))
        if status.get("status") != "inmigrate":
            break
        if time.monotonic() > deadline:
            raise StartFailed("timed out")
        if not alive():
            raise StartFailed("QEMU exited while loading the snapshot")
        time.sleep(0.005)
    monitor.execute("cont", timeout=max(0.1, deadline - time.monotonic()))


def save(monitor: Monitor, staging: Path, deadline: float) -> bool:
    """Snapshot a running guest to ``staging`` and run it again; False if the save failed."""
    started = time.monotonic()
    ok = False
    try:
        monitor.execute("stop")
        monitor.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
        fd = os.open(staging, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            monitor.send_fd(fd, "corral-snapshot")
        finally:
            os.close(fd)
        monitor.execute("migrate", {"uri": "fd:corral-snapshot"})
        while True:
            info = monitor.execute("query-migrate")
            status = info.get("status")
            if status in ("completed", "failed", "cancelled"):
                ok = status == "completed"
                if not ok:
                    log.warning("snapshot failed: %s", info.get("error-desc", status))
                break
            if time.monotonic() > deadline:
                with contextlib.suppress(QmpError):
                    monitor.execute("migrate_cancel")
                log.warning("snapshot not finished in time; abandoned")
                break
            time.sleep(0.01)
    except (QmpError, OSError) as exc:
        log.warning("snapshot failed: %s", exc)
    finally:
        monitor.execute("cont")
    if ok:
        log.info(
            "snapshot written in %.2fs (%d MiB)",
            time.monotonic() - started,
            staging.stat().st_size >> 20,
        )
    return ok
