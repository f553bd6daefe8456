"""Orphan VMs kept in the store until their node has released them.

The model
---------
An orphan is a VM no replica took: a READY no spawn recorded in time, a maybe's VM that
showed up after its replacement (:mod:`workers.replicas.reports`), a create's answer
that came after its row was deleted or moved (:mod:`workers.replicas.arrivals`, whose
own release ends the row at once). On an agent that can
list its VMs, reconcile would find it again; on one that speaks only the seed protocol
(no ``ListReplicas``) the report was the only sign of it, and a release message lost
in transit - its retry unpublished while the broker was away, a worker cut off holding
it - left the VM running for good.

So finding an orphan writes a row, ``orphan_releases(node, vmid)`` (:func:`note`), in the
transaction that judged the VM an orphan, and the release is asked twice over:

* **at once**, by a ``release_orphan`` message (the registry queues it), whose task
  ends the row when the release concludes (:func:`end`): released, already gone, taken
  by a live row after all, or its node removed;
* **later**, by reconcile: a row still there at its due time (``CORRAL_TASK_TIME_LIMIT_S``
  after it was noted: the message's task had all its time) is released by the next pass
  with its own orphans (:func:`due`); a release that fails again is put off, twice as
  long each time up to ``MAX_PUT_OFF_S`` (:func:`put_off`), while its node is healthy.

Releasing twice is harmless (a VM already gone counts as released), so the two paths
need no coordination.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from config.settings import Settings
from workers.base.clock import now
from workers.store.db import Database, insert_for
from workers.store.models import LIVE_STATES, Node, OrphanRelease, Replica

log = logging.getLogger(__name__)

MAX_PUT_OFF_S = 600.0  # the longest a failed release waits for its next try
ERROR_CHARS = 300  # the last error kept on a row


@dataclass(frozen=True)
class Due:
    """An orphan whose release is due, and the node to release it on."""

    node: Node
    vmid: str


def note(session: Session, settings: Settings, node_id: str, vmid: str) -> None:
    """Keep ``vmid`` on ``node_id`` as an orphan to release (in the caller's transaction)."""
    at = now()
    insert = insert_for(session)
    session.execute(
        insert(OrphanRelease)
        .values(
            node_id=node_id,
            vmid=vmid,
            noted_at=at,
            due_at=at + timedelta(seconds=settings.task_time_limit_s),
            attempts=0,
        )
        .on_conflict_do_nothing()
    )


def end(db: Database, node_id: str, vmid: str) -> None:
    """The release of ``vmid`` on ``node_id`` concluded: forget the orphan."""
    with db.transaction() as s:
        s.execute(
            delete(OrphanRelease).where(
                OrphanRelease.node_id == node_id, OrphanRelease.vmid == vmid
            )
        )


def due(db: Database, limit: int) -> list[Due]:
    """Orphans on healthy nodes whose release is due (oldest first, ``limit`` at most).

    One a live row on its node holds after all is forgotten instead (it is that
    replica's VM).
    """
    at = now()
    with db.transaction() as s:
        rows = s.execute(
            select(OrphanRelease.vmid, Node)
            .join(Node, Node.id == OrphanRelease.node_id)
            .where(OrphanRelease.due_at <= at, Node.healthy.is_(True))
            .order_by(OrphanRelease.due_at)
            .limit(limit)
        ).all()
        taken = _taken(s, [(node.id, vmid) for vmid, node in rows])
        for node_id, vmid in taken:
            s.execute(
                delete(OrphanRelease).where(
                    OrphanRelease.node_id == node_id, OrphanRelease.vmid == vmid
                )
            )
        out = [Due(node, vmid) for vmid, node in rows if (node.id, vmid) not in taken]
        s.expunge_all()
    return out


def put_off(db: Database, node_id: str, vmid: str, error: str | None) -> None:
    """A release was not done (not sent in time, or failed): try again later, backing off."""
    with db.transaction() as s:
        row = s.get(OrphanRelease, (node_id, vmid), with_for_update=True)
        if row is None:
            return
        row.attempts += 1
        wait = min(MAX_PUT_OFF_S, 10.0 * 2 ** min(row.attempts, 10))
        row.due_at = now() + timedelta(seconds=wait)
        if error is not None:
            row.error = error[:ERROR_CHARS]
    log.info("orphan %s on %s: release put off (%s)", vmid, node_id, error or "not sent in time")


def _taken(session: Session, keys: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """Which of these (node, vmid) a live row holds."""
    if not keys:
        return set()
    vmids = {vmid for _, vmid in keys}
    rows = session.execute(
        select(Replica.node_id, Replica.vmid).where(
            Replica.vmid.in_(vmids), Replica.status.in_(LIVE_STATES)
        )
    ).all()
    held = {(str(node_id), str(vmid)) for node_id, vmid in rows}
    return held & set(keys)
