"""The soak's plan: the settings of its processes and its fault schedule.

``python -m bench.soak`` runs a fleet on loopback under load while faults fire on a
schedule; the partition run (``python -m bench.partition``) runs its fleet with the same
settings. Both are here, apart from the run, so that tests can check the plan itself (a
short run must still fire every kind of fault) without starting a fleet.

:func:`schedule` scales the windows to the run's length: a 45-second run, as CI's, still
has every kind at least once, every window closed before the end.
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_KINDS = ("worker_kill", "redis_stop", "postgres_restart", "agent_stop", "agent_delay")
KILL_EVERY_S = 20.0

# Settings for every process of the soak: short intervals and deadlines, so that what
# the faults leave behind is found and repaired within the quiesce window.
SOAK_ENV = {
    "CORRAL_HEALTH_INTERVAL_S": "1",
    "CORRAL_HEALTH_TIMEOUT_S": "1",
    "CORRAL_HEALTH_MISSES": "3",
    "CORRAL_NODE_DEAD_GRACE_S": "60",
    "CORRAL_REAP_INTERVAL_S": "5",
    "CORRAL_RECONCILE_INTERVAL_S": "5",
    "CORRAL_ORPHAN_GRACE_S": "10",
    "CORRAL_IDLE_TIMEOUT_S": "40",
    "CORRAL_CREATING_DEADLINE_S": "45",
    "CORRAL_BOOT_DEADLINE_S": "30",
    "CORRAL_REDRIVE_AFTER_S": "15",
    "CORRAL_LEASE_TTL_S": "20",
    "CORRAL_TASK_SOFT_TIME_LIMIT_S": "15",
    "CORRAL_TASK_TIME_LIMIT_S": "20",
    "CORRAL_VISIBILITY_TIMEOUT_S": "30",
    "CORRAL_RETRY_MAX": "4",
    "CORRAL_RETRY_BACKOFF_S": "0.5",
    "CORRAL_RETRY_BACKOFF_MAX_S": "4",
    "CORRAL_RPC_TIMEOUT_S": "5",
    "CORRAL_CREATE_TIMEOUT_S": "10",
    "CORRAL_LAMBDO_TIMEOUT_S": "5",
    "CORRAL_NODE_CAPACITY": "40",
    "CORRAL_CLAIM_TTL_S": "60",
}


@dataclass(frozen=True)
class FaultEvent:
    """One fault of the schedule: when (seconds into the run), what, for how long."""

    at_s: float
    kind: str
    duration_s: float = 0.0


def schedule(duration_s: float) -> list[FaultEvent]:
    """The fault schedule for a run of ``duration_s``: windows shrink to fit short runs."""
    events = [
        FaultEvent(t, "worker_kill") for t in _steps(min(KILL_EVERY_S, duration_s / 4), duration_s)
    ]
    events += [
        FaultEvent(0.05 * duration_s, "agent_delay", min(60.0, duration_s / 4)),
        FaultEvent(0.30 * duration_s, "redis_stop", min(10.0, duration_s / 9)),
        FaultEvent(0.50 * duration_s, "postgres_restart"),
        FaultEvent(0.62 * duration_s, "agent_stop", min(30.0, duration_s / 6)),
    ]
    return sorted(events, key=lambda e: e.at_s)


def _steps(every: float, until: float) -> list[float]:
    out, t = [], every
    while t < until:
        out.append(round(t, 3))
        t += every
    return out
