"""Row look-ups and removals shared by the registries of functions, nodes and GPUs.

Each registry looks a row up by its key (``NotFound`` when there is none, optionally
locked ``FOR UPDATE``) and removes a node or GPU by first unlinking the replica rows
that still point at it (history keeps the replica, without the link).
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, update
from sqlalchemy.orm import InstrumentedAttribute, Session

from workers.base.errors import NotFound
from workers.store.models import Replica

__all__ = ["delete_unlinking_replicas", "one_or_not_found"]

T = TypeVar("T")


def one_or_not_found(session: Session, query: Select[T], what: str, *, lock: bool = False) -> T:
    """The row ``query`` selects (locked FOR UPDATE with ``lock``); NotFound("unknown {what}")."""
    if lock:
        query = query.with_for_update()
    row = session.scalars(query).first()
    if row is None:
        raise NotFound(f"unknown {what}")
    return row


def delete_unlinking_replicas(
    session: Session, row: Any, link: InstrumentedAttribute[str | None]
) -> None:
    """Delete ``row`` after clearing ``link`` (a Replica column) on the replicas naming it."""
    session.execute(
        update(Replica)
        .where(link == row.id)
        .values({link.key: None})
        .execution_options(synchronize_session=False)
    )
    session.delete(row)
