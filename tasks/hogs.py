"""The ``corral.hogs`` task: CPU hogs on node agents (logic in :mod:`workers.fleet.hogs`)."""

from __future__ import annotations

from typing import Any

from workers.celery import CorralTask, app
from workers.fleet.hogs import HogRequest, run_hogs


@app.task(bind=True, name="corral.hogs")
def hogs(
    self: CorralTask, action: str, n: int, node: str | None = None, op_id: str | None = None
) -> dict[str, Any]:
    """Start or stop ``n`` CPU hogs on one node or every healthy fcdaemon node."""
    settings = self.settings
    last_try = op_id is None or self.request.retries >= settings.retry_max
    report = run_hogs(self.db, settings, HogRequest(action, n, node), op_id, last_try=last_try)
    if report["retry"]:
        self.retry_within_budget(f"{action} {n} on {node or 'all nodes'}")
    return {"op_id": op_id, "action": action, "n": n, "nodes": report["nodes"]}
