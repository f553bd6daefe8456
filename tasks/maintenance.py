"""Periodic and operator-triggered maintenance: health checks (and, below, reap and reconcile).

Beat sends these on the ``corral.maintenance`` queue; each expires before the next
one is due, so a stopped worker does not come back to a pile of stale passes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from workers import health
from workers.app import CorralTask, app


@app.task(bind=True, name="corral.check_health")
def check_health(self: CorralTask) -> dict[str, Any]:
    """Probe every node and update its health."""
    return asdict(health.check_health(self.db, self.settings))
