"""What one reaper pass did, and how it is kept: a report, and its operation's record.

A pass (:mod:`workers.maintenance.reaper`) fills a :class:`ReapReport`, one
:class:`Reaped` per replica it deleted; the reap task stores it as the result of the
pass's operation (:func:`record`), so ``corral ops`` and Flower show what went and why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from workers.operations import MAX_OP_ERRORS, finish, mark_running
from workers.store.db import Database
from workers.store.models import OP_FINISHED, Operation, OpStatus

REASONS = ("stuck", "stale", "idle")


@dataclass
class Reaped:
    """One replica a pass deleted: why, and how it ended."""

    replica_id: str
    function: str
    reason: str  # stuck | stale | idle
    detail: str
    vmid: str | None
    node: str | None
    # deleted | gone (the node no longer had the VM) | retired (stuck: the row ends Dead, as
    # meant) | failed (the VM could not be released: the row is Dead with the error) |
    # left (the pass ran out of time: the row stays Deleting, a later pass finishes it) |
    # waiting (the node did not answer and cannot list its VMs: the row stays Deleting,
    # holding its slot, until a pass releases it once the node answers)
    outcome: str = "pending"
    error: str | None = None


@dataclass
class ReapReport:
    """What one reaper pass did (or that it was skipped)."""

    holder: str
    skipped: bool = False
    held_by: str | None = None
    idle_timeout: float | None = None
    batch: int = 0
    deleted: list[Reaped] = field(default_factory=list)
    kept_for_min: dict[str, int] = field(default_factory=dict)
    replace: dict[str, int] = field(default_factory=dict)
    more: bool = False  # the batch was full: the next pass continues
    claims_expired: int = 0  # expired claims whose environment the pass gave back
    keep_alive: dict[str, dict[str, Any]] = field(default_factory=dict)  # adaptive: windows
    started_at: str | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Deletions per reason."""
        return {r: sum(1 for d in self.deleted if d.reason == r) for r in REASONS}

    @property
    def failed(self) -> int:
        """Deletions whose VM could not be released (left Dead with an error)."""
        return sum(1 for d in self.deleted if d.outcome == "failed")

    @property
    def changed(self) -> bool:
        """Whether the pass deleted, gave back or asked for anything."""
        return bool(self.deleted or self.claims_expired or self.replace)

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping."""
        data = asdict(self)
        data["counts"] = self.counts
        return data


def outcome(report: ReapReport, extra: dict[str, Any]) -> dict[str, Any]:
    """A pass's report as an operation's result, with the errors of failed deletions."""
    errors = [f"{d.replica_id}: {d.error}" for d in report.deleted if d.outcome == "failed"]
    return {**report.as_dict(), **extra, "errors": errors[:MAX_OP_ERRORS]}


def record(db: Database, op_id: str, report: ReapReport, extra: dict[str, Any]) -> None:
    """Store a pass's report as its operation's result and finish the operation."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is None or op.status in OP_FINISHED:
            return
        op.result = outcome(report, extra)
        if report.skipped:
            op.total, op.failed = 1, 1
            finish(
                op,
                failed=1,
                total=1,
                error=(
                    f"skipped: another reap pass holds the lease ({report.held_by or 'unknown'})"
                ),
            )
            return
        op.total = len(report.deleted)
        op.failed = report.failed
        op.done = op.total - op.failed
        finish(op, failed=op.failed, total=op.total)


def start(db: Database, op_id: str) -> None:
    """Mark a reap operation running."""
    with db.transaction() as s:
        op = s.get(Operation, op_id, with_for_update=True)
        if op is not None and op.status == OpStatus.PENDING:
            mark_running(op)
            op.progress_at = op.started_at
