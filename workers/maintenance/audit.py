"""Counter audit: the stored counters against the replica rows they count.

Placement never counts rows; it reads counters that :mod:`workers.replicas.lifecycle`
keeps in the same transaction as every state change:

* ``nodes.live`` - replicas on the node in a live (not final) state;
* ``functions.replica_count`` - the function's replicas in ``COUNTED_STATES``;
* ``gpus.slots_free`` / ``gpus.mem_free_mb`` - what the replicas holding a slot
  on the GPU leave free.

They cannot drift through corral, but a row edited by hand, a restore from a
backup or a bug would leave a node "full" or a GPU "busy" for good. :func:`audit`
recounts every counter from the rows and reports each one that disagrees; with
``fix`` it sets it to the rows' value. It locks the counter rows first (functions,
nodes, GPUs: the one order of :mod:`workers.locks`), then counts, so a
change in flight either committed before the count or applies its own change on
top of the corrected value.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from workers.store.models import COUNTED_STATES, LIVE_STATES, Function, Gpu, Node, Replica


@dataclass(frozen=True)
class Drift:
    """One counter that disagrees with the rows it counts."""

    kind: str  # node | function | gpu
    name: str
    counter: str
    stored: int
    actual: int

    def as_dict(self) -> dict[str, Any]:
        """A plain dict, for JSON output."""
        return asdict(self)

    @property
    def message(self) -> str:
        """One line for humans."""
        return (
            f"{self.kind} {self.name}: {self.counter} is {self.stored}, "
            f"the replica rows say {self.actual}"
        )


@dataclass(frozen=True)
class Audit:
    """What an audit looked at, and what disagreed."""

    checked: dict[str, int]  # nodes / functions / gpus -> how many
    drifts: list[Drift]


def _per(session: Session, key: Any, *where: Any, total: Any = None) -> dict[str, Any]:
    """``key`` -> count of matching replicas (or ``(count, sum(total))``)."""
    columns = [key, func.count(Replica.id)]
    if total is not None:
        columns.append(func.coalesce(func.sum(total), 0))
    rows = session.execute(select(*columns).where(*where).group_by(key))
    if total is None:
        return {k: int(n) for k, n in rows}
    return {k: (int(n), int(t)) for k, n, t in rows}


def audit(session: Session, *, fix: bool = False, lock: bool = True) -> Audit:
    """Every counter that disagrees with the replica rows; with ``fix``, corrected.

    ``lock=False`` (a read-only session) counts without locking: under concurrent
    spawns and deletes it can report a counter that is only mid-change.
    """

    def rows(model: Any, order: Any) -> Any:
        query = select(model).order_by(order)
        return session.scalars(query.with_for_update() if lock or fix else query).all()

    functions = rows(Function, Function.name)
    nodes = rows(Node, Node.name)
    gpus = rows(Gpu, Gpu.uuid)
    counted = _per(session, Replica.function_id, Replica.status.in_(COUNTED_STATES))
    live = _per(
        session, Replica.node_id, Replica.status.in_(LIVE_STATES), Replica.node_id.is_not(None)
    )
    held = _per(session, Replica.gpu_id, Replica.gpu_slot.is_not(None), total=Replica.gpu_mem_mb)
    drifts: list[Drift] = []
    plain = [("function", fn, fn.name, "replica_count", counted.get(fn.id, 0)) for fn in functions]
    plain += [("node", node, node.name, "live", live.get(node.id, 0)) for node in nodes]
    for kind, row, name, counter, actual in plain:
        stored = getattr(row, counter)
        if stored != actual:
            drifts.append(Drift(kind, name, counter, stored, actual))
            if fix:
                setattr(row, counter, actual)
    for gpu in gpus:
        slots, mem = held.get(gpu.id, (0, 0))
        for counter, total, free, actual in (
            ("slots_used", "slots_total", "slots_free", slots),
            ("mem_used_mb", "mem_total_mb", "mem_free_mb", mem),
        ):
            used = getattr(gpu, total) - getattr(gpu, free)
            if used != actual:
                drifts.append(Drift("gpu", gpu.uuid, counter, used, actual))
                if fix:
                    setattr(gpu, free, max(0, getattr(gpu, total) - actual))
    checked = {"nodes": len(nodes), "functions": len(functions), "gpus": len(gpus)}
    return Audit(checked, drifts)
